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


# --- the HF patch on a Gemma 3 text model built here (no family wiring needed) --------------


def _gemma3(window: int = 6) -> torch.nn.Module:
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    )
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF initializes Gemma's norm weights to 0 (scale 1 + 0): make them matter
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.to(torch.bfloat16).eval()


def _logprobs(model: torch.nn.Module, batch: list[list[int]], strict: bool) -> list[torch.Tensor]:
    from mismatch_probe.probes.hf.patch import token_logprobs_fn

    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(batch):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.inference_mode():
        lp = token_logprobs_fn("strict" if strict else None)(model(input_ids=ids, attention_mask=mask).logits, ids)
    return [lp[i, : len(s) - 1].clone() for i, s in enumerate(batch)]


def test_hf_patch_gemma3_strict_bitwise_alone_equals_batch_close_to_engine_and_undoes() -> None:
    """(1 + w) norms, the scaled embedding, GELU-tanh, per-layer rope bases and the sliding window
    all go through the strict patch: a sequence alone == in a padded batch (bitwise), the strict
    logprobs are close to HF's own (so no scale or offset is lost), and undo restores HF exactly."""
    from mismatch_probe.probes.hf.patch import patch

    model = _gemma3(window=6)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 11, 27)]  # longer than the window
    engine = _logprobs(model, seqs, strict=False)
    with patch(model, "strict", norm_unit_offset=True) as h:
        attn = [model.model.layers[i].self_attn for i in (0, 1)]
        assert [a._mp_rope_base for a in attn] == [10_000.0, 1_000_000.0]
        assert any(n.endswith("mlp.act_fn") for n in h.patched) and "model.embed_tokens" in h.patched
        batch = _logprobs(model, seqs, strict=True)
        for i in (0, 3):
            assert torch.equal(_logprobs(model, [seqs[i]], strict=True)[0], batch[i])
    gap = max(float((a - b).abs().max()) for a, b in zip(batch, engine, strict=True))
    assert 0 < gap < 0.05, gap
    after = _logprobs(model, seqs, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(engine, after, strict=True))
    # the window matters: without it (a window as long as the sequences) the strict logprobs change
    wide = _gemma3(window=64)
    wide.load_state_dict(model.state_dict())
    with patch(wide, "strict", norm_unit_offset=True):
        assert not torch.equal(_logprobs(wide, [seqs[3]], strict=True)[0], batch[3])


def test_plugin_layer_subsets_follow_the_calling_layer_for_shared_modules() -> None:
    """vLLM shares one rotary embedding (and one GeluAndMul) between decoder layers: a layer
    subset (bisect's ablation) must switch such a module on only while those layers run."""
    from mismatch_probe.kernels import vllm_plugin as vp

    calls: list[bool] = []

    class Shared(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(vp._on("rope", self))
            return x

    class Layer(torch.nn.Module):
        def __init__(self, shared: torch.nn.Module) -> None:
            super().__init__()
            self.rotary_emb, self.own = shared, torch.nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rotary_emb(self.own(x))

    shared = Shared()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer(shared) for _ in range(3)])
    vp.tag_modules(model)
    assert shared._mp_layer == vp.SHARED and model.layers[2].own._mp_layer == 2
    saved = dict(vp._STATE)
    try:
        vp._STATE.update(ops=frozenset({"rope"}), layers=frozenset({1}))
        x = torch.zeros(1)
        for layer in model.layers:
            layer(x)
        assert calls == [False, True, False]
    finally:
        vp._STATE.clear()
        vp._STATE.update(saved)
