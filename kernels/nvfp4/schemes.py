"""The NVFP4 scaling schemes of the recipes (docs/nvfp4.md "Scaling schemes") and how each
quantizes a weight into shards, with the pure-torch reference quantizer (the spec). Shared by
:mod:`linear` (the recipes' linear) and :mod:`sync` (the fused weight sync, checked against this)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .ref import NVFP4Tensor, nvfp4_quantize_ref


@dataclass(frozen=True)
class Scheme:
    """An NVFP4 activation-scaling scheme: per-token or per-tensor activation amax, static
    (calibrated) or dynamic, 16x16 or 1x16 weight blocks, one weight amax over fused shards or one
    per logical weight."""

    name: str
    per_token: bool
    static: bool
    weight_tile16: bool
    fused_weight_amax: bool


SCHEMES = {
    "nvfp4-dynamic-tensor": Scheme("nvfp4-dynamic-tensor", False, False, True, False),
    "nvfp4-static": Scheme("nvfp4-static", False, True, False, True),
    "nvfp4-per-token": Scheme("nvfp4-per-token", True, False, False, False),
}


def quantize_upstream(recipe: Any, ops: Any) -> bool:
    """Whether a recipe's ops that produce a linear's input (on CUDA: the norms, vLLM's act-and-mul) also
    quantize their output for the linears that read it (:mod:`fused_input`): a per-token linear scheme
    with the ``linear`` op class on (``recipe``: a :class:`recipes.Recipe`, ``ops``: the op classes patched)."""
    s = SCHEMES.get(recipe.linear)
    return bool(recipe.nvfp4 and s is not None and s.per_token and "linear" in ops)


def shard_sizes(n: int, partitions: list[int] | None) -> list[int]:
    """The shards of a fused weight of ``n`` rows (partitions that do not add up to ``n``: one shard)."""
    return list(partitions) if partitions and sum(partitions) == n else [n]


def quantize_weight_ref(w: torch.Tensor, scheme: Scheme, partitions: list[int] | None = None) -> list[NVFP4Tensor]:
    """The reference quantization of ``w [N, K]`` under ``scheme``, one NVFP4Tensor per shard: one
    amax per shard, or (``fused_weight_amax``) one over the whole fused weight."""
    parts = list(torch.split(w.detach(), shard_sizes(w.shape[0], partitions), dim=0))
    shared = w.detach().float().abs().amax().reshape(1) if scheme.fused_weight_amax else None
    return [nvfp4_quantize_ref(p, tile16=scheme.weight_tile16, amax=shared) for p in parts]
