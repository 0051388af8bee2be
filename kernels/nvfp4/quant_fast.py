"""Memory-speed NVFP4 quantizer (per-token or given amax) and fused RMSNorm + quantize.

Same bits as :func:`ref.nvfp4_quantize_ref` (the named checks compare with ``torch.equal``);
built for bandwidth:

* several rows per program, each row read once (the row stays in registers: per-token amax,
  block maxima, codes); the row is seen as ``[ROWS, K/16, 16]`` so a 16-value block's max,
  scale and codes stay within one thread or a few neighbouring lanes;
* E2M1 round-to-nearest-even by integer arithmetic, no compare chain: ``|y| >= 1`` rounds the
  fp32 mantissa to one bit with one integer add (``u + 0x1FFFFF + lsb``), ``|y| < 1`` is
  ``RNE(2|y|)`` through the ``+ 2^23`` trick; both give the code directly;
* the E4M3 block scale by the hardware ``cvt.rn.satfinite.e4m3x2.f32`` on the GPU (matches
  torch's ``float8_e4m3fn`` cast bit for bit, ties included); the exact integer emulation of
  :mod:`common` in the interpreter (whose fp8 cast is not RNE);
* packed stores: two codes per byte, the row's scale bytes and amax.

``EMIT_OP``: also write the GEMM operand ``E2M1 * sf`` as fp16 (exact), so the tensor-core GEMM
(:mod:`gemm_tc`) reads its activation operand without a second pass over the codes.
"""

from __future__ import annotations

import torch
import triton.language as tl

from mismatch_probe.kernels.launch_math import cdiv, next_pow2

from .common import INTERPRET, bf16_bits_rne, bf16_round, e4m3_round, kjit, launch, load_as_f32, quant_outputs, rmax, rsum

MAX_K = 16384  # a row must fit in registers; longer rows use the tiled kernel of triton_nvfp4


@kjit
def e2m1_encode_int(y):
    """fp32 y (finite or not; clamped here to |y| <= 6) -> int32 E2M1 codes, RNE, sign 8 when y < 0."""
    a = tl.minimum(tl.abs(y), 6.0)
    u = a.to(tl.int32, bitcast=True)
    big = ((u + 0x1FFFFF + ((u >> 22) & 1)) >> 22) - 252  # |y| in [1, 6]: 2(e-127) + m + 2
    t = a * 2.0 + 8388608.0  # |y| < 1: RNE(2|y|) in the low mantissa bits of 2^23 + 2|y|
    small = t.to(tl.int32, bitcast=True) - 0x4B000000
    mag = tl.where(a < 1.0, small, big)
    return mag | tl.where(y < 0, 8, 0)


@kjit
def _scale_bytes(v, HW: tl.constexpr):
    """fp32 v in [0, 448] -> (E4M3 byte int32, fp32 value); hardware cvt on the GPU."""
    if HW:
        f8 = v.to(tl.float8e4nv)
        return f8.to(tl.uint8, bitcast=True).to(tl.int32), f8.to(tl.float32)
    else:
        return e4m3_round(v)


@kjit
def _row_scales_fast(amax):
    s_enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), 3.4028234663852886e38)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    return s_dec, s_enc * 0.1666666716337204


@kjit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@kjit
def _block_max(x):
    """x fp32 [R, NB, 16] -> (vmax [R, NB]: the block's max |x| when finite, bad [R, NB] int32: the
    block holds NaN/Inf). One NaN-propagating max per element; the finiteness test per block."""
    vmax = tl.reduce(tl.abs(x), 2, _max_nan)
    return vmax, ((vmax < float("inf")) == 0).to(tl.int32)


@kjit
def _row_amax(x, vmax, bad):
    """Per-row amax over finite values: the max of the block maxima; a row holding a NaN/Inf
    block takes the slow per-element path (rare)."""
    if rmax(rmax(bad, 1), 0) > 0:
        fin = tl.abs(x) < float("inf")
        amax = rmax(rmax(tl.where(fin, tl.abs(x), 0.0), 2), 1)
    else:
        amax = rmax(vmax, 1)
    return amax


