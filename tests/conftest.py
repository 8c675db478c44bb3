"""Shared helpers: launching multi-rank workers with torchrun on CPU (gloo)."""

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# No test reaches the network. Set before any test module is collected: huggingface_hub and datasets read these
# once, at import, and test modules import them (a hub look-up made online waits ~20 s for its retries to fail).
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run where CUDA is available, and those marked ``multigpu(N)`` where N GPUs are; the rest
    are skipped with the reason, so a single-GPU machine's report says which tests it did not run."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        needs = item.get_closest_marker("multigpu")
        if "gpu" in item.keywords and not gpus:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif needs is not None and gpus < needs.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"not run: needs {needs.args[0]} GPUs, this machine has {gpus}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, script_and_args, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a script on ``nproc`` CPU ranks (as torchrun would start them; forked_ranks.py says how) or, for one, as
    a plain process; fail the test with the output tail if it fails."""
    import forked_ranks

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(port))
    proc = forked_ranks.launch(nproc, list(script_and_args), env, REPO, timeout, port)
    if proc.returncode != 0:
        pytest.fail(f"{nproc} rank(s) of {' '.join(script_and_args)} exited {proc.returncode}:\n"
                    f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


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
    dist.destroy_process_group()


def run_tool(name: str, *args) -> None:
    """tools/<name>.py's ``main`` in this process: no second interpreter paying megatron-core's imports. (Exit
    codes and one-line errors are tested through subprocesses where they matter.)"""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in args])
