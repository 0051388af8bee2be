"""Replay of the attention core in CUDA vLLM: the layer's FLASH_ATTN implementation
(``impl.do_kv_cache_update`` and ``impl.forward``) on a private paged KV cache and metadata built
for the given sequences (one prefill step, all sequences in one call). With the strict recipe's
plugin active the same calls reach the strict kernel (:mod:`mismatch_probe.probes.vllm.plugin`)."""

from __future__ import annotations

from typing import Any


def flash_attention(model: Any, layer: int, xs: list[Any], spans: list[tuple[int, int]], table: Any, slots: Any,
                    n_blocks: int) -> Any:
    """``xs = [q, k, v]`` rows ``[tokens, H*D]`` on the GPU; ``spans`` each sequence's row range;
    ``table``, ``slots``, ``n_blocks``: a paged layout of 16-slot blocks for them (host tensors)."""
    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata

    attn = model.model.layers[layer].self_attn.attn
    impl = attn.impl
    if not isinstance(impl, FlashAttentionImpl):
        raise NotImplementedError(f"attention replay on CUDA needs vLLM's FLASH_ATTN backend, not {type(impl).__name__}")
    q_all, k_all, v_all = xs
    dev = q_all.device
    n = int(q_all.shape[0])
    hq, hkv, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    bs = 16
    lens = [e - s for s, e in spans]
    dtype = torch.bfloat16 if q_all.dtype not in (torch.float16, torch.bfloat16) else q_all.dtype
    # physical NHD layout (blocks, page, Hkv, 2D), seen as vLLM's logical (blocks, Hkv, page, 2D)
    kv = torch.zeros(n_blocks, bs, hkv, 2 * d, dtype=dtype, device=dev).permute(0, 2, 1, 3)
    q = q_all.reshape(n, hq, d).to(dtype)
    k = k_all.reshape(n, hkv, d).to(dtype)
    v = v_all.reshape(n, hkv, d).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    meta = FlashAttentionMetadata(
        num_actual_tokens=n, max_query_len=max(lens), query_start_loc=qsl, max_seq_len=max(lens),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_table=table.to(dev),
        slot_mapping=slots.to(dev), use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
        prefix_kv_lens=None, suffix_kv_lens=None,
    )
    out = torch.empty(n, hq * d, dtype=dtype, device=dev)
    with torch.inference_mode():
        impl.do_kv_cache_update(attn, k, v, kv, meta.slot_mapping)
        impl.forward(attn, q, k, v, kv, meta, out.view(n, hq, d))
    return out.clone()
