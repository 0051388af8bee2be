"""Pure-torch NVFP4 reference: the spec (``docs/nvfp4.md``, TE's canonical quantizer) as code.

Everything here is deterministic elementwise / exact-reduction torch code, so it gives the same
bits on any device. The Triton kernels must match these functions bit for bit.

Numerics (fp32 throughout, each step rounded to nearest even):

* ``amax``: max |x| over the scaling domain (whole tensor or one row), over *finite* values.
* ``S_enc = min(2688 / amax, FLT_MAX)`` (correctly rounded), 1 when ``amax == 0`` or ``S_enc == 0``;
  ``S_dec = 1 / S_enc``; ``mult = S_enc * RN(1/6)``.
* block scale ``sf = e4m3(min(vmax * mult, 448))`` (RNE, saturating), ``enc = min(1/(sf*S_dec), FLT_MAX)``.
* ``y = clamp(x * enc, -6, 6)``; E2M1 code by the RNE thresholds; sign bit 8 when ``y < 0``.
* packing: byte j = code[2j] | code[2j+1] << 4.
* dequant: ``E2M1[code] * ((sf * amax) * RN(1/2688))``.

NaN/Inf policy ("flagged blocks"): non-finite inputs are excluded from ``amax``; every 1x16 block
(or 16x16 tile) that holds a NaN or +-Inf gets the E4M3 NaN scale byte ``0x7F`` and codes 0, so it
dequantizes to NaN (the non-finite value propagates, confined to its block, and never corrupts
the other blocks' scales). ``nonfinite="error"`` raises ``ValueError`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FLT_MAX = float(np.finfo(np.float32).max)
RCP6 = float(np.float32(1) / np.float32(6))  # RN(1/6) = 0x3E2AAAAB
RCP2688 = float(np.float32(1) / np.float32(2688))  # RN(1/2688)
# alpha = amaxA * amaxB / (36 * 448^2) evaluated as (amaxA * amaxB) * RN(1 / 7225344)
RCP_ALPHA = float(np.float32(1) / np.float32(6 * 6 * 448 * 448))
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_NAN_BYTE = 0x7F
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class NVFP4Tensor:
    """A quantized [rows, K] tensor.

    ``codes``: uint8 [rows, K/2] packed E2M1 (even element in the low nibble);
    ``scales``: uint8 [rows, K/16] E4M3 bit patterns, linear layout;
    ``amax``: fp32 [rows] (per-token) or [1] (per-tensor): the global amax (decode scale is
    ``amax / 2688``); ``per_token``: which of the two; ``tile16``: 16x16 weight tiles.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    per_token: bool = False
    tile16: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 2)

    def row_amax(self) -> torch.Tensor:
        """fp32 [rows] amax of every row (per-tensor amax broadcast)."""
        return self.amax.expand(self.codes.shape[0]) if not self.per_token else self.amax


def _f32(v: float, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=device)


