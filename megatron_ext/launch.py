"""torchrun for our entry scripts, with one line per mistake: ``python -m megatron_ext.launch <torchrun's options>
finetune_qwen.py <flags>`` (what examples/_launch.sh runs on every node).

torchrun itself (its elastic agent, in this process), with what a newcomer needs around it:
- The flags are checked once, in one process, before any rank starts: a bad flag or a missing file is the entry
  script's own one line in about 2 s, exit 2, instead of every rank starting first. A second node that would wait
  for itself (NNODES > 1, NODE_RANK > 0, MASTER_ADDR unset or loopback) is refused in one line.
- When a rank fails, the first failing rank's one line is printed, not torchrun's traceback: exit 2 for bad input
  (a rank's ``ConfigError``), 1 for a failure. Each rank writes that line to a file of ours (``STATUS_DIR``) instead
  of printing it, so it appears once; a rank's own traceback, when it has one, stays above it.
- SIGTERM and SIGUSR1 have one outcome at every moment (docs/reliability.md's table). Before any rank runs (the
  flag check, the rendezvous) this process stops what it started and ends in about a second, one line, exit 0.
  Once ranks run, the signal goes to each rank as soon as it holds it (megatron_ext's import, ``cli``): a rank
  still starting, preparing data or scoring a reference holds it and stops after its first step, saved; in the
  loop it finishes its step, saves and exits 0; this process then exits 0 too (torchrun exits 1 after a SIGTERM
  whatever its ranks did). Ranks still running SHUTDOWN_TIMEOUT seconds later (``--shutdown-timeout``) are
  killed, exit 1. torchrun's own ``--signals-to-handle`` is honoured without these two (refused with them).
``python finetune_qwen.py`` and ``torchrun ... finetune_qwen.py`` keep working without it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import List, Optional

from megatron_ext.cli import STATUS_DIR  # set for the ranks: where each writes how it failed (cli.run_main)
from megatron_ext.errors import PREFLIGHT  # set for the single-process check: arguments.parse stops after its checks

ENTRY_SCRIPTS = ("finetune_qwen.py", "pretrain_gpt.py", "pretrain_vit.py", "verify_model.py")  # what the check runs
LOOPBACK = ("127.", "localhost", "::1", "0.0.0.0")
NAME = "megatron_ext.launch"


def _statuses(folder: str) -> dict:
    statuses = {}
    for path in glob.glob(os.path.join(folder, "rank*.json")):
        with open(path) as f:
            status = json.load(f)
        statuses[status["rank"]] = status
    return statuses


def first_failure(failures: dict, statuses: dict) -> str:
    """The line that explains a failed run, from torchrun's ``{rank: ProcessFailure}`` and the ranks' own lines:
    bad input first; then a rank that ended on its own without a word of ours (a crash, an exit: the others' failed
    collectives follow from it); then the earliest line; last a rank killed by SIGTERM or SIGKILL, which is how
    torchrun stops the ranks left after a failure (and how the OOM killer ends one), named only when no rank said
    anything."""
    bad_input = [s for s in statuses.values() if s["code"] == 2]
    stopped = (-signal.SIGTERM, -signal.SIGKILL)
    silent = sorted(r for r, f in failures.items() if r not in statuses and f.exitcode not in stopped)
    if bad_input or not silent and statuses:
        status = min(bad_input or statuses.values(), key=lambda s: (s["time"], s["rank"]))
        line = status["line"]
        return line if line.startswith(f"rank {status['rank']}") else f"rank {status['rank']}: {line}"
    rank = silent[0] if silent else min(r for r in failures if r not in statuses) if set(failures) - set(statuses) \
        else min(failures)
    code = failures[rank].exitcode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return f"rank {rank} ended ({how}) without a word of ours; its output is above"


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _node0_here(addr: str, port: int) -> bool:
    """Node 0 of this job runs on this machine (several "nodes" on one host): its rendezvous port is open, or its
    launcher process is starting."""
    import socket

    import psutil

    try:
        socket.create_connection((addr, port), 1).close()
        return True
    except OSError:
        pass

    def value(argv, flag):  # torchrun takes --node-rank and --node_rank alike
        names = (flag, "--" + flag[2:].replace("-", "_"))
        at = next((i for i, a in enumerate(argv) if a in names), None)
        return argv[at + 1] if at is not None and at + 1 < len(argv) else None

    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if (process.pid != os.getpid() and NAME in argv and value(argv, "--node-rank") == "0"
                and value(argv, "--master-port") == str(port)):
            return True
    return False


def _check_nodes(args, max_nodes: int) -> Optional[str]:
    """A node other than the first whose MASTER_ADDR is unset or loopback would wait forever for a rendezvous on
    itself, unless node 0 runs on this very machine."""
    node_rank = int(args.node_rank)
    addr = args.master_addr or "127.0.0.1"
    if max_nodes == 1 or node_rank == 0 or not addr.startswith(LOOPBACK):
        return None
    if _node0_here(addr, int(args.master_port or 29500)):
        return None
    return (f"NNODES={max_nodes} NODE_RANK={node_rank} with MASTER_ADDR={args.master_addr or '(unset)'}: node 0 is "
            "not on this machine, so this node would wait for a rendezvous on itself; set MASTER_ADDR to node 0's "
            "address (the same on every node)")


def preflight(script: str, script_args: List[str], world_size: int, nproc: int, node_rank: int) -> int:
    """The entry script's own checks (arguments.parse) in one process that stands for rank 0 of the whole world."""
    if os.path.basename(script) not in ENTRY_SCRIPTS:
        return 0
    env = dict(os.environ, WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK=str(node_rank), **{PREFLIGHT: "1"})
    env.pop(STATUS_DIR, None)
    with subprocess.Popen([sys.executable, script, *script_args], env=env) as check:
        return check.wait()


