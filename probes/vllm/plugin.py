"""Sampler side: a vLLM plugin that installs a recipe's ops (the same
:mod:`mismatch_probe.kernels.strict.ops` and :mod:`mismatch_probe.kernels.nvfp4.linear` functions
the HF patch uses) into vLLM.

Registered through the ``vllm.general_plugins`` entry point (``pyproject.toml``): vLLM calls
:func:`register` in every engine process at start-up. The plugin does nothing unless a recipe is
active: :func:`activate` (called by ``VllmSampler`` before the engine starts; vLLM runs in-process
here, so this is process-global state, mirrored in ``$MISMATCH_PROBE_RECIPE`` for engine worker
processes) records the recipe and installs the overrides. They are class-level wrappers around
vLLM's own methods that defer to the original whenever the op class is not selected, so module
trees, names and hooks are unchanged; :func:`deactivate` puts the original methods back.

Overrides (vLLM 0.32; CPU and CUDA layers share them):
``RMSNorm.forward`` and ``GemmaRMSNorm.forward`` (norm, with the fused residual add; Gemma's
scales by ``1 + w``), ``SiluAndMul.forward`` and ``GeluAndMul.forward`` (act),
``RotaryEmbedding.forward`` (rope), ``UnquantizedLinearMethod.apply`` (linear: the strict GEMM or
the NVFP4 W4A4 linear: a process-wide patch of vLLM's class, not a registered quantization
config; the weight is kept at load time because the CPU backend repacks and drops it),
``UnquantizedEmbeddingMethod.apply/embedding`` (logits, embedding), ``MoERunner.forward`` (moe:
router through the patched gate, fixed-order experts),
``CPUAttentionBackendImpl.do_kv_cache_update/forward`` (attention on the CPU: our own paged KV
layout, prefill and decode from the cache, sliding windows included), ``FlashAttentionImpl.forward``
(attention on CUDA: the learner's strict Triton kernel over vLLM's paged KV cache; the sampler is
then held to the FLASH_ATTN backend), ``Sampler.compute_logprobs``
(logsoftmax).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mismatch_probe import settings
from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
from mismatch_probe.kernels.nvfp4.schemes import quantize_upstream
from mismatch_probe.kernels.recipes import OP_KINDS, Recipe, parse
from mismatch_probe.kernels.strict import ops as so

ENV = "MISMATCH_PROBE_RECIPE"
_STATE: dict[str, Any] = {"recipe": None, "ops": frozenset(), "layers": None}
_ORIG: dict[tuple[type, str], Any] = {}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def register() -> None:
    """Entry point (``vllm.general_plugins``): install the overrides if a recipe is requested."""
    if _STATE["recipe"] is None and settings.get(ENV):
        activate(settings.get(ENV))


def active() -> Recipe | None:
    return _STATE["recipe"]


def active_ops() -> frozenset[str]:
    return _STATE["ops"]


def activate(recipe: Recipe | str | None, ops: Iterable[str] | None = None, layers: Iterable[int] | None = None) -> None:
    """Make ``recipe`` (its ``ops`` subset, in ``layers``) what vLLM computes from now on. Call
    before the engine is built (the linear weights are kept at load time)."""
    r = parse(recipe) if isinstance(recipe, str) else recipe
    if r is None or r.is_engine:
        deactivate()
        return
    chosen = r.ops() if ops is None else frozenset(ops) & r.ops()
    _STATE.update(recipe=r, ops=chosen, layers=None if layers is None else frozenset(layers))
    settings.export(ENV, r.name)
    install()


def deactivate() -> None:
    _STATE.update(recipe=None, ops=frozenset(), layers=None)
    settings.export(ENV, None)
    uninstall()


def _on(op: str, module: Any = None) -> bool:
    if op not in _STATE["ops"]:
        return False
    layers = _STATE["layers"]
    if layers is None or module is None:
        return True
    idx = getattr(module, "_mp_layer", None)
    if idx == SHARED:  # one module serves several layers (vLLM's shared rotary, GeluAndMul)
        idx = _STATE.get("cur_layer")
    return idx is None or idx in layers


SHARED = -1  # ``_mp_layer`` of a module that several decoder layers call


def tag_modules(model: torch.nn.Module) -> int:
    """``LLM.apply_model`` helper: record each module's decoder-layer index (for ``layers=``).

    A module reached from several layers (vLLM shares one rotary embedding between layers, and one
    ``GeluAndMul`` instance) is tagged :data:`SHARED`: it then follows the layer being computed,
    which a pre-hook on every decoder layer records."""
    seen: dict[int, set[int]] = {}
    mods: dict[int, torch.nn.Module] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        m = _LAYER.search(name)
        if m:
            seen.setdefault(id(mod), set()).add(int(m.group(1)))
            mods[id(mod)] = mod
            if name.endswith(f"layers.{m.group(1)}") and not getattr(mod, "_mp_layer_hook", False):
                mod.register_forward_pre_hook(lambda _m, _a, i=int(m.group(1)): _STATE.__setitem__("cur_layer", i))
                mod._mp_layer_hook = True
    for key, idxs in seen.items():
        mod = mods[key]
        tag = next(iter(idxs)) if len(idxs) == 1 else SHARED
        mod._mp_layer = tag
        impl = getattr(mod, "impl", None)
        if impl is not None:
            impl._mp_layer = tag
    return len(seen)


# --- the overrides -------------------------------------------------------------------------


def _rmsnorm(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if not _on("norm", self) or self.variance_size_override is not None:
            return orig(self, x, residual) if residual is not None else orig(self, x)
        w = self.weight.data if self.has_weight else None
        if _fuse_quant(x):
            return _fused_norm(self, x, residual, w, False)
        if residual is None:
            return so.rmsnorm(x, w, self.variance_epsilon)
        return so.add_rmsnorm(x, residual, w, self.variance_epsilon)

    return forward


def _fuse_quant(x: torch.Tensor) -> bool:
    """A CUDA norm or act-and-mul under a per-token NVFP4 recipe with its linears on: :func:`norm_quant.rmsnorm`
    / :func:`act_quant.act_and_mul`, which also quantize the output for the linear that reads it (the same
    bits as the strict op)."""
    return x.is_cuda and quantize_upstream(_STATE["recipe"], _STATE["ops"])


def _fused_norm(module: Any, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor | None,
                unit_offset: bool) -> Any:
    from mismatch_probe.kernels.nvfp4 import norm_quant

    y, r = norm_quant.rmsnorm(module, x, residual, w, module.variance_epsilon, unit_offset)
    return y if residual is None else (y, r)


def _gemma_rmsnorm(orig: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``GemmaRMSNorm``: scale ``1 + w`` (the strict norm with ``unit_offset``)."""

    def forward(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if not _on("norm", self):
            return orig(self, x, residual) if residual is not None else orig(self, x)
        w = self.weight.data
        if _fuse_quant(x):
            return _fused_norm(self, x, residual, w, True)
        if residual is None:
            return so.rmsnorm(x, w, self.variance_epsilon, unit_offset=True)
        return so.add_rmsnorm(x, residual, w, self.variance_epsilon, unit_offset=True)

    return forward


def _act_mul(module: Any, x: torch.Tensor, kind: str) -> torch.Tensor:
    """The strict ``act(gate) * up`` of vLLM's fused ``[gate | up]`` rows; under a per-token NVFP4 recipe on
    CUDA :func:`act_quant.act_and_mul`, which also quantizes the product for the down projection."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if _fuse_quant(x):
        from mismatch_probe.kernels.nvfp4 import act_quant

        return act_quant.act_and_mul(module, gate, up, kind)
    return so.act_and_mul(gate, up, kind)


def _gelu_and_mul(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if not _on("act", self):
            return orig(self, x)
        return _act_mul(self, x, "gelu_tanh" if self.approximate == "tanh" else "gelu")

    return forward


def _silu_and_mul(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if not _on("act", self):
            return orig(self, x)
        return _act_mul(self, x, "silu")

    return forward


def _rope(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None) -> Any:
        if not _on("rope", self):
            return orig(self, positions, query, key)
        if not self.is_neox_style or self.rotary_dim != self.head_size or type(self).__name__ != "RotaryEmbedding":
            raise NotImplementedError("strict rope: neox-style, full rotary dim, default rope only")
        pos = positions.flatten()
        hd = self.head_size

        def rot(t: torch.Tensor) -> torch.Tensor:
            return so.rope(t.reshape(pos.shape[0], -1, hd), pos, float(self.base)).reshape(t.shape)

        return rot(query), None if key is None else rot(key)

    return forward


def nvfp4_state(layer: Any) -> NVFP4Linear | None:
    """The NVFP4 linear state the plugin attached to a vLLM linear module (None: not quantized)."""
    return getattr(layer, "_mp_nvfp4", None)


def nvfp4_kernels(model: torch.nn.Module) -> dict[str, Any] | None:
    """Per NVFP4 linear of vLLM's ``model``: which GEMM path computed it and how often (eager calls,
    and each CUDA graph capture once), the last kernel's config; None where nothing is quantized."""
    out = {name: st.kernel_summary() for name, mod in model.named_modules() if (st := nvfp4_state(mod)) is not None}
    return out or None


