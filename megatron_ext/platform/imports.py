"""Start-up cost that no run uses, deferred as megatron_ext is imported (before megatron-core is).

Every rank imports megatron-core, and ``megatron.core.jit`` wraps its fusions in ``torch.compile`` as they are
defined, which imports TorchDynamo and Inductor's compiler. Without CUDA those fusions are never used (the model
configs set them on GPU only, ``models/qwen/model.py``), so there megatron-core's own switch, ``disable_jit_fuser``, is
thrown as soon as the module exists, before any fusion is defined; with CUDA nothing changes. Measured: the 4-rank
CPU quickstart, 3 steps, 22.3 instead of 27.3 s of CPU, 14 instead of 16.5 s wall. (W&B, which megatron-core
imports twice only to know whether it is there, cannot be deferred so: the second import loads a lazy module.)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable


def _disable_jit_without_cuda(module) -> None:
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules ``wanted(name)`` selects as the path finder would, and runs ``then(module)`` right after
    each is executed (also platform/cpu.py's, for megatron-core modules imported after its redirects)."""

    def __init__(self, wanted: Callable[[str], bool], then: Callable[[ModuleType], None]):
        self.wanted, self.then = wanted, then

    def find_spec(self, name, path, target=None):
        if not self.wanted(name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


_finder = AfterImport(lambda name: name == "megatron.core.jit", _disable_jit_without_cuda)


def install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
