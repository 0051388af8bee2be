"""Strict linear across tensor-parallel ranks: the row-parallel split as a node of the K reduction.

A row-parallel layer (vLLM's ``o_proj`` and ``down_proj`` under ``tensor_parallel_size = N``)
holds a contiguous K/N slice of the input features on each rank; vLLM rounds each rank's partial
product to bf16 and all-reduces the rounded partials, which is not the single-process result. Under
the strict recipe with N > 1 these layers compute, in both engines:

    y = round( tree_r( P_r ) + bias ),   P_r = fp32 strict linear of K slice r (not rounded)

``P_r`` is :func:`.strict_ops.linear` on fp32 operands (bf16 values are exact in fp32; its own
fixed, batch-invariant K reduction, no rounding), ``tree_r`` the fixed pairwise fp32 tree over the
N partials in rank order (:func:`.strict_ops.tree_sum`). In the sampler each rank computes its own
``P_r`` and the partials are all-gathered (fp32) and combined on every rank; the learner, which
holds the whole weight in one process, computes the same N slices one after the other
(:func:`split_row_parallel`). So the slices are nodes of one reduction tree in both engines, and the
result is rounded once, after the "all-reduce".
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from . import strict_ops as so

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # HF names of the layers vLLM splits along K


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


def split_row_parallel(model: torch.nn.Module, n: int) -> list[str]:
    """(Learner) make the HF model's row-parallel linears compute :func:`ksplit_linear` with ``n``
    slices (an instance ``forward``, after the strict patch). Returns the module names."""
    done = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.endswith(ROW_PARALLEL):

            def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
                return ksplit_linear(x, self.weight, self.bias, n)

            mod.forward = types.MethodType(forward, mod)
            done.append(name)
    return done


def _row_parallel_forward(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, input_: torch.Tensor) -> Any:
        from . import vllm_plugin

        r = vllm_plugin.active()
        w = getattr(self, "_mp_weight", None)
        strict_here = r is not None and not r.nvfp4 and w is not None and vllm_plugin._on("linear", self)
        if self.tp_size <= 1 or not strict_here or not self.reduce_results:
            return orig(self, input_)
        from vllm.distributed import tensor_model_parallel_all_gather

        x = input_ if self.input_is_parallel else input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        part = partial(x, w).unsqueeze(0).contiguous()
        parts = tensor_model_parallel_all_gather(part, dim=0)  # [ranks, ...], rank order
        out = combine(parts, None if self.skip_bias_add else self.bias, x.dtype)
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)

    return forward


def targets() -> list[tuple[type, str, Callable[..., Any]]]:
    """The vLLM plugin's override of row-parallel linears (it defers to vLLM's own forward unless
    the strict linear is on for the layer and the layer is split over ranks)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    return [(RowParallelLinear, "forward", _row_parallel_forward)]
