"""The CPU kernel of :mod:`mismatch_probe.probes.digest`: digest and stats of each row in one
pass over the row's memory (numba, parallel over rows). 16-bit floats are decoded through a
65,536-entry table (exact), wider floats are read as they are."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

from mismatch_probe.probes.digest import GOLDEN, MIX1, MIX2

_G, _M1, _M2 = np.uint64(GOLDEN), np.uint64(MIX1), np.uint64(MIX2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@numba.njit(inline="always")
def _mix(w: Any, i: Any) -> Any:
    x = numba.uint64(w) ^ (numba.uint64(i) * _G)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


@numba.njit(parallel=True, cache=True, nogil=True)
def _rows_lut(words: Any, lut: Any, off: Any, dig: Any, st: Any) -> None:  # pragma: no cover - compiled
    rows, n = words.shape
    for r in numba.prange(rows):
        d = numba.uint64(0)
        s = 0.0
        ss = 0.0
        am = 0.0
        nn = 0
        ni = 0
        for i in range(n):
            w = words[r, i]
            d += _mix(numba.int64(w), i + 1 + off)
            v = lut[numba.int64(w) & 0xFFFF]
            fin = (v - v) == 0.0
            c = v if fin else 0.0
            nn += v != v
            ni += (not fin) and v == v
            s += c
            ss += c * c
            am = max(am, abs(c))
        dig[r] = d
        st[r, 0] = s
        st[r, 1] = ss
        st[r, 2] = am
        st[r, 3] = nn
        st[r, 4] = ni


@numba.njit(parallel=True, cache=True, nogil=True)
def _rows_val(words: Any, vals: Any, off: Any, dig: Any, st: Any) -> None:  # pragma: no cover - compiled
    rows, n = words.shape
    for r in numba.prange(rows):
        d = numba.uint64(0)
        s = 0.0
        ss = 0.0
        am = 0.0
        nn = 0
        ni = 0
        for i in range(n):
            d += _mix(numba.int64(words[r, i]), i + 1 + off)
            v = numba.float64(vals[r, i])
            fin = (v - v) == 0.0
            c = v if fin else 0.0
            nn += v != v
            ni += (not fin) and v == v
            s += c
            ss += c * c
            am = max(am, abs(c))
        dig[r] = d
        st[r, 0] = s
        st[r, 1] = ss
        st[r, 2] = am
        st[r, 3] = nn
        st[r, 4] = ni


def _lut(dtype: torch.dtype) -> np.ndarray:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float64).numpy()


_LUTS = {torch.bfloat16: _lut(torch.bfloat16), torch.float16: _lut(torch.float16)}
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool)


def rows(t: torch.Tensor, dig: np.ndarray, st: np.ndarray, col_offset: int = 0) -> None:
    """``t``: 2-D CPU tensor with unit inner stride; writes ``dig`` (uint64 [rows]) and ``st``."""
    if t.dtype == torch.bool:
        words = t.view(torch.uint8).view(torch.int8).numpy()
    else:
        words = t.view(_INTS[t.element_size()]).numpy()
    lut = _LUTS.get(t.dtype)
    if lut is not None:
        _rows_lut(words, lut, np.int64(col_offset), dig, st)
    elif t.dtype in (torch.float32, torch.float64):
        _rows_val(words, t.numpy(), np.int64(col_offset), dig, st)
    else:
        _rows_val(words, words, np.int64(col_offset), dig, st)
