"""How an op that produces a per-token NVFP4 linear's input also quantizes it (the protocol shared by the
fused producers: :mod:`norm_quant`, the RMSNorm before q/k/v and gate/up; :mod:`act_quant`, the
act-and-mul before down).

The producer's output carries the producer module's :class:`Consumers` and, once the producer knows the
operand layout its consumer's GEMM takes at this row count, its quantization ``(tag, (NVFP4Tensor,
operand))`` (:func:`mark`). The linear that reads the output takes it (:func:`take`, from
``NVFP4Linear._quantized_input``) instead of quantizing; when the layout is not the one the producer made
(or it made none yet), the linear quantizes and the producer learns that linear's weight for its next
call. Producers make exactly the bits of the per-token quantizer (``quant_fast.quantize_rows``), so
whether an input was quantized upstream or by the linear never changes a result; :data:`ENABLED` off
(a bench's A/B) makes every producer run its strict op alone.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import triton.language as tl

from mismatch_probe.kernels.launch_math import next_pow2

from .common import INTERPRET, device_cc, gpu_capable, kjit
from .quant_fast import MAX_K, _block_max, _quant_rows3d, _store_q, op_values

try:  # programmatic dependent launch: the GEMM after a producer may start streaming its weights
    from triton.language.extra.cuda import gdc_launch_dependents as gdc_trigger

    HAS_PDL = not INTERPRET
except ImportError:  # older Triton
    gdc_trigger = None
    HAS_PDL = False

ENABLED = True  # process switch (bench: the unfused pairs for comparison); the bits are the same either way
CHUNKED = True  # process switch (bench: a program per whole row, the tiling before); the bits are the same either way
_ATTR_Q = "_mp_nvfp4_q"  # on a producer's output: (tag, (NVFP4Tensor, operand)) made by the fused kernel
_ATTR_SINK = "_mp_nvfp4_sink"  # on a producer's output: the producer module's Consumers


def pdl(x: torch.Tensor) -> bool:
    """Trigger the dependent launch: Triton has it and the GPU is sm_90+ (``griddepcontrol`` is Hopper's)."""
    return HAS_PDL and x.is_cuda and device_cc(x.device)[0] >= 9


def tag(layout: int, per_token: bool = True) -> tuple[Any, ...]:
    """Which quantization of an input a linear takes: the kernels', per token or not, its operand in
    ``layout`` (the key of :func:`take` and of ``NVFP4Linear``'s ``SharedInput``)."""
    return ("kernel", per_token, layout)


class Consumers:
    """What one producer's fused quantization is for: the first per-token NVFP4 linear that read its output
    (a weak reference to its prepared weight: the layout its GEMM takes depends on the row count)."""

    def __init__(self) -> None:
        self._w: weakref.ReferenceType[Any] | None = None

    def has(self) -> bool:
        return self._w is not None and self._w() is not None

    def note(self, tw: Any) -> None:
        if self._w is None or self._w() is None:
            self._w = weakref.ref(tw)

    def layout(self, m: int) -> int | None:
        """The operand layout to emit for ``m`` rows (None: no consumer, or one the producers cannot write)."""
        tw = self._w() if self._w is not None else None
        if tw is None:
            return None
        from .tc_linear import operand_layout

        lay = operand_layout(m, tw, "auto")
        return lay if lay in (0, 2) else None


def consumers(module: Any) -> Consumers:
    """The producer module's :class:`Consumers` (made on first use)."""
    c = module.__dict__.get("_mp_nvfp4_consumers")
    if c is None:
        c = module.__dict__["_mp_nvfp4_consumers"] = Consumers()
    return c


def fits(x: torch.Tensor) -> bool:
    """A fused producer can take rows of ``x``'s width: bf16 on CUDA (or the interpreter), whole rows in
    registers."""
    h = x.shape[-1]
    if not INTERPRET and (x.dtype != torch.bfloat16 or not gpu_capable(x.device)):
        return False
    return h % 128 == 0 and h <= MAX_K


def layout_for(module: Any, x: torch.Tensor) -> int | None:
    """The operand layout the producer ``module`` emits for output rows of ``x``'s shape (None: run the
    strict op alone)."""
    sink = consumers(module)
    if not (ENABLED and sink.has() and fits(x)):
        return None
    return sink.layout(x.numel() // x.shape[-1])


def mark(y: torch.Tensor, module: Any, lay: int | None, q: Any) -> torch.Tensor:
    """Attach the producer's :class:`Consumers` and (``lay`` not None) its quantization ``q`` to ``y``."""
    setattr(y, _ATTR_SINK, consumers(module))
    if lay is not None:
        setattr(y, _ATTR_Q, (tag(lay), q))
    return y


def take(src: Any, tw: Any, key: tuple[Any, ...]) -> Any:
    """For a per-token linear reading ``src``, whose quantization would be ``key`` (:func:`tag` of its
    operand layout): the producer's fused quantization of ``src`` if it made that one (else None, and the
    producer learns this linear's layout for its next call)."""
    sink = getattr(src, _ATTR_SINK, None)
    if sink is None:
        return None
    got = getattr(src, _ATTR_Q, None)
    if got is not None and got[0] == key:
        return got[1]
    if key[2] in (0, 2):
        sink.note(tw)
    return None


@kjit
def store_core(op_ptr, val, row, b, j16, nb_ok, groups):
    """Row ``row`` of the fp16 operand in the core-matrix layout: element (row, 16 b + j) at
    (((b // 8 * 16 + 2 (b % 8) + j // 8) groups + row // 8) 8 + row % 8) 8 + j % 8."""
    kg = (b // 8) * 16 + 2 * (b % 8)
    off = (((kg[:, None] + j16[None, :] // 8) * groups + row // 8) * 8 + row % 8) * 8 + j16[None, :] % 8
    tl.store(op_ptr + off[None, :, :], val.to(op_ptr.dtype.element_ty), mask=nb_ok[None, :, None])


@kjit
def chunk_ids(K, CB: tl.constexpr):
    """Program (row, c) of a producer's grid (rows of ``K`` values, chunks of ``CB`` 16-element blocks):
    ``row``, ``c``, ``rv`` (the row as a [1] vector), ``j16``, ``nb`` (the row's blocks), ``b`` (the chunk's
    blocks) and ``ok`` (``b < nb``)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    nb = K // 16
    b = c * CB + tl.arange(0, CB)
    return row, c, row + tl.arange(0, 1), tl.arange(0, 16), nb, b, b < nb


@kjit
def finite_amax(acc, yy):
    """``acc`` [1] raised to the max |y| over the finite values of ``yy`` [1, CB, 16]: a row's amax taken
    chunk by chunk is the quantizer's (the max of its blocks' maxima, or of its finite values where a block
    holds NaN/Inf: the same number; a max is exact in any order)."""
    ay = tl.abs(yy)
    return tl.maximum(acc, tl.max(tl.max(tl.where(ay < float("inf"), ay, 0.0), 2), 1))


@kjit
def quantize_chunk(yv, amax, c, row, rv, rows, b, j16, ok, amax_ptr, codes_ptr, scales_ptr, op_ptr, K, groups,
                   CB: tl.constexpr, LAYOUT: tl.constexpr, HW: tl.constexpr):
    """Blocks ``b`` (chunk ``c`` of CB blocks) of a producer's row ``yv`` [1, CB, 16] (fp32 values of its
    rounded output), quantized per token with the row's ``amax`` [1] and stored: codes, scales, the fp16
    operand (LAYOUT 0 row-major, 2 core-matrix); chunk 0 stores the amax. The per-token quantizer's bits
    (:mod:`quant_fast`'s helpers)."""
    vmax, bad = _block_max(yv)
    packed, sbyte, sf, codes = _quant_rows3d(yv, vmax, bad, amax, HW)
    _store_q(packed, sbyte, sf, codes, bad, rv, rv < rows, ok, codes_ptr + c * CB * 8, scales_ptr + c * CB,
             op_ptr + c * CB * 16, K, CB, LAYOUT == 0)
    if c == 0:
        tl.store(amax_ptr + rv, amax)
    if LAYOUT == 2:
        store_core(op_ptr, op_values(codes, sf, bad), row, b, j16, ok, groups)


def chunks(k: int, chunk_blocks: int) -> tuple[int, int]:
    """(blocks per program, programs per row) of a producer's rows of ``k`` values."""
    cb = min(next_pow2(k // 16), chunk_blocks) if CHUNKED else next_pow2(k // 16)
    return cb, -(-(k // 16) // cb)


def operand_buffers(rows: int, h: int, layout: int, dev: torch.device) -> tuple[Any, ...]:
    """(amax, codes, scales, operand, grid, groups) of a producer's per-token quantization of ``rows`` x ``h``:
    layout 0 the operand row-major, one program per row; 2 core-matrix, one program per row of the
    operand's 8-row groups (the rows past ``rows`` zero)."""
    if layout == 2 and rows > 64:
        raise ValueError("the core-matrix operand holds at most 64 rows")
    from .native import token_cols
    from .tc_linear import OP_DTYPE

    amax = torch.empty(rows, dtype=torch.float32, device=dev)
    codes = torch.empty(rows, h // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, h // 16, dtype=torch.uint8, device=dev)
    if layout == 2:
        ntok = token_cols(rows)
        op = torch.empty(h // 128, 16, ntok // 8, 8, 8, dtype=OP_DTYPE, device=dev)
        return amax, codes, scales, op, ntok, ntok // 8
    return amax, codes, scales, torch.empty(rows, h, dtype=OP_DTYPE, device=dev), rows, 1
