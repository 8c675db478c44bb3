"""Every launch a test makes of an entry script or worker: ``run_ranks`` (N ranks, or one plain process, with the
port retry), ``run_script`` (one process, nothing checked), ``run_concurrently``, ``run_tool`` (in this process)."""

import concurrent.futures
import os
import random
import socket
import subprocess
from typing import Callable, Dict, TypeVar

import pytest

from support import REPO, TESTS, faults, forked_ranks

T = TypeVar("T")


def free_port() -> int:
    """A port for a rendezvous, free now and below the kernel's ephemeral range (32768 and up on Linux): there a
    gloo connection of the other lane, whose source port the kernel picks from that range, cannot take it before
    rank 0 listens on it (seen once: EADDRINUSE)."""
    low, _ = _ephemeral_range()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a busy machine: whatever the kernel gives)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return tuple(int(x) for x in f.read().split())
    except OSError:
        return 32768, 60999


# DeepSpeed's defaults are sized for real models: ZeRO-3 keeps a parameter of under 1e5 elements whole on every rank
# (stage3_param_persistence_threshold), and gradients are reduced and weights gathered in buckets of 5e8 elements.
# Every parameter of the tiny test models would stay whole and every step be one bucket, so ZeRO-3's gathers and
# releases and the reductions during the backward would go untested. Test runs use buckets of 4,096 elements (dozens
# per tiny model) and partition every parameter.
DEEPSPEED_AT_TEST_SCALE = os.path.join(TESTS, "support", "deepspeed_at_test_scale.json")


def deepspeed_at_test_scale(args: list) -> list:
    """``args`` of a DeepSpeed run with ``DEEPSPEED_AT_TEST_SCALE``, unless they bring their own DeepSpeed config."""
    if "deepspeed" in args and "--deepspeed-config" not in args:
        return [*args, "--deepspeed-config", DEEPSPEED_AT_TEST_SCALE]
    return args


def run_ranks(nproc: int, script_and_args, timeout: int = 600, plot: bool = False, check: bool = True,
              fault: str = "", **env) -> subprocess.CompletedProcess:
    """Run a script on ``nproc`` CPU ranks (as torchrun would start them; forked_ranks.py says how) or, for one, as
    a plain process, with ``env`` added to the environment and ``fault`` planted (support/faults.py); fail the test
    with the output tail if it fails, unless not ``check``. No training.png unless ``plot``: it is a third of a short
    run's wall time. DeepSpeed runs at test scale (``deepspeed_at_test_scale``)."""
    script_and_args = deepspeed_at_test_scale([str(a) for a in script_and_args])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGATRON_EXT_PLOT="1" if plot else "0",
               **faults.env(fault), **{k: str(v) for k, v in env.items()})
    for attempt in range(2):  # a port free when picked can be taken before rank 0 listens (the other lane's
        port = free_port()   # launch picked it too): that launch is run again on another port, once
        proc = forked_ranks.launch(nproc, list(script_and_args), dict(env, MASTER_PORT=str(port)), REPO, timeout,
                                   port)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            break
    if check and proc.returncode != 0:
        pytest.fail(f"{nproc} rank(s) of {' '.join(script_and_args)} exited {proc.returncode}:\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def run_concurrently(launches: Dict[str, Callable[[], T]]) -> Dict[str, T]:
    """``{name: launch()}``: all at once on a CUDA machine (small GPU runs are a few CPU-bound seconds of start-up
    each, on 16 cores, beside a GPU they leave mostly idle; the GPU tier's window is minutes), one after another on
    CPU (two cores: nothing to gain). A failing launch fails the test once the others have finished."""
    if not forked_ranks.real_processes() or len(launches) < 2:
        return {name: launch() for name, launch in launches.items()}
    # Each run compiles megatron-core's fused kernels (torch.compile): one compile worker each, not a pool of one
    # per core in every run at once.
    saved = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    try:
        with concurrent.futures.ThreadPoolExecutor(len(launches)) as pool:
            futures = {name: pool.submit(launch) for name, launch in launches.items()}
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS")
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = saved
    return {name: future.result() for name, future in futures.items()}


def run_script(script_and_args, env=None, cwd: str = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python script args`` as a plain process (exit status, stdout, stderr; nothing checked), forked from the
    preloaded server of forked_ranks.py: a subprocess's view without paying the imports again (~6 s a run). Tests of
    what happens before the slow imports, or of the interpreter's start-up, keep a real subprocess."""
    return forked_ranks.launch(1, [str(a) for a in script_and_args], dict(os.environ, **(env or {})), str(cwd),
                               timeout, free_port())


def run_tool(name: str, *args) -> None:
    """tools/<name>.py's ``main`` in this process: no second interpreter paying megatron-core's imports. (Exit
    codes and one-line errors are tested through subprocesses where they matter.)"""
    import importlib.util

    from megatron.core import parallel_state

    from megatron_ext import parallel

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    had_groups = parallel_state.model_parallel_is_initialized()  # single_rank's, which the tool's replace
    try:
        module.main([str(a) for a in args])
    finally:  # a conversion builds a world of one's model-parallel groups: the process outlives them
        if not had_groups:
            parallel.destroy_model_parallel()
