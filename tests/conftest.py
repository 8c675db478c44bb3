"""Shared helpers: launching multi-rank workers with torchrun on CPU (gloo)."""

import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run where CUDA is available and are skipped (with the reason) elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(nproc: int, script_and_args, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a script under torchrun with ``nproc`` CPU ranks; fail the test with the output tail if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={env['MASTER_PORT']}", *script_and_args] if nproc > 1 else \
        [sys.executable, *script_and_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def single_rank():
    """A world of one CPU rank in this process, with megatron-core's groups (TP=PP=1)."""
    import torch.distributed as dist

    from megatron_ext import parallel
    from megatron_ext.arguments import Mesh

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
