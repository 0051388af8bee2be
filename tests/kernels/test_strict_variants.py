"""Strict op variants that model families beyond Llama/Qwen3 need (Gemma 3, Qwen2): (1 + w) RMSNorm,
GELU (tanh and erf) and-mul, sliding-window attention, a scaled embedding, a biased linear.

Bitwise tests assert exact equality (``torch.equal``) and say so in their names; "close" tests
compare with the HF/torch implementations of the same functions.
"""

from __future__ import annotations

import pytest
import torch

from mismatch_probe.kernels.strict import ops as so


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _within_one_ulp(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0) -> bool:
    """Every element within one bf16 unit in the last place (2^-7 relative) of the other, or atol."""
    af, bf = a.float(), b.float()
    return bool(((af - bf).abs() <= 2**-7 * torch.maximum(af.abs(), bf.abs()) + atol).all())


def test_unit_offset_rmsnorm_close_to_hf_gemma_norm_and_bitwise_rows_independent_of_batch() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x = _bf16(40, 128, seed=0, scale=3.0)
    hf = Gemma3RMSNorm(128, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(_bf16(128, seed=1, scale=0.2).float())
    w = hf.weight.detach().to(torch.bfloat16)
    hf = hf.to(torch.bfloat16)
    ours = so.rmsnorm(x, w, 1e-6, unit_offset=True)
    with torch.no_grad():
        ref = hf(x)
    assert ours.dtype == torch.bfloat16
    assert _within_one_ulp(ours, ref)  # same rounding order as HF, only the sum of squares' order differs
    assert not torch.equal(ours, so.rmsnorm(x, w, 1e-6))  # (1 + w), not w
    for i in (0, 13, 39):
        assert torch.equal(so.rmsnorm(x[i : i + 1], w, 1e-6, unit_offset=True), ours[i : i + 1])
    # fused add: the residual is the bf16 sum, normalized as the HF decoder does (add, then norm)
    r = _bf16(40, 128, seed=2)
    normed, resid = so.add_rmsnorm(x, r, w, 1e-6, unit_offset=True)
    assert torch.equal(resid, x + r)
    assert torch.equal(normed, so.rmsnorm(x + r, w, 1e-6, unit_offset=True))


@pytest.mark.parametrize(("act", "approximate"), [("gelu_tanh", "tanh"), ("gelu", "none")])
def test_gelu_and_mul_close_to_torch_and_bitwise_independent_of_batch(act: str, approximate: str) -> None:
    g, u = _bf16(33, 256, seed=3, scale=2.0), _bf16(33, 256, seed=4)
    ours = so.act_and_mul(g, u, act)
    ref = (torch.nn.functional.gelu(g, approximate=approximate) * u)  # HF's MLP: two bf16 roundings
    assert (ours.float() - ref.float()).abs().max() <= 2 * ref.float().abs().max() * 2**-8
    # torch's 1 + erf / tanh cancels differently in the far negative tail (|gelu| < 2e-5 there)
    assert _within_one_ulp(so.ACTIVATIONS[act](g), torch.nn.functional.gelu(g, approximate=approximate), atol=2e-5)
    for i in (0, 7, 32):
        assert torch.equal(so.act_and_mul(g[i : i + 1], u[i : i + 1], act), ours[i : i + 1])
    assert torch.equal(so.act_and_mul(g, u), so.silu_and_mul(g, u))  # the default is SiLU


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """fp64 softmax attention with HF's sliding-window mask (key j visible iff q - W < j <= q)."""
    t, hq, _ = q.shape
    rep = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    i, j = torch.arange(t)[:, None], torch.arange(k.shape[0])[None, :]
    vis = j <= i if window is None else (j <= i) & (j > i - window)
    s = s.masked_fill(~vis, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


def test_sliding_window_attention_close_to_reference_and_bitwise_prefill_equals_decode() -> None:
    t, w = 21, 6
    q, k, v = _bf16(t, 4, 32, seed=5), _bf16(t, 2, 32, seed=6), _bf16(t, 2, 32, seed=7)
    pos = torch.arange(t)
    full = so.attention(q, k, v, pos, 32**-0.5, window=w)
    ref = _reference_attention(q, k, v, 32**-0.5, w)
    assert (full.double() - ref).abs().max() < 2e-2
    assert not torch.equal(full, so.attention(q, k, v, pos, 32**-0.5))  # the window clips
    # decode: one query over the keys so far (a vLLM decode step), and a chunk of queries
    for p in (0, 5, 6, 13, 20):
        one = so.attention(q[p : p + 1], k[: p + 1], v[: p + 1], pos[p : p + 1], 32**-0.5, window=w)
        assert torch.equal(one, full[p : p + 1])
    chunk = so.attention(q[9:15], k[:15], v[:15], pos[9:15], 32**-0.5, window=w)
    assert torch.equal(chunk, full[9:15])
    # keys outside every query's window do not matter, bit for bit (vLLM may free their blocks)
    k2, v2 = k.clone(), v.clone()
    k2[:3], v2[:3] = 0, 0
    late = so.attention(q[10:], k2, v2, pos[10:], 32**-0.5, window=w)
    assert torch.equal(late, full[10:])
    # a window at least as long as the sequence is no window
    assert torch.equal(so.attention(q, k, v, pos, 32**-0.5, window=t), so.attention(q, k, v, pos, 32**-0.5))


def test_scaled_embedding_bitwise_equals_hf_gemma_scaled_embedding() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    emb = Gemma3TextScaledWordEmbedding(64, 128, padding_idx=0, embed_scale=128**0.5).to(torch.bfloat16)
    with torch.no_grad():
        emb.weight.copy_(_bf16(64, 128, seed=8))
    emb.embed_scale = torch.tensor(128**0.5)  # a float32 buffer, as from_pretrained leaves it
    ids = torch.tensor([[3, 9, 63, 0], [1, 2, 3, 4]])
    with torch.no_grad():
        ref = emb(ids)
    assert torch.equal(so.embedding(ids, emb.weight, emb.embed_scale), ref)
    assert not torch.equal(so.embedding(ids, emb.weight), ref)


def test_biased_linear_bitwise_rows_independent_of_batch_and_fused_equals_split() -> None:
    """Qwen2's q/k/v projections carry a bias; vLLM applies the fused qkv bias in one call."""
    x, w, b = _bf16(30, 128, seed=9), _bf16(96, 128, seed=10), _bf16(96, seed=11)
    full = so.linear(x, w, b)
    for i in (0, 29):
        assert torch.equal(so.linear(x[i : i + 1], w, b), full[i : i + 1])
    split = torch.cat([so.linear(x, w[:64], b[:64]), so.linear(x, w[64:], b[64:])], -1)
    assert torch.equal(split, full)
    assert (full.float() - torch.nn.functional.linear(x.float(), w.float(), b.float())).abs().max() < 0.1

