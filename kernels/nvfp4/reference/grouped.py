"""The exact per-16-block MoE grouped W4A4 GEMM (the older Triton stack; a slow cross-check).

Not the recipes' path: their grouped GEMM is :func:`tc_linear.tc_grouped`. This kernel
(:mod:`reference.w4a4`) adds each 16-wide K block's exact partial sum to the fp32 accumulator with
one IEEE add, in K order, so each output element equals :func:`ref.w4a4_gemm_ref` bit for bit and
a token's row does not depend on how many tokens its expert got. Used by the named checks
(``grouped_moe_*``), the tests and the benches. Routing, expert weights, the tile schedule and the
combine are the production ones of :mod:`moe`.
"""

from __future__ import annotations

import torch

from mismatch_probe.kernels.launch_math import cdiv

from ..common import INTERPRET, kernel_device_ok, launch, require_contiguous
from ..moe import GroupedNVFP4Weights, gather_rows, moe_combine, moe_route, tile_schedule
from ..ref import NVFP4Tensor, nvfp4_quantize_ref, w4a4_gemm_ref
from ..triton_quant import check_qtensor, nvfp4_dequantize, nvfp4_quantize
from .aligned_linear import _PATH_OPERANDS, PATHS, gemm_config, kstep_for
from .w4a4 import w4a4_kernel


def choose_grouped_path(avg_rows: int, path: str = "auto") -> str:
    """'auto': 'fp4' (both operands packed, 64x64 wgmma tiles) when experts get <= 64 rows on
    average, else 'bf16'. Both were bit-checked in grouped mode on the H200 (2026-11-29). The
    faster 'fp4w-swap' (measured at 64 tokens) is available by name; in grouped mode it was timed
    but not bit-checked on the GPU (it was on CPU, and non-grouped on the GPU)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path != "auto":
        return path
    return "fp4" if avg_rows <= 64 else "bf16"


def grouped_w4a4(
    a: NVFP4Tensor,
    offsets: torch.Tensor,
    w: GroupedNVFP4Weights,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    path: str = "auto",
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """One-launch grouped GEMM: rows ``offsets[e]:offsets[e+1]`` of ``a`` (per-token NVFP4,
    grouped by expert) times expert e's weights ``[N, K]`` transposed. Bit-exact with
    :func:`grouped_w4a4_ref` and batch invariant."""
    check_qtensor(a, "a")
    kernel_device_ok(a.codes, w.codes, offsets)
    for t, name in ((w.codes, "w.codes"), (w.scales, "w.scales"), (w.amax, "w.amax")):
        require_contiguous(t, name)
    if w.codes.dtype != torch.uint8 or w.scales.dtype != torch.uint8 or w.amax.dtype != torch.float32:
        raise TypeError("grouped weights: codes/scales must be uint8 and amax float32")
    e_count, n, k2 = w.codes.shape
    m, k = a.shape
    if k2 * 2 != k:
        raise ValueError(f"K mismatch: activations have K={k}, expert weights have K={k2 * 2}")
    if tuple(w.scales.shape) != (e_count, n, k // 16) or w.amax.numel() != e_count:
        raise ValueError(f"grouped weights: scales must be [E, N, K/16] = {(e_count, n, k // 16)} and amax [E]")
    if offsets.numel() != e_count + 1:
        raise ValueError(f"offsets must have E+1 = {e_count + 1} entries, got {offsets.numel()}")
    if not a.per_token:
        raise ValueError("grouped_w4a4 needs per-token activations (per_token=True)")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.codes.device)
    if m == 0:
        return out
    avg = max(1, m // max(1, e_count))
    p = choose_grouped_path(avg, path)
    cfg = {**gemm_config(avg, p), **(config or {})}
    bm, bn = cfg["BM"], cfg["BN"]
    te, tr0, tr1 = tile_schedule(offsets.to(a.codes.device), bm, m)
    a_fp4, b_fp4, mode = _PATH_OPERANDS[p]
    a_op = a.codes if a_fp4 else nvfp4_dequantize(a, torch.bfloat16, apply_global=False)
    if b_fp4:
        b_op = w.codes
    else:
        flat = NVFP4Tensor(w.codes.reshape(e_count * n, k // 2), w.scales.reshape(e_count * n, k // 16), w.amax[:1])
        b_op = nvfp4_dequantize(flat, torch.bfloat16, apply_global=False).reshape(e_count, n, k)
    obf = out_dtype == torch.bfloat16
    launch(
        w4a4_kernel, (te.numel(), cdiv(n, bn)),
        a_op, a.scales, a.amax, b_op, w.scales, w.amax, out.view(torch.int16) if obf else out,
        te, tr0, tr1,
        m, n, k, b_op[0].numel(), n * (k // 16), 1,
        a_fp4, b_fp4, True, False,
        True, bm, bn, kstep_for(cfg, k // 16, config), INTERPRET, not INTERPRET, obf, mode,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def grouped_w4a4_ref(
    a: NVFP4Tensor, offsets: torch.Tensor, w: GroupedNVFP4Weights, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Reference: per-expert :func:`w4a4_gemm_ref` on each expert's rows."""
    m = a.shape[0]
    out = torch.empty(m, w.codes.shape[1], dtype=out_dtype, device=a.codes.device)
    off = offsets.tolist()
    for e in range(w.codes.shape[0]):
        r0, r1 = off[e], off[e + 1]
        if r1 > r0:
            sub = NVFP4Tensor(a.codes[r0:r1], a.scales[r0:r1], a.amax[r0:r1], True, False)
            out[r0:r1] = w4a4_gemm_ref(sub, w.expert(e), out_dtype)
    return out


def moe_grouped_linear(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: GroupedNVFP4Weights,
    *,
    use_ref: bool = False,
    path: str = "auto",
) -> torch.Tensor:
    """One MoE projection end to end: route, per-token quantize, grouped GEMM, weighted combine
    (fixed order). ``x`` [T, K]; returns [T, N] in x's dtype (bf16 GEMM output combined in fp32)."""
    e_count = w.codes.shape[0]
    perm, offsets = moe_route(topk_ids, e_count)
    top_k = topk_ids.shape[1]
    q = (nvfp4_quantize_ref if use_ref else nvfp4_quantize)(x.contiguous(), per_token=True)
    a = gather_rows(q, perm // top_k)
    y = grouped_w4a4_ref(a, offsets, w) if use_ref else grouped_w4a4(a, offsets, w, path=path)
    return moe_combine(y, perm, topk_weights, x.dtype)
