"""Backend selection: which implementation runs a kernel here, recorded for the run manifest.

Backends:

* ``triton``: the Triton kernels on a CUDA GPU (compute capability >= 8.0: bf16 tensor cores).
* ``triton-interpreter``: the same kernels on CPU tensors through Triton's interpreter (CI).
* ``torch-reference``: the pure-torch spec (any device; slow; the fallback for other GPUs).
* ``cutlass``: NOT implemented. The issue asks for one where it beats Triton (e.g. a Hopper GEMM
  with FP4 dequantization in the mainloop for decode shapes); it would need the
  ``nvidia-cutlass`` wheel and its Python emitter compiled with nvcc on the GPU machine, and a
  proof of the same bitwise checks. Not built in this pass: selection never returns it.
"""

from __future__ import annotations

from typing import Any

KERNELS = ("quantize", "dequantize", "rmsnorm_quantize", "aligned_linear", "grouped_gemm")


def select_backend(kernel: str, device: str = "cuda", m: int | None = None) -> dict[str, Any]:
    """Choose the backend for ``kernel`` on ``device`` (and the GEMM path by M, or by the average
    rows per expert for ``grouped_gemm``). Returns a record
    ``{kernel, backend, path, reason, compute_capability, triton, torch}`` for manifests."""
    import torch
    import triton

    from ._triton_common import INTERPRET

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
    if kernel == "grouped_gemm" and m is not None:  # m: average rows per expert
        from .grouped_gemm import choose_grouped_path

        rec["path"] = choose_grouped_path(m)
    return rec
