"""Triton NVFP4 quantize / dequantize / fused RMSNorm + per-token quantize.

Bit-exact with :mod:`ref` (``torch.equal`` on codes, scales, amax and outputs). All
bit-deciding divisions use ``tl.div_rn``; E4M3/E2M1/bf16 rounding uses the exact helpers of
:mod:`common` (identical on GPU and in the CPU interpreter).
"""

from __future__ import annotations

import torch
import triton.language as tl

from mismatch_probe.kernels.launch_math import cdiv, next_pow2

from .common import (
    INTERPRET,
    bf16_bits_rne,
    bf16_round,
    e2m1_encode,
    e4m3_decode,
    e4m3_round,
    kernel_device_ok,
    kjit,
    launch,
    load_as_f32,
    require_contiguous,
    rmax,
    rsum,
    unpack_decode_tile,
)
from .quant_fast import MAX_K, quantize_rows
from .ref import NVFP4Tensor, check_amax, validate_input

_RCP6 = 0.1666666716337204  # fp32 0x3E2AAAAB exactly
_RCP2688 = 0.00037202381645329297


@kjit
def _row_scales(amax):
    """Per-row (S_dec, mult) from fp32 amax, as the spec."""
    s_enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), 3.4028234663852886e38)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    return s_dec, s_enc * 0.1666666716337204


