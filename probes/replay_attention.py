"""Replay of the attention core (``L.attn.core``) in each engine, on given q/k/v rows.

Inputs are the captured rows of ``L.attn.rope_q``, ``L.attn.rope_k`` and ``L.attn.v`` for whole
sequences (prefill rows, positions ``0..T-1`` of each sequence in order, sequences one after
another; ``pos`` says where each starts). Output: the attention output rows ``[tokens, Hq*D]``
(the input of ``o_proj``), causal, with the layer's sliding window where it has one.

* HF: the model's own attention function (``config._attn_implementation``: sdpa, eager, ...)
  with an explicit causal (and windowed) additive mask, one sequence at a time.
* vLLM: the layer's own attention backend implementation (``impl.do_kv_cache_update`` and
  ``impl.forward``) on a private paged KV cache and metadata built here for these sequences, all
  sequences in one call (a prefill step of the CPU backend). With the strict recipe's plugin
  active the same calls reach the strict attention.
"""

from __future__ import annotations

from typing import Any


def _spans(pos: Any) -> list[tuple[int, int]]:
    """(start, end) row ranges of the sequences: a sequence starts where ``pos`` is 0."""
    starts = [i for i, p in enumerate(pos.tolist()) if p == 0] + [int(pos.shape[0])]
    return [(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _window(module: Any) -> int | None:
    w = getattr(module, "sliding_window", None)
    if isinstance(w, tuple):  # some backends keep (left, right)
        w = w[0] + 1 if w[0] >= 0 else None
    return int(w) if w else None


def hf_attention(model: Any, layer: int, xs: list[Any], pos: Any) -> Any:
    import sys

    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    a = model.model.layers[layer].self_attn
    eager = sys.modules[type(a).__module__].eager_attention_forward
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, eager)
    q_all, k_all, v_all = xs
    d = a.head_dim
    win = _window(a)
    outs = []
    with torch.inference_mode():
        for s, e in _spans(pos):
            t = e - s
            q = q_all[s:e].reshape(t, -1, d).transpose(0, 1).unsqueeze(0)
            k = k_all[s:e].reshape(t, -1, d).transpose(0, 1).unsqueeze(0)
            v = v_all[s:e].reshape(t, -1, d).transpose(0, 1).unsqueeze(0)
            i = torch.arange(t, device=q.device)  # the mask on the rows' device (CUDA sdpa refuses a host mask)
            vis = i[None, :] <= i[:, None]
            if win:
                vis &= i[None, :] > i[:, None] - win
            mask = torch.zeros(1, 1, t, t, dtype=q.dtype, device=q.device).masked_fill(~vis, torch.finfo(q.dtype).min)
            out, _ = fn(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, sliding_window=getattr(a, "sliding_window", None))
            outs.append(out.reshape(t, -1))
    return torch.cat(outs)


def paged_layout(spans: list[tuple[int, int]], bs: int) -> tuple[Any, Any, int]:
    """A private paged KV layout for ``spans``: (block table ``[seqs, max blocks]`` int32, slot of
    each row int64, number of blocks); sequence i takes the next whole blocks of ``bs`` slots."""
    import torch

    n = spans[-1][1] if spans else 0
    nblk = [-(-(e - s) // bs) for s, e in spans]
    table = torch.zeros(len(spans), max(nblk, default=1), dtype=torch.int32)
    slots = torch.empty(n, dtype=torch.int64)
    first = 0
    for i, ((s, e), nb) in enumerate(zip(spans, nblk, strict=True)):
        table[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        p = torch.arange(e - s)
        slots[s:e] = table[i, p // bs].long() * bs + p % bs
        first += nb
    return table, slots, first


def vllm_attention(model: Any, layer: int, xs: list[Any], pos: Any) -> Any:
    """Run inside ``LLM.apply_model`` (CPU attention backend of vLLM 0.32; CUDA: FLASH_ATTN)."""
    import torch

    if xs[0].is_cuda:
        from mismatch_probe.probes.vllm.replay_cuda import flash_attention

        spans = _spans(pos)
        return flash_attention(model, layer, xs, spans, *paged_layout(spans, 16))
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    attn = model.model.layers[layer].self_attn.attn
    impl = attn.impl
    q_all, k_all, v_all = xs
    n = int(q_all.shape[0])
    hq, hkv, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list | tuple) else attn.kv_cache
    bs = int(cache.shape[2])
    spans = _spans(pos)
    lens = [e - s for s, e in spans]
    table, slots, first = paged_layout(spans, bs)
    kv = torch.zeros(first, hkv, bs, 2 * d, dtype=cache.dtype)
    q = q_all.reshape(n, hq, d).to(cache.dtype)
    k = k_all.reshape(n, hkv, d).to(cache.dtype)
    v = v_all.reshape(n, hkv, d).to(cache.dtype)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    win = impl.sliding_window
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(spans), num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq_lens, dtype=cache.dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1 if win is None else win, isa=attn.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=impl.kv_cache_dtype,
    )
    meta = CPUAttentionMetadata(num_actual_tokens=n, max_query_len=max(lens), query_start_loc=qsl, max_seq_len=max(lens),
                                seq_lens=seq_lens, block_table=table, slot_mapping=slots, scheduler_metadata=sched, causal=True)
    out = torch.empty(n, hq * d, dtype=cache.dtype)
    with torch.inference_mode():
        impl.do_kv_cache_update(attn, k, v, kv, slots)
        impl.forward(attn, q, k, v, kv, meta, out.view(n, hq, d))
    return out.clone()
