"""Other engines' NVFP4 quantizer formulas, and how they disagree with the canonical one.

Each variant reproduces the formula of one implementation (as summarised in docs/nvfp4.md,
read from their public sources) in pure torch:

* ``vllm_cuda``: ``sf = e4m3(gs * (vmax * RN(1/6)))``, ``enc = rcp(sf * rcp(gs))``, sf == 0 -> codes 0.
  The GPU's ``rcp.approx.ftz`` (<= 1 ulp off) cannot be reproduced bit-exactly off-GPU: it is
  emulated by a correctly rounded reciprocal, so real vLLM may differ in a few more codes.
* ``vllm_emulation``: same codes formula with exact division; its dequantization folds the global
  scale into the bf16 weight (``bf16(code * sf / gs)``), reported as dequant disagreement.
* ``modelopt``: ``sf = e4m3(vmax / (6 * S2))`` with ``S2 = amax / 2688``, zero scale -> 1.0,
  ``y = x / (sf * S2)``.
* ``compressed_tensors``: ``sf = e4m3(gs * (vmax / 6))``, zero scale -> 0.125, ``y = x / (sf / gs)``.
* ``torchao``: ``sf = e4m3(clamp((vmax / 6) / S2, 2^-6, 448))`` (no subnormal scales),
  ``y = x / (S2 * sf)``.

All use the canonical E2M1 RNE rounding and the same amax; NaN/Inf are not flagged (inputs must
be finite here).
"""

from __future__ import annotations

from typing import Any

import torch

from .nvfp4.ref import (
    FLT_MAX,
    RCP6,
    NVFP4Tensor,
    e2m1_round,
    global_scales,
    nonfinite_amax,
    nvfp4_dequantize_ref,
    nvfp4_quantize_ref,
    pack_codes,
    unpack_codes,
    validate_input,
)

VARIANTS = ("vllm_cuda", "vllm_emulation", "modelopt", "compressed_tensors", "torchao")


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(v, max=448.0).to(torch.float8_e4m3fn)


