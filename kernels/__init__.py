"""NVFP4 kernels for aligned (batch-invariant, bit-exact) train/inference numerics.

Plain functions (no CLI needed):

* :func:`nvfp4_quantize_ref`, :func:`nvfp4_dequantize_ref`, :func:`w4a4_gemm_ref`: the pure-torch
  spec (shared/NVFP4.md; TE's canonical quantizer), any device.
* :func:`nvfp4_quantize`, :func:`nvfp4_dequantize`, :func:`rmsnorm_nvfp4_quantize`: Triton
  kernels, bit-exact with the reference (CUDA; on a CPU-only machine through the Triton
  interpreter on CPU tensors).
* :func:`aligned_linear`, :func:`w4a4_matmul`: batch-invariant W4A4 linear.
* :func:`moe_route`, :func:`grouped_w4a4`, :func:`moe_combine`, :func:`moe_grouped_linear`: MoE.
* :func:`select_backend`: which backend runs a kernel here, as a manifest record.
* :mod:`.conformance`: other engines' quantizer formulas and their disagreement.
* :mod:`.checks`: the named bitwise equivalence checks.

Importing this package is cheap: the names below are resolved lazily (PEP 562), so
``mismatch_probe.kernels.cli`` (and the ``mismatch-probe`` CLI start-up) import neither torch nor
triton; the first use of a kernel function does.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "aligned_linear": "aligned_linear",
    "aligned_linear_ref": "aligned_linear",
    "w4a4_matmul": "aligned_linear",
    "select_backend": "backends",
    "GroupedNVFP4Weights": "grouped_gemm",
    "grouped_w4a4": "grouped_gemm",
    "grouped_w4a4_ref": "grouped_gemm",
    "moe_combine": "grouped_gemm",
    "moe_grouped_linear": "grouped_gemm",
    "moe_route": "grouped_gemm",
    "quantize_expert_weights": "grouped_gemm",
    "NVFP4Tensor": "nvfp4_ref",
    "nvfp4_dequantize_ref": "nvfp4_ref",
    "nvfp4_quantize_ref": "nvfp4_ref",
    "pack_codes": "nvfp4_ref",
    "swizzle_scales_ref": "nvfp4_ref",
    "unpack_codes": "nvfp4_ref",
    "unswizzle_scales_ref": "nvfp4_ref",
    "w4a4_gemm_ref": "nvfp4_ref",
    "nvfp4_dequantize": "triton_nvfp4",
    "nvfp4_quantize": "triton_nvfp4",
    "rmsnorm_nvfp4_quantize": "triton_nvfp4",
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
