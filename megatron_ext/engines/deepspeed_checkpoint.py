"""DeepSpeed checkpoints: what we save beside DeepSpeed's own files, what a resume checks, and a resume on another
data-parallel size through DeepSpeed's universal checkpoints.

A ZeRO checkpoint holds each DP rank's partition of the optimizer state; DeepSpeed refuses to load it under another
DP size. Its answer is the universal checkpoint: ``ds_to_universal`` gathers every parameter's fp32 weight and Adam
moments into one file per parameter (TP slices merged), and an engine started with ``checkpoint.load_universal``
re-partitions them for its own mesh. Every save records ``universal_checkpoint_info`` (which megatron-core
parameters are row-parallel, replicated, two fused halves), as Megatron-DeepSpeed's do, and every parameter says how
TP splits it (``annotate``); at start-up a checkpoint written under another DP or TP size is converted once, into
``iter_N/universal`` beside the files it came from, and loaded.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.errors import ConfigError
from megatron_ext.parallel import on_rank0

UNIVERSAL = "universal"  # inside iter_N: the converted checkpoint, tag ``universal``
_OPTIM = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
_GATED = re.compile(r"linear_fc1\.(weight|bias|lora_b\.weight)$")  # SwiGLU's [gate; up], each half split over TP


def _split(name: str, param: torch.nn.Parameter, gated: bool) -> str:
    """How tensor parallelism splits a parameter, as megatron-core marks it: "rows" (dim 1), "columns" (dim 0),
    "halves" (the gated fc1's [gate; up]: dim 0 within each half), or "replicated"."""
    if not getattr(param, "tensor_model_parallel", False):
        return "replicated"
    if param.partition_dim == 1:
        return "rows"
    return "halves" if gated and _GATED.search(name) else "columns"


def checkpoint_info(model: torch.nn.Module, gated: bool) -> dict:
    """What ``ds_to_universal`` needs to merge tensor-parallel slices of ``model``'s trained parameters (attached to
    the module DeepSpeed saves): from how megatron-core marks each one, as name patterns with layer numbers
    generalised where that is unambiguous (exact names otherwise). Columns are ds_to_universal's default. The padded
    vocabulary is merged as a column-parallel tensor, padding kept: it does not change with TP
    (``qwen.padded_vocab_size``), and a size that does is refused before a resume (``_same_vocabulary``)."""
    from deepspeed.checkpoint import constants as c

    kinds, exact = collections.defaultdict(set), {}
    for name, param in model.named_parameters():
        if param.requires_grad:  # (frozen ones have no optimizer state to merge; ds_to_universal refuses patterns
            kind = _split(name, param, gated)  # that match nothing)
            general = r"\.".join(r"\d+" if piece.isdigit() else re.escape(piece) for piece in name.split(".")) + "$"
            kinds[general].add(kind)
            exact[re.escape(name) + "$"] = (general, kind)
    patterns = collections.defaultdict(set)
    for pattern, (general, kind) in exact.items():
        patterns[kind].add(general if len(kinds[general]) == 1 else pattern)
    info = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(patterns["rows"]),
            c.TP_REPLICATED_PARAMETER_PATTERNS: sorted(patterns["replicated"])}
    if patterns["halves"]:
        info[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = sorted(patterns["halves"])
    return info


def annotate(model: torch.nn.Module, gated: bool) -> None:
    """Each parameter's TP layout where DeepSpeed's universal loader reads it (the attribute its AutoTP layers set):
    it then takes this rank's piece of every merged tensor itself, under ZeRO-1/2 and ZeRO-3 alike, on any TP size
    (without it ZeRO-3 would partition the whole merged tensor)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    from megatron_ext.models.init import full_shape

    for name, param in model.named_parameters():
        kind = _split(name, param, gated)
        if kind == "replicated":
            meta = {"replicated": True, "partition_dim": None}
        else:
            shape = tuple(full_shape(param))
            meta = {"partition_dim": 1 if kind == "rows" else 0, "logical_shape": shape}
            if kind == "halves":
                meta["sub_param_sizes"] = (shape[0] // 2, shape[0] // 2)
        setattr(param, DS_AUTOTP_UC_META, meta)


def saved_layout(path: str) -> Optional[Tuple[int, int, bool]]:
    """(DP size, TP x PP ranks, written by DeepSpeed's pipeline engine) of a checkpoint, from its files' names; DP is
    None without partitioned optimizer state (ZeRO-0: any DP size loads it). None for a directory without any."""
    names = os.listdir(path)
    found = [m.groups() for m in map(_OPTIM.search, names) if m]
    models = [int(m[1]) for m in map(_MODEL.search, names) if m]
    if not found and not models:
        return None
    mp = 1 + max([int(mp) for _, mp in found] + models)
    return (1 + max(int(dp) for dp, _ in found) if found else None), mp, any(n.startswith("layer_") for n in names)


def convert(path: str, workers: int = 4) -> float:
    """``ds_to_universal`` from ``path`` (an iteration directory) into ``path/universal`` (written aside, then renamed:
    a crash leaves no half-converted directory); returns its seconds. Runs on one rank."""
    out = os.path.join(path, UNIVERSAL)
    staging = out + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", path,
                           "--output_folder", staging, "--num_extract_workers", str(workers),
                           "--num_merge_workers", str(max(1, workers // 2)), "--inject_missing_state"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise ConfigError(f"--load {path}: DeepSpeed's ds_to_universal could not convert it for another "
                          f"mesh ({last}); resume with the DP and TP sizes it was saved with")
    os.replace(staging, out)
    return time.monotonic() - start


def plan(path: str, dp: int, tp: int, pp: int = 1) -> Optional[str]:
    """None when ``path`` loads as it is; else the reason it needs the universal form: another DP size (also of
    DeepSpeed's pipeline engine), or, under ZeRO-1/2/3 without a pipeline, another TP size. What DeepSpeed cannot
    resume is one line: a TP x PP change of its pipeline engine or of ZeRO-0 (no optimizer partitions to convert);
    the weights go anywhere through ``mcore/``, the optimizer state does not."""
    layout = saved_layout(path)
    if layout is None:
        return None
    saved_dp, saved_mp, pipelined = layout
    if saved_mp != tp * pp or pipelined != (pp > 1):
        why = "its pipeline engine" if pipelined or pp > 1 else "ZeRO-0" if saved_dp is None else None
        if why:
            raise ConfigError(f"--load {os.path.dirname(path)} was saved by DeepSpeed on {saved_mp} tensor x "
                              f"pipeline rank(s){' (pipeline engine)' if pipelined else ''} and this run has "
                              f"{tp * pp}{' (pipeline engine)' if pp > 1 else ''}: DeepSpeed resumes {why} on another "
                              f"data-parallel size only; keep TP x PP = {saved_mp}, or start from its weights alone "
                              f"with --load {path}/mcore --finetune (any mesh, any engine)")
        return f"saved at TP{saved_mp} x DP{saved_dp}, resumed at TP{tp} x DP{dp}"
    if saved_dp is None or saved_dp == dp:
        return None
    return f"saved at DP{saved_dp}, resumed at DP{dp}"


def _same_vocabulary(universal: str, model: torch.nn.Module) -> None:
    """The padded vocabulary is the one merged shape that may depend on TP (``qwen.padded_vocab_size``: only for a
    TP size that does not divide --make-vocab-size-divisible-by); one line when the checkpoint's differs from this
    mesh's. (Reads the tensors' headers: mmap.)"""
    from megatron_ext.models.init import full_shape

    for name, param in model.named_parameters():
        saved = os.path.join(universal, "zero", name, "fp32.pt")
        if name.endswith(("word_embeddings.weight", "output_layer.weight")) and os.path.isfile(saved):
            tensor = torch.load(saved, mmap=True, weights_only=False)
            tensor = tensor["param"] if isinstance(tensor, dict) else tensor  # (flattened, in some versions)
            ours, width = full_shape(param)
            rows = tensor.numel() // width
            if rows != ours:
                raise ConfigError(f"--load {os.path.dirname(universal)}: its vocabulary is padded to {rows} rows and "
                                  f"this mesh pads it to {ours} (--make-vocab-size-divisible-by x "
                                  "TP); use a TP size that divides --make-vocab-size-divisible-by, as the run that "
                                  "saved it did")


def universal_if_resharded(path: str, model: torch.nn.Module):
    """(directory, tag) of the universal form when ``path`` was saved under another data-parallel (or TP) size
    (converted once by rank 0, said in one line); None when it loads as it is."""
    why = on_rank0(lambda: plan(path, parallel_state.get_data_parallel_world_size(),
                                parallel_state.get_tensor_model_parallel_world_size(),
                                parallel_state.get_pipeline_model_parallel_world_size()))
    if why is None:
        return None

    def converted() -> str:
        before = os.path.isdir(os.path.join(path, UNIVERSAL))
        seconds = None if before else convert(path, workers=min(8, os.cpu_count() or 1))
        _same_vocabulary(os.path.join(path, UNIVERSAL), model)
        if before:
            return f"megatron_ext: --load {path} {why}: its universal form ({UNIVERSAL}/) converted before"
        return (f"megatron_ext: --load {path} {why}: converted once to DeepSpeed's universal checkpoint "
                f"({UNIVERSAL}/ beside it, ds_to_universal, {seconds:.1f} s)")

    line = on_rank0(converted)
    if dist.get_rank() == 0:
        print(line, flush=True)
    return path, UNIVERSAL


@contextlib.contextmanager
def loading_universal(engine, optimizer, universal):
    """DeepSpeed's ``load_checkpoint`` reading the universal form (``universal``: ``universal_if_resharded``'s answer;
    None: the checkpoint as saved). After it, what DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong is undone: it
    gives every parameter group the first one's settings (``wd_mult``: decay on norms and biases) and one shared step
    tensor, which the fused AdamW then advances once per group. (The scheduler's load sets lr and decay after.)
    During the load, DeepSpeed's TP group is megatron-core's."""
    if universal is None:
        yield
        return
    from deepspeed.utils import groups as ds_groups

    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    engine._config.load_universal_checkpoint = True  # (read by load_checkpoint alone)
    # ZeRO-3's loader asks DeepSpeed's own TP group (AutoTP's), not the mpu's, for this rank's piece: megatron-core's
    own_tp = ds_groups._TENSOR_MODEL_PARALLEL_GROUP
    ds_groups._TENSOR_MODEL_PARALLEL_GROUP = own_tp or parallel_state.get_tensor_model_parallel_group()
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False
        ds_groups._TENSOR_MODEL_PARALLEL_GROUP = own_tp
    for group, own in zip(optimizer.param_groups, groups):
        group.update(own)
    for state in getattr(optimizer, "optimizer", optimizer).state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def checked_checkpoint_tag(root: str) -> Optional[Tuple[str, str]]:
    """(directory, tag) of the checkpoint ``--load root`` names: the one DeepSpeed's ``latest`` names, or ``root``
    itself when it is an ``iter_`` directory; checked complete (manifest) and free of code (every pickle scanned:
    DeepSpeed unpickles with ``weights_only=False``) by rank 0 for all; None for a directory without any."""
    from megatron_ext.checkpoint import files, safe_load

    def check() -> Optional[Tuple[str, str]]:
        directory, tag = os.path.split(os.path.normpath(root))
        named = files.ITER.fullmatch(tag)  # --load DIR/iter_XXXXXXX: that one
        if named and not os.path.isdir(root):
            raise ConfigError(f"--load {root} is missing; name an existing iter_ directory, or its parent for the "
                              "newest")
        if not named:
            directory, latest = root, os.path.join(root, files.DS_LATEST)
            if not os.path.isfile(latest):
                if files.holds_checkpoints(root):
                    raise ConfigError(f"--load {root} holds no DeepSpeed checkpoint ({files.DS_LATEST} is missing): "
                                      "resume it with the engine that wrote it, or use a new directory")
                return None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(directory, tag)
        if not os.path.isdir(path):
            raise ConfigError(f"--load {root}: {files.DS_LATEST} names {path}, which is missing; point "
                              f"{latest} at an older iter_ directory or delete this one")
        error = files.check_complete(path, root)
        if error:
            raise ConfigError(error)
        safe_load.check_tree(path)
        return directory, tag

    return on_rank0(check)


@contextlib.contextmanager
def saved_module_state(engine, module: torch.nn.Module, frozen: bool):
    """DeepSpeed's model states as we save them: without megatron-core's empty ``_extra_state`` entries (None, which
    ds_to_universal cannot read; ``load_module_state`` puts them back) and, for LoRA, without the frozen weights.
    Those DeepSpeed leaves out by name, but a LoRA layer names its base weight as the plain model does
    (``linear_qkv.weight``, not ``linear_qkv.base.weight``): they go by identity. (DeepSpeed's pipeline engine
    writes its layers itself.)"""
    import deepspeed

    if type(engine).module_state_dict is not deepspeed.DeepSpeedEngine.module_state_dict:
        yield
        return
    ids = {id(p) for p in module.parameters() if not p.requires_grad} if frozen else set()
    original = engine.module_state_dict

    def kept(*args, **kwargs):
        state = original(*args, **{**kwargs, "keep_vars": True})
        return collections.OrderedDict((k, v.detach() if torch.is_tensor(v) else v) for k, v in state.items()
                                       if id(v) not in ids and not (v is None and k.endswith("_extra_state")))

    engine.module_state_dict = kept
    try:
        yield
    finally:
        del engine.module_state_dict


def load_module_state(engine):
    """DeepSpeed's ``load_module_state_dict`` with the empty ``_extra_state`` entries ``saved_module_state`` left
    out put back, so a strict load still checks every parameter."""
    original = engine.load_module_state_dict

    def load(checkpoint, *args, **kwargs):
        module = checkpoint.get("module")
        if module is not None:
            for key, value in engine.module.state_dict(keep_vars=True).items():
                if value is None and key.endswith("_extra_state"):
                    module.setdefault(key, None)
        return original(checkpoint, *args, **kwargs)

    engine.load_module_state_dict = load
