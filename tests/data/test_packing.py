"""Packed rows by best-fit decreasing (``megatron_ext/data/packing.py``): the same rows as TRL's ``pack_dataset``
default (``_pack_bfd``) on the same lengths, every example in exactly one row, no row over the capacity."""

import numpy as np
import pytest

from megatron_ext.data.packing import best_fit_decreasing

RNG = np.random.default_rng(0)
CASES = {  # capacity, lengths
    "uniform": (64, RNG.integers(1, 65, 500)),
    "long_tail": (4096, np.minimum(RNG.lognormal(6, 1, 5000).astype(int) + 1, 4096)),
    "many_ties": (16, RNG.integers(1, 5, 300)),
}


def trl_rows(lengths, capacity):
    """TRL's rows as sets of example indices (each example's tokens are its own index)."""
    import pyarrow as pa
    from trl.data_utils import _pack_bfd

    table = pa.table({"input_ids": [[i] * int(n) for i, n in enumerate(lengths)]})
    return sorted(sorted(set(row)) for row in _pack_bfd(table, capacity)["input_ids"].to_pylist())


@pytest.mark.parametrize("case", CASES)
def test_rows_are_trls(case):
    capacity, lengths = CASES[case]
    rows = best_fit_decreasing(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert max(sum(int(lengths[i]) for i in row) for row in rows) <= capacity
    assert sorted(sorted(row) for row in rows) == trl_rows(lengths, capacity)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="every length must be in 1..8"):
        best_fit_decreasing([3, 9], 8)
    assert best_fit_decreasing([], 8) == []
