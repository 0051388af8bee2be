"""vLLM's memory on the CPU: the RAM share it may take, and its KV cache sized from the run.

vLLM's CPU backend reserves ``gpu_memory_utilization`` of the node's RAM and fills what its model
leaves of it with KV cache, which it allocates and zeroes at start-up. The tool's share
(:func:`ram_share`: 0.3 of RAM) is far more than a run of a small model needs: on a 24 GB machine
~7 GB zeroed per engine start, ~4 s of a tiny model's 24 s ``compare`` (2-core dev box, 2026-12-06).
Where the user sets neither ``gpu_memory_utilization`` nor ``kv_cache_memory_bytes`` (one process:
tensor-parallel ranks keep their per-rank share, probes/vllm/tp.py), the sampler asks for
:func:`kv_cache_bytes`: every sequence vLLM may hold at once (``max_num_seqs``) at the full context,
rounded up to whole blocks of the largest CPU block size, with a margin, never more than the RAM
share. No sequence is ever preempted for want of blocks (vLLM could not then batch differently than
with the larger cache), and vLLM skips its warm-up forward when the size is explicit in eager mode
(nothing compiled to warm). The KV cache's size changes no value vLLM computes: attention reads the
same cached keys and values whatever pool the blocks come from (a run's tables compared bit for bit
with both sizes, README).
"""

from __future__ import annotations

import math

from mismatch_probe.probes.models import ModelInfo

CPU_MAX_NUM_SEQS = 256  # vLLM's default for the LLM class on the CPU (per rank; engine/arg_utils.py)
BLOCK = 256  # the largest KV block size of vLLM's CPU attention backends: each sequence rounds up to it
MARGIN = 1.25
FLOOR = 64 << 20

SHARE_WHY = (
    "on CPU vLLM reserves this fraction of the NUMA node's RAM for its KV cache and refuses to start "
    "when less is free (its default 0.92 always fails): 0.3, or less when other processes hold memory; "
    "where the KV cache is sized from the run (kv_cache_memory_bytes), its upper bound"
)
WHY = ("vLLM on the CPU zeroes its whole KV cache at start-up: sized for max_num_seqs sequences at the full "
       "context (whole blocks, x1.25 + 64 MiB) instead of 0.3 of RAM, never more than that share; "
       "--sampler-arg kv_cache_memory_bytes=N or gpu_memory_utilization=F overrides it")


def ram_share() -> float:
    """0.3 of RAM, or 60% of what is free now if that is less (never below 0.02)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return round(max(0.02, min(0.3, 0.6 * vm.available / vm.total)), 3)
    except Exception:
        return 0.3


def bytes_per_token(model: ModelInfo, dtype: str) -> int | None:
    """Keys and values of one token over all layers (None: the config did not say: keep the RAM share)."""
    if model.kv_width <= 0 or model.num_layers <= 0:
        return None
    return 2 * model.num_layers * model.kv_width * (4 if dtype in ("float32", "float") else 2)


def kv_cache_bytes(model: ModelInfo, dtype: str, max_model_len: int, max_num_seqs: int | None,
                   share: float) -> int | None:
    """``kv_cache_memory_bytes`` for contexts of ``max_model_len`` tokens, at most ``share`` of RAM (the
    share vLLM would otherwise take); None where it cannot be sized (the share then applies)."""
    per = bytes_per_token(model, dtype)
    try:
        import psutil

        cap = int(share * psutil.virtual_memory().total)
    except Exception:
        return None
    if per is None:
        return None
    tokens = int(max_num_seqs or CPU_MAX_NUM_SEQS) * math.ceil(max_model_len / BLOCK) * BLOCK
    return int(min(cap, per * tokens * MARGIN + FLOOR))
