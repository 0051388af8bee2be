"""The CPU kernel of :mod:`mismatch_probe.probes.digest`: digest and stats of each row in one
pass over the row's memory (numba, one thread, no threading layer).

Each row is one simple loop that LLVM vectorizes (AVX2 / AVX-512 where the CPU has them): the
digest is integer arithmetic (exact in any order); finiteness, NaN/Inf counts and ``abs_max`` are
read off the raw bits (integer compares and an integer max: for finite floats the order of
``|x|`` is the order of the bits with the sign cleared); only ``sum`` and ``sum_sq`` are float64,
accumulated with reassociation allowed (vector lanes), so their last bits may differ from the
numpy reference, as the module docstring of ``digest`` allows. 16-bit floats are widened from
their bits (bf16: shift into a float32; fp16: LLVM's half type), exactly.

No ``parallel=True``: numba's parallel backend (OpenMP by default) runs a second OpenMP runtime
beside torch's, and the two pools' spinning threads slowed the engine's own kernels (sdpa) several
times over on a 2-core machine. The kernels release the GIL instead (``nogil``), and :func:`rows`
splits a large tensor's rows over a small pool of plain threads, as many as torch's intra-op
threads: the recorder calls it between the engine's ops, while torch's threads wait, so the
cores the forward uses are the ones the capture uses (one thread left the other cores idle for
~40% of a 129M model's forward on 2 cores). Each row is still one loop of one thread: the bits do
not depend on the split."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from mismatch_probe.probes.digest_constants import GOLDEN, MIX1, MIX2

_G, _M1, _M2 = np.uint64(GOLDEN), np.uint64(MIX1), np.uint64(MIX2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_FM = {"reassoc", "contract"}  # vector lanes for the float sums; no nnan/ninf: NaN and Inf stay exact


@intrinsic
def _f32(typingctx: Any, x: Any) -> Any:
    """int32 bits -> float32."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _f64(typingctx: Any, x: Any) -> Any:
    """int64 bits -> float64."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def _f16(typingctx: Any, x: Any) -> Any:
    """int16 bits of an IEEE half -> float64 (exact)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.DoubleType())

    return types.float64(types.int16), codegen


@numba.njit(inline="always")
def _mix(w: Any, i: Any) -> Any:
    x = numba.uint64(w) ^ (numba.uint64(i) * _G)
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


_BF16, _HALF, _SINGLE, _DOUBLE = 0, 1, 2, 3  # how ``_widen`` reads a word's bits


@numba.njit(inline="always")
def _widen(w: Any, kind: Any) -> Any:
    """A float word's bits (sign-extended to int64) -> float64, exactly."""
    if kind == _BF16:
        return numba.float64(_f32(w << 16))
    if kind == _HALF:
        return _f16(numba.int16(w))
    if kind == _SINGLE:
        return numba.float64(_f32(w))
    return _f64(w)


def _float_kernel(mask: int, inf: int, kind: int) -> Any:
    """The row kernel of one float dtype: ``mask`` clears the sign, ``inf`` is the Inf pattern
    (above it: NaN), ``kind`` picks the widening. numba freezes the three as constants, so each
    dtype compiles to its own specialized loop, as fast as a hand-written one per dtype (measured:
    equal ns per element); the cache keeps one entry per dtype (it keys closures by their values)."""

    @numba.njit(nogil=True, fastmath=_FM, cache=True)
    def rows_float(words: Any, off: Any, dig: Any, st: Any) -> None:  # pragma: no cover - compiled
        rows, n = words.shape
        for r in range(rows):
            d = numba.uint64(0)
            s = 0.0
            q = 0.0
            am = numba.int64(0)
            nn = numba.int64(0)
            ni = numba.int64(0)
            for i in range(n):
                w = numba.int64(words[r, i])
                d += _mix(w, i + 1 + off)
                e = w & mask
                fin = e < inf
                nn += e > inf
                ni += e == inf
                am = max(am, e if fin else 0)
                f = _widen(w, kind) if fin else 0.0
                s += f
                q += f * f
            dig[r] = d
            st[r, 0] = s
            st[r, 1] = q
            st[r, 2] = _widen(am, kind)
            st[r, 3] = nn
            st[r, 4] = ni

    return rows_float


@numba.njit(nogil=True, fastmath=_FM, cache=True)
def _rows_int(words: Any, vals: Any, off: Any, dig: Any, st: Any) -> None:  # pragma: no cover - compiled
    rows, n = words.shape
    for r in range(rows):
        d = numba.uint64(0)
        s = 0.0
        q = 0.0
        am = 0.0
        for i in range(n):
            d += _mix(numba.int64(words[r, i]), i + 1 + off)
            f = numba.float64(vals[r, i])
            s += f
            q += f * f
            am = max(am, abs(f))
        dig[r] = d
        st[r, 0] = s
        st[r, 1] = q
        st[r, 2] = am
        st[r, 3] = 0.0
        st[r, 4] = 0.0


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOAT = {torch.bfloat16: _float_kernel(0x7FFF, 0x7F80, _BF16), torch.float16: _float_kernel(0x7FFF, 0x7C00, _HALF),
          torch.float32: _float_kernel(0x7FFFFFFF, 0x7F800000, _SINGLE),
          torch.float64: _float_kernel(0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, _DOUBLE)}
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool)


SPLIT_ELEMENTS = 1 << 18  # a tensor this large or larger is split over the pool (below: one call)
_POOL: Any = None
_POOL_N = 0


def _pool(n: int) -> Any:
    global _POOL, _POOL_N
    if _POOL is None or _POOL_N != n:
        from concurrent.futures import ThreadPoolExecutor

        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL, _POOL_N = ThreadPoolExecutor(n, thread_name_prefix="mp-digest"), n
    return _POOL


def _one(t: torch.Tensor, dig: np.ndarray, st: np.ndarray, off: np.int64) -> None:
    if t.dtype == torch.bool:
        u8 = t.view(torch.uint8)
        _rows_int(u8.view(torch.int8).numpy(), u8.numpy(), off, dig, st)
        return
    words = t.view(_INTS[t.element_size()]).numpy()
    k = _FLOAT.get(t.dtype)
    if k is not None:
        k(words, off, dig, st)
    else:
        _rows_int(words, t.numpy(), off, dig, st)


def rows(t: torch.Tensor, dig: np.ndarray, st: np.ndarray, col_offset: int = 0) -> None:
    """``t``: 2-D CPU tensor with unit inner stride; writes ``dig`` (uint64 [rows]) and ``st``
    (a large tensor's rows split over torch's intra-op thread count of plain threads)."""
    off = np.int64(col_offset)
    n = min(torch.get_num_threads(), 8, t.shape[0])
    if n < 2 or t.numel() < SPLIT_ELEMENTS:
        _one(t, dig, st, off)
        return
    cut = np.linspace(0, t.shape[0], n + 1).astype(np.int64)
    parts = [(int(a), int(b)) for a, b in zip(cut[:-1], cut[1:], strict=True) if b > a]
    futs = [_pool(n - 1).submit(_one, t[a:b], dig[a:b], st[a:b], off) for a, b in parts[1:]]
    a, b = parts[0]
    _one(t[a:b], dig[a:b], st[a:b], off)  # the calling thread takes the first part
    for f in futs:
        f.result()
