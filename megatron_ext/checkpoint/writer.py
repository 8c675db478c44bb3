"""Writing checkpoints, in the foreground or in the background (``--async-save``), for every engine.

An engine *stages* a save (``stage_checkpoint``): the collective part (megatron-core's and DCP's save planning,
DeepSpeed's own bookkeeping) runs, and what is left is a ``StagedSave``: megatron-core write requests with their
tensors on the host, and DeepSpeed's files as host copies. Writing it needs no process group, so it runs here or
in a forked writer process; the fork is taken before the next step changes anything (copy-on-write keeps the
staged state as it was), it ignores the signals the loop handles (torchrun's killpg does not stop it), and it never
holds the GIL the training step needs. Committing is collective again: every rank agrees that every write
succeeded, megatron-core finalises (metadata), then the manifest, the rename and the trackers
(``files.commit_save``), in that order: a crash at any moment leaves the last committed checkpoint
loadable. A failed write is one line per rank naming the file and the OS error, and exit 1.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import gc
import io
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ext.errors import TrainingStopped
from megatron_ext.checkpoint import files


@dataclasses.dataclass
class StagedSave:
    root: str
    iteration: int
    staging: str  # the iter_XXXXXXX.tmp directory the writes go to
    requests: List[Any] = dataclasses.field(default_factory=list)  # megatron-core AsyncRequests, preloaded
    files: List[Tuple[str, Any]] = dataclasses.field(default_factory=list)  # (path, object or its torch.save bytes)
    trackers: Optional[Dict[str, str]] = None  # default: ours

    def write(self) -> None:
        """Every file of this rank; raises what the filesystem raised."""
        for request in self.requests:
            if request.async_fn is not None:
                request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
        for path, obj in self.files:
            with open(path, "wb") as f:
                if isinstance(obj, bytes):
                    f.write(obj)
                else:
                    torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())

    def queues(self) -> List["ResultsQueue"]:
        return [r.async_fn_args[2] for r in self.requests if r.async_fn is not None]

    def write_errors(self) -> Optional[BaseException]:
        """What megatron-core's writers reported once the writes are over: they put their results (or an
        exception) in a queue instead of raising; left there for megatron-core's finalisation."""
        for results in self.queues():
            result = results.peek()
            if result is None or isinstance(result, BaseException):
                return result or RuntimeError("megatron-core's writer left no results")
        return None


def preloaded(request, copy: bool = False):
    """A megatron-core AsyncRequest with its tensors on the host (device tensors copied now; ``copy``: host
    tensors too, for state that is about to change or be freed before the writer forks)."""
    args = list(request.async_fn_args)
    if request.async_fn is None:
        return request
    buckets = request.preload_fn() if request.preload_fn is not None else args[1]
    if copy:
        buckets = [(path, key, (raw, [(item, t.clone()) for item, t in tensors]))
                   for path, key, (raw, tensors) in buckets]
    args[1] = buckets
    return request._replace(async_fn_args=tuple(args), preload_fn=None)


class ResultsQueue:
    """What megatron-core's writer puts its results (or exception) in, and its finalisation reads. Put from a
    forked writer: through a pipe the parent drains while it waits (``drain``), so a large result never blocks the
    writer; put in this process (a foreground save): kept here. Replaces megatron-core's queue, served by a
    *spawned* manager process, which torchrun's killpg SIGTERM would end mid-save."""

    def __init__(self):
        self._pipe = mp.get_context("fork").SimpleQueue()
        self._held = collections.deque()
        self._owner = os.getpid()

    def put(self, item) -> None:
        if os.getpid() == self._owner:
            self._held.append(item)
        else:
            self._pipe.put(item)

    def drain(self) -> None:
        while not self._pipe.empty():
            self._held.append(self._pipe.get())

    def peek(self):
        self.drain()
        return self._held[0] if self._held else None

    def get_nowait(self):
        self.drain()
        if not self._held:
            raise queue.Empty
        return self._held.popleft()

    get = get_nowait

    @property
    def reader(self):
        return self._pipe._reader


def use_our_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, ResultsQueue):
        filesystem_async._results_queue = ResultsQueue()


