"""Shared helpers: launching multi-rank workers with torchrun on CPU (gloo)."""

import concurrent.futures
import gc
import os
import socket
import subprocess
import time
from typing import Callable, Dict, TypeVar

import pytest

import thread_guard

T = TypeVar("T")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# No test reaches the network. Set before any test module is collected: huggingface_hub and datasets read these
# once, at import, and test modules import them (a hub look-up made online waits ~20 s for its retries to fail).
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n 2``) each lane keeps to its own share of the cores, and so does every
    process it starts: ranks that talk through gloo hand each message between threads (~6 wake-ups per collective
    and rank), and on a core of their own those hand-offs stay local instead of crossing to the other lane's core
    (measured on 2 cores: a quarter less kernel time, 6% less CPU in all)."""
    worker, lanes = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker and lanes > 1 and len(cores) >= lanes and os.environ.get("MEGATRON_EXT_PIN_LANES", "1") == "1":
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % lanes::lanes])


def pytest_collection_finish(session):
    """What the imports made is never garbage: frozen out of the collector, a ``gc.collect`` (the thread guard's,
    ``parallel.destroy_model_parallel``'s) takes milliseconds instead of a quarter second."""
    gc.freeze()


# The files that keep a lane busy a minute or more (measured on 2 cores), longest first. Under ``--dist loadfile``
# (with xdist's own reordering, by number of tests, turned off) the lanes take files in collection order, so these
# go first: a long file that starts last runs alone while the other core idles.
LONG_FILES = ("test_async_save.py", "test_pretrained.py", "test_math_report.py", "test_deepspeed_engine.py",
              "test_parity_megatron.py", "test_repo.py", "test_multinode.py", "test_gpu_check.py",
              "test_finetune_e2e.py", "test_reliability.py", "test_pretrain_vit.py", "test_pretrain_gpt.py",
              "test_generate_eval.py", "test_peft.py", "test_verify_model.py", "test_bench.py", "test_dpo.py")


def pytest_collection_modifyitems(config, items):
    """The long files first (LONG_FILES). Tests marked ``gpu`` run where CUDA is available, and those marked
    ``multigpu(N)`` where N GPUs are; the rest are skipped with the reason, so a single-GPU machine's report says
    which tests it did not run."""
    import torch

    items.sort(key=lambda item: LONG_FILES.index(item.path.name) if item.path.name in LONG_FILES else len(LONG_FILES))

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        needs = item.get_closest_marker("multigpu")
        if "gpu" in item.keywords and not gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif needs is not None and gpus < needs.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"not run: needs {needs.args[0]} GPUs, this machine has {gpus}"))


def free_port() -> int:
    """A port for a rendezvous, free now and below the kernel's ephemeral range (32768 and up on Linux): there a
    gloo connection of the other lane, whose source port the kernel picks from that range, cannot take it before
    rank 0 listens on it (seen once: EADDRINUSE)."""
    import random

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
DEEPSPEED_AT_TEST_SCALE = os.path.join(REPO, "tests", "deepspeed_at_test_scale.json")


def deepspeed_at_test_scale(args: list) -> list:
    """``args`` of a DeepSpeed run with ``DEEPSPEED_AT_TEST_SCALE``, unless they bring their own DeepSpeed config."""
    if "deepspeed" in args and "--deepspeed-config" not in args:
        return [*args, "--deepspeed-config", DEEPSPEED_AT_TEST_SCALE]
    return args


