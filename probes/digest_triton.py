"""The CUDA kernel of :mod:`mismatch_probe.probes.digest`: one launch computes the digest and the
stats of every row of several tensors of one dtype (a descriptor table of base address, rows,
columns, row stride, output row, column offset), reading each element once.

Without CUDA the same kernel runs through Triton's interpreter on CPU tensors (for tests)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction as _jit
else:
    _jit = triton.jit

BLOCK = 1024
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32, torch.float64: tl.float64,
       torch.int64: tl.int64, torch.int32: tl.int32, torch.int16: tl.int16, torch.int8: tl.int8, torch.uint8: tl.int8,
       torch.bool: tl.int8}
_ITL = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


# tl.sum / tl.max are @triton.jit functions the interpreter cannot call; tl.reduce is a builtin.
@_jit
def _rsum(x):
    return tl.reduce(x, 0, tl.standard._sum_combine)


@_jit
def _rmax(x):
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@_jit
def _rows_kernel(desc_ptr, dig_ptr, st_ptr, DTYPE: tl.constexpr, ITYPE: tl.constexpr, HALF: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    d = desc_ptr + tl.program_id(1) * 6
    n_rows = tl.load(d + 1)
    if row < n_rows:
        addr = tl.load(d)
        n_cols = tl.load(d + 2)
        stride = tl.load(d + 3)
        out = tl.load(d + 4) + row
        coff = tl.load(d + 5)
        base = addr.to(tl.pointer_type(DTYPE)) + row * stride
        acc = tl.full([BLOCK], 0, tl.uint64)
        s = tl.full([BLOCK], 0.0, tl.float64)
        ss = tl.full([BLOCK], 0.0, tl.float64)
        am = tl.full([BLOCK], 0.0, tl.float64)
        nn = tl.full([BLOCK], 0, tl.int32)
        ni = tl.full([BLOCK], 0, tl.int32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < n_cols
            v = tl.load(base + cols, mask=m, other=0)
            w = v.to(ITYPE, bitcast=True).to(tl.int64).to(tl.uint64, bitcast=True)
            x = w ^ ((cols + coff + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
            x = x ^ (x >> 30)
            x = x * 0xBF58476D1CE4E5B9
            x = x ^ (x >> 27)
            x = x * 0x94D049BB133111EB
            x = x ^ (x >> 31)
            acc += tl.where(m, x, 0)
            if HALF:
                f = v.to(tl.float32).to(tl.float64)
            else:
                f = v.to(tl.float64)
            fin = (f - f) == 0.0
            c = tl.where(fin, f, 0.0)
            s += c
            ss += c * c
            am = tl.maximum(am, tl.abs(c))
            nn += (f != f).to(tl.int32)
            ni += ((f == f) & (~fin)).to(tl.int32)
        tl.store(dig_ptr + out, _rsum(acc))
        st = st_ptr + out * 5
        tl.store(st, _rsum(s))
        tl.store(st + 1, _rsum(ss))
        tl.store(st + 2, _rmax(am))
        tl.store(st + 3, _rsum(nn).to(tl.float64))
        tl.store(st + 4, _rsum(ni).to(tl.float64))


def launch(items: list[tuple[Any, int, int]], dig: Any, st: Any) -> None:
    """``items``: (2-D tensor with unit inner stride, output row, column offset), all of one dtype;
    writes ``dig`` (int64 [cap], the uint64 bits) and ``st`` (float64 [cap, 5]) at the output rows."""
    t0 = items[0][0]
    desc = [[t.data_ptr(), t.shape[0], t.shape[1], t.stride(0), out, coff] for t, out, coff in items]
    max_rows = max(t.shape[0] for t, _, _ in items)
    grid = (max_rows, len(items))
    args = dict(DTYPE=_TL[t0.dtype], ITYPE=_ITL[t0.element_size()], HALF=t0.dtype in (torch.bfloat16, torch.float16),
                BLOCK=BLOCK)
    if INTERPRET:
        import numpy as np

        with np.errstate(invalid="ignore"):  # inf - inf in the finiteness test is intended
            _rows_kernel[grid](torch.tensor(desc, dtype=torch.int64), dig, st, **args)
    else:
        dt = torch.tensor(desc, dtype=torch.int64, pin_memory=True).to(t0.device, non_blocking=True)
        _rows_kernel[grid](dt, dig, st, **args)