def validate_input(x: torch.Tensor, name: str = "x") -> None:
    """Raise TypeError/ValueError naming the violated constraint."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if x.shape[1] % 16 != 0 or x.shape[1] == 0:
        raise ValueError(f"{name}: K = {x.shape[1]} must be a positive multiple of 16 (NVFP4 1x16 blocks)")


def nonfinite_amax(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """fp32 amax over finite values: [rows] if ``per_token`` else [1]."""
    a = x.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    return a.amax(dim=1) if per_token else a.amax().reshape(1)


def global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) from fp32 amax, per the spec (correctly rounded fp32 divisions)."""
    amax = amax.float()
    s_enc = torch.clamp(_f32(2688.0, amax.device) / amax, max=FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    s_dec = 1.0 / s_enc
    return s_enc, s_dec


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """E2M1 RNE codes (uint8, 0..15) of fp32 ``y`` already clamped to [-6, 6]."""
    a = y.abs()
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return idx | ((y < 0).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[R, K] uint8 codes -> [R, K/2] bytes, even element in the low nibble."""
    c = codes.reshape(codes.shape[0], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[R, K/2] bytes -> [R, K] uint8 codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> fp32 E2M1 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def e4m3_decode(scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bit patterns -> fp32 values (0x7F -> NaN)."""
    return scale_bytes.view(torch.float8_e4m3fn).float()


def nvfp4_quantize_ref(
    x: torch.Tensor,
    *,
    per_token: bool = False,
    tile16: bool = False,
    amax: torch.Tensor | None = None,
    nonfinite: str = "flag",
) -> NVFP4Tensor:
    """Reference NVFP4 quantizer (the spec). ``x``: [rows, K] bf16/fp16/fp32, K % 16 == 0.

    ``per_token``: one global scale per row (batch invariant) instead of per tensor.
    ``tile16``: 16x16 weight tiles (one scale per tile, repeated for its 16 rows; per-tensor only).
    ``amax``: give the global amax ([rows] or [1] fp32) instead of computing it (amax reuse /
    static scaling). ``nonfinite``: ``"flag"`` (default, see module doc) or ``"error"``.
    """
    validate_input(x)
    if tile16 and per_token:
        raise ValueError("tile16 (16x16 weight tiles) requires per-tensor scaling (per_token=False)")
    if nonfinite not in ("flag", "error"):
        raise ValueError(f"nonfinite must be 'flag' or 'error', got {nonfinite!r}")
    xf = x.float()
    finite = torch.isfinite(xf)
    if nonfinite == "error" and not bool(finite.all()):
        raise ValueError(f"x holds {int((~finite).sum())} NaN/Inf values (nonfinite='error')")
    rows, k = x.shape
    if amax is None:
        amax = nonfinite_amax(x, per_token)
    else:
        amax = check_amax(amax, rows, per_token, x.device)
    s_enc, s_dec = global_scales(amax)
    if per_token:
        s_enc, s_dec = s_enc[:, None], s_dec[:, None]
    mult = s_enc * _f32(RCP6, x.device)
    absx = torch.where(finite, xf.abs(), torch.zeros_like(xf))
    blk = absx.reshape(rows, k // 16, 16)
    bad = (~finite).reshape(rows, k // 16, 16).any(dim=2)
    vmax = blk.amax(dim=2)
    if tile16:
        pad = (-rows) % 16
        vp = torch.nn.functional.pad(vmax, (0, 0, 0, pad))
        bp = torch.nn.functional.pad(bad, (0, 0, 0, pad))
        vt = vp.reshape(-1, 16, k // 16).amax(dim=1)
        bt = bp.reshape(-1, 16, k // 16).any(dim=1)
        vmax = vt.repeat_interleave(16, dim=0)[:rows]
        bad = bt.repeat_interleave(16, dim=0)[:rows]
    sf8 = torch.clamp(vmax * mult, max=448.0).to(torch.float8_e4m3fn)
    sf = sf8.float()
    enc = torch.clamp(1.0 / (sf * s_dec), max=FLT_MAX)
    y = torch.clamp(xf * enc.repeat_interleave(16, dim=1), -6.0, 6.0)
    codes = e2m1_round(y)
    badx = bad.repeat_interleave(16, dim=1)
    codes = torch.where(badx, torch.zeros_like(codes), codes)
    sbytes = sf8.view(torch.uint8)
    sbytes = torch.where(bad, torch.full_like(sbytes, SCALE_NAN_BYTE), sbytes)
    return NVFP4Tensor(pack_codes(codes), sbytes.contiguous(), amax.contiguous(), per_token, tile16)


def check_amax(amax: torch.Tensor, rows: int, per_token: bool, device: torch.device) -> torch.Tensor:
    """Validate a user-given amax: fp32, [rows] for per-token or [1] for per-tensor."""
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise TypeError("amax must be a float32 tensor")
    want = rows if per_token else 1
    amax = amax.reshape(-1)
    if amax.numel() != want:
        raise ValueError(f"amax has {amax.numel()} values; expected {want} ({'per-token' if per_token else 'per-tensor'})")
    if amax.device != device:
        raise ValueError(f"amax is on {amax.device} but x is on {device}")
    return amax.contiguous()


def nvfp4_dequantize_ref(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantize: ``E2M1[code] * ((sf * amax) * RN(1/2688))`` in fp32, then cast."""
    rows = q.codes.shape[0]
    vals = e2m1_decode(unpack_codes(q.codes))
    sf = e4m3_decode(q.scales)
    amax = q.row_amax().float().reshape(rows, 1)
    bscale = (sf * amax) * _f32(RCP2688, sf.device)
    return (vals * bscale.repeat_interleave(16, dim=1)).to(dtype)


def block_dequant_operand(q: NVFP4Tensor) -> torch.Tensor:
    """fp32 [rows, K]: E2M1[code] * sf (no global scale). Exact in bf16 and fp32."""
    vals = e2m1_decode(unpack_codes(q.codes))
    return vals * e4m3_decode(q.scales).repeat_interleave(16, dim=1)


def gemm_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    """alpha = (amaxA * amaxB) * RN(1/(36*448^2)) in fp32 (broadcasting)."""
    return (amax_a.float() * amax_b.float()) * _f32(RCP_ALPHA, amax_a.device)


def w4a4_accumulate_ref(a_op: torch.Tensor, b_op: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """acc[m, n] = sum over blocks b in order 0,1,2,... (fp32, RN each add) of
    P_b[m, n] = sum_{i in b} a_op[m, i] * b_op[n, i] (exact: products and their sums fit fp32)."""
    m, k = a_op.shape
    n = b_op.shape[0]
    nb = k // 16
    acc = torch.zeros(m, n, dtype=torch.float32, device=a_op.device)
    a3 = a_op.reshape(m, nb, 16).transpose(0, 1)  # [nb, m, 16]
    b3 = b_op.reshape(n, nb, 16).permute(1, 2, 0)  # [nb, 16, n]
    for c0 in range(0, nb, chunk):
        p = torch.bmm(a3[c0 : c0 + chunk], b3[c0 : c0 + chunk])  # exact per block
        for j in range(p.shape[0]):
            acc = acc + p[j]
    return acc


def w4a4_gemm_ref(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W4A4 GEMM as defined by the spec: ``D = alpha * sum_b sfA_b sfB_b sum_i codeA_i codeB_i``.

    Block partial sums are exact in fp32; blocks are accumulated in increasing K order with fp32
    round-to-nearest adds; alpha (per row of ``a`` when it is per-token) is applied once in the
    epilogue: ``out = RN_fp32(acc * alpha[m, n])`` then cast to ``out_dtype``, with
    ``alpha[m, n] = (amaxA[m] * amaxB[n]) * RN(1/(36*448^2))`` (per-tensor amax broadcast).
    """
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"K mismatch: a has K={a.shape[1]}, b has K={b.shape[1]}")
    acc = w4a4_accumulate_ref(block_dequant_operand(a), block_dequant_operand(b))
    alpha = gemm_alpha(a.row_amax()[:, None], b.row_amax()[None, :])
    return (acc * alpha).to(out_dtype)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm (fp32 math, output in x's dtype) for tolerance checks of the fused kernel."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def swizzle_scales_ref(scales: torch.Tensor) -> torch.Tensor:
    """Linear [rows, K/16] scales -> padded, swizzled 1-D layout for GEMM libraries.

    Padded to ``[ceil(rows/128)*128, ceil(Kb/4)*4]`` (pad bytes 0); element (m, k) goes to
    ``((m/128)*(Kp/4) + k/4)*512 + (m%32)*16 + ((m/32)%4)*4 + k%4``.
    """
    rows, kb = scales.shape
    rp, kp = -(-rows // 128) * 128, -(-kb // 4) * 4
    padded = torch.zeros(rp, kp, dtype=scales.dtype, device=scales.device)
    padded[:rows, :kb] = scales
    m = torch.arange(rp, device=scales.device)[:, None]
    k = torch.arange(kp, device=scales.device)[None, :]
    off = ((m // 128) * (kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4
    out = torch.empty(rp * kp, dtype=scales.dtype, device=scales.device)
    out[off.reshape(-1)] = padded.reshape(-1)
    return out


def unswizzle_scales_ref(swz: torch.Tensor, rows: int, kb: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales_ref`."""
    rp, kp = -(-rows // 128) * 128, -(-kb // 4) * 4
    m = torch.arange(rp, device=swz.device)[:, None]
    k = torch.arange(kp, device=swz.device)[None, :]
    off = ((m // 128) * (kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4
    return swz[off.reshape(-1)].reshape(rp, kp)[:rows, :kb].contiguous()
