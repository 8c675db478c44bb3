"""pytest's hooks and fixtures for the suite: lanes pinned to their cores, the long files first, GPU markers, the
hub offline, and guards against leaked threads and rank variables. What tests share otherwise: tests/support/."""

import gc
import glob
import os
import sys
import time

import pytest

from support import thread_guard

# Tests live by concern (tests/config/, tests/models/, ..., tests/gpu/); a few reuse another's fixtures by module
# name (``from test_vit import hf_vit``), so every folder is importable as pytest makes its own.
sys.path[1:1] = sorted(d for d in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "*", ""))
                       if not d.rstrip(os.sep).endswith(("support", "__pycache__")))

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
        if item.get_closest_marker("gpu") is not None and not gpus:  # (not the gpu/ folder's name)
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif needs is not None and gpus < needs.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"not run: needs {needs.args[0]} GPUs, this machine has {gpus}"))


@pytest.fixture(scope="session", autouse=True)
def published_hub(tmp_path_factory):
    """No test reaches the network (HF_HUB_OFFLINE), and the hub ids the launchers start from resolve to their
    published config.json (tests/support/hf_fixtures.py): their flags parse as they would on a cluster."""
    from support import hf_fixtures

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
    from support import forked_ranks

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