def recipe_weights(model: torch.nn.Module) -> dict[str, int] | None:
    """What the recipes' linear weights cost in vLLM's ``model`` (for the manifest): how many are vLLM's
    own weight (an alias: CUDA, where vLLM keeps its weight as loaded) and how many, of how many bytes,
    are a tensor vLLM let go of (its CPU backend repacks and drops its own). None: no recipe weights."""
    aliased = own = own_bytes = 0
    for mod in model.modules():
        w = getattr(mod, "_mp_weight", None)
        if w is None:
            continue
        kept = getattr(mod, "weight", None)
        if isinstance(kept, torch.Tensor) and kept.numel() and kept.data_ptr() == w.data_ptr():
            aliased += 1
        else:
            own += 1
            own_bytes += w.numel() * w.element_size()
    return {"aliased": aliased, "own": own, "own_bytes": own_bytes} if aliased + own else None


def weights_changed(model: torch.nn.Module) -> int:
    """After vLLM's weights were updated in place (an RL weight sync into its parameters): drop every
    NVFP4 linear's quantized weights, so the next call quantizes the new values. Their cache keys on the
    weight's address and version counter, which vLLM's loaders (writes through ``param.data``) do not
    move. Returns how many states were dropped."""
    n = 0
    for mod in model.modules():
        st = nvfp4_state(mod)
        if st is not None:
            st.invalidate()
            n += 1
    return n


