"""The strict RMSNorm with the per-token NVFP4 quantization of its output fused in: the linear that
reads the norm's output then costs its GEMM alone.

Both engines' norm adapters call :func:`rmsnorm` with the norm module; the NVFP4 linear that reads the
output (q/k/v after the input norm, gate/up after the post-attention norm) records itself in the
module's :class:`fused_input.Consumers` the first time, and from the next call on the norm runs one
kernel that writes the normalized rows *and* their quantization in the operand layout that linear's
GEMM takes at the call's row count (:func:`tc_linear.operand_layout`). The linear finds it on its input
(:func:`fused_input.take`) instead of quantizing (the protocol: :mod:`fused_input`).

Same bits as the two kernels it replaces, by construction and checked with ``torch.equal``
(``tests/kernels/test_norm_quant.py`` in the interpreter; on the GPU ``tests/kernels/test_kernels_gpu.py``
and ``bench/gpu_nvfp4_check.py`` section n):
each program runs the strict norm's own row code (:func:`strict.triton_ops.rmsnorm_row`, same block
and warps, so the same ``tl.sum`` order), stores the row, and only then reads it back, after a
barrier, in the quantizer's ``[K/16, 16]`` view (the reload keeps the quantizer's layout out of the
norm's reduction): the row's amax over the whole row, then its own chunk of :data:`CHUNK_BLOCKS` blocks
quantized with :mod:`quant_fast`'s helpers (the reference quantizer's bits). A row has several programs
(each computes the whole norm, the same bits; the quantize, most of the work, is split): one program per
row took 6.7 us at 16 rows of 4,096 on an H100, where bf16 vLLM's fused add + norm takes 2.1. Where the
fused kernel does not apply (no consumer yet, CPU, not bf16, a row over ``quant_fast.MAX_K``, the
chunk-major operand of pre-Hopper native kernels) it is the strict norm.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from mismatch_probe.kernels.launch_math import next_pow2
from mismatch_probe.kernels.strict.triton_ops import norm_warps, rmsnorm_row

from .common import INTERPRET, kjit, launch
from .fused_input import (
    chunk_ids,
    chunks,
    finite_amax,
    gdc_trigger,
    layout_for,
    mark,
    operand_buffers,
    pdl,
    quantize_chunk,
    store_core,
)
from .ref import NVFP4Tensor

CHUNK_BLOCKS = 64  # 16-element blocks of a row each program quantizes (1,024 values); a row gets several programs


@kjit
def _norm_quant_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, amax_ptr, codes_ptr, scales_ptr, op_ptr, rows, H, eps, offset, groups,
    HAS_W: tl.constexpr, HAS_RES: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr,
    LAYOUT: tl.constexpr, HW: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, c): the strict norm of the whole row (every program of the row computes it, the same code
    and so the same bits; each stores the row, the same values), then, after a barrier, the row's amax read
    back chunk by chunk and the per-token quantization of the row's blocks [c CB, (c + 1) CB) (LAYOUT 2:
    rows of the operand's 8-row groups, the rows past ``rows`` writing zero operand rows). LAYOUT 0: the
    operand row-major [rows, H]; 2: core-matrix [H/128][16][groups][8][8] (``native.core_operand``)."""
    if PDL:
        gdc_trigger()
    row, c, rv, j16, nb, b, ok = chunk_ids(H, CB)
    if row < rows:
        rmsnorm_row(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, row, H, eps, offset, 1, H, 0, HAS_W, HAS_RES, ROUND_FIRST,
                    BLOCK)
        tl.debug_barrier()  # the row is in y: read it back in the quantizer's view
        amax = tl.zeros([1], tl.float32)
        for c0 in range(0, nb, CB):
            bb = c0 + tl.arange(0, CB)
            yy = tl.load(y_ptr + rv[:, None, None] * H + bb[None, :, None] * 16 + j16[None, None, :],
                         mask=(bb < nb)[None, :, None], other=0.0).to(tl.float32)
            amax = finite_amax(amax, yy)
        yv = tl.load(y_ptr + rv[:, None, None] * H + b[None, :, None] * 16 + j16[None, None, :], mask=ok[None, :, None],
                     other=0.0).to(tl.float32)
        quantize_chunk(yv, amax, c, row, rv, rows, b, j16, ok, amax_ptr, codes_ptr, scales_ptr, op_ptr, H, groups, CB,
                       LAYOUT, HW)
    elif LAYOUT == 2:
        store_core(op_ptr, tl.zeros([1, CB, 16], tl.float32), row, b, j16, ok, groups)


def norm_quantize(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                  offset: float, round_first: bool, layout: int) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """One kernel: (y, residual out or None, (NVFP4Tensor of y per token, fp16 operand in ``layout``)).
    ``x`` [rows, H] contiguous (``residual`` likewise); y and the residual are the strict norm's bits, the
    quantization the per-token quantizer's (``quant_fast.quantize_rows`` with ``emit_op``)."""
    rows, h = x.shape
    y = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else y
    amax, codes, scales, op, grid, groups = operand_buffers(rows, h, layout, x.device)
    if grid:
        cb, per_row = chunks(h, CHUNK_BLOCKS)
        launch(_norm_quant_kernel, (grid, per_row), x, residual.contiguous() if residual is not None else y,
               weight if weight is not None else y, y, rout, amax, codes, scales, op, rows, h, float(eps), float(offset),
               groups, weight is not None, residual is not None, round_first, next_pow2(h), cb, layout, not INTERPRET,
               pdl(x), num_warps=norm_warps(h))
    return y, (rout if residual is not None else None), (NVFP4Tensor(codes, scales, amax, True), op)


def rmsnorm(module: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The strict (add +) RMSNorm of ``x`` (CUDA) by the norm ``module`` of an NVFP4 recipe: fused with the
    per-token quantization its consuming linear takes where the module's :class:`Consumers` knows that
    layout, else the strict kernel (``strict.ops.rmsnorm`` / ``add_rmsnorm``'s CUDA path, with
    ``unit_offset`` as there); the output carries what the linear takes (:func:`fused_input.take`)."""
    from mismatch_probe.kernels.strict import triton_ops

    offset, round_first = (1.0, False) if unit_offset else (0.0, True)
    h = x.shape[-1]
    lay = None
    if x.is_contiguous() and (residual is None or residual.is_contiguous()):
        lay = layout_for(module, x)
    if lay is None:
        y, r = triton_ops._norm(x, residual, weight, eps, offset, round_first)
        q = None
    else:
        res2 = residual.reshape(-1, h) if residual is not None else None
        y2, r2, q = norm_quantize(x.reshape(-1, h), res2, weight, eps, offset, round_first, lay)
        y, r = y2.reshape(x.shape), (r2.reshape(x.shape) if r2 is not None else None)
    return mark(y, module, lay, q), r