@kjit
def _quant_rows3d(x, vmax, bad, amax, HW: tl.constexpr):
    """x fp32 [R, NB, 16] with its block maxima / flags and row amax [R] -> (packed bytes int32
    [R, NB, 8], scale bytes int32 [R, NB], sf fp32 [R, NB], codes int32 [R, NB, 16]).
    Non-finite blocks: scale 0x7F, codes 0."""
    s_dec, mult = _row_scales_fast(amax)
    sbyte, sf = _scale_bytes(tl.minimum(vmax * mult[:, None], 448.0), HW)
    den = sf * s_dec[:, None]
    enc = tl.minimum(tl.div_rn(tl.full(den.shape, 1.0, tl.float32), den), 3.4028234663852886e38)
    codes = e2m1_encode_int(x * enc[:, :, None])
    lo, hi = tl.split(tl.reshape(codes, (x.shape[0], x.shape[1], 8, 2)))
    packed = tl.where(bad[:, :, None] != 0, 0, lo | (hi << 4))
    sbyte = tl.where(bad != 0, 127, sbyte)
    return packed, sbyte, sf, codes


@kjit
def _store_q(packed, sbyte, sf, codes, bad, rows, rmask, nb_ok, codes_ptr, scales_ptr, op_ptr, K,
             NB: tl.constexpr, EMIT_OP: tl.constexpr):
    b = tl.arange(0, NB)
    j8 = tl.arange(0, 8)
    m3 = rmask[:, None, None] & nb_ok[None, :, None]
    cptr = codes_ptr + rows[:, None, None] * (K // 2) + b[None, :, None] * 8 + j8[None, None, :]
    tl.store(cptr, packed.to(tl.uint8), mask=m3)
    m2 = rmask[:, None] & nb_ok[None, :]
    tl.store(scales_ptr + rows[:, None] * (K // 16) + b[None, :], sbyte.to(tl.uint8), mask=m2)
    if EMIT_OP:
        j16 = tl.arange(0, 16)
        optr = op_ptr + rows[:, None, None] * K + b[None, :, None] * 16 + j16[None, None, :]
        tl.store(optr, op_values(codes, sf, bad).to(op_ptr.dtype.element_ty), mask=m3)


@kjit
def op_values(codes, sf, bad):
    """The GEMM operand ``E2M1 * sf`` in fp32 (exact) of codes [R, NB, 16]; NaN for a flagged block.
    The E2M1 value: the nibble placed in the fp32 bit fields (value * 2^-126), times 2^126."""
    bits = ((codes & 7) << 22) | ((codes & 8) << 28)
    val = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37 * sf[:, :, None]
    return tl.where(bad[:, :, None] != 0, float("nan"), val)


@kjit
def _quant_fast_kernel(
    x_ptr, amax_ptr, codes_ptr, scales_ptr, op_ptr, rows_total, K,
    R: tl.constexpr, NB: tl.constexpr, AMAX_MODE: tl.constexpr, XBITS: tl.constexpr,
    HW: tl.constexpr, EMIT_OP: tl.constexpr,
):
    """AMAX_MODE 0: per-row amax computed here (stored); 1: per-row amax given; 2: one amax given."""
    pid = tl.program_id(0)
    rows = (pid * R + tl.arange(0, R)).to(tl.int64)
    rmask = rows < rows_total
    b = tl.arange(0, NB)
    j16 = tl.arange(0, 16)
    nb_ok = b < K // 16
    m3 = rmask[:, None, None] & nb_ok[None, :, None]
    x = load_as_f32(x_ptr + rows[:, None, None] * K + b[None, :, None] * 16 + j16[None, None, :], m3, XBITS)
    vmax, bad = _block_max(x)
    if AMAX_MODE == 0:
        amax = _row_amax(x, vmax, bad)
        tl.store(amax_ptr + rows, amax, mask=rmask)
    elif AMAX_MODE == 1:
        amax = tl.load(amax_ptr + rows, mask=rmask, other=0.0)
    else:
        amax = tl.load(amax_ptr + rows * 0)
    packed, sbyte, sf, codes = _quant_rows3d(x, vmax, bad, amax, HW)
    _store_q(packed, sbyte, sf, codes, bad, rows, rmask, nb_ok, codes_ptr, scales_ptr, op_ptr, K, NB, EMIT_OP)


QF_CFG: dict[str, int] = {}  # tuning overrides (bench): ELEMS (elements per program), num_warps


def pick_rows(k: int) -> tuple[int, int, int]:
    """(rows per program, padded blocks per row, num_warps) for row length K."""
    nb = next_pow2(max(1, k // 16))
    elems = nb * 16
    r = max(1, min(16, (1024 if INTERPRET else QF_CFG.get("ELEMS", 8192)) // elems))
    nw = QF_CFG.get("num_warps", 4)  # H200, 8192^2 bf16: 4 warps 78 us, 8: 83, 2: 100 (2026-12-01)
    return r, nb, nw


def use_native_quant(x: torch.Tensor, emit_op: torch.dtype | None = None) -> bool:
    """The native (CUDA C++) quantizer runs this call: bf16 rows, fp16 operand if any, built here."""
    if INTERPRET or not QF_CFG.get("NATIVE", 1) or emit_op not in (None, torch.float16) or not x.is_cuda:
        return False
    from . import native

    return native.quant_ok(x)


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None, per_token: bool,
                  emit_op: torch.dtype | None = None, op_layout: int = 0) -> tuple[torch.Tensor, ...]:
    """The fast kernel: (codes, scales, amax, op or None). ``amax`` None computes it per row
    (``per_token`` must be True). x: contiguous [rows, K] bf16/fp16/fp32 with K <= MAX_K.
    ``op_layout``: the fp16 operand in a layout of the native decode GEMM (``native.token_layout``'s
    numbering: 1 chunk-major, 2 core-matrix; K % 128 == 0), written by the native quantizer directly."""
    if use_native_quant(x, emit_op):
        from . import native

        return native.quantize_rows(x, amax, per_token, emit_op, op_layout)
    if op_layout:
        from . import native

        codes, scales, amax_t, op = quantize_rows(x, amax, per_token, emit_op)
        return codes, scales, amax_t, native.layout_operand(op, op_layout)
    rows, k = x.shape
    codes, scales, mode, amax_t, op = quant_outputs(x, amax, per_token, emit_op)
    if rows == 0:
        return codes, scales, amax_t, op
    xbits = x.dtype == torch.bfloat16
    r, nb, nw = pick_rows(k)
    launch(_quant_fast_kernel, (cdiv(rows, r),), x.view(torch.int16) if xbits else x, amax_t, codes, scales,
           codes if op is None else op, rows, k, r, nb, mode, xbits, not INTERPRET, op is not None, num_warps=nw)
    return codes, scales, amax_t, op


@kjit
def _rmsnorm_quant_fast_kernel(
    x_ptr, w_ptr, y_ptr, amax_ptr, codes_ptr, scales_ptr, op_ptr, rows_total, K, eps,
    R: tl.constexpr, NB: tl.constexpr, Y_BF16: tl.constexpr, W_BF16: tl.constexpr, HW: tl.constexpr,
    EMIT_OP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * R + tl.arange(0, R)).to(tl.int64)
    rmask = rows < rows_total
    b = tl.arange(0, NB)
    j16 = tl.arange(0, 16)
    nb_ok = b < K // 16
    m3 = rmask[:, None, None] & nb_ok[None, :, None]
    off = rows[:, None, None] * K + b[None, :, None] * 16 + j16[None, None, :]
    x = load_as_f32(x_ptr + off, m3, Y_BF16)
    w = load_as_f32(w_ptr + b[:, None] * 16 + j16[None, :], nb_ok[:, None], W_BF16)
    ms = rsum(rsum(x * x, 2), 1) / K
    rstd = 1.0 / tl.sqrt(ms + eps)
    y = (x * rstd[:, None, None]) * w[None, :, :]
    if Y_BF16:
        y = bf16_round(y)
        tl.store(y_ptr + off, bf16_bits_rne(y).to(tl.int16), mask=m3)
    else:
        tl.store(y_ptr + off, y, mask=m3)
    vmax, bad = _block_max(y)
    amax = _row_amax(y, vmax, bad)  # amax reuse: taken from the block maxima, the row in registers
    tl.store(amax_ptr + rows, amax, mask=rmask)
    packed, sbyte, sf, codes = _quant_rows3d(y, vmax, bad, amax, HW)
    _store_q(packed, sbyte, sf, codes, bad, rows, rmask, nb_ok, codes_ptr, scales_ptr, op_ptr, K, NB, EMIT_OP)


def rmsnorm_quantize_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          emit_op: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """(y, codes, scales, amax, op or None) of the fused kernel; x contiguous [rows, K] bf16/fp32."""
    rows, k = x.shape
    dev = x.device
    bf = x.dtype == torch.bfloat16
    wbf = weight.dtype == torch.bfloat16
    wk = weight.contiguous().view(torch.int16) if wbf else weight.contiguous().float()
    y = torch.empty_like(x)
    amax = torch.empty(rows, dtype=torch.float32, device=dev)
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, k // 16, dtype=torch.uint8, device=dev)
    op = torch.empty(rows, k, dtype=emit_op, device=dev) if emit_op is not None else codes
    if rows:
        r, nb, nw = pick_rows(k)
        launch(_rmsnorm_quant_fast_kernel, (cdiv(rows, r),), x.view(torch.int16) if bf else x, wk,
               y.view(torch.int16) if bf else y, amax, codes, scales, op, rows, k, float(eps), r, nb, bf, wbf,
               not INTERPRET, emit_op is not None, num_warps=nw)
    return y, codes, scales, amax, (op if emit_op is not None else None)