@kjit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@kjit
def _quant_tile(x, s_dec, mult, ROWS: tl.constexpr, BK: tl.constexpr, TILE16: tl.constexpr):
    """x fp32 [ROWS, BK] -> (packed bytes [ROWS, BK/2] int32, scale bytes [ROWS, BK/16] int32)."""
    a = tl.reshape(_finite_abs(x), (ROWS, BK // 16, 16))
    badv = tl.reshape((tl.abs(x) < float("inf")) == 0, (ROWS, BK // 16, 16)).to(tl.int32)
    vmax = rmax(a, axis=2)
    bad = rmax(badv, axis=2)
    if TILE16:
        vmax = tl.broadcast_to(rmax(vmax, axis=0)[None, :], (ROWS, BK // 16))
        bad = tl.broadcast_to(rmax(bad, axis=0)[None, :], (ROWS, BK // 16))
    sbyte, sf = e4m3_round(tl.minimum(vmax * mult[:, None], 448.0))
    den = sf * s_dec[:, None]
    enc = tl.minimum(tl.div_rn(tl.full(den.shape, 1.0, tl.float32), den), 3.4028234663852886e38)
    y = tl.reshape(x, (ROWS, BK // 16, 16)) * enc[:, :, None]
    y = tl.minimum(tl.maximum(y, -6.0), 6.0)
    codes = e2m1_encode(y)
    codes = tl.where(bad[:, :, None] != 0, 0, codes)
    lo, hi = tl.split(tl.reshape(codes, (ROWS, BK // 2, 2)))
    packed = lo | (hi << 4)
    sbyte = tl.where(bad != 0, 127, sbyte)
    return packed, sbyte


@kjit
def _quantize_kernel(
    x_ptr, amax_ptr, codes_ptr, scales_ptr, rows, K,
    ROWS: tl.constexpr, BK: tl.constexpr, NUM_K: tl.constexpr, TILE16: tl.constexpr,
    COMPUTE_AMAX: tl.constexpr, AMAX_PER_ROW: tl.constexpr, XBITS: tl.constexpr,
):
    pid = tl.program_id(0)
    r = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rmask = r < rows
    cols = tl.arange(0, BK)
    if COMPUTE_AMAX:
        amax = tl.full([ROWS], 0.0, tl.float32)
        for c in range(NUM_K):
            m = rmask[:, None] & ((c * BK + cols) < K)[None, :]
            xv = load_as_f32(x_ptr + r[:, None] * K + c * BK + cols[None, :], m, XBITS)
            amax = tl.maximum(amax, rmax(_finite_abs(xv), axis=1))
        tl.store(amax_ptr + r, amax, mask=rmask)
    elif AMAX_PER_ROW:
        amax = tl.load(amax_ptr + r, mask=rmask, other=0.0)
    else:
        amax = tl.load(amax_ptr + r * 0)
    s_dec, mult = _row_scales(amax)
    c2 = tl.arange(0, BK // 2)
    c16 = tl.arange(0, BK // 16)
    for c in range(NUM_K):
        m = rmask[:, None] & ((c * BK + cols) < K)[None, :]
        xv = load_as_f32(x_ptr + r[:, None] * K + c * BK + cols[None, :], m, XBITS)
        packed, sbyte = _quant_tile(xv, s_dec, mult, ROWS, BK, TILE16)
        m2 = rmask[:, None] & ((c * (BK // 2) + c2) < K // 2)[None, :]
        tl.store(codes_ptr + r[:, None] * (K // 2) + c * (BK // 2) + c2[None, :], packed.to(tl.uint8), mask=m2)
        m16 = rmask[:, None] & ((c * (BK // 16) + c16) < K // 16)[None, :]
        tl.store(scales_ptr + r[:, None] * (K // 16) + c * (BK // 16) + c16[None, :], sbyte.to(tl.uint8), mask=m16)


@kjit
def _quant_blocks(x, s_dec, mult):
    """x fp32 [BB, 16] (one row's blocks), s_dec/mult [1] -> (packed [BB, 8], scale bytes [BB]) int32."""
    vmax = rmax(_finite_abs(x), 1)
    bad = rmax(((tl.abs(x) < float("inf")) == 0).to(tl.int32), 1)
    sbyte, sf = e4m3_round(tl.minimum(vmax * mult, 448.0))
    den = sf * s_dec
    enc = tl.minimum(tl.div_rn(tl.full(den.shape, 1.0, tl.float32), den), 3.4028234663852886e38)
    y = tl.minimum(tl.maximum(x * enc[:, None], -6.0), 6.0)
    codes = tl.where(bad[:, None] != 0, 0, e2m1_encode(y))
    lo, hi = tl.split(tl.reshape(codes, (x.shape[0], 8, 2)))
    return lo | (hi << 4), tl.where(bad != 0, 127, sbyte)


@kjit
def _quantize_rows_kernel(
    x_ptr, amax_ptr, codes_ptr, scales_ptr, K,
    BB: tl.constexpr, NUM_C: tl.constexpr, COMPUTE_AMAX: tl.constexpr, AMAX_PER_ROW: tl.constexpr,
    XBITS: tl.constexpr, AMAX_ONLY: tl.constexpr,
):
    """One program per row; the row is seen as [K/16, 16] blocks (block-major tile: the block max,
    the scale and the broadcast back stay inside a thread's registers). AMAX_ONLY: just store
    the row's finite amax (first pass of per-tensor scaling)."""
    row = tl.program_id(0).to(tl.int64)
    nb = K // 16
    b = tl.arange(0, BB)
    j16 = tl.arange(0, 16)
    xrow = x_ptr + row * K
    if COMPUTE_AMAX:
        am = tl.full([BB], 0.0, tl.float32)
        for c in range(NUM_C):
            bb = c * BB + b
            xv = load_as_f32(xrow + bb[:, None] * 16 + j16[None, :], (bb < nb)[:, None], XBITS)
            am = tl.maximum(am, rmax(_finite_abs(xv), 1))
        amax = rmax(am[None, :], 1)
        tl.store(amax_ptr + row + tl.arange(0, 1), amax)
    elif AMAX_PER_ROW:
        amax = tl.load(amax_ptr + row + tl.arange(0, 1))
    else:
        amax = tl.load(amax_ptr + tl.arange(0, 1))
    if not AMAX_ONLY:
        _quantize_row_blocks(xrow, amax, codes_ptr, scales_ptr, row, K, nb, BB, NUM_C, XBITS)


@kjit
def _quantize_row_blocks(xrow, amax, codes_ptr, scales_ptr, row, K, nb, BB: tl.constexpr, NUM_C: tl.constexpr,
                         XBITS: tl.constexpr):
    b = tl.arange(0, BB)
    j16 = tl.arange(0, 16)
    j8 = tl.arange(0, 8)
    s_dec, mult = _row_scales(amax)
    for c in range(NUM_C):
        bb = c * BB + b
        bm = bb < nb
        xv = load_as_f32(xrow + bb[:, None] * 16 + j16[None, :], bm[:, None], XBITS)
        packed, sbyte = _quant_blocks(xv, s_dec, mult)
        tl.store(codes_ptr + row * (K // 2) + bb[:, None] * 8 + j8[None, :], packed.to(tl.uint8), mask=bm[:, None])
        tl.store(scales_ptr + row * nb + bb, sbyte.to(tl.uint8), mask=bm)


# "fast": quant_fast (rows in registers, integer E2M1, hardware E4M3; default for 1x16 blocks
# with K <= quant_fast.MAX_K); "v1": [rows, K]-tile kernel (16x16 tiles, long rows); "v2":
# block-major rows (also provides the per-tensor amax pass). All pass every bitwise check.
QUANT_IMPL = "fast"
QUANT_NUM_WARPS: int | None = None  # tuning override (bench)


def _pick_tiles(rows: int, k: int, tile16: bool) -> tuple[int, int, int]:
    kp = next_pow2(k)
    if tile16:
        bk = max(16, min(kp, 256 if INTERPRET else 512))
        return 16, bk, cdiv(k, bk)
    bk = max(16, min(kp, 2048 if INTERPRET else 8192))
    target = 4096 if INTERPRET else 4096
    r = max(1, min(64, target // bk, next_pow2(rows)))
    return r, bk, cdiv(k, bk)


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    per_token: bool = False,
    tile16: bool = False,
    amax: torch.Tensor | None = None,
    nonfinite: str = "flag",
) -> NVFP4Tensor:
    """Triton NVFP4 quantizer, bit-exact with :func:`nvfp4_quantize_ref` (same arguments).

    ``per_token``: one global scale per row (computed in the kernel, single pass when K fits in
    one tile); ``tile16``: 16x16 weight tiles (per-tensor); ``amax``: reuse a given amax.
    """
    validate_input(x)
    require_contiguous(x, "x")
    kernel_device_ok(x)
    if tile16 and per_token:
        raise ValueError("tile16 (16x16 weight tiles) requires per-tensor scaling (per_token=False)")
    if nonfinite not in ("flag", "error"):
        raise ValueError(f"nonfinite must be 'flag' or 'error', got {nonfinite!r}")
    if nonfinite == "error" and not bool(torch.isfinite(x).all()):
        raise ValueError("x holds NaN/Inf values (nonfinite='error')")
    rows, k = x.shape
    compute = per_token and amax is None
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, k // 16, dtype=torch.uint8, device=x.device)
    xbits = x.dtype == torch.bfloat16
    xk = x.view(torch.int16) if xbits else x
    nb = k // 16
    bb = max(1, min(next_pow2(nb), 128 if INTERPRET else 512))
    nw = QUANT_NUM_WARPS or (8 if bb >= 256 else 4)
    v2_args = (k, bb, cdiv(nb, bb))
    if amax is not None:
        amax_t = check_amax(amax, rows, per_token, x.device)
    elif per_token:
        amax_t = torch.empty(rows, dtype=torch.float32, device=x.device)
    else:  # per-tensor: a Triton row-amax pass, then the max of the row maxima (exact)
        row_amax = torch.empty(rows, dtype=torch.float32, device=x.device)
        launch(_quantize_rows_kernel, (rows,), xk, row_amax, codes, scales, *v2_args, True, True, xbits, True,
               num_warps=nw)
        amax_t = row_amax.amax().reshape(1)
    if not tile16 and QUANT_IMPL == "fast" and k <= MAX_K:
        codes, scales, amax_t, _ = quantize_rows(x, None if compute else amax_t, per_token)
        return NVFP4Tensor(codes, scales, amax_t, per_token, tile16)
    if not tile16 and QUANT_IMPL == "v2":
        launch(_quantize_rows_kernel, (rows,), xk, amax_t, codes, scales, *v2_args, compute, per_token, xbits, False,
               num_warps=nw)
        return NVFP4Tensor(codes, scales, amax_t, per_token, tile16)
    r, bk, nk = _pick_tiles(rows, k, tile16)
    grid = (cdiv(rows, r),)
    kw = {"num_warps": 8 if bk * r >= 4096 else 4}
    launch(_quantize_kernel, grid, xk, amax_t, codes, scales, rows, k, r, bk, nk, tile16, compute, per_token, xbits,
           **kw)
    return NVFP4Tensor(codes, scales, amax_t, per_token, tile16)


@kjit
def _dequant_kernel(
    codes_ptr, scales_ptr, amax_ptr, out_ptr, rows, K,
    ROWS: tl.constexpr, BK: tl.constexpr, AMAX_PER_ROW: tl.constexpr, GLOBAL: tl.constexpr,
    OUT_MODE: tl.constexpr,
):
    """OUT_MODE 0: fp32 out; 1: bf16 bits (int16) out. GLOBAL=False: E2M1*sf only (GEMM operand)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = (pid_m * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rmask = r < rows
    c2 = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    c16 = pid_k * (BK // 16) + tl.arange(0, BK // 16)
    p = tl.load(codes_ptr + r[:, None] * (K // 2) + c2[None, :], mask=rmask[:, None] & (c2 < K // 2)[None, :], other=0)
    sb = tl.load(scales_ptr + r[:, None] * (K // 16) + c16[None, :], mask=rmask[:, None] & (c16 < K // 16)[None, :], other=0)
    vals = unpack_decode_tile(p)
    sf = e4m3_decode(sb.to(tl.int32))
    if GLOBAL:
        if AMAX_PER_ROW:
            amax = tl.load(amax_ptr + r, mask=rmask, other=0.0)
        else:
            amax = tl.load(amax_ptr + r * 0)
        bscale = (sf * amax[:, None]) * 0.00037202381645329297
    else:
        bscale = sf
    out = tl.reshape(tl.reshape(vals, (ROWS, BK // 16, 16)) * bscale[:, :, None], (ROWS, BK))
    cols = pid_k * BK + tl.arange(0, BK)
    m = rmask[:, None] & (cols < K)[None, :]
    if OUT_MODE == 1:
        tl.store(out_ptr + r[:, None] * K + cols[None, :], bf16_bits_rne(out).to(tl.int16), mask=m)
    else:
        tl.store(out_ptr + r[:, None] * K + cols[None, :], out, mask=m)


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32, *, apply_global: bool = True) -> torch.Tensor:
    """Triton dequantize, bit-exact with :func:`nvfp4_dequantize_ref`.

    ``apply_global=False`` returns ``E2M1[code] * sf`` (no global scale; exact in bf16): the
    operand form the aligned GEMM uses for large M.
    """
    check_qtensor(q, "q")
    kernel_device_ok(q.codes)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    rows, k = q.shape
    mode = 1 if dtype == torch.bfloat16 else 0
    out = torch.empty(rows, k, dtype=torch.bfloat16 if mode else torch.float32, device=q.codes.device)
    bk = max(16, min(next_pow2(k), 1024))
    r = max(1, min(32, 4096 // bk, next_pow2(rows)))
    grid = (cdiv(rows, r), cdiv(k, bk))
    launch(_dequant_kernel, grid,
        q.codes, q.scales, q.amax, out.view(torch.int16) if mode else out, rows, k, r, bk, q.per_token, apply_global, mode
    )
    return out.to(dtype) if dtype == torch.float16 else out


def check_qtensor(q: NVFP4Tensor, name: str) -> None:
    """Validate an NVFP4Tensor's dtypes, shapes and contiguity (ValueError/TypeError)."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"{name} must be an NVFP4Tensor, got {type(q).__name__}")
    if q.codes.dtype != torch.uint8 or q.scales.dtype != torch.uint8:
        raise TypeError(f"{name}: codes and scales must be uint8, got {q.codes.dtype} / {q.scales.dtype}")
    if q.amax.dtype != torch.float32:
        raise TypeError(f"{name}: amax must be float32, got {q.amax.dtype}")
    rows, k = q.shape
    if tuple(q.scales.shape) != (rows, k // 16):
        raise ValueError(f"{name}: scales shape {tuple(q.scales.shape)} != (rows, K/16) = {(rows, k // 16)}")
    if q.amax.numel() != (rows if q.per_token else 1):
        raise ValueError(f"{name}: amax has {q.amax.numel()} values, expected {rows if q.per_token else 1}")
    for t, n in ((q.codes, "codes"), (q.scales, "scales"), (q.amax, "amax")):
        require_contiguous(t, f"{name}.{n}")
        if t.device != q.codes.device:
            raise ValueError(f"{name}.{n} is on {t.device}, codes on {q.codes.device}")


@kjit
def _rmsnorm_quant_kernel(
    x_ptr, w_ptr, y_ptr, amax_ptr, codes_ptr, scales_ptr, rows, K, eps,
    BK: tl.constexpr, Y_BF16: tl.constexpr, W_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BK)
    m = cols < K
    x = load_as_f32(x_ptr + row * K + cols, m, Y_BF16)
    w = load_as_f32(w_ptr + cols, m, W_BF16)
    ms = rsum(x * x, axis=0) / K
    rstd = 1.0 / tl.sqrt(ms + eps)
    y = (x * rstd) * w
    if Y_BF16:
        y = bf16_round(y)
        tl.store(y_ptr + row * K + cols, bf16_bits_rne(y).to(tl.int16), mask=m)
    else:
        tl.store(y_ptr + row * K + cols, y, mask=m)
    y2 = tl.reshape(y, (1, BK))
    amax = rmax(_finite_abs(y2), axis=1)  # amax reuse: taken while the row is in registers
    tl.store(amax_ptr + row + tl.arange(0, 1), amax)
    s_dec, mult = _row_scales(amax)
    packed, sbyte = _quant_tile(y2, s_dec, mult, 1, BK, False)
    c2 = tl.arange(0, BK // 2)
    c16 = tl.arange(0, BK // 16)
    tl.store(codes_ptr + row * (K // 2) + c2[None, :], packed.to(tl.uint8), mask=(c2 < K // 2)[None, :])
    tl.store(scales_ptr + row * (K // 16) + c16[None, :], sbyte.to(tl.uint8), mask=(c16 < K // 16)[None, :])


def rmsnorm_nvfp4_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, NVFP4Tensor]:
    """Fused RMSNorm + per-token NVFP4 quantize with amax reuse (one read of x).

    Returns ``(y, q)``: ``y`` the normalized rows in x's dtype (bf16 or fp32), ``q`` bit-identical
    to ``nvfp4_quantize_ref(y, per_token=True)``. The norm's own reduction order is Triton's; the
    named check ``rmsnorm_quant_amax_reuse`` requires y to equal torch's RMSNorm bit for bit
    (measured equal on the CPU interpreter and on the H200) and q to equal the reference on it.
    """
    validate_input(x)
    require_contiguous(x, "x")
    kernel_device_ok(x, weight)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fused RMSNorm+quantize supports bfloat16 and float32 x, got {x.dtype}")
    rows, k = x.shape
    if weight.shape != (k,):
        raise ValueError(f"weight must have shape ({k},), got {tuple(weight.shape)}")
    if k > 16384:
        raise ValueError(f"fused RMSNorm+quantize holds a row in registers: K = {k} must be <= 16384")
    bf = x.dtype == torch.bfloat16
    wbf = weight.dtype == torch.bfloat16
    wk = weight.contiguous().view(torch.int16) if wbf else weight.contiguous()
    y = torch.empty_like(x)
    amax = torch.empty(rows, dtype=torch.float32, device=x.device)
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, k // 16, dtype=torch.uint8, device=x.device)
    bk = max(16, next_pow2(k))
    kw = {"num_warps": 8 if bk >= 4096 else 4}
    launch(_rmsnorm_quant_kernel, (rows,),
        x.view(torch.int16) if bf else x, wk, y.view(torch.int16) if bf else y, amax, codes, scales, rows, k,
        float(eps), bk, bf, wbf, **kw
    )
    return y, NVFP4Tensor(codes, scales, amax, True, False)
