"""The CPU kernel of :mod:`mismatch_probe.probes.digest`: digest and stats of each row in one
pass over the row's memory (numba, parallel over rows). 16-bit floats are decoded through a
65,536-entry table (exact), wider floats are read as they are."""

from __future__ import annotations

import os
from typing import Any

import numba
import numpy as np
import torch

from mismatch_probe.probes.digest_constants import GOLDEN, MIX1, MIX2

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
    n4 = n - n % 4
    for r in numba.prange(rows):
        # four independent accumulator lanes: the float adds do not wait on each other
        d = numba.uint64(0)
        s0 = s1 = s2 = s3 = 0.0
        q0 = q1 = q2 = q3 = 0.0
        a0 = a1 = a2 = a3 = 0.0
        nn = 0
        ni = 0
        for i in range(0, n4, 4):
            w0, w1, w2, w3 = words[r, i], words[r, i + 1], words[r, i + 2], words[r, i + 3]
            d += _mix(numba.int64(w0), i + 1 + off) + _mix(numba.int64(w1), i + 2 + off)
            d += _mix(numba.int64(w2), i + 3 + off) + _mix(numba.int64(w3), i + 4 + off)
            v0 = lut[numba.int64(w0) & 0xFFFF]
            v1 = lut[numba.int64(w1) & 0xFFFF]
            v2 = lut[numba.int64(w2) & 0xFFFF]
            v3 = lut[numba.int64(w3) & 0xFFFF]
            f0, f1, f2, f3 = (v0 - v0) == 0.0, (v1 - v1) == 0.0, (v2 - v2) == 0.0, (v3 - v3) == 0.0
            c0 = v0 if f0 else 0.0
            c1 = v1 if f1 else 0.0
            c2 = v2 if f2 else 0.0
            c3 = v3 if f3 else 0.0
            nn += (v0 != v0) + (v1 != v1) + (v2 != v2) + (v3 != v3)
            ni += ((not f0) and v0 == v0) + ((not f1) and v1 == v1) + ((not f2) and v2 == v2) + ((not f3) and v3 == v3)
            s0 += c0
            s1 += c1
            s2 += c2
            s3 += c3
            q0 += c0 * c0
            q1 += c1 * c1
            q2 += c2 * c2
            q3 += c3 * c3
            a0 = max(a0, abs(c0))
            a1 = max(a1, abs(c1))
            a2 = max(a2, abs(c2))
            a3 = max(a3, abs(c3))
        for i in range(n4, n):
            w = words[r, i]
            d += _mix(numba.int64(w), i + 1 + off)
            v = lut[numba.int64(w) & 0xFFFF]
            f = (v - v) == 0.0
            c = v if f else 0.0
            nn += v != v
            ni += (not f) and v == v
            s0 += c
            q0 += c * c
            a0 = max(a0, abs(c))
        dig[r] = d
        st[r, 0] = (s0 + s1) + (s2 + s3)
        st[r, 1] = (q0 + q1) + (q2 + q3)
        st[r, 2] = max(max(a0, a1), max(a2, a3))
        st[r, 3] = nn
        st[r, 4] = ni


@numba.njit(parallel=True, cache=True, nogil=True)
def _rows_val(words: Any, vals: Any, off: Any, dig: Any, st: Any) -> None:  # pragma: no cover - compiled
    rows, n = words.shape
    n4 = n - n % 4
    for r in numba.prange(rows):
        # four independent accumulator lanes: the float adds do not wait on each other
        d = numba.uint64(0)
        s0 = s1 = s2 = s3 = 0.0
        q0 = q1 = q2 = q3 = 0.0
        a0 = a1 = a2 = a3 = 0.0
        nn = 0
        ni = 0
        for i in range(0, n4, 4):
            w0, w1, w2, w3 = words[r, i], words[r, i + 1], words[r, i + 2], words[r, i + 3]
            d += _mix(numba.int64(w0), i + 1 + off) + _mix(numba.int64(w1), i + 2 + off)
            d += _mix(numba.int64(w2), i + 3 + off) + _mix(numba.int64(w3), i + 4 + off)
            v0 = numba.float64(vals[r, i])
            v1 = numba.float64(vals[r, i + 1])
            v2 = numba.float64(vals[r, i + 2])
            v3 = numba.float64(vals[r, i + 3])
            f0, f1, f2, f3 = (v0 - v0) == 0.0, (v1 - v1) == 0.0, (v2 - v2) == 0.0, (v3 - v3) == 0.0
            c0 = v0 if f0 else 0.0
            c1 = v1 if f1 else 0.0
            c2 = v2 if f2 else 0.0
            c3 = v3 if f3 else 0.0
            nn += (v0 != v0) + (v1 != v1) + (v2 != v2) + (v3 != v3)
            ni += ((not f0) and v0 == v0) + ((not f1) and v1 == v1) + ((not f2) and v2 == v2) + ((not f3) and v3 == v3)
            s0 += c0
            s1 += c1
            s2 += c2
            s3 += c3
            q0 += c0 * c0
            q1 += c1 * c1
            q2 += c2 * c2
            q3 += c3 * c3
            a0 = max(a0, abs(c0))
            a1 = max(a1, abs(c1))
            a2 = max(a2, abs(c2))
            a3 = max(a3, abs(c3))
        for i in range(n4, n):
            w = words[r, i]
            d += _mix(numba.int64(w), i + 1 + off)
            v = numba.float64(vals[r, i])
            f = (v - v) == 0.0
            c = v if f else 0.0
            nn += v != v
            ni += (not f) and v == v
            s0 += c
            q0 += c * c
            a0 = max(a0, abs(c))
        dig[r] = d
        st[r, 0] = (s0 + s1) + (s2 + s3)
        st[r, 1] = (q0 + q1) + (q2 + q3)
        st[r, 2] = max(max(a0, a1), max(a2, a3))
        st[r, 3] = nn
        st[r, 4] = ni


def _lut(dtype: torch.dtype) -> np.ndarray:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float64).numpy()


_LUTS = {torch.bfloat16: _lut(torch.bfloat16), torch.float16: _lut(torch.float16)}
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool)


# Threads for the row loop. One by default: capture runs between the engine's own (OpenMP)
# kernels, whose pool would otherwise compete with numba's; MISMATCH_PROBE_CAPTURE_THREADS=N to change.
THREADS = max(1, int(os.environ.get("MISMATCH_PROBE_CAPTURE_THREADS", "1")))


def rows(t: torch.Tensor, dig: np.ndarray, st: np.ndarray, col_offset: int = 0) -> None:
    """``t``: 2-D CPU tensor with unit inner stride; writes ``dig`` (uint64 [rows]) and ``st``."""
    numba.set_num_threads(min(THREADS, numba.config.NUMBA_NUM_THREADS))
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
