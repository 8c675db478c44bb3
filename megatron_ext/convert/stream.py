"""An export written without holding it (``--save-hf``): safetensors files whose header goes first, then each
tensor's bytes as they arrive, a bounded block at a time; and a tensor split over ranks sent to the rank that writes
it one block after another, never gathered whole.

Every exported tensor's name and shape is known before any value is (the family table's split run on a meta tensor
of the parameter's shape), so each writing rank plans its files up front (``RankFiles``) and writes the values in
the planned order; the tensor is converted to the export dtype block by block. ``stream_rows`` sends a parameter
whose exported form is its leading rows (the embedding and the output layer without their vocabulary padding, and
any tensor exported as it is) from the ranks that hold its parts, in the order they make up the flattened tensor
(tensor-parallel shards by rows, then within each the data-parallel parts of ZeRO-3's flat partitions or FSDP's
dim-0 shards), straight into the writer's file: no rank holds more than ``BLOCK_BYTES`` of it besides its own part.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

BLOCK_BYTES = 16 * 2**20  # what a rank holds at most of a tensor in flight (received, or converted to the dtype)
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _block(tensor: torch.Tensor) -> int:
    return max(1, BLOCK_BYTES // tensor.element_size())


class RankFiles:
    """This rank's part of an export: the planned ``entries`` (name, shape) in files of at most ``max_bytes`` (a
    larger tensor gets a file of its own), written in that order by ``write``; ``files`` lists (file, names, bytes)."""

    def __init__(self, directory: str, prefix: str, entries: Sequence[Tuple[str, Tuple[int, ...]]],
                 dtype: torch.dtype, max_bytes: int):
        self.directory, self.dtype, self.files, self._plan = directory, dtype, [], []
        size = torch.empty((), dtype=dtype).element_size()
        group, group_bytes = [], 0
        for name, shape in entries:
            nbytes = math.prod(shape) * size
            if group and group_bytes + nbytes > max_bytes:
                self._add_file(prefix, group, group_bytes)
                group, group_bytes = [], 0
            group.append((name, tuple(shape), nbytes))
            group_bytes += nbytes
        if group:
            self._add_file(prefix, group, group_bytes)
        self._queue = [(k, name, nbytes) for k, (_, group) in enumerate(self._plan) for name, _, nbytes in group]
        self._at, self._left, self._handle, self._open_file = 0, None, None, None

    def _add_file(self, prefix: str, group, nbytes: int) -> None:
        file = f"{prefix}-{len(self.files):05d}.safetensors"
        self.files.append((file, [name for name, _, _ in group], nbytes))
        self._plan.append((file, group))

    def write(self, name: str, values: torch.Tensor) -> None:
        """The next values of tensor ``name`` (the planned one now due), in any dtype and on any device."""
        if self._left is None:
            if self._at >= len(self._queue) or self._queue[self._at][1] != name:
                due = self._queue[self._at][1] if self._at < len(self._queue) else "nothing"
                raise RuntimeError(f"--save-hf: {name} written where {due} was planned (an export bug)")
            self._left = self._queue[self._at][2]
            self._open(self._queue[self._at][0])
        flat = values.detach().reshape(-1)
        step = _block(flat)
        for start in range(0, flat.numel(), step):
            block = flat[start:start + step].to("cpu", self.dtype).contiguous()
            data = block.view(torch.uint8).numpy()
            if data.nbytes > self._left:
                raise RuntimeError(f"--save-hf: {name} is larger than planned (an export bug)")
            self._handle.write(memoryview(data))
            self._left -= data.nbytes
        if self._left == 0:
            self._left, self._at = None, self._at + 1
            if self._at == len(self._queue) or self._queue[self._at][0] != self._open_file:
                self._handle.close()
                self._handle = None

    def _open(self, k: int) -> None:
        if self._open_file == k:
            return
        file, group = self._plan[k]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nbytes in group:
            header[name] = {"dtype": SAFETENSORS_DTYPES[self.dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._handle, self._open_file = open(os.path.join(self.directory, file), "wb"), k
        self._handle.write(struct.pack("<Q", len(raw)) + raw)

    def close(self) -> None:
        if self._at != len(self._queue):
            raise RuntimeError(f"--save-hf: {self._queue[self._at][1]} was planned but not written (an export bug)")


def row_prefix(rule, ctx, shape: Sequence[int]) -> Optional[int]:
    """How many leading rows of the (TP-whole) parameter of ``shape`` its one exported tensor is, when the family
    table's split only drops trailing rows (vocabulary padding) or exports it as it is; None otherwise. Found by
    splitting row numbers, as ``pretrained._rows`` fuses them: no per-family code."""
    probe = torch.arange(shape[0], dtype=torch.float64).reshape(-1, *([1] * (len(shape) - 1)))
    try:
        out = rule.to_hf(probe, ctx)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    if len(out) != 1 or out[0].shape[1:] != probe.shape[1:] or out[0].shape[0] > shape[0]:
        return None
    rows = out[0].shape[0]
    return rows if torch.equal(out[0].reshape(-1), probe.reshape(-1)[:rows]) else None


def stream_rows(files: Optional[RankFiles], hf_name: str, keep: int, holders: List[Tuple[int, int]],
                mine: Optional[torch.Tensor]) -> None:
    """The first ``keep`` elements of a tensor made of the flattened parts ``holders`` lists in order (global rank,
    elements), into the file of ``holders[0]``'s rank: its own part written from where it lies, every other part
    sent to it block by block. Called on every rank of ``holders`` (``mine``: this rank's part); ``files`` on the
    writer."""
    me, writer = dist.get_rank(), holders[0][0]
    # NCCL moves device memory only (a ZeRO-3 part offloaded to the host goes through the GPU a block at a time)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else mine.device
    if keep == 0 and me == writer:
        files.write(hf_name, mine[:0])
    offset = 0
    for rank, numel in holders:
        count = min(numel, keep - offset)
        offset += numel
        if count <= 0:
            break
        if rank == me and me == writer:
            files.write(hf_name, mine[:count])
        elif me == writer:
            buffer = torch.empty(min(count, _block(mine)), dtype=mine.dtype, device=device)
            for start in range(0, count, buffer.numel()):
                part = buffer[:min(buffer.numel(), count - start)]
                dist.recv(part, src=rank)
                files.write(hf_name, part)
        elif rank == me:
            for start in range(0, count, _block(mine)):
                dist.send(mine[start:min(count, start + _block(mine))].to(device), dst=writer)
