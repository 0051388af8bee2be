"""Recipe patches for model families beyond Llama/Qwen3, without vLLM: the HF patch on a Gemma 3
text model built here ((1 + w) norms, scaled embedding, GELU-tanh, per-layer rope bases, sliding
window) and the vLLM plugin's layer tagging of modules that several layers share.

Bitwise tests assert exact equality (``torch.equal``) and say so in their names.
"""

from __future__ import annotations

import torch


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
    shapes: list[tuple[int, ...]] = []  # what a capture hook on the q norm sees
    hook = model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, a, o: shapes.append(tuple(o.shape)))
    engine = _logprobs(model, seqs, strict=False)
    with patch(model, "strict") as h:  # (1 + w) norms: from the gemma3_text family spec
        attn = [model.model.layers[i].self_attn for i in (0, 1)]
        assert [a._mp_rope_base for a in attn] == [10_000.0, 1_000_000.0]
        assert any(n.endswith("mlp.act_fn") for n in h.patched) and "model.embed_tokens" in h.patched
        batch = _logprobs(model, seqs, strict=True)
        for i in (0, 3):
            assert torch.equal(_logprobs(model, [seqs[i]], strict=True)[0], batch[i])
    hook.remove()
    # the patched attention calls the q norm in HF Gemma's own layout [batch, heads, time, dim]
    assert len(set(shapes)) == 1 + 2 and {s[1] for s in shapes} == {4}, shapes  # the batch, then two sequences alone
    gap = max(float((a - b).abs().max()) for a, b in zip(batch, engine, strict=True))
    assert 0 < gap < 0.05, gap
    after = _logprobs(model, seqs, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(engine, after, strict=True))
    # the window matters: without it (a window as long as the sequences) the strict logprobs change
    wide = _gemma3(window=64)
    wide.load_state_dict(model.state_dict())
    with patch(wide, "strict"):
        assert not torch.equal(_logprobs(wide, [seqs[3]], strict=True)[0], batch[3])


def test_plugin_layer_subsets_follow_the_calling_layer_for_shared_modules() -> None:
    """vLLM shares one rotary embedding (and one GeluAndMul) between decoder layers: a layer
    subset (bisect's ablation) must switch such a module on only while those layers run."""
    from mismatch_probe.probes.vllm import plugin as vp

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


def test_plugin_linear_weight_is_an_alias_where_vllm_keeps_it_and_the_loaded_tensor_where_it_does_not() -> None:
    """The recipes' weight of a vLLM linear costs no copy: where the backend keeps its weight as
    loaded (CUDA vLLM's process_weights_after_loading does nothing) it is that tensor; where the
    backend replaces it (vLLM's CPU backend repacks it and leaves an empty parameter) it is the
    loaded tensor, with its values."""
    from mismatch_probe.kernels.recipes import parse
    from mismatch_probe.probes.vllm import plugin as vp

    def keep(self, layer):  # noqa: ANN001, ANN202
        return None

    def replace(self, layer):  # noqa: ANN001, ANN202
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)

    def copy_out(self, layer):  # noqa: ANN001, ANN202  (a backend that repacks into new storage of the same shape)
        layer.weight = torch.nn.Parameter(layer.weight.detach().t().contiguous().t() * 0, requires_grad=False)

    saved = dict(vp._STATE)
    try:
        vp._STATE["recipe"] = parse("strict")
        model = torch.nn.Sequential()
        for orig, alias in ((keep, True), (replace, False), (copy_out, False)):
            layer = torch.nn.Module()
            w = torch.randn(6, 4, dtype=torch.bfloat16)
            layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
            ptr = layer.weight.data_ptr()
            vp._linear_pwal(orig)(None, layer)
            assert layer._mp_weight.data_ptr() == ptr  # no copy either way
            assert torch.equal(layer._mp_weight, w)
            assert (layer.weight.data_ptr() == ptr) is alias
            model.append(layer)
        assert vp.recipe_weights(model) == {"aliased": 1, "own": 2, "own_bytes": 2 * 6 * 4 * 2}  # the manifest's record
        vp._STATE["recipe"] = None  # no recipe: nothing kept
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)
        vp._linear_pwal(keep)(None, layer)
        assert not hasattr(layer, "_mp_weight")
    finally:
        vp._STATE.clear()
        vp._STATE.update(saved)


def test_plugin_weights_changed_drops_every_nvfp4_state_cache() -> None:
    """vLLM's loaders write weights through ``param.data`` (no version bump): after such an update the
    plugin's ``weights_changed`` makes every NVFP4 linear quantize the new values."""
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.probes.vllm import plugin as vp

    model = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 32, bias=False))
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    w = model[0].weight.detach().to(torch.bfloat16)
    model[0]._mp_nvfp4 = st = NVFP4Linear("nvfp4-per-token")
    before = st(x, w)
    w.data.mul_(-1.0)  # as vLLM's weight loader writes
    assert torch.equal(st(x, w), before)  # the stale cache this guards against
    assert vp.weights_changed(model) == 1
    assert torch.equal(st(x, w), -before)


def test_padded_forward_builds_no_kv_cache_and_equals_the_cached_forward_bitwise(monkeypatch) -> None:  # noqa: ANN001
    """The learner's forward scores as RL learners do (``use_cache=False``): no KV cache is made, whatever
    the checkpoint's ``config.use_cache`` says, and the logits (engine and strict, sliding window
    included) are exactly those of HF's default forward, which copies every layer's keys into a cache."""
    import transformers

    from mismatch_probe.probes.hf.patch import patch
    from mismatch_probe.probes.hf.runner import padded_forward

    model = _gemma3(window=6)
    assert model.config.use_cache  # HF's default: the plain forward builds a cache
    made = []
    init = transformers.cache_utils.DynamicCache.__init__

    def counting(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        made.append(1)
        init(self, *a, **kw)

    monkeypatch.setattr(transformers.cache_utils.DynamicCache, "__init__", counting)
    g = torch.Generator().manual_seed(3)
    chunk = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (19, 7, 13)]
    for recipe in (None, "strict"):
        h = patch(model, recipe) if recipe else None
        try:
            with torch.inference_mode():
                made.clear()
                logits, ids = padded_forward(model, chunk, "cpu")
                assert made == []
                keep = torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in chunk])[:, None]
                cached = model(input_ids=ids, attention_mask=keep.long()).logits
                assert made  # the default forward did build one: the count can fail
                assert torch.equal(logits[keep], cached[keep])
        finally:
            if h is not None:
                h.undo()
