"""Process groups for a validated ``Mesh``: nccl on CUDA, gloo on CPU ranks (with the CPU platform adaptation)."""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext.mesh import Mesh


def choose_backend(requested: Optional[str] = None) -> str:
    return requested or ("nccl" if torch.cuda.is_available() else "gloo")


_timeout_minutes: float = 10  # what every collective may take, megatron-core's groups included


def init_distributed(backend: Optional[str] = None, timeout_minutes: float = 10) -> torch.device:
    """Join the torchrun/Slurm world (a world of one when launched without torchrun); return this rank's device."""
    backend = choose_backend(backend)
    # Megatron-LM's launchers set this: TP's async grad all-reduce relies on one CUDA work queue for ordering.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if backend == "gloo":
        from megatron_ext.platform import cpu

        cpu.install()
        device = torch.device("cpu")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    global _timeout_minutes
    _timeout_minutes = timeout_minutes
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:  # torchrun / Slurm launcher: rendezvous through MASTER_ADDR:MASTER_PORT
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a plain process is a world of one: an in-memory store, no port to collide on
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def init_model_parallel(mesh: Mesh, seed: int) -> None:
    """Create megatron-core's groups for ``mesh`` (re-creatable: tests switch meshes inside one launch)."""
    from megatron.core import parallel_state, tensor_parallel

    if dist.get_world_size() != mesh.world:
        raise RuntimeError(f"mesh was validated for world {mesh.world}, but this launch has {dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**mesh.megatron_sizes(), distributed_timeout_minutes=_timeout_minutes)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    # Python's and numpy's generators too (as Megatron-LM seeds them, per pipeline stage): checkpoints carry them,
    # so two runs of the same command save the same bytes.
    import random

    import numpy as np

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)


def is_gloo() -> bool:
    return dist.get_backend() == "gloo"
