"""Fault injection for the reliability tests: ``MEGATRON_EXT_FAULTS="kind@step[:rank],..."`` makes a rank misbehave
at a training step, so preemption, bad steps, hangs and crashes are exercised on the real code path.

Kinds: ``sigterm``/``sigusr1`` (the rank signals itself as the step starts), ``die`` (exits 1 as the step starts),
``hang`` (sleeps forever as the step starts), ``nan`` (that rank's model output is multiplied by NaN), ``spike``
(multiplied by 10: a loss spike that training survives), ``crash_in_save`` (exits 1 after writing that step's
checkpoint, before it is published); for the writes of that step's checkpoint (in the background writer under
--async-save): ``enospc``, ``erofs``, ``eacces`` (opening a file of it for writing fails with that OS error, as on a
full disk, a read-only filesystem, a directory without write permission: the error arises inside megatron-core's
writer, or our own, and takes their way back), ``slow_save`` (they first sleep MEGATRON_EXT_SLOW_SAVE_SECONDS,
default 10), ``die_in_write`` (the writing process dies after its first file), ``bitflip`` (as the step starts, the
first weight of that rank's model moves by one unit in the last place: silent data corruption).
Without a rank, every rank; step 0, every step. Unset (always, outside tests), every hook is one dictionary lookup.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import signal
import time
from typing import Dict, List, Optional, Tuple

import torch

ENV = "MEGATRON_EXT_FAULTS"
WRITE_ERRORS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS, "eacces": errno.EACCES}
KINDS = ("sigterm", "sigusr1", "die", "hang", "nan", "spike", "crash_in_save", "slow_save", "die_in_write",
         "bitflip", *WRITE_ERRORS)
FACTORS = {"nan": float("nan"), "spike": 10.0}  # what the model output is multiplied by


def parse(spec: str) -> Dict[Tuple[str, int], Optional[int]]:
    """``"nan@3:1,sigterm@5"`` -> {("nan", 3): 1, ("sigterm", 5): None}."""
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV}: cannot read {item!r}; expected kind@step[:rank] with kind in {KINDS}")
        faults[(kind, int(step))] = int(rank) if rank else None
    return faults


_parsed: Tuple[str, Dict[Tuple[str, int], Optional[int]]] = ("", {})


def _faults() -> Dict[Tuple[str, int], Optional[int]]:
    global _parsed
    spec = os.environ.get(ENV, "")
    if spec != _parsed[0]:
        _parsed = (spec, parse(spec))
    return _parsed[1]


def _active(kind: str, step: int) -> bool:
    faults = _faults()
    key = next((k for k in ((kind, step), (kind, 0)) if k in faults), None)  # step 0: every step
    if key is None:
        return False
    rank = faults[key]
    return rank is None or rank == int(os.environ.get("RANK", "0"))


_step = 0
_chunks: List = []  # the model, for ``bitflip``


def at_step_start(step: int) -> None:
    global _step
    _step = step
    for kind, sig in (("sigterm", signal.SIGTERM), ("sigusr1", signal.SIGUSR1)):
        if _active(kind, step):
            os.kill(os.getpid(), sig)
    if _active("die", step):
        print(f"fault injection: rank {os.environ.get('RANK', '0')} dies at step {step}", flush=True)
        os._exit(1)
    if _active("bitflip", step) and _chunks:
        weight = next(p for chunk in _chunks for p in chunk.parameters() if p.is_floating_point()).data.view(-1)
        weight[:1] = torch.nextafter(weight[:1], weight[:1] + 1)
        print(f"fault injection: rank {os.environ.get('RANK', '0')} flips a weight's last bit at step {step}",
              flush=True)
    if _active("hang", step):
        print(f"fault injection: rank {os.environ.get('RANK', '0')} hangs at step {step}", flush=True)
        while True:
            time.sleep(60)


def in_save(step: int) -> None:
    """Between writing a checkpoint and publishing it."""
    if _active("crash_in_save", step):
        print(f"fault injection: rank {os.environ.get('RANK', '0')} crashes while saving step {step}", flush=True)
        os._exit(1)


@contextlib.contextmanager
def in_write(step: int, staging: str):
    """Around the writes of step ``step``'s checkpoint into ``staging``. A write-error fault makes every ``open``
    for writing under ``staging`` fail (processes forked meanwhile, megatron-core's writers, inherit it) as the OS
    would fail it: an ``OSError`` with that errno and the file's path."""
    if _active("slow_save", step):
        time.sleep(float(os.environ.get("MEGATRON_EXT_SLOW_SAVE_SECONDS", "10")))
    code = next((code for kind, code in WRITE_ERRORS.items() if _active(kind, step)), None)
    if code is None:
        yield
        return
    real_open, inside = builtins.open, os.path.join(os.path.abspath(staging), "")

    def failing_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+") and \
                os.path.abspath(file).startswith(inside):
            raise OSError(code, os.strerror(code), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    builtins.open = failing_open
    try:
        yield
    finally:
        builtins.open = real_open


def after_first_write(step: int) -> None:
    if _active("die_in_write", step):
        print(f"fault injection: the writer of rank {os.environ.get('RANK', '0')} dies saving step {step}", flush=True)
        os._exit(9)


def install(chunks: List) -> None:
    """For ``nan`` and ``spike`` faults: this rank's model outputs are multiplied by NaN or 10 during the named steps
    (the loss, or the activations a later pipeline stage turns into the loss); for ``bitflip``, the model kept."""
    global _chunks
    _chunks = list(chunks) if any(kind == "bitflip" for kind, _ in _faults()) else []
    factors = {step: FACTORS[kind] for (kind, step) in _faults() if kind in FACTORS and _active(kind, step)}
    if not factors:
        return

    def poison(module, inputs, output):
        if _step in factors and isinstance(output, torch.Tensor):
            return output * factors[_step]
        return output

    for chunk in chunks:
        chunk.register_forward_hook(poison)
