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
Without a rank, every rank; step 0, every step.

Planted from outside (``plant``): the functions of megatron_ext at those moments are wrapped as their modules are
imported, in ranks forked by forked_ranks.py (which call ``plant``) and in any Python process started with ``env``'s
environment (support/plant/sitecustomize.py: ranks under torchrun or ``megatron_ext.launch``). megatron_ext itself
knows nothing of it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import os
import signal
import sys
import time
from typing import Dict, List, Optional, Tuple

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
        import torch

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
    import torch

    def poison(module, inputs, output):
        if _step in factors and isinstance(output, torch.Tensor):
            return output * factors[_step]
        return output

    for chunk in chunks:
        chunk.register_forward_hook(poison)


def env(spec: str) -> Dict[str, str]:
    """The environment that plants ``spec`` in every Python process started with it (nothing for no fault)."""
    if not spec:
        return {}
    plant_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plant")
    return {ENV: spec, "PYTHONPATH": os.pathsep.join(filter(None, (plant_dir, os.environ.get("PYTHONPATH"))))}


def _plant_loop(loop) -> None:
    step = loop._step

    def faulty_step(engine, data, settings, number, *rest):
        at_step_start(number)
        return step(engine, data, settings, number, *rest)

    loop._step = faulty_step


def _plant_run(run) -> None:
    build_model = run.build_model

    def faulty_build_model(*args, **kwargs):
        engine, chunks, meta = build_model(*args, **kwargs)
        install(chunks)
        return engine, chunks, meta

    run.build_model = faulty_build_model


def _plant_files(files) -> None:
    commit_save = files.commit_save

    def faulty_commit_save(root, iteration, *args, **kwargs):
        in_save(iteration)
        return commit_save(root, iteration, *args, **kwargs)

    files.commit_save = faulty_commit_save


def _plant_writer(writer) -> None:
    write = writer.StagedSave.write

    def faulty_write(self):
        with in_write(self.iteration, self.staging):
            if not _active("die_in_write", self.iteration) or not (self.requests or self.files):
                return write(self)
            if self.requests:  # the first of megatron-core's writes, then death
                first = self.requests[0]
                if first.async_fn is not None:
                    first.async_fn(*first.async_fn_args, **first.async_fn_kwargs)
            else:  # the first of our files
                write(dataclasses.replace(self, files=self.files[:1]))
            after_first_write(self.iteration)

    writer.StagedSave.write = faulty_write


PLANTS = {"megatron_ext.training.loop": _plant_loop, "megatron_ext.training.run": _plant_run,
          "megatron_ext.checkpoint.files": _plant_files, "megatron_ext.checkpoint.writer": _plant_writer}


class _Planter:
    """A meta-path finder that plants in the modules of PLANTS as they are imported, after their own code ran."""

    def find_spec(self, name, path, target=None):
        if name not in PLANTS:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_plant(module):
            exec_module(module)
            PLANTS[name](module)

        spec.loader.exec_module = exec_and_plant
        return spec


def plant() -> None:
    """Wrap megatron_ext's functions at the moments faults strike: now for modules already imported (a forked
    rank's), as they are imported for the others. Once per process."""
    if any(isinstance(finder, _Planter) for finder in sys.meta_path):
        return
    for name, planter in PLANTS.items():
        if name in sys.modules:
            planter(sys.modules[name])
    sys.meta_path.insert(0, _Planter())