class _Signals:
    """SIGTERM/SIGUSR1 to this process. Before any rank runs: what this process started is stopped and it ends now,
    one line, exit 0 (nothing to save). After: passed to each rank once it holds such signals (its ``ready.<pid>``
    file in ``folder``; a rank still importing would die of one), and after ``grace`` seconds the ranks left are
    killed."""

    def __init__(self, grace: float, ours: bool = True):
        self.grace, self.received, self.killed = grace, None, False
        self.folder: Optional[str] = None  # the ranks' STATUS_DIR, once the launch has one
        self.ours = ours  # an entry script of ours, whose ranks say when they hold the signals
        self.passed: set = set()
        self.stopping = threading.Event()  # ending before any rank ran: the listener ends this process

    def install(self) -> None:
        """Handled off the main thread: Python runs a handler only when the main thread returns to the interpreter,
        and the rendezvous holds it in C++ for minutes; the signal's number reaches a thread through the wakeup fd
        the interpreter writes to as the signal arrives."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda signum, frame: None)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._listen, args=(read,), daemon=True, name="megatron_ext-signals").start()

    def _listen(self, read: int) -> None:
        while True:
            for signum in os.read(read, 64):
                if signum in (signal.SIGTERM, signal.SIGUSR1):
                    self._handle(signum, None)

    def _ranks(self):
        import psutil

        return psutil.Process().children()

    def _pass_on(self, signum) -> int:
        """The signal to every child that holds it; how many children are still starting."""
        waiting = 0
        for rank in self._ranks():
            ready = not self.ours or self.folder and os.path.exists(os.path.join(self.folder, f"ready.{rank.pid}"))
            if not ready:
                waiting += 1
            elif (rank.pid, signum) not in self.passed:
                self.passed.add((rank.pid, signum))
                try:
                    rank.send_signal(signum)
                except Exception:  # psutil.NoSuchProcess: it just ended
                    pass
        return waiting

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.folder is None or not self._ranks():  # the flag check or the rendezvous: no rank runs yet
            self._end_before_ranks(name)
        self._pass_on(signum)
        if self.received is None:
            self.received = name
            threading.Thread(target=self._pass_late, args=(signum,), daemon=True, name="megatron_ext-pass").start()
            threading.Thread(target=self._kill_late, daemon=True, name="megatron_ext-grace").start()

    def _end_before_ranks(self, name: str) -> None:
        """No rank to save anything: this process's children (the flag check; a rank spawned this very moment) are
        stopped, and it ends here."""
        self.stopping.set()
        print(f"megatron_ext.launch: {name} before any rank started: nothing to save; stopped", file=sys.stderr,
              flush=True)
        for _ in range(5):  # (a rank the agent is spawning right now shows up within these 0.5 s)
            for child in self._ranks():
                try:
                    child.kill()
                except Exception:
                    pass
            time.sleep(0.1)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(0)

    def _pass_late(self, signum) -> None:
        """Ranks that were still starting get the signal as soon as they hold it."""
        while self._pass_on(signum):
            time.sleep(0.05)

    def _kill_late(self) -> None:
        time.sleep(self.grace)
        ranks = self._ranks()
        if ranks:
            self.killed = True
            print(f"error: {len(ranks)} rank(s) still running {self.grace:.0f} s after {self.received} "
                  f"(SHUTDOWN_TIMEOUT, --shutdown-timeout): killed, their save is not committed; raise it to the "
                  "time a save takes", file=sys.stderr, flush=True)
            for rank in ranks:
                try:
                    rank.kill()
                except Exception:
                    pass


def _torchrun_defaults(args):
    """What torchrun's ``run()`` settles before it launches: --standalone, or one node with no port given, rendezvous
    on a free local port; else MASTER_PORT 29500."""
    import uuid

    from torch.distributed.run import parse_min_max_nnodes

    one_node = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None \
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or one_node:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    return args


OURS = ("SIGTERM", "SIGUSR1")  # the signals this launcher handles (_Signals)


def _agent_signals(argv: List[str], given: str) -> str:
    """torchrun's --signals-to-handle for its agent: the user's, if given, without ours (refused with them); else
    the rest of torchrun's default."""
    named = any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv) \
        or "PET_SIGNALS_TO_HANDLE" in os.environ
    if not named:
        return "SIGINT,SIGHUP,SIGQUIT"
    clash = [s.strip() for s in given.split(",") if s.strip() in OURS]
    if clash:
        raise ValueError(f"--signals-to-handle {given}: {', '.join(clash)} is megatron_ext.launch's (every rank saves "
                         "and exits 0, docs/reliability.md); leave SIGTERM and SIGUSR1 out")
    return given