def quantize_variant(x: torch.Tensor, variant: str, *, per_token: bool = False) -> NVFP4Tensor:
    """Quantize ``x`` [rows, K] with another implementation's formula (see module doc)."""
    validate_input(x)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    xf = x.float()
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("conformance variants need finite inputs (NaN/Inf found)")
    rows, k = x.shape
    amax = nonfinite_amax(x, per_token)
    gs, s2 = global_scales(amax)  # gs: encode scale 2688/amax; s2: decode scale
    if per_token:
        gs, s2, am = gs[:, None], s2[:, None], amax[:, None]
    else:
        am = amax
    vmax = xf.abs().reshape(rows, k // 16, 16).amax(dim=2)
    rcp6 = torch.tensor(RCP6, dtype=torch.float32, device=x.device)
    if variant in ("vllm_cuda", "vllm_emulation"):
        sf8 = _e4m3(gs * (vmax * rcp6))
        sf = sf8.float()
        enc = torch.where(sf != 0, 1.0 / (sf * (1.0 / gs)), torch.zeros_like(sf))
        y = xf * enc.repeat_interleave(16, dim=1)
    elif variant == "modelopt":
        s2m = am / 2688.0
        sf8 = _e4m3(vmax / (6.0 * s2m))
        sf = sf8.float()
        sf = torch.where(sf == 0, torch.ones_like(sf), sf)
        sf8 = sf.to(torch.float8_e4m3fn)
        y = xf / (sf * s2m).repeat_interleave(16, dim=1)
    elif variant == "compressed_tensors":
        sf8 = _e4m3(gs * (vmax / 6.0))
        sf = sf8.float()
        sf = torch.where(sf == 0, torch.full_like(sf, 0.125), sf)
        sf8 = sf.to(torch.float8_e4m3fn)
        y = xf / (sf / gs).repeat_interleave(16, dim=1)
    else:  # torchao
        s2m = am / 2688.0
        sf8 = torch.clamp((vmax / 6.0) / s2m, min=2.0**-6, max=448.0).to(torch.float8_e4m3fn)
        sf = sf8.float()
        y = xf / (s2m * sf).repeat_interleave(16, dim=1)
    y = torch.clamp(torch.nan_to_num(y, nan=0.0, posinf=FLT_MAX, neginf=-FLT_MAX), -6.0, 6.0)
    codes = e2m1_round(y)
    return NVFP4Tensor(pack_codes(codes), sf8.view(torch.uint8).contiguous(), amax, per_token, False)


def dequantize_variant(q: NVFP4Tensor, variant: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize as the variant does (vllm_emulation folds the global scale before bf16)."""
    if variant == "vllm_emulation":
        from .nvfp4.ref import e2m1_decode, e4m3_decode

        gs, _ = global_scales(q.row_amax())
        sf = e4m3_decode(q.scales).repeat_interleave(16, dim=1)
        return (e2m1_decode(unpack_codes(q.codes)) * sf / gs[:, None]).to(dtype)
    return nvfp4_dequantize_ref(q, dtype)


def disagreement(x: torch.Tensor, *, per_token: bool = False) -> list[dict[str, Any]]:
    """For every variant: share of codes, scales and dequantized values (in bf16) that differ
    from the canonical quantizer, plus zero-scale-block handling."""
    ref = nvfp4_quantize_ref(x, per_token=per_token)
    ref_codes = unpack_codes(ref.codes)
    ref_deq = nvfp4_dequantize_ref(ref, torch.bfloat16)
    zero_blocks = int(((ref.scales == 0) & (x.float().abs().reshape(x.shape[0], -1, 16).amax(2) > 0)).sum())
    rows = [
        {
            "variant": "canonical (TE)",
            "codes_differ": 0.0,
            "scales_differ": 0.0,
            "dequant_differ": 0.0,
            "max_abs_dequant_diff": 0.0,
            "nonzero_blocks_with_zero_scale": zero_blocks,
        }
    ]
    for v in VARIANTS:
        q = quantize_variant(x, v, per_token=per_token)
        deq = dequantize_variant(q, v)
        rows.append(
            {
                "variant": v,
                "codes_differ": float((unpack_codes(q.codes) != ref_codes).float().mean()),
                "scales_differ": float((q.scales != ref.scales).float().mean()),
                "dequant_differ": float((deq.view(torch.int16) != ref_deq.view(torch.int16)).float().mean()),
                "max_abs_dequant_diff": float((deq.float() - ref_deq.float()).abs().max()),
                "nonzero_blocks_with_zero_scale": int(
                    ((q.scales == 0) & (x.float().abs().reshape(x.shape[0], -1, 16).amax(2) > 0)).sum()
                ),
            }
        )
    return rows


def load_tensor(path: str) -> torch.Tensor:
    """Load a captured tensor from .pt/.pth (a tensor, or a dict/list holding one) or .npy, as
    2-D [-1, last dim] float. Raises ValueError with the reason."""
    import os

    if not os.path.exists(path):
        raise ValueError(f"no such file: {path}")
    if path.endswith(".npy"):
        import numpy as np

        t = torch.from_numpy(np.load(path))
    elif path.endswith((".pt", ".pth")):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            tens = [v for v in obj.values() if isinstance(v, torch.Tensor)]
            if len(tens) != 1:
                raise ValueError(f"{path}: expected one tensor in the dict, found {len(tens)}")
            obj = tens[0]
        elif isinstance(obj, (list, tuple)) and len(obj) == 1:
            obj = obj[0]
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"{path}: holds a {type(obj).__name__}, not a tensor")
        t = obj
    else:
        raise ValueError(f"{path}: unsupported file type (use .pt, .pth or .npy)")
    if not t.is_floating_point():
        raise ValueError(f"{path}: tensor dtype {t.dtype} is not floating point")
    if t.dim() == 0 or t.shape[-1] % 16 != 0:
        raise ValueError(f"{path}: last dimension {tuple(t.shape)[-1:]} must be a multiple of 16 (NVFP4 blocks)")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        t = t.float()
    return t.reshape(-1, t.shape[-1]).contiguous()
