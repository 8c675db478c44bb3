"""Checkpoints in megatron-core's distributed format, laid out as Megatron-LM lays them out.

``<dir>/iter_0000042/`` holds one distributed checkpoint (every tensor saved once, with its global shape, so it
loads under any TP/PP/DP mesh) and ``<dir>/latest_checkpointed_iteration.txt`` names the newest. Besides model and
optimizer, the checkpoint carries the LR schedule, the data position and every rank's RNG state. Saves are atomic
and listed in a manifest (``checkpoint.files``); loads check it and run no code from the checkpoint (``safe_load``).
The package sits below the engines: they stage and load through it (``writer`` runs the saves).
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import List, Optional, Tuple

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.checkpoint import safe_load
from megatron_ext.checkpoint.files import DS_LATEST, FIX, TRACKER, begin_save, locate
from megatron_ext.parallel import on_rank0
from megatron_ext.errors import ConfigError
from megatron_ext.models.sharding import unwrap


def _rng_state() -> ShardedObject:
    """This rank's RNG states, one object per (pp, tp, dp) position; restored only on the same mesh."""
    state = dict(random=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                 tracker=tensor_parallel.get_cuda_rng_tracker().get_states(),
                 cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
    pp, tp, dp = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_data_parallel_rank(with_context_parallel=True))
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    return ShardedObject("rng_state", state, shape, (pp, tp, dp), replica_id=0)


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def stage(root: str, iteration: int, engine, extra: dict):
    """Everything needed to resume at ``iteration``, staged for writing (``checkpoint_writer``); ``extra`` (data
    position, mesh, model shape and dtype, the original HF config: what resuming and the HF exporter need) is
    common to all ranks. Written beside, renamed when complete, tracker last (``commit_save``)."""
    from megatron_ext.checkpoint.writer import StagedSave, preloaded

    staging = begin_save(root, iteration)
    state = engine.sharded_state_dict()
    state.update(iteration=iteration, rng_state=_rng_state(), **extra)
    request = dist_checkpointing.save(state, staging, async_sharded_save=True)
    return StagedSave(root, iteration, staging, requests=[preloaded(request)])


def find(root: str) -> Optional[str]:
    """The newest megatron-core checkpoint under ``root`` (or ``root`` itself, an ``iter_`` directory); None if
    ``root`` holds none at all; ConfigError (one line) for an incomplete one, another engine's, or one whose pickles
    name anything but data classes."""
    path = locate(root)
    if path is None:
        if os.path.isfile(os.path.join(root, DS_LATEST)):
            raise ConfigError(f"--load {root} was written by --engine deepspeed; resume it with --engine deepspeed, "
                              f"or take its weights with --load {root}/iter_XXXXXXX/mcore --finetune")
        return None
    if os.path.isfile(os.path.join(path, "metadata.json")):
        def scan() -> None:  # what megatron-core unpickles before any tensor (.metadata: plain pickle.load)
            for name in ("common.pt", ".metadata"):
                if os.path.isfile(os.path.join(path, name)):
                    safe_load.check_file(os.path.join(path, name), f"--load {root}: {os.path.join(path, name)}")

        on_rank0(scan)
        return path
    if os.path.isfile(os.path.join(path, "fsdp_common.pt")):
        raise ConfigError(f"--load {root} was written by --engine fsdp (torch.distributed.checkpoint), which "
                          "only --engine fsdp resumes so far")
    if os.path.isdir(os.path.join(path, "mcore")):
        raise ConfigError(f"--load {root} was written by --engine deepspeed; resume it with --engine deepspeed, "
                          f"or take its weights with --load {os.path.join(path, 'mcore')} --finetune")
    what = "is missing" if not os.path.isdir(path) else "has no metadata.json (not a complete checkpoint)"
    raise ConfigError(f"--load {root}: {path} {what}; {FIX}")


def read_errors():
    """What reading a damaged checkpoint raises (torch, DCP, zip, pickle), turned into one line by ``reading``."""
    import pickle
    import zipfile

    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    return (OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, CheckpointException,
            CheckpointingException, RuntimeError)