def serialized(obj) -> bytes:
    """``obj`` as ``torch.save`` writes it (DeepSpeed's files, staged for a background write): the same bytes a
    foreground save writes, storage sharing kept, device tensors copied out."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def describe(error: BaseException, directory: Optional[str] = None) -> str:
    """One line: the OS error and its file when one is inside (megatron-core and DCP wrap them); else, writing to
    ``directory`` on a filesystem with no space left, the OS's cause (torch.save's writer reports a full disk as
    "[enforce fail at inline_container.cc] unexpected pos", so ranks would name one cause two ways); else the first
    line of the message."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            name = errno.errorcode.get(e.errno, str(e.errno))
            where = f" writing {e.filename}" if e.filename else ""
            return f"{e.strerror or os.strerror(e.errno)} ({name}){where}"
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
        todo += [v for v in getattr(e, "failures", {}).values() if isinstance(v, BaseException)]
    if directory is not None and _full(directory):
        return f"{os.strerror(errno.ENOSPC)} (ENOSPC) writing {directory}"
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return f"{type(error).__name__}: {lines[0][:300]}"


def _full(directory: str) -> bool:
    """No space left for an unprivileged write on ``directory``'s filesystem (or its nearest existing parent)."""
    while directory and not os.path.exists(directory):
        directory = os.path.dirname(directory)
    try:
        return os.statvfs(directory or ".").f_bavail == 0
    except OSError:
        return False


def _handled_signals() -> set:
    """The signals this process handles in Python (the loop's --exit-signals, Ctrl-C)."""
    return {sig for sig in signal.valid_signals() if callable(signal.getsignal(sig))}


def _write_in_child(staged: StagedSave, report) -> None:
    gc.disable()  # the parent's device tensors must not be collected here
    # The loop's --exit-signals (torchrun's SIGTERM reaches this process too) are the parent's to act on: the write
    # goes on, silently. They arrive blocked (_Writer), so one sent while this process starts is dropped here.
    handled = _handled_signals()
    for sig in handled:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    try:
        staged.write()
        report.send(None)
    except BaseException as e:  # noqa: B036 (everything becomes the parent's one line)
        report.send(describe(e, staged.staging))
        os._exit(1)


