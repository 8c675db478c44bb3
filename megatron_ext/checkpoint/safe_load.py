"""Loading a checkpoint never runs code from it: every pickle a load would unpickle is scanned first.

torch.load(weights_only=True) protects only the files we load ourselves. megatron-core 0.16.1 unpickles the DCP
``.metadata`` with plain ``pickle.load`` and each sharded object (the RNG states) with
``torch.load(weights_only=False)`` (torch's ``DefaultLoadPlanner.load_bytes``), and DeepSpeed 0.19.8 ``torch.load``s
its ``*_states.pt`` with ``weights_only=False``. So before any of those run, the pickles are walked opcode by opcode
(``pickletools``, nothing executed) and a global outside the classes megatron_ext's own checkpoints hold (read off
real ones) is refused in one line: a malicious ``__reduce__`` needs such a global (``os.system``, ``eval``, ...).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickletools
import zipfile
from typing import Iterator, List, Optional

from megatron_ext.errors import ConfigError

# Module prefixes whose classes are plain data: tensors and storages, numpy arrays, DCP and DeepSpeed records.
SAFE_PREFIXES = ("torch.distributed.checkpoint.metadata.", "torch.distributed.checkpoint.filesystem.",
                 "torch.distributed.checkpoint.planner.", "deepspeed.runtime.zero.config.",
                 "deepspeed.runtime.fp16.loss_scaler.", "deepspeed.utils.tensor_fragment.")
SAFE_GLOBALS = {
    "collections.OrderedDict", "collections.defaultdict", "builtins.set", "builtins.frozenset", "builtins.slice",
    "builtins.complex", "builtins.bytearray", "_codecs.encode", "pathlib.PosixPath", "pathlib.Path",
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter", "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_parameter_with_state", "torch.Size", "torch.device", "torch.dtype",
    "torch.storage.UntypedStorage", "torch.storage.TypedStorage", "torch._tensor._rebuild_from_type_v2",
    "torch.nn.parameter.Parameter", "torch.Tensor", "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.serialization._get_layout", "torch.strided", "torch.contiguous_format", "torch.preserve_format",
    "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct", "numpy.core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar", "numpy.dtypes.UInt32DType",
    "numpy.dtypes.Float64DType", "numpy.dtypes.Int64DType", "numpy.dtypes.Float32DType",
    "argparse.Namespace",
}
_TORCH_TYPES = ("Storage", "float", "bfloat16", "half", "int", "long", "bool", "uint8", "int8", "int16", "int32",
                "int64", "float16", "float32", "float64", "double", "complex64", "complex128")

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


def allowed(name: str) -> bool:
    """``module.attr`` a checkpoint may name: an allowed global, a class defined in one of the data modules (not
    anything those modules import: ``attr`` is one identifier), a torch dtype or storage type."""
    module, _, attr = name.rpartition(".")
    if not attr.isidentifier() or name.startswith("<"):
        return False
    if name in SAFE_GLOBALS:
        return True
    if module == "torch":  # torch.FloatStorage, torch.bfloat16, ...: unpickle to themselves
        return attr.endswith("Storage") or attr in _TORCH_TYPES
    if not (module + ".").startswith(SAFE_PREFIXES):
        return False
    try:
        found = getattr(importlib.import_module(module), attr, None)  # a trusted module: as the unpickler would
    except ImportError:
        return False
    return isinstance(found, type) and found.__module__ == module


def pickle_globals(data: bytes) -> List[str]:
    """Every global (``module.name``) the pickles in ``data`` name, without unpickling; one that cannot be
    resolved statically is returned as ``<unresolved>`` (and so refused)."""
    found, stream = [], io.BytesIO(data)
    while stream.tell() < len(data):
        recent: List[Optional[str]] = []  # what each op pushed: the string, or None
        memo: dict = {}
        for op, arg, _ in pickletools.genops(stream):
            name = op.name
            if name in _STRINGS:
                recent.append(arg if isinstance(arg, str) else arg.decode("latin-1"))
            elif name in _GETS:
                recent.append(memo.get(arg))
            elif name in _PUTS:
                memo[arg] = recent[-1] if recent else None
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("GLOBAL", "INST"):
                module, _, attr = arg.partition(" ")
                found.append(f"{module}.{attr}" if "." not in attr else "<dotted>")
                recent.append(None)
            elif name == "STACK_GLOBAL":
                module, attr = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
                found.append(f"{module}.{attr}" if module and attr and "." not in attr else "<unresolved>")
                recent.append(None)
            elif name.startswith("EXT"):
                found.append("<extension registry>")
            elif name not in ("STOP", "FRAME", "PROTO"):  # framing pushes nothing
                recent.append(None)
    return found


def _pickles_of(path: str) -> Iterator[bytes]:
    """The pickles of a file: each ``.pkl`` of a torch.save zip (read alone: not the tensors), or the file itself."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for member in archive.namelist():
                if member.endswith(".pkl"):
                    yield archive.read(member)
        return
    with open(path, "rb") as f:
        yield f.read()


def _pickles_in(data: bytes) -> Iterator[bytes]:
    if data[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for member in archive.namelist():
                if member.endswith(".pkl"):
                    yield archive.read(member)
    else:
        yield data


def _refuse(what: str, name: str) -> ConfigError:
    return ConfigError(f"{what} would run {name} when unpickled, which no megatron_ext checkpoint holds; refusing to "
                       "load it (loading never runs code from a checkpoint): use a checkpoint this toolkit wrote")


def check_file(path: str, what: Optional[str] = None) -> None:
    """ConfigError (one line) if unpickling ``path`` could call anything but the allowed classes."""
    try:
        for data in _pickles_of(path):
            for name in pickle_globals(data):
                if not allowed(name):
                    raise _refuse(what or path, name)
    except FileNotFoundError:
        raise ConfigError(f"{what or path} is missing; the checkpoint is incomplete: point the tracker at an older "
                          "iter_ directory or delete it") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{what or path} is not a readable pickle ({type(e).__name__}: {str(e)[:80]}); the "
                          "checkpoint is corrupt: point the tracker at an older iter_ directory or delete it") from None


def check_tree(top: str) -> None:
    """Every pickle a load of the checkpoint ``top`` reads directly: ``.metadata``, ``*.pt``."""
    for dirpath, _, names in os.walk(top):
        for name in sorted(names):
            if name == ".metadata" or name.endswith(".pt"):
                check_file(os.path.join(dirpath, name))


@contextlib.contextmanager
def scanned_sharded_objects(where: str):
    """Inside: every byte object DCP unpickles (``DefaultLoadPlanner.load_bytes``, megatron-core's sharded objects)
    is scanned first."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    original = DefaultLoadPlanner.load_bytes

    def load_bytes(self, read_item, value):
        data = value.read()
        for pickled in _pickles_in(data):
            for name in pickle_globals(pickled):
                if not allowed(name):
                    raise _refuse(f"{where} (object {read_item.dest_index.fqn})", name)
        return original(self, read_item, io.BytesIO(data))

    DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        DefaultLoadPlanner.load_bytes = original