def _nvfp4_state(layer: Any, scheme: str) -> NVFP4Linear:
    st = getattr(layer, "_mp_nvfp4", None)
    if st is None or st.scheme.name != scheme:
        st = NVFP4Linear(scheme, getattr(layer, "output_sizes", None))
        layer._mp_nvfp4 = st
    return st


def _linear_apply(orig: Callable[..., Any]) -> Callable[..., Any]:
    def apply(self: Any, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        is_router = type(layer).__name__ == "GateLinear"
        w = getattr(layer, "_mp_weight", None)
        if w is None or not _on("moe" if is_router else "linear", layer):
            return orig(self, layer, x, bias)
        r: Recipe = _STATE["recipe"]
        if r.nvfp4 and not is_router:
            return _nvfp4_state(layer, r.linear)(x, w, bias)
        return so.linear(x, w, bias)

    return apply


def _same_tensor(a: Any, b: Any) -> bool:
    """``b`` is ``a`` as it was (same storage, layout and dtype), not a replacement."""
    return (isinstance(b, torch.Tensor) and b.data_ptr() == a.data_ptr() and b.shape == a.shape
            and b.stride() == a.stride() and b.dtype == a.dtype and b.device == a.device)


def _linear_pwal(orig: Callable[..., Any]) -> Callable[..., Any]:
    """The recipes' weight of a linear: vLLM's own weight where its backend keeps it as loaded (CUDA:
    an alias, no copy), else the loaded tensor vLLM let go of (the CPU backend repacks it for oneDNN
    and replaces ``layer.weight`` by an empty one; it never writes into the loaded tensor)."""

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        w = getattr(layer, "weight", None)
        if _STATE["recipe"] is None or w is None or w.ndim != 2:
            return orig(self, layer)
        loaded = w.detach()  # a reference, not a copy
        out = orig(self, layer)
        kept = getattr(layer, "weight", None)
        layer._mp_weight = kept.detach() if _same_tensor(loaded, kept) else loaded
        return out

    return process_weights_after_loading


def _embedding_apply(orig: Callable[..., Any]) -> Callable[..., Any]:
    def apply(self: Any, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not _on("logits", layer):
            return orig(self, layer, x, bias)
        return so.linear(x, layer.weight, bias)

    return apply


def _embedding_lookup(orig: Callable[..., Any]) -> Callable[..., Any]:
    def embedding(self: Any, layer: Any, input_: torch.Tensor) -> torch.Tensor:
        if not _on("embedding", layer):
            return orig(self, layer, input_)
        return so.embedding(input_, layer.weight)

    return embedding


def _moe_forward(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _on("moe", self) or self.gate is None or getattr(self, "_shared_experts", None) is not None:
            return orig(self, hidden_states, router_logits, *args, **kwargs)
        logits, _ = self.gate(hidden_states)
        ex = self.routed_experts
        w, ids = so.moe_route(logits, ex.top_k, ex.renormalize)
        r: Recipe = _STATE["recipe"]
        fn = None
        if r.nvfp4:
            st = _nvfp4_state(self, r.linear)
            fn = lambda x, wt, key: st(x, wt, key=key)  # noqa: E731
        w13 = getattr(ex, "_mp_w13", ex.w13_weight)
        w2 = getattr(ex, "_mp_w2", ex.w2_weight)
        return so.moe_experts(hidden_states, w, ids, w13, w2, fn)

    return forward


def _moe_pwal(orig: Callable[..., Any]) -> Callable[..., Any]:
    def process_weights_after_loading(self: Any, layer: Any) -> None:
        if _STATE["recipe"] is not None and hasattr(layer, "w13_weight"):
            layer._mp_w13 = layer.w13_weight.detach().clone()
            layer._mp_w2 = layer.w2_weight.detach().clone()
        return orig(self, layer)

    return process_weights_after_loading


def _kv_update(orig: Callable[..., Any]) -> Callable[..., Any]:
    def do_kv_cache_update(self: Any, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if not _on("attention", self):
            return orig(self, layer, key, value, kv_cache, slot_mapping)
        kc, vc = _split_cache(kv_cache)
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        ok = slots >= 0
        bs = kc.shape[2]
        blk, off = slots[ok] // bs, slots[ok] % bs
        kc[blk, :, off, :] = key[:n][ok].to(kc.dtype)
        vc[blk, :, off, :] = value[:n][ok].to(vc.dtype)

    return do_kv_cache_update


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nb, nkv, bs, _ = kv_cache.shape
    k, v = kv_cache.view(nb, nkv, bs * 2, -1).chunk(2, dim=2)
    return k, v


def _attn_forward(orig: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if attn_metadata is None or not _on("attention", self):
            return orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.alibi_slopes is not None or self.logits_soft_cap:
            raise NotImplementedError("strict attention: no ALiBi or soft cap")
        window = None if self.sliding_window in (-1, None) else int(self.sliding_window)
        kc, vc = _split_cache(kv_cache)
        bs = kc.shape[2]
        n = attn_metadata.num_actual_tokens
        q = query[:n].reshape(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        qsl = attn_metadata.query_start_loc.tolist()
        lens = attn_metadata.seq_lens.tolist()
        for i, seq_len in enumerate(lens):
            a, b = qsl[i], qsl[i + 1]
            if b <= a:
                continue
            nblk = -(-seq_len // bs)
            blocks = attn_metadata.block_table[i, :nblk].long()
            kk = kc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, kc.shape[1], -1)[:seq_len]
            vv = vc[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, vc.shape[1], -1)[:seq_len]
            qpos = torch.arange(seq_len - (b - a), seq_len)
            if window is not None and seq_len - (b - a) - window + 1 > 0:
                # keys no query of this chunk can see: their blocks may be freed (sliding-window KV
                # groups), so zero them; they add exact zeros either way
                lo = seq_len - (b - a) - window + 1
                kk, vv = kk.clone(), vv.clone()
                kk[:lo], vv[:lo] = 0, 0
            out[a:b] = so.attention(q[a:b], kk, vv, qpos, self.scale, window)
        return output

    return forward


def _flash_attn_forward(orig: Callable[..., Any]) -> Callable[..., Any]:
    """CUDA (vLLM's FLASH_ATTN backend): the strict attention kernel over vLLM's own paged KV cache.

    vLLM still writes the cache (``do_kv_cache_update``: an exact copy of bf16 keys and values); the
    attention itself is :func:`mismatch_probe.kernels.strict.triton_ops.paged_attention`, the kernel
    the learner's strict attention runs, reading the pages through the block table. No host sync,
    so it runs inside vLLM's CUDA graphs too."""

    def forward(self: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if attn_metadata is None or not _on("attention", self):
            return orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.alibi_slopes is not None or self.logits_soft_cap or getattr(self, "sinks", None) is not None:
            raise NotImplementedError("strict attention: no ALiBi, soft cap or attention sinks")
        if getattr(self, "dcp_world_size", 1) > 1 or str(getattr(self, "kv_cache_dtype", "auto")) != "auto":
            raise NotImplementedError("strict attention: no decode context parallelism, no quantized KV cache")
        from mismatch_probe.kernels.strict import triton_ops as st

        sw = getattr(attn_metadata, "sliding_window", None) or self.sliding_window
        window = None if sw is None or sw[0] < 0 else int(sw[0]) + 1
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)  # [blocks, page, Hkv, D]
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        st.paged_attention(q, key_cache, value_cache, out, attn_metadata.query_start_loc, attn_metadata.seq_lens,
                           attn_metadata.block_table, attn_metadata.max_query_len, self.scale, window,
                           meta=step_meta(self, attn_metadata, n))
        return output

    return forward


_STEP_META: dict[str, Any] = {}


def step_meta(layer: Any, md: Any, n: int) -> Any:
    """:func:`triton_ops.paged_meta` of a step's attention metadata, computed at its first layer and
    reused by the others (vLLM hands every layer of a KV-cache group the same metadata object): ~8 small
    launches per layer less. Recomputed when ``layer`` (the attention that asks) is the one that computed
    it (so a new forward, a CUDA-graph capture included, starts afresh), or when the object, its tensors'
    contents (their version counters move on any in-place write) or the token count differ; the entry
    keeps the object alive, so its id cannot be reused while cached."""
    from mismatch_probe.kernels.strict import triton_ops as st

    qsl, sl, bt = md.query_start_loc, md.seq_lens, md.block_table
    key = (n, *(_version(t) for t in (qsl, sl, bt)), qsl.data_ptr(), sl.data_ptr(), bt.data_ptr())
    e = _STEP_META
    if e.get("owner") is layer or e.get("md") is not md or e.get("key") != key:
        e.update(owner=layer, md=md, key=key, meta=st.paged_meta(qsl, sl, bt, n))
    return _STEP_META["meta"]


def _version(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for an inference-mode tensor, which has none (the rule that the
    computing layer's next call recomputes still holds for those)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _compute_logprobs(orig: Callable[..., Any]) -> Callable[..., Any]:
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        if not _on("logsoftmax"):
            return orig(logits)
        return so.log_softmax_fp32(logits)  # vLLM passes the raw logits (model dtype), as the learner's

    return staticmethod(compute_logprobs)


def _v2_token_logprobs(orig: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's model runner V2 (CUDA; the default for dense models in vLLM 0.26) computes sampled,
    top-K and prompt logprobs with its own Triton kernel, not ``Sampler.compute_logprobs``: the
    strict log-softmax there, gathered as the learner gathers (``logit - max - log(sum)``)."""

    def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if not _on("logsoftmax") or not logits.is_cuda:
            return orig(logits, token_ids)
        from mismatch_probe.kernels.strict import triton_ops as st

        mx, lz = st.max_logz_rows(logits)  # raw logits in the model's dtype, as the learner's
        return (logits.gather(-1, token_ids.to(torch.int64)).float() - mx[:, None]) - lz[:, None]

    return compute_token_logprobs


def _targets() -> list[tuple[type, str, Callable[..., Any]]]:
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.sample.sampler import Sampler

    t: list[tuple[type, str, Callable[..., Any]]] = [
        (RMSNorm, "forward", _rmsnorm),
        (GemmaRMSNorm, "forward", _gemma_rmsnorm),
        (SiluAndMul, "forward", _silu_and_mul),
        (GeluAndMul, "forward", _gelu_and_mul),
        (RotaryEmbedding, "forward", _rope),
        (UnquantizedLinearMethod, "apply", _linear_apply),
        (UnquantizedLinearMethod, "process_weights_after_loading", _linear_pwal),
        (UnquantizedEmbeddingMethod, "apply", _embedding_apply),
        (UnquantizedEmbeddingMethod, "embedding", _embedding_lookup),
        (MoERunner, "forward", _moe_forward),
        (UnquantizedFusedMoEMethod, "process_weights_after_loading", _moe_pwal),
    ]
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        t += [(CPUAttentionBackendImpl, "do_kv_cache_update", _kv_update), (CPUAttentionBackendImpl, "forward", _attn_forward)]
    except ImportError:  # a CUDA build: vLLM's FLASH_ATTN backend instead (below)
        pass
    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

        t.append((FlashAttentionImpl, "forward", _flash_attn_forward))
    except ImportError:  # no CUDA build of vLLM (the CPU wheel has no flash_attn backend)
        pass
    t.append((Sampler, "compute_logprobs", _compute_logprobs))
    try:  # CUDA builds: the model runner V2's logprob kernel (a module function, looked up at each call)
        import vllm.v1.worker.gpu.sample.logprob as v2_logprob

        t.append((v2_logprob, "compute_token_logprobs", _v2_token_logprobs))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - the CPU wheel may lack it or its Triton backend
        pass
    t += row_parallel_targets()  # row-parallel linears under tensor parallelism (kernels/strict/tp.py)
    return t


def install() -> None:
    """Install the wrappers (idempotent). They defer to vLLM's methods for unselected ops."""
    for cls, attr, make in _targets():
        if (cls, attr) in _ORIG:
            continue
        raw = cls.__dict__.get(attr)
        _ORIG[(cls, attr)] = raw
        orig = raw.__func__ if isinstance(raw, staticmethod) else getattr(cls, attr)
        setattr(cls, attr, make(orig))


def uninstall() -> None:
    """Put vLLM's original methods back, exactly (class attributes restored or removed)."""
    _STEP_META.clear()
    for (cls, attr), raw in list(_ORIG.items()):
        if raw is None:
            delattr(cls, attr)
        else:
            setattr(cls, attr, raw)
        del _ORIG[(cls, attr)]


def installed() -> list[str]:
    return [f"{cls.__module__}.{cls.__qualname__}.{attr}" if isinstance(cls, type) else f"{cls.__name__}.{attr}"
            for cls, attr in _ORIG]


__all__ = [
    "ENV", "OP_KINDS", "activate", "active", "active_ops", "deactivate", "install", "installed", "register", "tag_modules",
    "recipe_weights", "uninstall", "weights_changed",
]


# ---- strict row-parallel linears (the sampler's side of kernels/strict/tp.py) ---------------


def _row_parallel_forward(orig: Any) -> Any:
    def forward(self: Any, input_: Any) -> Any:
        from mismatch_probe.kernels.strict import tp as stp

        r = active()
        w = getattr(self, "_mp_weight", None)
        strict_here = r is not None and not r.nvfp4 and w is not None and _on("linear", self)
        if self.tp_size <= 1 or not strict_here or not self.reduce_results:
            return orig(self, input_)
        from vllm.distributed import tensor_model_parallel_all_gather

        x = input_ if self.input_is_parallel else input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        part = stp.partial(x, w).unsqueeze(0).contiguous()
        parts = tensor_model_parallel_all_gather(part, dim=0)  # [ranks, ...], rank order
        out = stp.combine(parts, None if self.skip_bias_add else self.bias, x.dtype)
        if not self.return_bias:
            return out
        return out, (self.bias if self.skip_bias_add else None)

    return forward


def row_parallel_targets() -> list[tuple[type, str, Any]]:
    """The vLLM plugin's override of row-parallel linears: vLLM's own forward unless the strict
    linear is on for the layer and the layer is split over ranks."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    return [(RowParallelLinear, "forward", _row_parallel_forward)]
