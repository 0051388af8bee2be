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

This package imports torch and triton; ``mismatch_probe.kernels.cli`` does not (lazy).
"""

from .aligned_linear import aligned_linear, aligned_linear_ref, w4a4_matmul
from .backends import select_backend
from .grouped_gemm import (
    GroupedNVFP4Weights,
    grouped_w4a4,
    grouped_w4a4_ref,
    moe_combine,
    moe_grouped_linear,
    moe_route,
    quantize_expert_weights,
)
from .nvfp4_ref import (
    NVFP4Tensor,
    nvfp4_dequantize_ref,
    nvfp4_quantize_ref,
    pack_codes,
    swizzle_scales_ref,
    unpack_codes,
    unswizzle_scales_ref,
    w4a4_gemm_ref,
)
from .triton_nvfp4 import nvfp4_dequantize, nvfp4_quantize, rmsnorm_nvfp4_quantize

__all__ = [
    "GroupedNVFP4Weights",
    "NVFP4Tensor",
    "aligned_linear",
    "aligned_linear_ref",
    "grouped_w4a4",
    "grouped_w4a4_ref",
    "moe_combine",
    "moe_grouped_linear",
    "moe_route",
    "nvfp4_dequantize",
    "nvfp4_dequantize_ref",
    "nvfp4_quantize",
    "nvfp4_quantize_ref",
    "pack_codes",
    "quantize_expert_weights",
    "rmsnorm_nvfp4_quantize",
    "select_backend",
    "swizzle_scales_ref",
    "unpack_codes",
    "unswizzle_scales_ref",
    "w4a4_gemm_ref",
    "w4a4_matmul",
]
