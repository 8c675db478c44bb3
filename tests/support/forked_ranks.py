"""Multi-rank test launches without paying the imports in every rank.

torch, megatron-core, DeepSpeed and transformers take ~6 s of CPU to import; a 4-rank launch on the 2 CI cores
spends ~12 s on that alone, and the suite has dozens of launches. Here the ranks are forked from one server process
that imported them once (multiprocessing's forkserver with preloading: single-threaded when it forks). Each rank
gets the environment torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and runs the entry
script as ``__main__``; when one rank fails the others are stopped, as torchrun does. A world of one gets no rank
variables: a plain ``python script.py``. torchrun itself stays covered by the quickstart and launcher tests, and
``MEGATRON_EXT_TEST_LAUNCHER=torchrun`` runs every launch through it, as a CUDA machine does (``real_processes``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Dict, List

# megatron_ext first, as every entry script imports it: it defers what megatron-core's import pays for nothing
# (platform/imports.py). TorchDynamo and Inductor, which every engine still imports later in a run (DeepSpeed,
# FSDP2, megatron-core's optimizer), ~2 s per rank otherwise. Then what every run imports after them (~1.5 s per
# rank: tokenizers' lazy module tree, the plot, ours).
PRELOAD = ["megatron_ext", "torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "megatron.core", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel", "megatron.core.distributed", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "megatron.core.transformer.moe.moe_layer", "deepspeed", "transformers",
           "safetensors", "datasets", "transformers.models.auto.tokenization_auto", "matplotlib.backends.backend_agg",
           "matplotlib.figure", "megatron_ext.training.run", "megatron_ext.arguments"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        # What the server imports under is what every rank inherits: one intra-op thread, no warnings noise.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # The server outlives the test process otherwise (half a GB each, one per pytest run). Killed, not asked:
        # it waits for its pipe from this process to close, and a process forked from this one may hold that open.
        atexit.register(_kill_server)
    return _context


def _kill_server() -> None:
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:  # gone already
            pass


def _rank_main(script: str, argv: List[str], env: Dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank, in a process forked from the server: ``python script argv`` with ``env``, output to files."""
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    if env.get("MEGATRON_EXT_FAULTS"):  # (a real process plants them as it starts: support/plant/sitecustomize.py)
        from support import faults

        faults.plant()
    # what importing megatron_ext does in a real rank (preloaded here, so not again): its environment settings, such
    # as kineto's log level, which kineto reads when a profile starts (a test run alone had no one to set it)
    from megatron_ext import cli
    from megatron_ext.platform import quiet

    quiet.install()
    cli.hold_stop_signals()
    os.chdir(cwd)
    # A forkserver child inherits "forkserver" as its start method; a torchrun rank has the platform's default
    # (fork on Linux). Without this, every DataLoader worker boots a second server and re-imports (~5 s each).
    multiprocessing.set_start_method(None, force=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    if env.get("PYTHONWARNINGS") == "ignore":
        import warnings

        warnings.simplefilter("ignore")
    import gc

    gc.freeze()  # the preloaded libraries are never garbage: a collection (a mesh torn down) skips them
    script = os.path.abspath(script)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: B036 (a rank's failure is its exit status, as in a real process)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # multiprocessing's children skip them; a real interpreter would run them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


LAUNCHES: List[dict] = []  # every launch of this process: the test, ranks, seconds, timeout (conftest reports them)


def launch(nproc: int, script_and_args: List[str], env: Dict[str, str], cwd: str, timeout: float,
           port: int) -> subprocess.CompletedProcess:
    """Run ``nproc`` ranks; returns the ranks' output concatenated in rank order and the first failing status."""
    start = time.monotonic()
    try:
        return _launch(nproc, script_and_args, env, cwd, timeout, port)
    finally:
        LAUNCHES.append(dict(test=os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0], ranks=nproc,
                             seconds=time.monotonic() - start, timeout=timeout))


def real_processes() -> bool:
    """torchrun's own processes (a plain ``python`` for one rank) instead of forks: when asked, and on a CUDA
    machine, where the imports are cheap beside the runs and a fork from a server that may have touched the driver
    (DeepSpeed's accelerator probe at import) is unsafe."""
    if os.environ.get("MEGATRON_EXT_TEST_LAUNCHER") == "torchrun":
        return True
    import torch

    return torch.cuda.device_count() > 0  # NVML: no CUDA context in the test process


def _launch(nproc: int, script_and_args: List[str], env: Dict[str, str], cwd: str, timeout: float,
            port: int) -> subprocess.CompletedProcess:
    if real_processes():
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
               *script_and_args] if nproc > 1 else [sys.executable, *script_and_args]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    context = _forkserver()
    script, *argv = script_and_args
    with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
        procs, files = [], []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                                ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            files.append((os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err")))
            proc = context.Process(target=_rank_main, args=(script, argv, rank_env, cwd, *files[-1]))
            proc.start()
            procs.append(proc)
        returncode = _wait(procs, timeout)
        stdout, stderr = ("".join(open(path).read() if os.path.exists(path) else f"(no {path})\n"
                                  for path in paths) for paths in zip(*files))
    if returncode is None:
        raise subprocess.TimeoutExpired(script_and_args, timeout, stdout, stderr)
    return subprocess.CompletedProcess(script_and_args, returncode, stdout, stderr)


def _wait(procs, timeout: float):
    """0 when every rank exits 0; the first nonzero status, after stopping the rest; None on timeout."""
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.exitcode is None for p in procs):
        left = deadline - time.monotonic()
        if left <= 0:
            _stop(procs)
            return None
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(left, 1.0))
        failed = next((p.exitcode for p in procs if p.exitcode not in (None, 0)), None)
        if failed is not None:
            time.sleep(1.0)  # let the others report their own error, then stop them (torchrun does the same)
            _stop(procs)
            return failed
    return next((p.exitcode for p in procs if p.exitcode != 0), 0)


def _stop(procs) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(5)
