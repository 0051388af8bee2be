"""Backend selection: which implementation runs a kernel here, recorded for the run manifest.

Backends:

* ``triton``: the Triton kernels on a CUDA GPU (compute capability >= 8.0: bf16 tensor cores).
* ``triton-interpreter``: the same kernels on CPU tensors through Triton's interpreter (CI).
* ``torch-reference``: the pure-torch spec (any device; slow; the fallback for other GPUs).
* ``cutlass``: NOT implemented; selection never returns it. On the H200 (BENCHMARKS.md) the
  Triton prefill GEMM is within 1.07x of cuBLAS bf16 and the grouped GEMM within 1.17x of
  ``torch._grouped_mm``, so CUTLASS would only pay for the decode GEMM, where the Triton kernel
  (register decode of FP4 into mma.sync operands) is 0.8x of cuBLAS bf16 instead of the 2.5x
  goal: a warp-specialized CUTLASS/Gluon mainloop (producer warps decoding into shared memory
  while the MMA warps consume) is the route there; not built in this pass.

``tc_linear`` (the recipes' NVFP4 GEMM on CUDA) reports its path as ``decode`` (M <= 64, FP4
weights streamed and decoded in registers) or ``prefill``; both give identical rows.
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

    from .common import INTERPRET

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
        if cc < (8, 0):
            rec.update(backend="torch-reference", reason=f"sm_{cc[0]}{cc[1]} < sm_80: no bf16 tensor cores")
            return rec
        rec.update(backend="triton", reason=f"sm_{cc[0]}{cc[1]}: Triton kernels (CUTLASS backend not implemented)")
    else:
        rec.update(backend="triton-interpreter", reason="CPU tensors: Triton interpreter (bit-identical, slow)")
    if kernel == "aligned_linear" and m is not None:
        from .aligned_linear import choose_path

        rec["path"] = choose_path(m)
    if kernel == "tc_linear" and m is not None:
        from .tc_linear import DECODE_MAX_M

        rec["path"] = "decode" if m <= DECODE_MAX_M else "prefill"
    if kernel == "grouped_gemm" and m is not None:  # m: average rows per expert
        from .grouped import choose_grouped_path

        rec["path"] = choose_grouped_path(m)
    return rec
