"""The KV cache of vLLM on the CPU, sized from the run instead of from the machine's RAM.

vLLM's CPU backend reserves ``gpu_memory_utilization`` of the node's RAM and fills what its model
leaves of it with KV cache, which it allocates and zeroes at start-up. The tool's share (0.3 of RAM)
is far more than a run of a small model needs: on a 24 GB machine ~7 GB zeroed per engine start,
~4 s of a tiny model's 23 s ``compare`` (2-core dev box, 2026-12-06). Where the user sets neither
``gpu_memory_utilization`` nor ``kv_cache_memory_bytes``, the sampler asks for
:func:`kv_cache_bytes`: every sequence vLLM may hold at once (``max_num_seqs``) at the full context,
rounded up to whole blocks of the largest CPU block size, with a margin, never more than the
RAM share it took before. No sequence is ever preempted for want of blocks (vLLM could not then
batch differently than with the larger cache), and vLLM skips its warm-up forward when the size
is explicit in eager mode (nothing compiled to warm). The KV cache's size changes no value vLLM
computes: attention reads the same cached keys and values whatever pool the blocks come from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CPU_MAX_NUM_SEQS = 256  # vLLM's default for the LLM class on the CPU (per rank; engine/arg_utils.py)
BLOCK = 256  # the largest KV block size of vLLM's CPU attention backends: each sequence rounds up to it
MARGIN = 1.25
FLOOR = 64 << 20

WHY = ("vLLM on the CPU zeroes its whole KV cache at start-up: sized for max_num_seqs sequences at the full "
       "context (whole blocks, x1.25 + 64 MiB) instead of 0.3 of RAM, never more than that share; "
       "--sampler-arg kv_cache_memory_bytes=N or gpu_memory_utilization=F overrides it")


def bytes_per_token(model_dir: Path, dtype: str) -> int | None:
    """Keys and values of one token over all layers, from the checkpoint's config (None: not a config
    this knows: the caller keeps vLLM's RAM share)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        c = cfg.get("text_config") or cfg
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if min(layers, heads, kv, head_dim) <= 0:
        return None
    elem = 4 if dtype in ("float32", "float") else 2
    return 2 * layers * kv * head_dim * elem


def kv_cache_bytes(model_dir: Path, dtype: str, max_model_len: int, max_num_seqs: int | None,
                   cap_bytes: int) -> int | None:
    """``kv_cache_memory_bytes`` for a run of contexts of ``max_model_len`` tokens, at most ``cap_bytes``
    (the RAM share vLLM would otherwise take); None where the config is not understood."""
    per = bytes_per_token(model_dir, dtype)
    if per is None:
        return None
    tokens = int(max_num_seqs or CPU_MAX_NUM_SEQS) * math.ceil(max_model_len / BLOCK) * BLOCK
    return int(min(cap_bytes, per * tokens * MARGIN + FLOOR))
