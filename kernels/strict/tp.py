"""Strict linear across tensor-parallel ranks: the row-parallel split as a node of the K reduction.

A row-parallel layer (vLLM's ``o_proj`` and ``down_proj`` under ``tensor_parallel_size = N``)
holds a contiguous K/N slice of the input features on each rank; vLLM rounds each rank's partial
product to bf16 and all-reduces the rounded partials, which is not the single-process result. Under
the strict recipe with N > 1 these layers compute, in both engines:

    y = round( tree_r( P_r ) + bias ),   P_r = fp32 strict linear of K slice r (not rounded)

``P_r`` is :func:`.ops.linear` on fp32 operands (bf16 values are exact in fp32; its own
fixed, batch-invariant K reduction, no rounding), ``tree_r`` the fixed pairwise fp32 tree over the
N partials in rank order (:func:`.ops.tree_sum`). In the sampler each rank computes its own
``P_r`` and the partials are all-gathered (fp32) and combined on every rank; the learner, which
holds the whole weight in one process, computes the same N slices one after the other
(``probes/hf/tp.py``; the sampler's side is ``probes/vllm/tp.py``). So the slices are nodes of
one reduction tree in both engines, and the result is rounded once, after the "all-reduce".
"""

from __future__ import annotations

import torch

from . import ops as so


def partial(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 strict ``x @ weight.T`` over one K slice, not rounded."""
    return so.linear(x.float(), weight.float())


def combine(partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[N, ...]`` fp32 partials summed in rank order with the fixed tree, + bias, rounded once."""
    acc = so.tree_sum(partials, dim=0)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype)


def ksplit_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The row-parallel strict linear of N ranks, computed in one process."""
    k = weight.shape[1]
    if k % n:
        raise ValueError(f"K={k} does not split into {n} equal slices")
    s = k // n
    parts = torch.stack([partial(x[..., r * s : (r + 1) * s], weight[:, r * s : (r + 1) * s]) for r in range(n)])
    return combine(parts, bias, x.dtype)
