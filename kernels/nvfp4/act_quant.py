"""The strict act-and-mul with the per-token NVFP4 quantization of its output fused in: the down
projection that reads it then costs its GEMM alone.

vLLM's ``SiluAndMul`` / ``GeluAndMul`` adapter calls :func:`act_and_mul` with the activation module;
the protocol with the linear is :mod:`fused_input`'s (the first call quantizes in the linear and
teaches the module its consumer's operand layout; from the next call on one kernel writes the product
*and* its quantization in that layout). Same bits as the two kernels it replaces: the activation and
the product are elementwise, computed by the strict kernel's own code (:func:`strict.triton_ops.act_value`,
then the same two bf16 roundings) on the same values, only the tiling differs (here programs of 2,048
values of a row in the quantizer's ``[K/16, 16]`` view, each taking the row's amax over the whole row),
and the quantization is :mod:`quant_fast`'s helpers on the rounded product (checked with ``torch.equal``:
``tests/kernels/test_act_quant.py`` in the interpreter, ``tests/kernels/test_kernels_gpu.py`` and
``bench/gpu_nvfp4_check.py`` section n on the GPU). Where it does not apply (no consumer yet, CPU, not
bf16, a row over ``quant_fast.MAX_K``) it is the strict act-and-mul. The learner's HF MLP multiplies
``act(gate) * up`` in its own forward, so there the down projection quantizes its input itself (the
same bits).
"""

from __future__ import annotations

import torch
import triton.language as tl

from mismatch_probe.kernels.strict.triton_ops import act_code, act_value, rows2d

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

CHUNK_BLOCKS = 128  # 16-element blocks of a row per program (2,048 values); a longer row gets several programs


@kjit
def _act_rows(g_ptr, u_ptr, rv, b, j16, ok, sg, su, ACT: tl.constexpr, OUT_TY: tl.constexpr):
    """``bf16(bf16(act(g)) * u)`` of blocks ``b`` of row ``rv`` as fp32 [1, CB, 16] (masked blocks 0)."""
    m3 = ok[None, :, None]
    col = b[None, :, None] * 16 + j16[None, None, :]
    g = tl.load(g_ptr + rv[:, None, None] * sg + col, mask=m3, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rv[:, None, None] * su + col, mask=m3, other=0.0).to(tl.float32)
    a = act_value(g, ACT).to(OUT_TY)
    return (a.to(tl.float32) * u).to(OUT_TY)


@kjit
def _act_quant_kernel(
    g_ptr, u_ptr, y_ptr, amax_ptr, codes_ptr, scales_ptr, op_ptr, rows, D, sg, su, groups,
    ACT: tl.constexpr, CB: tl.constexpr, LAYOUT: tl.constexpr, HW: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, c): ``y = bf16(bf16(act(g)) * u)`` of the row's blocks [c CB, (c + 1) CB) and their per-token
    quantization (LAYOUT 2: rows of the operand's 8-row groups, the rows past ``rows`` writing zero operand
    rows). The row's amax (the max |y| over its finite values: the quantizer's, whatever the block split)
    is taken over the whole row in chunks of CB blocks, so a program holds one chunk in registers (one
    program per whole row of 12,288 values spilled: 255 registers and a stack, 10 us at 16 rows on an H100)."""
    if PDL:
        gdc_trigger()
    row, c, rv, j16, nb, b, ok = chunk_ids(D, CB)
    oty = y_ptr.dtype.element_ty
    if row < rows:
        amax = tl.zeros([1], tl.float32)
        for c0 in range(0, nb, CB):
            bb = c0 + tl.arange(0, CB)
            yy = _act_rows(g_ptr, u_ptr, rv, bb, j16, bb < nb, sg, su, ACT, oty).to(tl.float32)
            amax = finite_amax(amax, yy)
        y = _act_rows(g_ptr, u_ptr, rv, b, j16, ok, sg, su, ACT, oty)
        tl.store(y_ptr + rv[:, None, None] * D + b[None, :, None] * 16 + j16[None, None, :], y, mask=ok[None, :, None])
        quantize_chunk(y.to(tl.float32), amax, c, row, rv, rows, b, j16, ok, amax_ptr, codes_ptr, scales_ptr, op_ptr, D,
                       groups, CB, LAYOUT, HW)
    elif LAYOUT == 2:
        store_core(op_ptr, tl.zeros([1, CB, 16], tl.float32), row, b, j16, ok, groups)


def act_quantize(gate: torch.Tensor, up: torch.Tensor, kind: str,
                 layout: int) -> tuple[torch.Tensor, tuple[NVFP4Tensor, torch.Tensor]]:
    """One kernel: (y = ``bf16(bf16(act(gate)) * up)`` [rows, D], (NVFP4Tensor of y per token, fp16 operand
    in ``layout``)). ``gate``, ``up`` [rows, D] with unit column stride (views of a fused gate_up output)."""
    code = act_code(kind)
    g, u = rows2d(gate), rows2d(up)
    rows, d = g.shape
    y = torch.empty(rows, d, dtype=gate.dtype, device=gate.device)
    amax, codes, scales, op, grid, groups = operand_buffers(rows, d, layout, gate.device)
    if grid:
        cb, per_row = chunks(d, CHUNK_BLOCKS)
        launch(_act_quant_kernel, (grid, per_row), g, u, y, amax, codes, scales, op, rows, d, g.stride(0),
               u.stride(0), groups, code, cb, layout, not INTERPRET, pdl(gate), num_warps=4)
    return y, (NVFP4Tensor(codes, scales, amax, True), op)


def act_and_mul(module: object, gate: torch.Tensor, up: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """The strict ``bf16(bf16(act(gate)) * up)`` (CUDA) by the activation ``module`` of an NVFP4 recipe:
    fused with the per-token quantization its consuming linear takes where the module's
    :class:`fused_input.Consumers` knows that layout, else the strict kernel; the output carries what the
    linear takes (:func:`fused_input.take`)."""
    from mismatch_probe.kernels.strict import triton_ops

    lay = layout_for(module, gate) if gate.shape == up.shape else None
    if lay is None:
        return mark(triton_ops.act_and_mul(gate, up, kind), module, None, None)
    y, q = act_quantize(gate, up, kind, lay)
    return mark(y.reshape(gate.shape), module, lay, q)
