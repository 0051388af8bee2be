"""One pass over two buffers of the same rows' raw float bits (the reference's and the other
engine's): the sums and maxima of :func:`mismatch_probe.analysis.op_errors.error_stats` and the max
ULP distance, without float64 copies of the rows (numba, one thread per call, no GIL held).

Same definitions as the numpy path: a position where either value is not finite counts as 0 in
both (difference 0); the ULP distance is taken on the raw bits of every position. Maxima are exact
in any order; the float64 sums are accumulated left to right, so their last bits may differ from
numpy's pairwise sums and BLAS norms (relative 1e-15 or so)."""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

_BF16, _HALF, _SINGLE, _DOUBLE = 0, 1, 2, 3
_KIND = {"bfloat16": (_BF16, np.uint16, 0x7FFF, 0x7F80), "float16": (_HALF, np.uint16, 0x7FFF, 0x7C00),
         "float32": (_SINGLE, np.uint32, 0x7FFFFFFF, 0x7F800000),
         "float64": (_DOUBLE, np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


@numba.njit(nogil=True, cache=True)
def _pass(a: Any, b: Any, fa: Any, fb: Any, kind: int, mask: Any, inf: Any, out: Any) -> None:  # pragma: no cover
    # a, b: raw bits; fa, fb: the same memory as floats (fp32 / fp64), or (16-bit) fa the value of each bit pattern
    # out: max|d|, sum|d|, sum d^2, sum r^2, sum s^2, sum s*r, max ulp
    mx = 0.0
    sa = 0.0
    sd = 0.0
    sr = 0.0
    ss = 0.0
    sx = 0.0
    mu = 0
    for i in range(a.shape[0]):
        wr = a[i]
        ws = b[i]
        er = wr & mask
        es = ws & mask
        orr = -np.int64(er) if wr != er else np.int64(er)
        oss = -np.int64(es) if ws != es else np.int64(es)
        u = abs(orr - oss)
        if u > mu:
            mu = u
        if er < inf and es < inf:
            if kind == _BF16 or kind == _HALF:  # 16-bit: the exact value from a 65,536-entry table
                r = fa[wr]
                s = fa[ws]
            else:
                r = np.float64(fa[i])
                s = np.float64(fb[i])
            d = s - r
            ad = abs(d)
            if ad > mx:
                mx = ad
            sa += ad
            sd += d * d
            sr += r * r
            ss += s * s
            sx += s * r
    out[0] = mx
    out[1] = sa
    out[2] = sd
    out[3] = sr
    out[4] = ss
    out[5] = sx
    out[6] = mu


_TABLES: dict[int, np.ndarray] = {}


def _table(kind: int) -> np.ndarray:
    """float64 value of every 16-bit pattern (bf16 or fp16), exact (NaN/Inf entries are never read)."""
    t = _TABLES.get(kind)
    if t is None:
        bits = np.arange(1 << 16, dtype=np.uint32)
        f = (bits << 16).view(np.float32) if kind == _BF16 else bits.astype(np.uint16).view(np.float16)
        with np.errstate(invalid="ignore"):
            t = _TABLES[kind] = f.astype(np.float64)
    return t


def supported(dtype: str) -> bool:
    return dtype in _KIND


def pair_stats(ref: Any, got: Any, dtype: str) -> dict[str, float]:
    """``error_stats`` of ``got`` against ``ref`` and ``max_ulp``, from their raw bytes (same length)."""
    kind, ut, mask, inf = _KIND[dtype]
    a = np.frombuffer(ref, ut)
    b = np.frombuffer(got, ut)
    if kind in (_SINGLE, _DOUBLE):
        ft = np.float32 if kind == _SINGLE else np.float64
        fa, fb = a.view(ft), b.view(ft)
    else:
        fa = fb = _table(kind)
    out = np.zeros(7, np.float64)
    _pass(a, b, fa, fb, kind, ut(mask), ut(inf), out)
    n = a.size
    mx, sa, sd, sr, ss, sx, mu = out.tolist()
    nd, nr, ns = math.sqrt(sd), math.sqrt(sr), math.sqrt(ss)
    return {
        "max_abs_diff": mx if n else 0.0,
        "mean_abs_diff": sa / n if n else 0.0,
        "rel_l2": nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf),
        "cosine": 1.0 if nd == 0 else (sx / (ns * nr) if ns > 0 and nr > 0 else 0.0),
        "sqnr_db": 10 * math.log10(nr**2 / nd**2) if nd > 0 and nr > 0 else math.inf,
        "max_ulp": float(mu) if n else 0.0,
    }
