"""The CUDA kernel of :mod:`mismatch_probe.probes.digest`: one launch computes the digest and the
stats of every row of several tensors of one dtype (a descriptor table of base address, rows,
columns, row stride, output row, column offset), reading each element once.

Cost per element (what keeps it near the memory rate): the elements are loaded as integers of
their width; the digest is 64-bit integer arithmetic with the position key added, not multiplied,
per element; finiteness, NaN/Inf counts and ``abs_max`` come from the raw bits (integer compares,
an integer max: for finite floats the order of ``|x|`` is the order of the bits with the sign
cleared); only ``sum`` and ``sum_sq`` are float64 (one conversion, one add, one fma). One warp
per row (``WARPS``), so the per-row reductions stay inside a warp.

Without CUDA the same kernel runs through Triton's interpreter on CPU tensors (for tests)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from mismatch_probe import settings

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction as _jit
else:
    _jit = triton.jit

# elements per program per step, warps per program (one row per program)
BLOCK: int = settings.get("MISMATCH_PROBE_DIGEST_BLOCK")  # module constants: benches set them directly
WARPS: int = settings.get("MISMATCH_PROBE_DIGEST_WARPS")

_ITORCH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# KIND: 0 bf16, 1 fp16, 2 fp32, 3 fp64, 4 signed int, 5 unsigned byte (uint8, bool)
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3, torch.int64: 4, torch.int32: 4,
         torch.int16: 4, torch.int8: 4, torch.uint8: 5, torch.bool: 5}


# tl.sum / tl.max are @triton.jit functions the interpreter cannot call; tl.reduce is a builtin.
@_jit
def _rsum(x):
    return tl.reduce(x, 0, tl.standard._sum_combine)


@_jit
def _rmax(x):
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@_jit
def _step(ptrs, m, key, acc, s, ss, am, nn, ni, KIND: tl.constexpr, MASKED: tl.constexpr, STATS: tl.constexpr,
          FINITE: tl.constexpr):
    """One block of a row: digest terms and (STATS) stats of BLOCK elements (MASKED: the row's tail).
    FINITE (floats): assume every element finite: ``am`` is the max of the bits with the sign
    cleared over all elements (the caller checks it and redoes the row's stats if it is not finite),
    NaN/Inf are neither tested nor counted; the same sums as the careful step on a finite row."""
    if MASKED:
        w = tl.load(ptrs, mask=m, other=0)
    else:
        w = tl.load(ptrs)
    x = w.to(tl.int64).to(tl.uint64, bitcast=True) ^ key
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    if MASKED:
        acc += tl.where(m, x, 0)  # masked lanes read 0: neutral for every stat, not for the digest
    else:
        acc += x
    if not STATS:  # digest-only rows (mode digest): the stats are never read
        return acc, s, ss, am, nn, ni
    if KIND <= 3:  # floats: finiteness, NaN/Inf counts and abs_max from the bits with the sign cleared
        if KIND == 0:  # bf16: its bits are the high half of a float32
            e = w.to(tl.int32) & 0x7FFF
            inf = 0x7F80
            f = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        elif KIND == 1:  # fp16
            e = w.to(tl.int32) & 0x7FFF
            inf = 0x7C00
            f = w.to(tl.float16, bitcast=True).to(tl.float32)
        elif KIND == 2:  # fp32
            e = w & 0x7FFFFFFF
            inf = 0x7F800000
            f = w.to(tl.float32, bitcast=True)
        else:  # fp64
            e = w & 0x7FFFFFFFFFFFFFFF
            inf = 0x7FF0000000000000
            f = w.to(tl.float64, bitcast=True)
        if FINITE:
            f = f.to(tl.float64)
            am = tl.maximum(am, e)
        else:
            fin = e < inf
            f = tl.where(fin, f, 0.0).to(tl.float64)
            nn += (e > inf).to(tl.int32)
            ni += (e == inf).to(tl.int32)
            am = tl.maximum(am, tl.where(fin, e, 0))
    elif KIND == 5:  # uint8, bool: unsigned values (the digest reads them sign-extended)
        f = (w.to(tl.int32) & 0xFF).to(tl.float64)
        am = tl.maximum(am, f)
    else:  # signed integers: always finite
        f = w.to(tl.float64)
        am = tl.maximum(am, tl.abs(f))
    s += f
    ss += f * f
    return acc, s, ss, am, nn, ni


@_jit
def _row(base, n_cols, coff, lane, lane_key, KIND: tl.constexpr, BLOCK: tl.constexpr, STATS: tl.constexpr,
         FINITE: tl.constexpr):
    """Digest terms and stats accumulators of one row (per lane: the kernel reduces them)."""
    acc = tl.full([BLOCK], 0, tl.uint64)
    s = tl.full([BLOCK], 0.0, tl.float64)
    ss = tl.full([BLOCK], 0.0, tl.float64)
    if KIND == 3:
        am = tl.full([BLOCK], 0, tl.int64)
    elif KIND >= 4:
        am = tl.full([BLOCK], 0.0, tl.float64)
    else:
        am = tl.full([BLOCK], 0, tl.int32)
    nn = tl.full([BLOCK], 0, tl.int32)
    ni = tl.full([BLOCK], 0, tl.int32)
    n_full = n_cols - n_cols % BLOCK
    for c0 in range(0, n_full, BLOCK):
        cols = tl.max_contiguous(tl.multiple_of(c0 + lane, BLOCK), BLOCK)
        key = (c0 + coff + 1).to(tl.uint64) * 0x9E3779B97F4A7C15 + lane_key
        acc, s, ss, am, nn, ni = _step(base + cols, cols < n_cols, key, acc, s, ss, am, nn, ni, KIND=KIND,
                                       MASKED=False, STATS=STATS, FINITE=FINITE)
    if n_full < n_cols:
        cols = tl.max_contiguous(tl.multiple_of(n_full + lane, BLOCK), BLOCK)
        key = (n_full + coff + 1).to(tl.uint64) * 0x9E3779B97F4A7C15 + lane_key
        acc, s, ss, am, nn, ni = _step(base + cols, cols < n_cols, key, acc, s, ss, am, nn, ni, KIND=KIND,
                                       MASKED=True, STATS=STATS, FINITE=FINITE)
    return acc, s, ss, am, nn, ni


@_jit
def _abs_max(a, KIND: tl.constexpr):
    """The row's abs_max (float64) from the reduced ``am`` (floats: bits with the sign cleared)."""
    if KIND == 0:
        r = (a << 16).to(tl.float32, bitcast=True).to(tl.float64)
    elif KIND == 1:
        r = a.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.float64)
    elif KIND == 2:
        r = a.to(tl.float32, bitcast=True).to(tl.float64)
    elif KIND == 3:
        r = a.to(tl.float64, bitcast=True)
    else:
        r = a
    return r


@_jit
def _rows_kernel(x_ptr, desc_ptr, dig_ptr, st_ptr, amf_ptr, cnt_ptr, amb_ptr, KIND: tl.constexpr, BLOCK: tl.constexpr,
                 VEC: tl.constexpr, STATS: tl.constexpr):
    row = tl.program_id(0)
    d = desc_ptr + tl.program_id(1) * 6
    n_rows = tl.load(d + 1)
    if row < n_rows:
        start = tl.load(d)  # elements from x_ptr (an integer-typed view of the first tensor)
        n_cols = tl.load(d + 2)
        stride = tl.load(d + 3)
        out = tl.load(d + 4) + row
        coff = tl.load(d + 5)
        if VEC > 1:  # every start, row stride and row width is a multiple of 16 bytes: vector loads
            start = tl.multiple_of(start, VEC)
            stride = tl.multiple_of(stride, VEC)
            n_cols = tl.multiple_of(n_cols, VEC)
        base = x_ptr + (start + row * stride)
        lane = tl.arange(0, BLOCK)
        lane_key = lane.to(tl.uint64) * 0x9E3779B97F4A7C15  # key of column c0 + j = (c0 + coff + 1) * G + j * G
        # floats: first the pass that assumes every element finite (fewer instructions per element)
        acc, s, ss, am, nn, ni = _row(base, n_cols, coff, lane, lane_key, KIND=KIND, BLOCK=BLOCK, STATS=STATS,
                                      FINITE=True)
        tl.store(dig_ptr + out, _rsum(acc).to(tl.int64, bitcast=True))
        if not STATS:
            return
        amax = _abs_max(_rmax(am), KIND)
        if KIND <= 3:
            if not (amax < float("inf")):  # a NaN or an Inf in the row (rare): its stats again, counted
                acc, s, ss, am, nn, ni = _row(base, n_cols, coff, lane, lane_key, KIND=KIND, BLOCK=BLOCK,
                                              STATS=True, FINITE=False)
                amax = _abs_max(_rmax(am), KIND)
        # the file's parts (recorder_writer.STATS_PARTS, split_arena), so a chunk's copy needs no split kernels
        tl.store(st_ptr + out * 2, _rsum(s))
        tl.store(st_ptr + out * 2 + 1, _rsum(ss))
        tl.store(amf_ptr + out, amax)
        tl.store(cnt_ptr + out * 2, _rsum(nn))
        tl.store(cnt_ptr + out * 2 + 1, _rsum(ni))
        # abs_max's bf16 bits: the float32 nearest abs_max, its high half (exact for a bf16 op's rows)
        tl.store(amb_ptr + out, (amax.to(tl.float32).to(tl.int32, bitcast=True) >> 16).to(tl.int16))


def launch(items: list[tuple[Any, int, int]], dig: Any, st: Any, stats: bool = True) -> None:
    """``items``: (2-D tensor with unit inner stride, output row, column offset), all of one dtype;
    writes ``dig`` (int64 [cap], the uint64 bits) and, if ``stats``, the stats parts ``st`` (the tuple of
    :func:`split_arena`) at the output rows."""
    t0 = items[0][0]
    desc = [[t.data_ptr(), t.shape[0], t.shape[1], t.stride(0), out, coff] for t, out, coff in items]
    launch_desc(desc, t0, max(t.shape[0] for t, _, _ in items), dig, st, stats)


def launch_desc(desc: Any, x: Any, max_rows: int, dig: Any, st: Any, stats: bool = True) -> None:
    """The launch over a ready descriptor table (rows of [address, rows, cols, row stride, out, col
    offset]: a list of rows or an int64 array [n, 6]) of tensors of ``x``'s dtype (any one of them);
    ``stats`` False: digests only (the stats rows are left as they are). ``st``: the tuple of
    :func:`split_arena` (the kernel writes the parts a chunk's copy takes as they are)."""
    size = 1 if x.dtype == torch.bool else x.dtype.itemsize
    base = x.data_ptr()
    d = np.array(desc, dtype=np.int64).reshape(-1, 6)
    d[:, 0] -= base  # addresses -> element offsets from x (tensors of one dtype are itemsize-aligned)
    d[:, 0] //= size
    vec = 16 // size
    aligned = base % 16 == 0 and not ((d[:, [0, 2, 3]] * size) % 16).any()
    xi = x.view(torch.uint8).view(torch.int8) if x.dtype == torch.bool else x.view(_ITORCH[size])
    grid = (max_rows, len(desc))
    args = dict(KIND=_KIND[x.dtype], BLOCK=BLOCK, VEC=vec if aligned else 1, STATS=bool(stats))
    if INTERPRET:
        _rows_kernel[grid](xi, torch.from_numpy(d), dig, *st, **args)
    else:
        dt = torch.from_numpy(d).pin_memory().to(x.device, non_blocking=True)
        _rows_kernel[grid](xi, dt, dig, *st, num_warps=WARPS, **args)


def split_arena(rows: int, device: Any) -> tuple[Any, Any, Any, Any]:
    """A stats arena as the file's parts (``recorder_writer.STATS_PARTS``): float64 [rows, 2] sum and sum_sq,
    float64 [rows] abs_max, int32 [rows, 2] NaN / Inf counts, int16 [rows] abs_max's bf16 bits."""
    return (torch.empty(rows, 2, dtype=torch.float64, device=device), torch.empty(rows, dtype=torch.float64, device=device),
            torch.empty(rows, 2, dtype=torch.int32, device=device), torch.empty(rows, dtype=torch.int16, device=device))


def stats_rows(st: tuple[Any, Any, Any, Any]) -> Any:
    """The parts of :func:`split_arena` as float64 [rows, 5] (sum, sum_sq, abs_max, n_nan, n_inf): the layout
    of the CPU arena and ``digest.stats_ref``, for checks against them."""
    s2, amf, cnt, _ = st
    return torch.cat([s2, amf[:, None], cnt.to(torch.float64)], dim=1)
