"""NVFP4 kernels for aligned (batch-invariant, bit-exact) train/inference numerics.

Plain functions (no CLI needed):

* :func:`nvfp4_quantize_ref`, :func:`nvfp4_dequantize_ref`, :func:`w4a4_gemm_ref`: the pure-torch
  spec (docs/nvfp4.md; TE's canonical quantizer), any device.
* :func:`nvfp4_quantize`, :func:`nvfp4_dequantize`, :func:`rmsnorm_nvfp4_quantize`: Triton
  kernels, bit-exact with the reference (CUDA; on a CPU-only machine through the Triton
  interpreter on CPU tensors).
* :class:`NVFP4Linear`: the recipes' NVFP4 linear (made from a scheme); :func:`prepare`,
  :func:`tc_matmul`, :func:`tc_grouped`: its GEMM (:mod:`.nvfp4.tc_linear`, the one production
  path), tuned by :class:`GemmTuning`.
* :func:`moe_route`, :func:`quantize_expert_weights`, :func:`gather_rows`, :func:`moe_combine`: MoE.
* :func:`select_backend`: which backend runs a kernel here, as a manifest record.
* :mod:`.conformance`: other engines' quantizer formulas and their disagreement.
* :mod:`.checks`: the named equivalence checks (the exact per-16-block Triton GEMMs they also
  cover live in :mod:`.nvfp4.reference`).

Importing this package is cheap: the names below are resolved lazily (PEP 562), so
``mismatch_probe.cli.kernels`` (and the ``mismatch-probe`` CLI start-up) import neither torch nor
triton; the first use of a kernel function does.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "select_backend": "nvfp4.backends",
    "NVFP4Linear": "nvfp4.linear",
    "GroupedNVFP4Weights": "nvfp4.moe",
    "gather_rows": "nvfp4.moe",
    "moe_combine": "nvfp4.moe",
    "moe_route": "nvfp4.moe",
    "quantize_expert_weights": "nvfp4.moe",
    "NVFP4Tensor": "nvfp4.ref",
    "nvfp4_dequantize_ref": "nvfp4.ref",
    "nvfp4_quantize_ref": "nvfp4.ref",
    "pack_codes": "nvfp4.ref",
    "swizzle_scales_ref": "nvfp4.ref",
    "unpack_codes": "nvfp4.ref",
    "unswizzle_scales_ref": "nvfp4.ref",
    "w4a4_gemm_ref": "nvfp4.ref",
    "prepare": "nvfp4.tc_linear",
    "tc_grouped": "nvfp4.tc_linear",
    "tc_matmul": "nvfp4.tc_linear",
    "nvfp4_dequantize": "nvfp4.triton_quant",
    "nvfp4_quantize": "nvfp4.triton_quant",
    "rmsnorm_nvfp4_quantize": "nvfp4.triton_quant",
    "GemmTuning": "nvfp4.tuning",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:  # AttributeError lets `from mismatch_probe.kernels import <submodule>` work
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
