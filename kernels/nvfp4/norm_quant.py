"""The strict RMSNorm with the per-token NVFP4 quantization of its output fused in: the linear that
reads the norm's output then costs its GEMM alone.

Both engines' norm adapters call :func:`rmsnorm` with the norm module's :class:`Consumers`; the
NVFP4 linear that reads the output (q/k/v after the input norm, gate/up after the post-attention
norm) records itself there (:meth:`Consumers.note`) the first time, and from the next call on the
norm runs one kernel that writes the normalized rows *and* their quantization in the operand layout
that linear's GEMM takes at the call's row count (:func:`tc_linear.operand_layout`). The linear
finds it on its input (:func:`take`) instead of quantizing.

Same bits as the two kernels it replaces, by construction and checked with ``torch.equal``
(``tests/kernels/test_norm_quant.py`` in the interpreter, ``bench/gpu_norm_quant.py`` on the GPU):
each program runs the strict norm's own row code (:func:`strict.triton_ops.rmsnorm_row`, same block
and warps, so the same ``tl.sum`` order), stores the row, and only then reads it back, after a
barrier, in the quantizer's ``[K/16, 16]`` view (the reload keeps the quantizer's layout out of the
norm's reduction), and quantizes it with :mod:`quant_fast`'s helpers (the reference quantizer's
bits). Where the fused kernel does not apply (no consumer yet, CPU, not bf16, a row over
``quant_fast.MAX_K``, the chunk-major operand of pre-Hopper native kernels) it is the strict norm.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import triton.language as tl

from mismatch_probe.kernels.launch_math import next_pow2
from mismatch_probe.kernels.strict.triton_ops import norm_warps, rmsnorm_row

from .common import INTERPRET, device_cc, gpu_capable, kjit, launch
from .quant_fast import MAX_K, _block_max, _quant_rows3d, _row_amax, _store_q, op_values
from .ref import NVFP4Tensor

try:  # programmatic dependent launch: the GEMM after this kernel may start streaming its weights
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_trigger

    HAS_PDL = not INTERPRET
except ImportError:  # older Triton
    _gdc_trigger = None
    HAS_PDL = False


def _pdl(x: torch.Tensor) -> bool:
    """Trigger the dependent launch: Triton has it and the GPU is sm_90+ (``griddepcontrol`` is Hopper's)."""
    return HAS_PDL and x.is_cuda and device_cc(x.device)[0] >= 9


ENABLED = True  # process switch (bench: the unfused pair for comparison); the bits are the same either way
_ATTR_Q = "_mp_nvfp4_q"  # on a norm's output: (tag, (NVFP4Tensor, operand)) made by the fused kernel
_ATTR_SINK = "_mp_nvfp4_sink"  # on a norm's output: the norm's Consumers


def tag(layout: int) -> tuple[Any, ...]:
    """The quantization a per-token linear takes in ``layout`` (NVFP4Linear's SharedInput tag)."""
    return ("kernel", True, layout)


class Consumers:
    """What one norm's fused quantization is for: the first per-token NVFP4 linear that read its output
    (a weak reference to its prepared weight: the layout its GEMM takes depends on the row count)."""

    def __init__(self) -> None:
        self._w: weakref.ReferenceType[Any] | None = None

    def has(self) -> bool:
        return self._w is not None and self._w() is not None

    def note(self, tw: Any) -> None:
        if self._w is None or self._w() is None:
            self._w = weakref.ref(tw)

    def layout(self, m: int) -> int | None:
        """The operand layout to emit for ``m`` rows (None: no consumer, or one this kernel cannot write)."""
        tw = self._w() if self._w is not None else None
        if tw is None:
            return None
        from .tc_linear import operand_layout

        lay = operand_layout(m, tw, "auto")
        return lay if lay in (0, 2) else None


def consumers(module: Any) -> Consumers:
    """The norm module's :class:`Consumers` (made on first use)."""
    c = module.__dict__.get("_mp_nvfp4_consumers")
    if c is None:
        c = module.__dict__["_mp_nvfp4_consumers"] = Consumers()
    return c


@kjit
def _norm_quant_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, amax_ptr, codes_ptr, scales_ptr, op_ptr, rows, H, eps, offset, groups,
    HAS_W: tl.constexpr, HAS_RES: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    LAYOUT: tl.constexpr, HW: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row (LAYOUT 2: per row of the operand's 8-row groups, the rows past ``rows``
    writing zero operand rows). LAYOUT 0: the operand row-major [rows, H]; 2: core-matrix
    [H/128][16][groups][8][8] (``native.core_operand``)."""
    if PDL:
        _gdc_trigger()
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB)
    j16 = tl.arange(0, 16)
    nb_ok = b < H // 16
    rv = row + tl.arange(0, 1)
    if row < rows:
        rmsnorm_row(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, row, H, eps, offset, 1, H, 0, HAS_W, HAS_RES, ROUND_FIRST,
                    BLOCK)
        tl.debug_barrier()  # the row is in y: read it back in the quantizer's view
        m3 = nb_ok[None, :, None] & (rv < rows)[:, None, None]
        yv = tl.load(y_ptr + rv[:, None, None] * H + b[None, :, None] * 16 + j16[None, None, :], mask=m3,
                     other=0.0).to(tl.float32)
        vmax, bad = _block_max(yv)
        amax = _row_amax(yv, vmax, bad)
        tl.store(amax_ptr + rv, amax)
        packed, sbyte, sf, codes = _quant_rows3d(yv, vmax, bad, amax, HW)
        _store_q(packed, sbyte, sf, codes, bad, rv, rv < rows, nb_ok, codes_ptr, scales_ptr, op_ptr, H, NB,
                 LAYOUT == 0)
        if LAYOUT == 2:
            val = op_values(codes, sf, bad)
            _store_core(op_ptr, val, row, b, j16, nb_ok, groups)
    elif LAYOUT == 2:
        _store_core(op_ptr, tl.zeros([1, NB, 16], tl.float32), row, b, j16, nb_ok, groups)


@kjit
def _store_core(op_ptr, val, row, b, j16, nb_ok, groups):
    """Row ``row`` of the fp16 operand in the core-matrix layout: element (row, 16 b + j) at
    (((b // 8 * 16 + 2 (b % 8) + j // 8) groups + row // 8) 8 + row % 8) 8 + j % 8."""
    kg = (b // 8) * 16 + 2 * (b % 8)
    off = (((kg[:, None] + j16[None, :] // 8) * groups + row // 8) * 8 + row % 8) * 8 + j16[None, :] % 8
    tl.store(op_ptr + off[None, :, :], val.to(op_ptr.dtype.element_ty), mask=nb_ok[None, :, None])


def fits(x: torch.Tensor) -> bool:
    """The fused kernel can take these rows: bf16 on CUDA (or the interpreter), whole rows in registers."""
    h = x.shape[-1]
    if not INTERPRET and (x.dtype != torch.bfloat16 or not gpu_capable(x.device)):
        return False
    return h % 128 == 0 and h <= MAX_K


def norm_quantize(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                  offset: float, round_first: bool, layout: int) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """One kernel: (y, residual out or None, (NVFP4Tensor of y per token, fp16 operand in ``layout``)).
    ``x`` [rows, H] contiguous (``residual`` likewise); y and the residual are the strict norm's bits, the
    quantization the per-token quantizer's (``quant_fast.quantize_rows`` with ``emit_op``)."""
    rows, h = x.shape
    if layout == 2 and rows > 64:
        raise ValueError("the core-matrix operand holds at most 64 rows")
    from .native import token_cols
    from .tc_linear import OP_DTYPE

    dev = x.device
    y = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else y
    amax = torch.empty(rows, dtype=torch.float32, device=dev)
    codes = torch.empty(rows, h // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, h // 16, dtype=torch.uint8, device=dev)
    if layout == 2:
        ntok = token_cols(rows)
        op = torch.empty(h // 128, 16, ntok // 8, 8, 8, dtype=OP_DTYPE, device=dev)
        grid, groups = ntok, ntok // 8
    else:
        op = torch.empty(rows, h, dtype=OP_DTYPE, device=dev)
        grid, groups = rows, 1
    if grid:
        launch(_norm_quant_kernel, (grid,), x, residual.contiguous() if residual is not None else y,
               weight if weight is not None else y, y, rout, amax, codes, scales, op, rows, h, float(eps), float(offset),
               groups, weight is not None, residual is not None, round_first, next_pow2(h), next_pow2(h // 16),
               layout, not INTERPRET, _pdl(x), num_warps=norm_warps(h))
    return y, (rout if residual is not None else None), (NVFP4Tensor(codes, scales, amax, True), op)


def rmsnorm(module: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The strict (add +) RMSNorm of ``x`` (CUDA) by the norm ``module`` of an NVFP4 recipe: fused with the
    per-token quantization its consuming linear takes where the module's :class:`Consumers` knows that
    layout, else the strict kernel (``strict.ops.rmsnorm`` / ``add_rmsnorm``'s CUDA path, with
    ``unit_offset`` as there); the output carries what the linear takes (:func:`take`)."""
    from mismatch_probe.kernels.strict import triton_ops

    offset, round_first = (1.0, False) if unit_offset else (0.0, True)
    sink = consumers(module)
    h = x.shape[-1]
    lay = None
    if ENABLED and sink.has() and x.is_contiguous() and fits(x) and (residual is None or residual.is_contiguous()):
        lay = sink.layout(x.numel() // h)
    if lay is None:
        y, r = triton_ops._norm(x, residual, weight, eps, offset, round_first)
        q = None
    else:
        res2 = residual.reshape(-1, h) if residual is not None else None
        y2, r2, q = norm_quantize(x.reshape(-1, h), res2, weight, eps, offset, round_first, lay)
        y, r = y2.reshape(x.shape), (r2.reshape(x.shape) if r2 is not None else None)
    setattr(y, _ATTR_SINK, sink)
    if q is not None:
        setattr(y, _ATTR_Q, (tag(lay), q))
    return y, r


def take(src: Any, tw: Any, key: tuple[Any, ...]) -> Any:
    """For a per-token linear reading ``src``, whose quantization would be ``key`` (:func:`tag` of its
    operand layout): the norm's fused quantization of ``src`` if it made that one (else None, and the norm
    learns this linear's layout for its next call)."""
    sink = getattr(src, _ATTR_SINK, None)
    if sink is None:
        return None
    got = getattr(src, _ATTR_Q, None)
    if got is not None and got[0] == key:
        return got[1]
    if key[2] in (0, 2):
        sink.note(tw)
    return None
