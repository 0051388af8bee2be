"""Recipes: how each op class of the forward pass computes, applied identically to both engines.

A recipe is an *alignment* (``engine``: each engine's own kernels, or ``strict``: every op from
:mod:`.strict.ops`, batch-invariant and identical in both engines) combined with a *linear
scheme* (``bf16`` or one of the NVFP4 activation-scaling schemes of :mod:`.nvfp4.linear`).

========================  ==========  ==============================================================
name                      alignment   linear
========================  ==========  ==============================================================
``engine``                engine      the engine's bf16 GEMM (nothing patched)
``strict``                strict      bf16 operands, fp32 accumulation in fixed blocks (strict.ops.linear)
``nvfp4-dynamic-tensor``  engine      W4A4, activation amax over the whole current batch, 16x16
                                      weight tiles (TE's learner default)
``nvfp4-static``          engine      W4A4, calibrated static input amax, 1x16 weight blocks, one
                                      weight amax over fused q/k/v and gate/up (vLLM serving)
``nvfp4-per-token``       engine      W4A4, amax per token row (batch-invariant), 1x16 blocks, one
                                      weight amax per logical weight (aligned)
``strict+nvfp4-*``        strict      as above, every other op strict
========================  ==========  ==============================================================

Op classes (the ``ops=`` subset of a patch; ``bisect``'s ablation picks subsets of these):
``embedding, norm, linear, rope, attention, act, moe, logits, logsoftmax``. Under an ``engine``
alignment with an NVFP4 linear, ``linear``, the ops that produce the quantizer's input (``norm``,
``act``), the ops whose last-bit differences FP4 amplifies (``rope``, ``attention``) and, on MoE
models, ``moe`` (expert GEMMs in NVFP4) are replaced (:data:`NVFP4_OPS`), and so are the LM head
(``logits``, the strict bf16 GEMM) and the log-softmax: the logprob is what the recipes are measured
by, and on CUDA vLLM computes it in its own kernel (model runner V2) and the LM head at its batch's
row count (cuBLAS picks kernels by shape), one fp32 ulp away from the learner's (measured on an H200:
4.8e-7). The embedding (a row gather, exact everywhere) stays the engine's.
The LM head (``logits``) and the MoE router stay bf16 in every recipe,
as NVFP4 checkpoints and TE recipes keep them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OP_KINDS = ("embedding", "norm", "linear", "rope", "attention", "act", "moe", "logits", "logsoftmax")
LINEARS = ("bf16", "nvfp4-dynamic-tensor", "nvfp4-static", "nvfp4-per-token")
ALIGNS = ("engine", "strict")
# What an NVFP4 recipe replaces under the engine alignment: the quantized GEMMs, the ops that
# produce their inputs (RMSNorm before q/k/v and gate/up, SiLU-and-mul before down: fused
# norm+quantize / act+quantize kernels in an NVFP4 stack) and the ops whose last-bit differences
# FP4 rounding amplifies into whole E2M1 steps (rotary, attention: they produce the residual
# stream and o_proj's input), plus the LM head and the log-softmax that make the logprob. All NVFP4
# recipes share these, so they differ only in the scaling scheme; the embedding stays each engine's.
NVFP4_OPS = ("linear", "norm", "act", "moe", "rope", "attention", "logits", "logsoftmax")
RECIPES = ("engine", "strict", "nvfp4-dynamic-tensor", "nvfp4-static", "nvfp4-per-token")

OP_DOC = {  # the CPU definition (kernels/strict/ops.py)
    "embedding": "row gather of the embedding table (exact everywhere)",
    "norm": "RMSNorm: fp32 tree sum of squares, 1/sqrt, bf16(x*inv) then bf16(w*y); vLLM's fused add = bf16(x+r)",
    "linear": "x @ W.T: CPU BLAS GEMM on rows padded to 16-row blocks, fp32 accumulation, rounded once (or the NVFP4 scheme)",
    "rope": "neox rotary: fp64 angle table -> fp32 cos/sin, fp32 rotation, rounded once",
    "attention": "causal softmax(q.k*scale) v: fixed-shape [16 q x 64 k] fp32 GEMM blocks, fp32 trees over key blocks; "
                 "vLLM reads K/V from its paged cache",
    "act": "SiLU-and-mul: bf16(silu_fp32(g)) then bf16(a*u)",
    "moe": "router fp32 softmax, stable top-k, renorm; experts row by row; combine in rank order in fp32",
    "logits": "LM head: the strict linear, bf16 logits",
    "logsoftmax": "fp32: s - log(tree_sum(exp(s))), s = x - max x",
}
# CUDA (learner): kernels/strict/triton_ops.py, one fixed Triton configuration per op; where the bits
# differ from the CPU definition above, it says so.
OP_DOC_CUDA = {
    "embedding": "row gather (same bits as CPU)",
    "norm": "one program per row, tl.sum, HF's roundings (another summation order than CPU: last-place differences)",
    "linear": "persistent Triton GEMM, 128x128x64 tile, no split-K, K ascending (another accumulation order: bits differ)",
    "rope": "same fp64-built table, fp32 rotation (may fuse multiply-adds: last-place differences)",
    "attention": "Triton flash attention, 64x64 blocks, online fp32 softmax, bf16 P (bits differ from CPU)",
    "act": "fp32 activation with Triton exp/erf (last-place differences)",
    "moe": "fixed expert order, experts through the CUDA linear (bits differ with the linear)",
    "logits": "the CUDA linear (bits differ)",
    "logsoftmax": "per row, fixed 4096-wide chunks in order (another summation order)",
}


@dataclass(frozen=True)
class Recipe:
    """A resolved recipe: ``align`` for every op, ``linear`` for the linear layers."""

    align: str = "engine"
    linear: str = "bf16"

    def __post_init__(self) -> None:
        if self.align not in ALIGNS:
            raise ValueError(f"alignment must be one of {ALIGNS}, got {self.align!r}")
        if self.linear not in LINEARS:
            raise ValueError(f"linear scheme must be one of {LINEARS}, got {self.linear!r}")

    @property
    def name(self) -> str:
        if self.align == "engine":
            return "engine" if self.linear == "bf16" else self.linear
        return "strict" if self.linear == "bf16" else f"strict+{self.linear}"

    @property
    def strict(self) -> bool:
        return self.align == "strict"

    @property
    def nvfp4(self) -> bool:
        return self.linear.startswith("nvfp4")

    @property
    def is_engine(self) -> bool:
        return self.align == "engine" and self.linear == "bf16"

    def ops(self) -> frozenset[str]:
        """The op classes this recipe replaces."""
        if self.strict:
            return frozenset(OP_KINDS)
        if self.nvfp4:
            return frozenset(NVFP4_OPS)
        return frozenset()

    def impl(self, op: str) -> str:
        """What op class ``op`` computes with: 'engine', 'strict', or the NVFP4 scheme (linear)."""
        if op not in OP_KINDS:
            raise ValueError(f"unknown op class {op!r}; one of {OP_KINDS}")
        if op == "linear" and self.nvfp4:
            return self.linear
        if op == "moe" and self.nvfp4:
            return f"fixed-order, experts {self.linear}"
        if op in NVFP4_OPS and self.nvfp4:
            return "strict (shared by the NVFP4 recipes)"
        return "strict" if self.strict else "engine"

    def describe(self) -> dict[str, Any]:
        """The manifest record: name, alignment, linear scheme and what each op class computes."""
        return {
            "name": self.name,
            "align": self.align,
            "linear": self.linear,
            "ops": {op: self.impl(op) for op in OP_KINDS},
            **({"strict_cpu": OP_DOC, "strict_cuda": OP_DOC_CUDA} if self.strict else {}),
        }


def parse(name: str) -> Recipe:
    """``Recipe`` from a name as :attr:`Recipe.name` prints it."""
    name = name.strip()
    if name == "engine" or name == "bf16":
        return Recipe()
    if name == "strict":
        return Recipe("strict", "bf16")
    if name.startswith("strict+"):
        return Recipe("strict", name.removeprefix("strict+"))
    if name in LINEARS:
        return Recipe("engine", name)
    raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)} (optionally 'strict+nvfp4-...')")


def resolve(align: str | None, recipe: str | None) -> Recipe:
    """Combine ``--align`` and ``--recipe``: ``--align strict --recipe nvfp4-per-token`` gives
    ``strict+nvfp4-per-token``; ``--recipe strict`` is ``--align strict``."""
    r = parse(recipe or "engine")
    a = align or "engine"
    if a not in ALIGNS:
        raise ValueError(f"--align must be one of {ALIGNS}, got {a!r}")
    if a == "strict" and not r.strict:
        r = Recipe("strict", r.linear)
    return r