def _reason(error: BaseException) -> str:
    """An exception's first line, and its innermost cause's when that says something else."""
    def first(e):
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"

    cause = error
    while cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__):
        cause = cause.__cause__ or cause.__context__
    return first(error) + (f" (caused by {first(cause)})" if cause is not error else "")


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    argv = sys.argv[1:] if argv is None else argv
    args = _torchrun_defaults(parse_args(argv))
    # torchrun's own default for its ranks, which it announces in a banner when the variable is unset
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config, cmd, cmd_args = config_from_args(args)
    try:
        config.signals_to_handle = _agent_signals(argv, args.signals_to_handle)
    except ValueError as e:
        return _fail(str(e), 2)
    problem = _check_nodes(args, config.max_nodes)
    if problem:
        return _fail(problem, 2)
    grace = args.shutdown_timeout or float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    signals = _Signals(grace, ours=os.path.basename(args.training_script) in ENTRY_SCRIPTS)
    signals.install()  # from here on a signal has its outcome (the flag check included)
    code = preflight(args.training_script, args.training_script_args, config.max_nodes * config.nproc_per_node,
                     config.nproc_per_node, int(args.node_rank))
    if signals.stopping.is_set():  # the check was stopped by a signal: the listener ends this process
        threading.Event().wait()
    if code:
        return code
    logging.disable(logging.ERROR)  # the agent's own lines; what they say is said below, once
    script = os.path.basename(args.training_script)
    with tempfile.TemporaryDirectory(prefix="megatron_ext-ranks-") as folder:
        os.environ[STATUS_DIR] = signals.folder = folder
        try:
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
            return 0
        except ChildFailedError as e:
            if signals.killed:
                return 1
            statuses = _statuses(folder)
            code = 2 if any(s["code"] == 2 for s in statuses.values()) else 1
            return _fail(f"{script}: {first_failure(e.failures, statuses)}", code)
        except SignalException as e:
            return 128 + int(e.sigval)
        except (RendezvousError, DistNetworkError, DistStoreError) as e:  # a node missing, a port taken
            return _fail(f"torchrun on {args.master_addr}:{args.master_port} (MASTER_ADDR:MASTER_PORT): "
                         f"{_reason(e)}", 1)
        except Exception as e:  # ours or torchrun's own failure: its traceback, then its cause
            traceback.print_exc()
            return _fail(f"{NAME}: internal error: {_reason(e)} (traceback above)", 1)


if __name__ == "__main__":
    sys.exit(main())