class _Writer:
    """A forked process writing one staged save."""

    def __init__(self, staged: StagedSave):
        context = mp.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self.process = context.Process(target=_write_in_child, args=(staged, send), name="megatron_ext-save")
        # Held across the fork: a signal in the child's first milliseconds would run the loop's inherited handler.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _handled_signals())
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        send.close()
        self._queues = staged.queues()

    def result(self, blocking: bool) -> Tuple[bool, Optional[str]]:
        """(finished, its error or None); the writer's results are drained meanwhile."""
        while True:
            for results in self._queues:
                results.drain()
            if not self.process.is_alive():
                break
            if not blocking:
                return False, None
            mp.connection.wait([self.process.sentinel] + [q.reader for q in self._queues])
        self.process.join()
        try:
            message = self._receive.recv() if self._receive.poll() else None
        except EOFError:  # ended without a word: its exit code says how
            message = None
        if message is None and self.process.exitcode != 0:
            message = f"the writer process ended with exit code {self.process.exitcode}"
        return True, message

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Checkpointer:
    """The loop's saves: ``save`` at a save step, ``poll`` after every step (commits a background save every rank
    has finished: one small all-reduce per step while one is in flight), ``wait`` at the end. Each returns its
    metrics: ``save_blocking_time`` (what the step loop waited: staging, a foreground write, a commit, or the save
    in flight a new one waits for), ``save_staging_time``, and, once committed, ``save_total_time`` (staged to
    committed) and ``saved_step``."""

    def __init__(self, engine, background: bool = False, retain: Optional[int] = None):
        self.engine, self.background, self.retain = engine, background, retain
        self.device = engine.device
        self.pending: Optional[Tuple[StagedSave, _Writer, float]] = None
        use_our_results_queue()

    def save(self, root: str, iteration: int, extra: dict, final: bool = False) -> Dict[str, float]:
        """Stage a save; write it in the background (``--async-save``, unless ``final``: the run ends after it),
        or here and commit it. A save in flight is committed first."""
        entered = time.perf_counter()
        record = self.wait() if self.pending else {}
        start = time.perf_counter()
        try:
            staged = self.engine.stage_checkpoint(root, iteration, extra, background=self.background and not final)
        except OSError as e:
            raise _failed(root, iteration, describe(e, root)) from None
        record["save_staging_time"] = time.perf_counter() - start
        if self.background and not final:
            self.pending = (staged, _Writer(staged), start)
        else:
            try:
                staged.write()
                error = staged.write_errors()
                error = describe(error, staged.staging) if error is not None else None
            except (OSError, RuntimeError) as e:  # (RuntimeError: torch.save's writer on a full disk)
                error = describe(e, staged.staging)
            record.update(self._commit(staged, error, start))
        return dict(record, save_blocking_time=time.perf_counter() - entered)

    def poll(self) -> Dict[str, float]:
        """After every step: a background save every rank has written is committed (its finalisation, manifest
        and rename are what the loop waits for then)."""
        if not self.pending:
            return {}
        entered = time.perf_counter()
        record = self._finish(blocking=False)
        return dict(record, save_blocking_time=time.perf_counter() - entered) if record else {}

    def wait(self) -> Dict[str, float]:
        """Commit the save in flight once written (every rank)."""
        return self._finish(blocking=True) if self.pending else {}

    def abandon(self) -> None:
        """The run is failing: a background write is stopped, never committed (its .tmp goes at the next start)."""
        if self.pending:
            self.pending[1].stop()
            self.pending = None

    def _finish(self, blocking: bool) -> Dict[str, float]:
        staged, writer, start = self.pending
        done, error = writer.result(blocking)
        if done and error is None:
            found = staged.write_errors()
            error = describe(found, staged.staging) if found is not None else None
        if not blocking:  # everyone finished? (an error ends the wait)
            flags = torch.tensor([0 if done else 1, 1 if error else 0], device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0].item() and not flags[1].item():
                return {}
        self.pending = None
        if error is None and not done:
            writer.stop()
            error = "stopped: another rank's save failed"
        return self._commit(staged, error, start)

    def _commit(self, staged: StagedSave, error: Optional[str], start: float) -> Dict[str, float]:
        failed = torch.tensor([1 if error else 0], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            raise _failed(staged.root, staged.iteration, error or "stopped: another rank's save failed (its line "
                                                                  "says why)")
        for request in staged.requests:
            for finalize in request.finalize_fns:
                finalize()
        seconds = time.perf_counter() - start
        files.commit_save(staged.root, staged.iteration, staged.staging, staged.trackers, seconds)
        files.retain(staged.root, self.retain)
        return dict(save_total_time=time.perf_counter() - start, saved_step=staged.iteration)


def budget_warning(root: Optional[str], exit_duration_mins: Optional[float] = None, env=os.environ,
                   now: Optional[float] = None) -> Optional[str]:
    """A line when the time a preempted or time-limited run has left cannot cover a save as long as the last one
    under ``root`` took (with a quarter of margin): torchrun's grace after a SIGTERM (``SHUTDOWN_TIMEOUT``, which
    the launchers pass to it and to the ranks), or what --exit-duration-in-mins leaves before Slurm's time limit."""
    seconds = files.last_save_seconds(root)
    if seconds is None:
        return None
    need = math.ceil(seconds * 1.25)
    grace = env.get("SHUTDOWN_TIMEOUT")
    if grace and float(grace) < need:
        return (f"megatron_ext: the last save to {root} took {seconds:.0f} s, but after a SIGTERM torchrun gives the "
                f"ranks SHUTDOWN_TIMEOUT={grace} s: a preempted run would be killed mid-save and lose the steps since "
                f"its previous checkpoint; raise SHUTDOWN_TIMEOUT, and the scheduler's grace period, to at least "
                f"{need} s plus a step")
    end = env.get("SLURM_JOB_END_TIME")
    if end and exit_duration_mins:
        left = float(end) - (now if now is not None else time.time())
        if exit_duration_mins * 60 + need > left:
            return (f"megatron_ext: --exit-duration-in-mins {exit_duration_mins:g} leaves "
                    f"{max(0.0, left - exit_duration_mins * 60):.0f} s before the job's time limit, less than the "
                    f"last save to {root} took ({seconds:.0f} s, with margin {need} s): the final save would be cut; "
                    f"use at most --exit-duration-in-mins {max(0, (left - need) // 60):.0f}")
    return None


def _failed(root: str, iteration: int, error: str) -> TrainingStopped:
    latest = files.latest_iteration(root) if os.path.isdir(root) else None
    kept = f"step {latest}, the last committed checkpoint, is intact" if latest is not None else \
        "no earlier checkpoint there"
    return TrainingStopped(f"rank {dist.get_rank()}: saving step {iteration} to --save {root} failed: {error}; "
                           f"{kept}: fix the filesystem (space, permissions, quota) and resume with --load {root}",
                           every_rank=True)
