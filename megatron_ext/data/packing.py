"""Which examples share a packed row: best-fit decreasing, TRL's ``pack_dataset`` default.

Filling rows in data order (the next example opens a new row when it does not fit) leaves, on average, part of an
example's length empty in every row: a few percent of each 4,096-token row with MetaMathQA's short examples, far more
with long conversations. Best-fit decreasing takes the examples longest first and puts each into the open row it
fills best (the least room left), opening a row only when none has room; what is left is nearly all full rows.
``bench/packing.py`` measures both, beside TRL's.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Dict, List, Sequence

import numpy as np


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Rows of example indices, each summing to at most ``capacity``. Ties go as in TRL's ``_pack_bfd`` (equal
    lengths in data order, equal room to the row that reached it first), so the rows are the same as TRL's."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"every length must be in 1..{capacity}")
    rows: List[List[int]] = []
    rooms: List[int] = []  # the distinct room left in open rows, ascending (full rows are closed)
    by_room: Dict[int, deque] = {}
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            row = by_room[room].popleft()
            if not by_room[room]:
                del by_room[room], rooms[k]
        else:
            row, room = len(rows), capacity
            rows.append([])
        rows[row].append(i)
        left = room - n
        if left:
            if left not in by_room:
                by_room[left] = deque()
                bisect.insort(rooms, left)
            by_room[left].append(row)
    return rows
