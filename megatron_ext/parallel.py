"""Process groups for a validated ``Mesh``: nccl on CUDA, gloo on CPU ranks (with the CPU platform adaptation)."""

from __future__ import annotations

import datetime
import os
import sys
import weakref
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from megatron_ext.errors import ConfigError
from megatron_ext.mesh import Mesh

T = TypeVar("T")


def choose_backend(requested: Optional[str] = None) -> str:
    return requested or ("nccl" if torch.cuda.is_available() else "gloo")


_timeout_minutes: float = 10  # what every collective may take, megatron-core's groups included
_worlds_torn_down = 0
_stores: list = []


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
        if "RANK" in os.environ and _worlds_torn_down:  # joined again after teardown(): the store (torchrun's, or
            # rank 0's, shared in-process) still holds the last world's keys under the same group names
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"world{_worlds_torn_down}/", store),
                                    rank=rank, world_size=world, timeout=timeout)
        elif "RANK" in os.environ:  # torchrun / Slurm launcher: rendezvous through MASTER_ADDR:MASTER_PORT
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a plain process is a world of one: an in-memory store, no port to collide on
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def init_model_parallel(mesh: Mesh, seed: int) -> None:
    """Create megatron-core's groups for ``mesh`` (re-creatable: tests switch meshes inside one launch)."""
    from megatron.core import parallel_state, tensor_parallel

    if dist.get_world_size() != mesh.world:
        raise RuntimeError(f"mesh was validated for world {mesh.world}, but this launch has {dist.get_world_size()}")
    destroy_model_parallel()
    parallel_state.initialize_model_parallel(**mesh.megatron_sizes(), distributed_timeout_minutes=_timeout_minutes)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    # Python's and numpy's generators too (as Megatron-LM seeds them, per pipeline stage): checkpoints carry them,
    # so two runs of the same command save the same bytes.
    import random

    import numpy as np

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)


_released_with_mesh: "weakref.WeakSet" = weakref.WeakSet()


def release_with_mesh(engine) -> None:
    """``engine.destroy()`` runs when the mesh is destroyed: DeepSpeed's engines keep their gradient hooks on
    autograd's C++ accumulator nodes, a cycle the collector cannot see, so without it an engine (its parameters, its
    optimizer state and the groups they name) outlives every reference to it."""
    _released_with_mesh.add(engine)


def destroy_model_parallel() -> None:
    """Destroy every process group but the world (megatron-core's, DeepSpeed's, those FSDP's meshes or we made) and
    forget the caches that hold them. megatron-core's own ``destroy_model_parallel`` only drops its references: each
    gloo group keeps three threads alive until it is destroyed, so a process that builds mesh after mesh (a test
    runner, a sweep over layouts, a notebook) grew by ~50 threads per world-of-one mesh and hundreds per 8-rank one.
    Every rank calls it (as it called ``new_group``); ``init_model_parallel`` does, before building the next mesh.
    A destroyed group's threads end when the last object holding it (an engine, a model's buffers) is freed."""
    import gc

    from megatron.core import parallel_state

    released = bool(_released_with_mesh)
    while _released_with_mesh:
        _released_with_mesh.pop().destroy()  # no reference kept here: the collection below frees it
    parallel_state.destroy_model_parallel()
    for name, value in vars(parallel_state).items():  # the few it forgets (0.16.1: the intra-partial DP gloo group)
        if name.isupper() and _holds_group(value):
            setattr(parallel_state, name, None)
    _forget_deepspeed_groups()
    _forget_rotary_caches()
    _forget_dtensor_caches()
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:  # the router losses' tracker keeps each loss's reduce and average groups
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    groups = [g for g in list(c10d._world.pg_map) if g is not world]
    for group in groups:
        dist.destroy_process_group(group)
    for _ in range(3 if groups or released else 0):  # (a first mesh has nothing to collect: no 0.7 s for it)
        # engines and models of the old mesh, kept only by reference cycles, let their groups go; what a
        # finaliser freed can take a second pass
        if not gc.collect():
            break


def teardown() -> None:
    """Everything ``init_distributed`` and ``init_model_parallel`` built, the world included: after it a process can
    join another world and build another mesh (engines built on the old groups must not be used again)."""
    global _worlds_torn_down
    destroy_model_parallel()
    if dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        # Kept: rank 0 serves the next world's rendezvous from the same store server (a new one on the same port
        # raced with the others' connections to the old one).
        _stores.append(c10d._world.pg_map[c10d._get_default_group()][1])
        dist.barrier()
        dist.destroy_process_group()
        _worlds_torn_down += 1
    try:
        import deepspeed.comm.comm as ds_comm
    except ImportError:
        return
    ds_comm.cdb = None  # DeepSpeed's comm adopts the current world; a new one is adopted afresh


def _holds_group(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_group(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_group(v) for v in value.values())
    return isinstance(value, dist.ProcessGroup)


def _forget_dtensor_caches() -> None:
    """DTensor caches sharding and redistribution plans by DeviceMesh, and two meshes over the same ranks compare
    equal whatever their groups: FSDP on the next mesh was handed a plan naming a destroyed group."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop, debug

    debug._clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    # Keyed by a weak reference to the mesh, but each planner holds the mesh (and so its groups' threads) itself.
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()


def _forget_rotary_caches() -> None:
    """megatron-core caches rotary embeddings with ``lru_cache`` on ``forward``: the key holds the module, so old
    models (their parameters and the context-parallel group they name) lived as long as the process."""
    for module, cls in (("rotary_pos_embedding", "RotaryEmbedding"), ("yarn_rotary_pos_embedding",
                                                                       "YarnRotaryEmbedding")):
        found = sys.modules.get(f"megatron.core.models.common.embeddings.{module}")
        forward = getattr(getattr(found, cls, None), "forward", None)
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()


def _forget_deepspeed_groups() -> None:
    """DeepSpeed caches the groups it was handed (its ``mpu``) or made (a cloned world, expert groups): forget them,
    so an engine built on the next mesh does not reach for a destroyed group."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name, value in vars(groups).items():
        if name.startswith("_") and name.isupper() and name.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(groups, name, {} if isinstance(value, dict) else None)
    groups.mpu = groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = groups._MPU_TENSOR_MODEL_PARALLEL_RANK = None
    groups.expert_tensor_parallel_world_size = 1


def is_gloo() -> bool:
    return dist.get_backend() == "gloo"


# How long the other ranks wait for rank 0's one-off preparation (tokenizing a data set, downloading one, converting
# a checkpoint): not a collective's --distributed-timeout-minutes, which a large data set can take longer than.
PREPARE_TIMEOUT = datetime.timedelta(hours=12)


def on_rank0(task: Callable[[], T]) -> T:
    """``task`` run by rank 0 alone (one pass over a shared filesystem or a hub download, not one per rank) while the
    others wait in a gloo group of their own with ``PREPARE_TIMEOUT``; its result on every rank, or its failure on
    every rank (a ConfigError as itself, anything else as a RuntimeError naming it), so no rank is left waiting."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return task()
    outcome, error = [None, None], None  # [result, (error type, message)]
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    try:
        if dist.get_rank() == 0:
            try:
                outcome[0] = task()
            except Exception as e:
                error, outcome[1] = e, (type(e).__name__, str(e))
        dist.broadcast_object_list(outcome, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    if outcome[1] is not None:
        kind, message = outcome[1]
        raise ConfigError(message) if kind == "ConfigError" else RuntimeError(
            f"rank 0 failed preparing this run: {kind}: {message}")
    return outcome[0]
