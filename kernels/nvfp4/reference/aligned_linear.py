"""The exact per-16-block W4A4 linear (the older Triton stack; a slow cross-check, not the default).

``aligned_linear(x, w)`` computes ``x @ w.T`` as defined by :func:`ref.w4a4_gemm_ref`, bit
for bit, with one kernel for every M (see :mod:`reference.w4a4` for the numerics). Row i of the
output depends only on row i of ``x``. The recipes run :class:`linear.NVFP4Linear` over
:mod:`tc_linear` instead (tensor-core accumulation, within the GEMM tolerance of docs/nvfp4.md);
this one is used by the named checks (``gemm_*``), the tests and the benches.
"""

from __future__ import annotations

import torch

from mismatch_probe.kernels.launch_math import cdiv

from ..common import INTERPRET, kernel_device_ok, launch
from ..ref import FLOAT_DTYPES, NVFP4Tensor, w4a4_gemm_ref
from ..triton_quant import check_qtensor, nvfp4_dequantize, nvfp4_quantize
from .w4a4 import w4a4_kernel

DECODE_MAX_M = 64  # at or below: packed FP4 weights read directly in the mainloop (swap-AB)
PATHS = ("auto", "fp4", "fp4w", "fp4w-swap", "fma", "bf16")
# path -> (A packed FP4?, B packed FP4?, kernel MODE: 0 dot, 1 swap-AB dot, 2 CUDA-core FMA)
_PATH_OPERANDS = {
    "fp4": (True, True, 0),
    "fp4w": (False, True, 0),
    "fp4w-swap": (False, True, 1),
    "fma": (True, True, 2),
    "bf16": (False, False, 0),
}


