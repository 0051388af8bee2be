"""The op comparison's per-side lookups: the fast paths (every full row in order, one dtype) give what
the general ones give."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mismatch_probe.analysis.op_errors import _Side


def _side(full_idx: list[int], vals: list[bytes]) -> _Side:
    s = _Side()
    s.set_full(np.asarray(full_idx, np.int64), pa.array(vals, pa.large_binary()))
    return s


def test_values_at_every_full_row_in_order_is_the_sides_own_array_else_a_take():
    s = _side([2, 5, 9], [b"a", b"bb", b"ccc"])
    assert s.values_at(np.array([2, 5, 9])) is s.full_vals
    assert s.values_at(np.array([5, 9])).to_pylist() == [b"bb", b"ccc"]
    assert s.values_at(np.array([9, 2, 5])).to_pylist() == [b"ccc", b"a", b"bb"]  # not ascending: a take
    assert s.values_at(np.array([2, 2, 9])).to_pylist() == [b"a", b"a", b"ccc"]


def test_packed_dtype_at_one_dtype_and_several():
    from mismatch_probe.analysis.op_errors import _PackedSide

    p = _PackedSide.__new__(_PackedSide)
    p.row_start = np.array([0, 3, 5, 9])
    idx = np.array([0, 2, 3, 4, 8])
    p.dtc = np.array([1, 1, 1])
    assert p.dtype_at(idx).tolist() == [1, 1, 1, 1, 1]
    p.dtc = np.array([1, 0, 2])
    assert p.dtype_at(idx).tolist() == [1, 1, 0, 0, 2]
