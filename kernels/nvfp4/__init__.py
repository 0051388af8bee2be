"""NVFP4 numerics: the spec as code, the recipes' one GEMM path, and the slow cross-checks.

The numerics contract (quantizer bit for bit, GEMM accumulation, what is bitwise) is docs/nvfp4.md.

The recipes' path (both engines build the same object per linear layer):

* :class:`linear.NVFP4Linear`: made from the recipe's :class:`schemes.Scheme` (activation amax per
  token / per tensor / static, weight blocks, weight amax); owns the scheme's quantizers and the
  prepared weights, and runs every GEMM through
* :mod:`tc_linear`: **the** NVFP4 GEMM (:func:`tc_linear.prepare`, :func:`tc_linear.tc_matmul`,
  :func:`tc_linear.tc_grouped` for MoE): decode path (M <= 64) or prefill path, identical rows
  either way, tensor-core fp32 accumulation in K segments that depend only on (N, K). Its kernels:
  :mod:`gemm_tc` (Triton) and :mod:`native` (CUDA C++ in ``csrc/``, built at first use on sm_89+:
  the decode GEMM and the quantizer, same bits).
* :mod:`sync`: the weights' layouts for that GEMM (codes, scales, decode and native layouts) in
  one fused pass per weight shard, bitwise :func:`schemes.quantize_weight_ref` + :func:`tc_linear.prepare`
  (what :meth:`linear.NVFP4Linear.prepared` runs on CUDA; the learner-to-sampler weight sync).
* :mod:`fused_input`: how an op that produces a per-token linear's input also quantizes it (the
  producer's output carries its quantization in the layout the linear's GEMM takes; the linear takes
  it instead of quantizing), for :mod:`norm_quant` (the strict RMSNorm: both engines' norms before
  q/k/v and gate/up) and :mod:`act_quant` (the strict act-and-mul: vLLM's, before down); the same
  bits as the op then the quantizer.
* :mod:`tuning`: how it runs, as frozen dataclasses (:class:`tuning.GemmTuning`; only the segment
  rule decides bits).
* quantizers: :mod:`quant_fast` (one pass, per token, emits the GEMM operand), :mod:`triton_quant`
  (every scheme, dequantize, fused RMSNorm + quantize); :mod:`moe` (routing, expert weights, the
  tile schedule, combine); :mod:`backends` (which backend runs here, for the manifest);
  :mod:`common` (Triton mode and exact device helpers).

The spec and the cross-checks (not run by the recipes):

* :mod:`ref`: the pure-torch reference quantizer and the exact per-16-block GEMM
  (:func:`ref.w4a4_gemm_ref`), any device.
* :mod:`reference`: the older exact per-16-block Triton GEMMs (:func:`reference.aligned_linear.aligned_linear`,
  :func:`reference.grouped.grouped_w4a4`), kept as slow bitwise cross-checks for the named checks,
  tests and benches.

Importing this package imports nothing heavy; the names below resolve lazily (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "NVFP4Linear": "linear",
    "Scheme": "schemes",
    "SCHEMES": "schemes",
    "GemmTuning": "tuning",
    "prepare": "tc_linear",
    "tc_matmul": "tc_linear",
    "tc_grouped": "tc_linear",
    "TCWeight": "tc_linear",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:  # AttributeError lets `from mismatch_probe.kernels.nvfp4 import <submodule>` work
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
