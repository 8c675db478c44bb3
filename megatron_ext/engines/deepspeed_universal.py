"""DeepSpeed checkpoints resumed on another data-parallel size, through DeepSpeed's own universal checkpoints.

A ZeRO checkpoint holds each DP rank's partition of the optimizer state; DeepSpeed refuses to load it under another
DP size. Its answer is the universal checkpoint: ``ds_to_universal`` gathers every parameter's fp32 weight and Adam
moments into one file per parameter, and an engine started with ``checkpoint.load_universal`` re-partitions them
for its own mesh. Every save records ``universal_checkpoint_info`` (which megatron-core parameters are row-parallel,
replicated, two fused halves), as Megatron-DeepSpeed's do; at start-up a checkpoint written
under another DP size is converted once, into ``iter_N/universal`` beside the files it came from, and loaded.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional, Tuple

from megatron_ext.errors import ConfigError

# megatron-core's parameter names, by how tensor parallelism splits them (everything else: column-parallel, dim 0)
ROW_PARALLEL = [r".*linear_proj\.weight$", r".*linear_fc2\.weight$"]
REPLICATED = [r".*norm.*", r".*linear_proj\.bias$", r".*linear_fc2\.bias$", r".*position_embeddings\.weight$",
              r".*class_token$", r".*router\.weight$"]
GATED_HALVES = [r".*linear_fc1\.weight$", r".*linear_fc1\.bias$"]  # SwiGLU: [gate; up], each split over TP
UNIVERSAL = "universal"  # inside iter_N: the converted checkpoint, tag ``universal``
_OPTIM = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def checkpoint_info(names, gated: bool) -> dict:
    """What ``ds_to_universal`` needs to merge tensor-parallel slices, for a model with parameters ``names``: attached
    to the module DeepSpeed saves. Only patterns that match (ds_to_universal refuses unused ones). The padded
    vocabulary is merged as a column-parallel tensor, padding kept: its size is this mesh's."""
    from deepspeed.checkpoint import constants as c

    names = list(names)

    def used(patterns):
        return [p for p in patterns if any(re.match(p, n) for n in names)]

    info = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: used(ROW_PARALLEL),
            c.TP_REPLICATED_PARAMETER_PATTERNS: used(REPLICATED)}
    if gated:
        info[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = used(GATED_HALVES)
    return info


def saved_layout(path: str) -> Optional[Tuple[int, int]]:
    """(DP size, TP x PP ranks) a ZeRO checkpoint was written with, from its partition files' names; None for one
    without partitioned optimizer state (ZeRO-0: any DP size loads it)."""
    found = [m.groups() for m in map(_OPTIM.search, os.listdir(path)) if m]
    if not found:
        return None
    return 1 + max(int(dp) for dp, _ in found), 1 + max(int(mp) for _, mp in found)


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
                          f"data-parallel size ({last}); resume with the DP size it was saved with")
    os.replace(staging, out)
    return time.monotonic() - start


def plan(path: str, dp: int, mp: int, pipelined: bool = False) -> Optional[str]:
    """None when ``path`` loads as it is; else the reason it needs the universal form (a DP change). A TP x PP
    change, or a DP change of DeepSpeed's pipeline engine (its layer files are not what ds_to_universal reads), is
    refused in one line: the weights go anywhere through ``mcore/``, the optimizer state does not."""
    layout = saved_layout(path)
    if layout is None or layout == (dp, mp):
        return None
    saved_dp, saved_mp = layout
    if pipelined and saved_mp == mp:
        raise ConfigError(f"--load {os.path.dirname(path)} was saved by DeepSpeed's pipeline engine at DP{saved_dp} "
                          f"and this run has DP{dp}: it resumes under the data-parallel size it was saved with; use "
                          f"DP{saved_dp}, or start from its weights alone with --load {path}/mcore --finetune")
    if saved_mp != mp:
        raise ConfigError(f"--load {os.path.dirname(path)} was saved by DeepSpeed on {saved_mp} tensor x pipeline "
                          f"rank(s) and this run has {mp}: DeepSpeed resumes its optimizer state on another data-"
                          f"parallel size only; keep TP x PP = {saved_mp}, or start from its weights alone with "
                          f"--load {path}/mcore --finetune (any mesh, any engine)")
    return f"saved at DP{saved_dp}, resumed at DP{dp}"