def run_ranks(nproc: int, script_and_args, timeout: int = 600, plot: bool = False) -> subprocess.CompletedProcess:
    """Run a script on ``nproc`` CPU ranks (as torchrun would start them; forked_ranks.py says how) or, for one, as
    a plain process; fail the test with the output tail if it fails. No training.png unless ``plot``: it is a third
    of a short run's wall time. DeepSpeed runs at test scale (``deepspeed_at_test_scale``)."""
    import forked_ranks

    script_and_args = deepspeed_at_test_scale([str(a) for a in script_and_args])
    for attempt in range(2):  # a port free when picked can be taken before rank 0 listens (the other lane's
        port = free_port()   # launch picked it too): that launch is run again on another port, once
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(port),
                   MEGATRON_EXT_PLOT="1" if plot else "0")
        proc = forked_ranks.launch(nproc, list(script_and_args), env, REPO, timeout, port)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            break
    if proc.returncode != 0:
        pytest.fail(f"{nproc} rank(s) of {' '.join(script_and_args)} exited {proc.returncode}:\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def run_concurrently(launches: Dict[str, Callable[[], T]]) -> Dict[str, T]:
    """``{name: launch()}``: all at once on a CUDA machine (small GPU runs are a few CPU-bound seconds of start-up
    each, on 16 cores, beside a GPU they leave mostly idle; the GPU tier's window is minutes), one after another on
    CPU (two cores: nothing to gain). A failing launch fails the test once the others have finished."""
    import forked_ranks

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
    import forked_ranks

    return forked_ranks.launch(1, [str(a) for a in script_and_args], dict(os.environ, **(env or {})), str(cwd),
                               timeout, free_port())


@pytest.fixture(scope="session", autouse=True)
def published_hub(tmp_path_factory):
    """No test reaches the network (HF_HUB_OFFLINE), and the hub ids the launchers start from resolve to their
    published config.json (tests/hf_fixtures.py): their flags parse as they would on a cluster."""
    import hf_fixtures

    env = hf_fixtures.published_hub(tmp_path_factory.mktemp("hub"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def single_rank():
    """A world of one CPU rank in this process, with megatron-core's groups (TP=PP=1)."""
    import torch.distributed as dist

    from megatron_ext import parallel
    from megatron_ext.mesh import Mesh

    parallel.init_distributed("gloo")
    parallel.init_model_parallel(Mesh(world=1), seed=1)
    yield
    if dist.is_initialized():
        parallel.teardown()


_peak_threads = [0]
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaked_rank_variables(request):
    """torchrun's variables as the test found them: one left in this process's environment (DeepSpeed sets
    LOCAL_RANK in a plain process; a RANK once made every later one-rank launch rendezvous through an unset
    MASTER_ADDR) would reach later tests. Restored, and named in the warnings summary."""
    before = {k: os.environ.get(k) for k in RANK_VARIABLES}
    yield
    changed = [key for key in RANK_VARIABLES if os.environ.get(key) != before[key]]
    for key in changed:
        os.environ.pop(key, None) if before[key] is None else os.environ.__setitem__(key, before[key])
    if changed:
        request.node.warn(pytest.PytestWarning(f"{request.node.nodeid} left {', '.join(changed)} changed in the "
                                               "environment (restored)"))


@pytest.fixture(autouse=True)
def no_leaked_threads(request):
    """A test must not end holding more threads than it started with: a process group left alive keeps three gloo
    threads spinning for the rest of the run (2,500 of them once made the suite 4x slower). Wider-scoped fixtures
    are set up before this one, so what they hold is not charged to the test that first asked for them."""
    before, by_name = thread_guard.count(), thread_guard.names()
    yield
    if request.node.get_closest_marker("gpu"):
        return  # CUDA, NCCL and inductor keep worker threads for the process's life (gloo's are what this guards)
    after = thread_guard.count()
    deadline = time.monotonic() + 2.0
    while after > before + thread_guard.SLACK and time.monotonic() < deadline:
        gc.collect()  # the test's engines, freed only by the collector, let go of their groups
        time.sleep(0.05)  # and threads already told to stop (a closed writer, a joined pool) finish
        after = thread_guard.count()
    _peak_threads[0] = max(_peak_threads[0], after)
    if after > before + thread_guard.SLACK:
        pytest.fail(f"{request.node.nodeid} leaked {after - before} threads ({before} -> {after}: "
                    f"{thread_guard.grown(by_name)}): destroy the process groups it builds "
                    "(megatron_ext.parallel.destroy_model_parallel, or teardown for the world)", pytrace=False)
    if after > thread_guard.LIMIT and after > before:  # (a fixture wider than the test may have added them)
        pytest.fail(f"the test process holds {after} threads after {request.node.nodeid} (limit {thread_guard.LIMIT})",
                    pytrace=False)


_started = time.monotonic()
_workers = []  # under pytest-xdist (the README's -n 2), in the controller: each worker's launches and threads


def _report() -> dict:
    import forked_ranks

    gc.collect()
    return dict(launches=forked_ranks.LAUNCHES, peak=_peak_threads[0], count=thread_guard.count(),
                held=thread_guard.names().most_common(3), seconds=time.monotonic() - _started,
                lane=os.environ.get("PYTEST_XDIST_WORKER", "main"))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints the summary
        session.config.workeroutput["megatron_ext"] = _report()


def pytest_testnodedown(node, error):
    if "megatron_ext" in getattr(node, "workeroutput", {}):
        _workers.append(node.workeroutput["megatron_ext"])


def pytest_terminal_summary(terminalreporter):
    reports = _workers or [_report()]
    launches = [launch for report in reports for launch in report["launches"]]
    if launches:
        tight = min(launches, key=lambda r: r["timeout"] / max(r["seconds"], 1e-9))
        terminalreporter.write_line(
            f"rank launches: {len(launches)}, {sum(r['seconds'] for r in launches):.0f} s in all; least "
            f"headroom {tight['timeout'] / tight['seconds']:.1f}x the measured time ({tight['test']}: "
            f"{tight['ranks']} ranks, {tight['seconds']:.0f} s of a {tight['timeout']:.0f} s timeout)")
        if os.environ.get("MEGATRON_EXT_LAUNCH_LOG"):
            import json

            with open(os.environ["MEGATRON_EXT_LAUNCH_LOG"], "w") as f:
                json.dump(launches, f, indent=1)
    for report in reports:
        held = ", ".join(f"{name} {k}" for name, k in report["held"])
        terminalreporter.write_line(f"{report['lane']}: {report['seconds']:.0f} s; threads: {report['count']} in the "
                                    f"test process at the end ({held}), at most {report['peak']} after any test "
                                    f"(limit {thread_guard.LIMIT})")


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