def choose_path(m: int, path: str = "auto") -> str:
    """Operand forms / engines, all giving identical bits (only speed differs):

    * 'fp4w-swap': weights packed FP4 + scales decoded in the mainloop and placed on the MMA's M
      side (swap-AB: out^T = W A^T, so M = 1..64 wastes no wgmma rows); activations
      pre-dequantized once to exact bf16 ``E2M1*sf``. Default for M <= 64 (fastest measured).
    * 'fp4': both operands packed, decoded in the mainloop; 'fp4w': weights packed, activations
      pre-dequantized (activation rows on the MMA's M side, padded to 64).
    * 'bf16': both pre-dequantized to exact bf16 (large M: the mainloop stays on the tensor
      cores); default for M > 64.
    * 'fma': CUDA cores only (no tensor cores); exact too but slow (kept as a cross-check).

    Every path passed the bitwise checks and batch invariance on the H200 (2026-11-29)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path != "auto":
        return path
    return "fp4w-swap" if m <= DECODE_MAX_M else "bf16"


def gemm_config(m: int, path: str) -> dict[str, int]:
    """Tile configuration by shape (never changes the bits: every tile computes the same sums).

    Tensor-core tiles keep both MMA dims >= 64 whenever an operand is decoded in registers: on the
    H200 with Triton 3.6 the mma.sync (BM or BN < 64) variants fed by register-decoded FP4
    operands returned wrong values (a register layout conversion; the same mma.sync fed from
    memory was exact), so those tile shapes are never chosen."""
    small = 1 << max(0, (max(1, min(m, 16)) - 1).bit_length())
    if INTERPRET:
        if path == "fma":
            return {"BM": small, "BN": 16, "num_warps": 4, "num_stages": 1}
        return {"BM": 16, "BN": 16, "num_warps": 4, "num_stages": 1}
    if path == "fma":
        return {"BM": small, "BN": 32, "num_warps": 4, "num_stages": 3}
    if path == "fp4w-swap":
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        return {"BM": bm, "BN": 64, "num_warps": 4, "num_stages": 3, "KSTEP": 2}
    if path in ("fp4", "fp4w"):
        return {"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 4}
    return {"BM": 128, "BN": 128, "num_warps": 8, "num_stages": 3, "KSTEP": 2}


def _kstep(nblocks: int) -> int:
    if INTERPRET:
        return 1
    for s in (8, 4, 2):
        if nblocks % s == 0:
            return s
    return 1


def kstep_for(cfg: dict[str, int], nblocks: int, user: dict[str, int] | None) -> int:
    """K blocks per unrolled loop step: the config's when it divides the block count (a user
    override that does not divide is an error), else the largest of 8, 4, 2, 1 that does."""
    ks = cfg.get("KSTEP")
    if ks is not None and nblocks % ks == 0:
        return ks
    if user and "KSTEP" in user:
        raise ValueError(f"config KSTEP={ks} must divide the number of K blocks {nblocks}")
    return _kstep(nblocks)


def _operand(q: NVFP4Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if fp4:
        return q.codes, q.scales
    return nvfp4_dequantize(q, torch.bfloat16, apply_global=False), q.scales


def w4a4_matmul(
    a: NVFP4Tensor,
    w: NVFP4Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    path: str = "auto",
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """NVFP4 x NVFP4 GEMM ``a @ w.T`` ([M, K] x [N, K] -> [M, N]); bit-exact with
    :func:`w4a4_gemm_ref`. ``path``: 'auto' | 'fp4' | 'fp4w' | 'bf16'; ``config``: tile override
    (BM, BN, num_warps, num_stages) for tuning. Neither changes the bits, only the speed."""
    check_qtensor(a, "a")
    check_qtensor(w, "w")
    kernel_device_ok(a.codes, w.codes)
    (m, k), (n, kw) = a.shape, w.shape
    if k != kw:
        raise ValueError(f"K mismatch: activations have K={k}, weights have K={kw}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    p = choose_path(m, path)
    cfg = {**gemm_config(m, p), **(config or {})}
    out = torch.empty(m, n, dtype=out_dtype, device=a.codes.device)
    if m == 0:
        return out
    a_fp4, b_fp4, mode = _PATH_OPERANDS[p]
    a_op, a_sf = _operand(a, a_fp4)
    b_op, b_sf = _operand(w, b_fp4)
    bm, bn = cfg["BM"], cfg["BN"]
    kstep = kstep_for(cfg, k // 16, config)
    grid = (cdiv(m, bm), cdiv(n, bn))
    obf = out_dtype == torch.bfloat16
    launch(
        w4a4_kernel, grid,
        a_op, a_sf, a.amax, b_op, b_sf, w.amax, out.view(torch.int16) if obf else out,
        a.amax, a.amax, a.amax,  # tile tables: unused when not grouped
        m, n, k, 0, 0, 0,
        a_fp4, b_fp4, a.per_token, w.per_token,
        False, bm, bn, kstep, INTERPRET, not INTERPRET, obf, mode,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def aligned_linear(
    x: torch.Tensor | NVFP4Tensor,
    w: NVFP4Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    path: str = "auto",
) -> torch.Tensor:
    """Batch-invariant NVFP4 linear ``y = x @ W.T``.

    ``x``: [M, K] bf16/fp16/fp32 activations (quantized here per token, 1x16, with the Triton
    quantizer) or an already quantized per-token :class:`NVFP4Tensor` (e.g. from
    :func:`rmsnorm_nvfp4_quantize`, amax reuse). ``w``: [N, K] NVFP4 weights (per-tensor 1x16
    or 16x16 tiles, or per-row). Fixed K order, fp32 accumulation, no split-K, alpha in the
    epilogue. Backend: Triton (GPU) or the Triton interpreter (CPU); no CUTLASS backend yet.
    """
    if isinstance(x, torch.Tensor):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
        x = nvfp4_quantize(x, per_token=True)
    elif not isinstance(x, NVFP4Tensor):
        raise TypeError(f"x must be a tensor or NVFP4Tensor, got {type(x).__name__}")
    elif not x.per_token:
        raise ValueError("aligned_linear needs per-token activations (per_token=True): per-tensor "
                         "activation scales make a row depend on the other rows of the batch")
    return w4a4_matmul(x, w, out_dtype=out_dtype, path=path)


def aligned_linear_ref(x: torch.Tensor | NVFP4Tensor, w: NVFP4Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """Pure-torch reference of :func:`aligned_linear` (any device)."""
    from ..ref import nvfp4_quantize_ref

    q = nvfp4_quantize_ref(x, per_token=True) if isinstance(x, torch.Tensor) else x
    return w4a4_gemm_ref(q, w, out_dtype)
