"""Backend selection: which implementation runs a kernel here, recorded for the run manifest.

Backends:

* ``cuda-native``: hand-written CUDA C++ (``csrc/``, built with nvcc at first use
  and cached; :mod:`.native`) on sm_89+ GPUs: the decode-path GEMM of ``tc_linear`` (M <= 64,
  dense weights) and the per-token / given-amax quantizer of bf16 rows. Same bits as the Triton
  kernels (GPU checks compare them with ``torch.equal``). Optional: without nvcc, on older GPUs,
  with ``MISMATCH_PROBE_NATIVE=0`` or after a failed build the selection falls back to ``triton``
  and the record says why (``native_reason``).
* ``triton``: the Triton kernels on a CUDA GPU of compute capability >= 8.9 (they convert E4M3 scale
  bytes in hardware; compiled for sm_80 / sm_86 they fail, so Ampere runs ``torch-reference``);
  the prefill GEMM, the grouped MoE GEMM, the fused RMSNorm + quantize and the fallbacks.
* ``triton-interpreter``: the same kernels on CPU tensors through Triton's interpreter (CI).
* ``torch-reference``: the pure-torch spec (any device; slow; the fallback for other GPUs, both engines alike).

CUTLASS: not used. On the H200 (BENCHMARKS.md) the Triton prefill and grouped GEMMs already meet
their goals; the decode GEMM, where a custom kernel was needed, is the hand-written CUDA kernel
above (CUTLASS's mixed-input mainloops want the scale group to be a multiple of the tile's K, so
16-wide NVFP4 groups would need a custom collective anyway).

``tc_linear`` (the recipes' NVFP4 GEMM on CUDA) reports its path as ``decode`` (M <= 64, FP4
weights streamed and decoded in registers) or ``prefill``; every path gives identical rows.
``aligned_linear`` and ``grouped_gemm`` name the exact per-16-block cross-check kernels of
:mod:`.reference` (not the recipes' path).
"""

from __future__ import annotations

from typing import Any

KERNELS = ("quantize", "dequantize", "rmsnorm_quantize", "aligned_linear", "grouped_gemm", "tc_linear")


def select_backend(kernel: str, device: str = "cuda", m: int | None = None) -> dict[str, Any]:
    """Choose the backend for ``kernel`` on ``device`` (and the GEMM path by M, or by the average
    rows per expert for ``grouped_gemm``). Returns a record
    ``{kernel, backend, path, reason, compute_capability, triton, torch}`` for manifests."""
    import torch
    import triton

    from .common import INTERPRET, MIN_CC

    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")
    rec: dict[str, Any] = {
        "kernel": kernel,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "compute_capability": None,
        "path": None,
    }
    if device.startswith("cuda"):
        if INTERPRET or not torch.cuda.is_available():
            rec.update(backend="torch-reference", reason="CUDA requested but not available")
            return rec
        cc = torch.cuda.get_device_capability()
        rec["compute_capability"] = f"{cc[0]}.{cc[1]}"
        if cc < MIN_CC:
            rec.update(backend="torch-reference",
                       reason=f"sm_{cc[0]}{cc[1]} < sm_89: the kernels' E4M3 conversions do not compile there")
            return rec
        rec.update(backend="triton", reason=f"sm_{cc[0]}{cc[1]}: Triton kernels")
        if kernel in ("quantize", "tc_linear"):
            from . import native

            native_path = kernel == "quantize" or (m is not None and m <= _decode_max_m())
            if native_path and native.available():
                rec.update(backend="cuda-native", reason=f"sm_{cc[0]}{cc[1]}: CUDA C++ kernels (nvfp4_native.cu)",
                           native=native.status())
            elif native_path:
                rec["native_reason"] = native.status()["reason"]
    else:
        rec.update(backend="triton-interpreter", reason="CPU tensors: Triton interpreter (bit-identical, slow)")
    if kernel == "aligned_linear" and m is not None:
        from .reference.aligned_linear import choose_path

        rec["path"] = choose_path(m)
    if kernel == "tc_linear" and m is not None:
        from .tc_linear import DECODE_MAX_M

        rec["path"] = "decode" if m <= DECODE_MAX_M else "prefill"
    if kernel == "grouped_gemm" and m is not None:  # m: average rows per expert
        from .reference.grouped import choose_grouped_path

        rec["path"] = choose_grouped_path(m)
    return rec


def _decode_max_m() -> int:
    from .tc_linear import DECODE_MAX_M

    return DECODE_MAX_M