@contextlib.contextmanager
def reading(root: str, path: str):
    """Reading the checkpoint ``path``: sharded objects scanned before they are unpickled, a read error one line
    naming it (the manifest check catches missing and truncated files first; this covers older checkpoints)."""
    try:
        with safe_load.scanned_sharded_objects(path):
            yield
    except ConfigError:
        raise
    except read_errors() as e:
        detail = " ".join(str(e).split())[:300]
        damaged = ("PytorchStreamReader", "No such file", "FileNotFoundError", "Errno", "EOF", "truncated", "corrupt",
                   "unpickl", "zip")
        if not isinstance(e, (OSError, EOFError)) and not any(word in detail for word in damaged):
            raise  # not a damaged file (a layout mismatch, a bug): as it is
        raise ConfigError(f"--load {root}: cannot read {path} ({type(e).__name__}: {detail}); {FIX}") from None


def _checked_path(root: str, model_shape: Optional[dict]) -> Optional[Tuple[str, dict]]:
    path = find(root)
    if path is None:
        return None
    with reading(root, path):
        common = dist_checkpointing.load_common_state_dict(path)
    if model_shape is not None and common.get("model_shape") not in (None, model_shape):
        raise ConfigError(f"--load {root} holds a model of shape {common['model_shape']}, but the flags build "
                          f"{model_shape}; pass the --model/--hf-config the checkpoint was made with")
    return path, common


def load_weights(root: str, chunks, model_shape: Optional[dict] = None, replaceable=()) -> List[str]:
    """--finetune: the newest checkpoint's weights into bare model chunks, before any engine wraps them.
    Parameters named in ``replaceable`` (a classifier head) that the checkpoint lacks or holds in another shape are
    left out and start at zero; returns those of this rank, described, for the caller to report."""
    found = _checked_path(root, model_shape)
    if found is None:
        raise ConfigError(f"--load {root} --finetune: no megatron-core distributed checkpoint there "
                          f"(expected {TRACKER} or an iter_XXXXXXX directory with metadata.json)")
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    templates = {k: unwrap(c).sharded_state_dict() for k, c in zip(keys, chunks)}
    with reading(root, found[0]):
        saved = dist_checkpointing.load_tensors_metadata(found[0]) if replaceable else {}
    fresh = {k: [] for k in keys}
    for key, template in templates.items():
        for name in [n for n in template if n in replaceable]:
            old = tuple(saved[template[name].key].global_shape) if template[name].key in saved else None
            if old != tuple(template[name].global_shape):
                fresh[key].append((name, tuple(template.pop(name).global_shape), old))
    with reading(root, found[0]):
        state = dist_checkpointing.load(templates, found[0])
    for key, chunk in zip(keys, chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(state[key], strict=False)
        if set(missing) != {name for name, _, _ in fresh[key]} or unexpected:
            raise RuntimeError(f"--finetune left {missing} unset and {unexpected} unused")
        params = dict(unwrap(chunk).named_parameters())
        with torch.no_grad():
            for name, _, _ in fresh[key]:
                params[name].zero_()
    return [f"{name} {list(new)} (--load has {list(old) if old else 'none'})"
            for key in keys for name, new, old in fresh[key]]


def load(root: str, engine, *, mesh: dict, model_shape: Optional[dict] = None) -> Optional[dict]:
    """Resume from the newest checkpoint under ``root``: returns its common state (iteration, data position, ...),
    or None when ``root`` holds no checkpoint yet (a first run of a launcher that always passes --load starts from
    scratch, as in Megatron-LM). RNG states are restored only when it was written under the same ``mesh``; a
    checkpoint of another ``model_shape`` is refused in one line."""
    found = _checked_path(root, model_shape)
    if found is None:
        return None
    path, common = found
    if common.get("weights_only"):
        raise ConfigError(f"--load {root} holds weights only (a converted or exported checkpoint); add --finetune")
    saved_ep = (common.get("mesh") or {}).get("ep", 1)
    if (model_shape or {}).get("moe") and (saved_ep > 1) != (mesh.get("ep", 1) > 1):
        # megatron-core chains a separate optimizer for experts only under EP > 1: its state does not cross.
        raise ConfigError(f"--load {root} was saved with --expert-model-parallel-size {saved_ep}; an MoE run resumes "
                          f"its optimizer only with EP {'> 1' if saved_ep > 1 else '1'} as well; use such a mesh, "
                          "or --finetune to take the weights alone")
    template = engine.sharded_state_dict(is_loading=True)
    if common.get("mesh") == mesh:
        template["rng_state"] = _rng_state()
    with reading(root, path):
        state = dist_checkpointing.load(template, path)
    engine.load_state_dict(state)
    if "rng_state" in template:
        _restore_rng(state["rng_state"])
    skip = set(template) | {"rng_state"}
    return {k: v for k, v in state.items() if k not in skip}
