"""MoE plumbing of the NVFP4 GEMM: expert weights, routing, the device-side tile schedule, combine.

The grouped GEMM itself is :func:`tc_linear.tc_grouped` (production; one launch for all experts,
each row equal to a per-expert :func:`tc_linear.tc_matmul` call); the exact per-16-block grouped
kernel kept as a cross-check is :func:`reference.grouped.grouped_w4a4`. Every step has a fixed order,
independent of the batch:

1. :func:`moe_route`: flatten the (token, slot) pairs ``t * top_k + k``, stable-sort them by expert
   id, so each expert's rows are contiguous and ordered by (token, slot); ``offsets[e]`` is where
   expert e's rows start.
2. per-token NVFP4 activations (quantize once per token, :func:`gather_rows` the quantized rows).
3. the grouped GEMM over :func:`tile_schedule` (tile -> expert, row range, built on the device).
4. :func:`moe_combine`: ``out[t] = sum_k w[t, k] * y[t, k]`` in slot order k = 0..top_k-1, fp32,
   one rounded multiply and one rounded add per step, then cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mismatch_probe.kernels.launch_math import cdiv

from .ref import NVFP4Tensor, nvfp4_quantize_ref
from .triton_quant import nvfp4_quantize


@dataclass
class GroupedNVFP4Weights:
    """Per-expert NVFP4 weights: codes [E, N, K/2], scales [E, N, K/16] (uint8), amax [E] fp32
    (per-tensor per expert)."""

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor

    def expert(self, e: int) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes[e], self.scales[e], self.amax[e : e + 1], False, False)


def quantize_expert_weights(w: torch.Tensor, *, tile16: bool = False, use_ref: bool = False) -> GroupedNVFP4Weights:
    """Quantize [E, N, K] expert weights, one per-tensor global scale per expert."""
    if w.dim() != 3:
        raise ValueError(f"expert weights must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    fn = nvfp4_quantize_ref if use_ref else nvfp4_quantize
    qs = [fn(w[e].contiguous(), tile16=tile16) for e in range(w.shape[0])]
    return GroupedNVFP4Weights(
        torch.stack([q.codes for q in qs]), torch.stack([q.scales for q in qs]), torch.cat([q.amax for q in qs])
    )


def moe_route(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, offsets): ``perm[r]`` = flat (token, slot) index of grouped row r (stable sort by
    expert), ``offsets`` [E+1] int64 row starts. No host synchronisation."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    flat = topk_ids.reshape(-1).long()
    perm = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return perm, offsets


def tile_schedule(offsets: torch.Tensor, bm: int, max_rows: int) -> tuple[torch.Tensor, ...]:
    """Device-side tile table: for tile t, (expert or -1, first row, row end). Sized by the upper
    bound ``ceil(rows/bm) + E`` so no host sync is needed."""
    e_count = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + bm - 1) // bm
    cum = torch.cumsum(tiles, 0)
    n_tiles = cdiv(max_rows, bm) + e_count
    t = torch.arange(n_tiles, device=offsets.device)
    e = torch.searchsorted(cum, t, right=True)
    valid = e < e_count
    ec = e.clamp(max=e_count - 1)
    first_tile = cum[ec] - tiles[ec]
    r0 = offsets[ec] + (t - first_tile) * bm
    r1 = offsets[ec + 1]
    return (
        torch.where(valid, ec, torch.full_like(ec, -1)).to(torch.int32).contiguous(),
        r0.to(torch.int32).contiguous(),
        r1.to(torch.int32).contiguous(),
    )


def gather_rows(q: NVFP4Tensor, rows: torch.Tensor) -> NVFP4Tensor:
    """Rows ``rows`` of a per-token NVFP4 tensor (codes, scales and amax gathered together)."""
    return NVFP4Tensor(q.codes[rows].contiguous(), q.scales[rows].contiguous(), q.amax[rows].contiguous(), True, False)


def moe_combine(y: torch.Tensor, perm: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * y[row(t,k)]`` in slot order, fp32 (separate rounded mul and add)."""
    t, top_k = topk_weights.shape
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    yk = y[inv].reshape(t, top_k, -1).float()
    wf = topk_weights.float()
    acc = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(top_k):
        prod = wf[:, j : j + 1] * yk[:, j]
        acc = acc + prod
    return acc.to(out_dtype)
