"""Start-up cost that no run uses, deferred as megatron_ext is imported (before megatron-core is).

Every rank imports megatron-core, and two of its import-time steps cost about 2.5 s of CPU per process (measured:
3.1 instead of 4.4-5.9 s for a rank's imports on 2 cores), paid by every rank of every launch:
- ``megatron.core.jit`` wraps its fusions in ``torch.compile`` as they are defined, which imports TorchDynamo and
  Inductor. Without CUDA those fusions are never used (the model configs set them on GPU only,
  ``models/qwen.py``), so there megatron-core's own switch, ``disable_jit_fuser``, is thrown as soon as the module
  exists, before any fusion is defined; with CUDA nothing changes.
- ``megatron.core.inference`` imports W&B only to know whether it is there: W&B is loaded lazily (the standard
  library's ``importlib.util.LazyLoader``), on first use, which is the ``--wandb-project`` logger's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys


def _disable_jit_without_cuda(module) -> None:
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


class _Deferred(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` and ``wandb`` as the path finder would, with a loader that does the above."""

    def find_spec(self, name, path, target=None):
        if name not in ("megatron.core.jit", "wandb"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        if name == "wandb":
            spec.loader = importlib.util.LazyLoader(spec.loader)
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _disable_jit_without_cuda(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(isinstance(finder, _Deferred) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Deferred())
