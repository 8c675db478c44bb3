"""Make megatron-core 0.16.1 run on CPU ranks (gloo), for development and CI.

megatron-core assumes CUDA in ~500 places: ``torch.cuda.current_device()`` and ``device="cuda"`` factories, streams,
events, NVTX ranges, the CUDA RNG tracker, three ``tensor.type() == 'torch.cuda.FloatTensor'`` checks and a few
``tensor.cuda()`` calls. Rather than touching torch or megatron's files, every ``megatron.core`` module gets its own
*view* of torch, in which CUDA device requests land on the CPU and streams/events/NVTX are no-ops. Everything else
is the real torch.

Installed only when no GPU is used (``megatron_ext.parallel`` decides). ``tests/training/test_platform_cpu.py`` fails loudly
if a megatron-core upgrade moves any of the places patched here.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types

import torch

from megatron_ext.platform import imports

MEGATRON_PREFIX = "megatron.core"
_CPU = torch.device("cpu")


def _to_cpu(device):
    """Map any CUDA device spec ("cuda", "cuda:1", 0, torch.device("cuda")) to the CPU; keep others."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


_FACTORIES = (
    "tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "linspace", "rand", "randn", "randint",
    "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "eye", "empty_strided",
)


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: on CPU everything is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):  # wait_stream, record, synchronize, query, elapsed_time, record_event...
        if name == "record_event":  # an event to synchronize on later (the MoE dispatcher's host copies)
            return lambda *args, **kwargs: _NoOpStream()
        return lambda *args, **kwargs: 0.0 if name == "elapsed_time" else None


def _noop(*args, **kwargs):
    return None


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as megatron-core sees it on a CPU rank. Unknown attributes fall through to the real one."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.is_available = lambda: False
        self.current_device = lambda: _CPU
        self.device_count = lambda: 0
        self.set_device = _noop
        self.synchronize = _noop
        self.empty_cache = _noop
        self.Stream = self.Event = self.ExternalStream = _NoOpStream
        self.current_stream = self.default_stream = lambda *args, **kwargs: _NoOpStream()
        self.stream = lambda *args, **kwargs: contextlib.nullcontext()
        self.set_stream = _noop
        self.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, mark=_noop,
                                          range=lambda *a, **k: contextlib.nullcontext())
        self.memory_allocated = self.max_memory_allocated = self.memory_reserved = lambda *a, **k: 0
        self.memory_stats = lambda *a, **k: {}
        self.manual_seed = self.manual_seed_all = torch.manual_seed
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """The ``torch`` module as megatron-core sees it on a CPU rank."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


TORCH_ON_CPU = _TorchOnCpu()


def _redirect(module: types.ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = TORCH_ON_CPU


# megatron-core source rewrites, shared with the MoE fixes (models/moe.py).
from megatron_ext.platform.patching import PATCHED, replace_in_source as _replace_in_source  # noqa: E402,F401


_HALF = "['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']"
_IS_HALF, _IS_FLOAT = ".dtype in (torch.float16, torch.bfloat16)", ".dtype == torch.float32"
# (module, owner, function, [(text, replacement), ...]): megatron-core code that checks tensor *types* or calls
# ``tensor.cuda()``, which no module-level view of torch can change.
SOURCE_PATCHES = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer", [("weight.data = weight.data.cuda()", "weight.data = weight.data")]),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "_build_model_and_main_param_groups",
     [(f"model_param.type() in {_HALF}", "model_param" + _IS_HALF),
      ("model_param.type() == 'torch.cuda.FloatTensor'", "model_param" + _IS_FLOAT)]),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__",
     [(f"param.type() in {_HALF}", "param" + _IS_HALF), ("param.type() == 'torch.cuda.FloatTensor'",
                                                        "param" + _IS_FLOAT)]),
    # Context parallelism: RoPE's per-rank chunk index is copied to "the" GPU.
    ("megatron.core.models.common.embeddings.rope_utils", "", "get_pos_emb_on_this_cp_rank",
     [(".cuda(non_blocking=True)", ".to(pos_emb.device)")]),
)


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


_installed = False


def install() -> None:
    """Apply the CPU adaptation to megatron-core (idempotent)."""
    global _installed
    if _installed:
        return
    import megatron.core.models.gpt  # noqa: F401  (import the bulk of megatron.core before redirecting)
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tensor_parallel.random as tp_random

    for name, module in list(sys.modules.items()):
        if name.startswith(MEGATRON_PREFIX) and module is not None:
            _redirect(module)
    # megatron.core modules imported later (megatron imports lazily in places) get the same view
    sys.meta_path.insert(0, imports.AfterImport(lambda name: name.startswith(MEGATRON_PREFIX), _redirect))

    # The RNG tracker saves/restores "CUDA" states through these two helpers: on CPU it is the default generator.
    tp_random._get_cuda_rng_state = _cpu_rng_state
    tp_random._set_cuda_rng_state = _set_cpu_rng_state

    for module_name, owner_name, attr, replacements in SOURCE_PATCHES:
        owner = sys.modules[module_name] if not owner_name else getattr(sys.modules[module_name], owner_name)
        _replace_in_source(owner, attr, replacements)
    _installed = True
