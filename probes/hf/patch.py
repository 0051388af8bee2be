"""Learner side: put a recipe's ops into an HF transformers model, in place and undoable.

``patch(model, recipe, ops=None, layers=None)`` replaces the ``forward`` of the chosen modules
(instance attributes, so the module tree, names and hooks stay as they are; FSDP2's
``fully_shard`` hooks still gather parameters before each forward) and returns a handle whose
``undo()`` (or the end of its ``with`` block) restores every module exactly: the model then
computes bit for bit what it computed before.

``ops`` picks op classes (:data:`recipes.OP_KINDS`), ``layers`` picks decoder layers (modules
outside the decoder layers, e.g. the embedding, the final norm and the LM head, follow ``ops``
only): ``bisect``'s ablation applies subsets of both. Supported: Llama, Qwen3, Qwen3-MoE.
``logsoftmax`` is not a module: the learner asks :func:`token_logprobs_fn` for it.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mismatch_probe.kernels.nvfp4.linear import CALIBRATION, NVFP4Linear, SharedInput, calibration_token_ids
from mismatch_probe.kernels.nvfp4.schemes import quantize_upstream
from mismatch_probe.kernels.recipes import OP_KINDS, Recipe, parse
from mismatch_probe.kernels.strict import ops as so

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class _PosEmb(tuple):
    """HF's (cos, sin) plus the position ids, so patched attention can index its own table."""

    positions: torch.Tensor


def _weights_signature(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Each parameter's id and version counter (a RuntimeError for inference tensors, which keep none)."""
    return tuple((id(p), p._version) for p in model.parameters())


class PatchHandle:
    """Undo record of one :func:`patch`; a context manager."""

    def __init__(self, recipe: Recipe, ops: frozenset[str], layers: frozenset[int] | None) -> None:
        self.recipe = recipe
        self.ops = ops
        self.layers = layers
        self.patched: list[str] = []  # qualified module names, in patch order
        self.nvfp4: dict[str, NVFP4Linear] = {}
        self.positions: dict[str, Any] = {}  # "ids": position ids of the last patched rotary call
        self._undo: list[tuple[torch.nn.Module, bool, Any]] = []
        self._model: torch.nn.Module | None = None
        self._hook: Any = None
        self._weights_sig: tuple[tuple[int, int], ...] | None = None
        self.shared = SharedInput()  # NVFP4: one activation quantization for q/k/v, one for gate/up
        self._scopes: list[Any] = []  # the hooks that open and close its scope around attention and MLP blocks

    def refresh_weights(self) -> bool:
        """Drop the NVFP4 linears' quantized weights where the model's parameters changed since the last
        call: a parameter's version counter moves with every in-place update through torch ops (an
        optimizer step, ``load_state_dict``; FSDP2's sharded DTensors included) and a replaced parameter
        has a new id. Host-side only (no device work; ~0.13 ms for 300-400 parameters). Runs before every forward of the patched
        model. A write through ``param.data`` bumps no counter: call :meth:`weights_changed` after one."""
        if self._model is None or not self.nvfp4:
            return False
        sig = _weights_signature(self._model)
        if sig == self._weights_sig:
            return False
        self._weights_sig = sig
        self.weights_changed()
        return True

    def _pre_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        self.refresh_weights()

    def weights_changed(self) -> None:
        """Drop every NVFP4 linear's quantized weights now."""
        for st in self.nvfp4.values():
            st.invalidate()

    def _track_weights(self, model: torch.nn.Module) -> None:
        """NVFP4 weights cached per shape (FSDP2 moves them every forward), dropped when the model's
        parameters change (:meth:`refresh_weights`, before every forward of ``model``)."""
        try:
            self._weights_sig = _weights_signature(model)
        except RuntimeError:  # inference tensors keep no version counter: the per-address cache stays
            return
        self._model = model
        for st in self.nvfp4.values():
            st.weights_by_shape = True
        # first: before FSDP2's own pre-forward hook swaps in unsharded parameters (whose counters never move)
        self._hook = model.register_forward_pre_hook(self._pre_forward, prepend=True)

    def _share_inputs(self, module: torch.nn.Module) -> None:
        """Around ``module``'s forward (an attention or MLP block, whose projections all read its input and
        never write it), the NVFP4 linears share one quantization of that input (:class:`SharedInput`)."""
        sh = self.shared

        def pre(_m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            sh.open(kwargs.get("hidden_states", kwargs.get("x", args[0] if args else None)))

        self._scopes.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._scopes.append(module.register_forward_hook(lambda *_: sh.close(), always_call=True))

    def _set(self, name: str, module: torch.nn.Module, fn: Callable[..., Any]) -> None:
        had = "forward" in module.__dict__
        self._undo.append((module, had, module.__dict__.get("forward")))
        module.forward = types.MethodType(fn, module)
        self.patched.append(name)

    def undo(self) -> None:
        for module, had, old in reversed(self._undo):
            if had:
                module.forward = old
            else:
                del module.forward
        self._undo.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for hook in self._scopes:
            hook.remove()
        self._scopes.clear()
        self.shared.close()

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def describe(self) -> dict[str, Any]:
        return {
            **self.recipe.describe(),
            "patched_ops": sorted(self.ops),
            "layers": None if self.layers is None else sorted(self.layers),
            "n_modules_patched": len(self.patched),
            "nvfp4": next(iter(self.nvfp4.values())).describe() if self.nvfp4 else None,
            "nvfp4_kernels": {name: st.kernel_summary() for name, st in self.nvfp4.items()} or None,
        }


def _rope_base(config: Any, layer_type: str | None = None) -> float:
    """The rope base of a layer: ``rope_parameters`` is one dict, or (Gemma 3: local and global
    layers) one dict per layer type."""
    rp = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    if rp.get("rope_type", "default") not in ("default", None):
        raise NotImplementedError(f"strict rope supports the default rope only, not {rp.get('rope_type')!r}")
    base = rp.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise NotImplementedError("strict rope: the config names no rope_theta")
    return float(base)


def _attention_forward(self: Any, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                       past_key_values: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Llama/Qwen3 attention with the strict rope and/or strict attention (right padding / none)."""
    b, t = hidden_states.shape[:2]
    shape = (b, t, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape)
    k = self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape)
    if hasattr(self, "q_norm"):
        if self._mp_heads_first:  # the module's own layout ([B, H, T, D], Gemma 3): what hooks observe
            q, k = self.q_norm(q.transpose(1, 2)).transpose(1, 2), self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
    if self._mp_rope:
        # the patched rotary's position ids: on the (cos, sin) tuple, or (when a wrapper rebuilt the
        # tuple, e.g. FSDP2's input casting) from the handle's record of the last rotary call
        positions = getattr(position_embeddings, "positions", None)
        pos = (positions if positions is not None else self._mp_positions["ids"]).expand(b, t)
        q, k = so.rope(q, pos, self._mp_rope_base), so.rope(k, pos, self._mp_rope_base)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    else:
        cos, sin = position_embeddings
        q, k = self._mp_apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v = v.transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    if self._mp_attn:
        if getattr(self, "attn_logit_softcapping", None):
            raise NotImplementedError("strict attention: no logit soft cap")
        # right padding: key j at position j, the queries at the last t positions (q_pos None)
        out = so.attention_batch(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, self.scaling,
                                 getattr(self, "sliding_window", None)).reshape(b, t, -1)
    else:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._mp_eager)
        out, _ = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                    sliding_window=getattr(self, "sliding_window", None), **kwargs)
        out = out.reshape(b, t, -1)
    return self.o_proj(out.contiguous()), None


def _linear_fn(recipe: Recipe, handle: PatchHandle, name: str) -> Callable[..., torch.Tensor]:
    if recipe.nvfp4:
        state = handle.nvfp4.setdefault(name, NVFP4Linear(recipe.linear))
        state.shared = handle.shared

        def fwd(self: Any, x: torch.Tensor) -> torch.Tensor:
            return state(x, self.weight, self.bias)

        return fwd

    def strict_fwd(self: Any, x: torch.Tensor) -> torch.Tensor:
        return so.linear(x, self.weight, self.bias)

    return strict_fwd


def _moe_fns(recipe: Recipe, handle: PatchHandle, name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    state = handle.nvfp4.setdefault(name, NVFP4Linear(recipe.linear)) if recipe.nvfp4 else None

    def router(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = so.linear(h, self.weight)
        w, ids = so.moe_route(logits, self.top_k, self.norm_topk_prob)
        return logits, w, ids

    def experts(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        fn = None if state is None else (lambda x, w, key: state(x, w, key=key))
        return so.moe_experts(hidden_states, top_k_weights, top_k_index, self.gate_up_proj, self.down_proj, fn)

    return router, experts


# HF activation modules -> the strict activation of the same function (kernels.strict.ops.ACTIVATIONS)
HF_ACTIVATIONS = {
    "SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
    "GELUActivation": "gelu",
}


def _strict_act(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    name = HF_ACTIVATIONS.get(type(module).__name__)
    if name is None:
        raise NotImplementedError(f"strict act: no strict version of {type(module).__name__}")
    return lambda x: so.act(x, name)  # CUDA: the Triton kernel; CPU: so.ACTIVATIONS[name]


def _kind(name: str, module: torch.nn.Module, lm_head: torch.nn.Module, embed: torch.nn.Module) -> str | None:
    cls = type(module).__name__
    if module is embed:
        return "embedding"
    if module is lm_head:
        return "logits"
    if cls.endswith("RMSNorm"):
        return "norm"
    if cls.endswith("RotaryEmbedding"):
        return "rope"
    if cls.endswith("Attention"):
        return "attention"
    if cls.endswith("SparseMoeBlock"):
        return "moe"
    if isinstance(module, torch.nn.Linear) and _LAYER.search(name):
        return "linear"
    if name.endswith("mlp.act_fn"):
        return "act"
    return None


def patch(model: torch.nn.Module, recipe: Recipe | str, ops: Iterable[str] | None = None,
          layers: Iterable[int] | None = None, *, norm_unit_offset: bool | None = None) -> PatchHandle:
    """Patch ``model`` (an HF causal LM, possibly FSDP2-sharded) with ``recipe``'s ops.

    ``norm_unit_offset``: the model's RMSNorms scale by ``1 + w`` (Gemma); None: as the model's
    family spec says (:attr:`FamilySpec.norm_unit_offset`, by ``config.model_type``). Per-layer rope bases
    (``rope_parameters`` per layer type), sliding-window layers (``sliding_window`` of the
    attention module), the activation (by its HF class) and a scaled embedding (``embed_scale``
    of the embedding module) are read from the model."""
    r = parse(recipe) if isinstance(recipe, str) else recipe
    from mismatch_probe.families import registry

    spec = registry.families().get(getattr(model.config, "model_type", ""))
    if norm_unit_offset is None:
        norm_unit_offset = bool(spec and spec.norm_unit_offset)
    qk_heads_first = bool(spec and "attn.q_norm" in spec.hf_heads_first)
    chosen = r.ops() if ops is None else frozenset(ops) & r.ops()
    bad = set(ops or ()) - set(OP_KINDS)
    if bad:
        raise ValueError(f"unknown op classes {sorted(bad)}; choose from {OP_KINDS}")
    lset = None if layers is None else frozenset(layers)
    h = PatchHandle(r, chosen, lset)
    fuse_norm = quantize_upstream(r, chosen)
    lm_head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    for name, mod in list(model.named_modules()):
        kind = _kind(name, mod, lm_head, embed)
        m = _LAYER.search(name)
        if kind is None or (lset is not None and m is not None and int(m.group(1)) not in lset):
            continue
        if kind == "attention":
            rope_on, attn_on = "rope" in chosen, "attention" in chosen
            if not (rope_on or attn_on):
                continue
            mod._mp_rope, mod._mp_attn = rope_on, attn_on
            mod._mp_rope_base = _rope_base(model.config, getattr(mod, "layer_type", None))
            mod._mp_positions = h.positions
            mod._mp_heads_first = qk_heads_first
            modeling = sys.modules[type(mod).__module__]
            mod._mp_apply_rope, mod._mp_eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward
            h._set(name, mod, _attention_forward)
        elif kind not in chosen:
            continue
        elif kind == "embedding":
            h._set(name, mod, lambda self, ids: so.embedding(ids, self.weight, getattr(self, "embed_scale", None)))
        elif kind == "norm":
            h._set(name, mod, _norm_fn(norm_unit_offset, fuse_norm))
        elif kind == "act":
            act = _strict_act(mod)
            h._set(name, mod, lambda self, x, _act=act: _act(x))
        elif kind == "logits":
            h._set(name, mod, lambda self, x: so.linear(x, self.weight, self.bias))
        elif kind == "linear":
            h._set(name, mod, _linear_fn(r, h, name))
        elif kind == "rope":
            orig = mod.forward

            def rope_fwd(self: Any, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, _orig: Any = orig,
                         **kwargs: Any) -> _PosEmb:
                out = _PosEmb(_orig(x, position_ids, *args, **kwargs))
                out.positions = position_ids
                h.positions["ids"] = position_ids
                return out

            h._set(name, mod, rope_fwd)
        elif kind == "moe":
            router, experts = _moe_fns(r, h, name)
            h._set(f"{name}.gate", mod.gate, router)
            h._set(f"{name}.experts", mod.experts, experts)
    if h.nvfp4:
        h._track_weights(model)
        for name, mod in model.named_modules():  # the blocks whose projections read one input
            m = _LAYER.search(name)
            if m is None or (lset is not None and int(m.group(1)) not in lset):
                continue
            cls = type(mod).__name__
            if cls.endswith("Attention") or (cls.endswith("MLP") and hasattr(mod, "gate_proj") and hasattr(mod, "up_proj")):
                h._share_inputs(mod)
    return h


def _norm_fn(unit_offset: bool, fuse: bool) -> Callable[..., torch.Tensor]:
    """The strict RMSNorm; ``fuse`` (a per-token NVFP4 linear recipe): on CUDA through
    :func:`norm_quant.rmsnorm`, which also quantizes the output for the linears that read it."""

    def fwd(self: Any, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", None)
        eps = self.eps if eps is None else eps
        if fuse and x.is_cuda:
            from mismatch_probe.kernels.nvfp4 import norm_quant

            return norm_quant.rmsnorm(self, x, None, self.weight, eps, unit_offset)[0]
        return so.rmsnorm(x, self.weight, eps, unit_offset=unit_offset)

    return fwd


def token_logprobs_fn(recipe: Recipe | str | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(logits [B, T, V], ids [B, T]) -> [B, T-1]`` fp32 logprob of ``ids[:, 1:]``: the strict
    log-softmax under a strict recipe, torch's otherwise (HfLearner's default)."""
    r = parse(recipe) if isinstance(recipe, str) else (recipe or Recipe())

    def f(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        lg = logits[:, :-1]
        if "logsoftmax" in r.ops() and lg.is_cuda:
            from mismatch_probe.kernels.strict import triton_ops as strict_triton

            return strict_triton.token_logprobs(lg, ids[:, 1:])  # no [B, T, V] fp32 tensor
        lp = so.log_softmax_fp32(lg) if "logsoftmax" in r.ops() else torch.log_softmax(lg.float(), dim=-1)
        return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    return f


def log_softmax_fn(recipe: Recipe | str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(logits [..., V]) -> fp32 log-probabilities [..., V]``, the same function as
    :func:`token_logprobs_fn` gathers from (the strict log-softmax under a strict recipe)."""
    r = parse(recipe) if isinstance(recipe, str) else (recipe or Recipe())
    if "logsoftmax" in r.ops():
        return so.log_softmax_fp32
    return lambda lg: torch.log_softmax(lg.float(), dim=-1)


def calibrate(model: torch.nn.Module, handle: PatchHandle, vocab_size: int) -> int:
    """``nvfp4-static``: run the fixed calibration set (one sequence at a time, no padding) with
    the static linears recording input amax. Returns the number of calibrated linears. No KV cache, as
    the learner's scoring forward (``runner.padded_forward``)."""
    states = [s for s in handle.nvfp4.values() if s.scheme.static]
    if not states:
        return 0
    dev = next(model.parameters()).device
    CALIBRATION["on"] = True
    try:
        with torch.inference_mode():
            for seq in calibration_token_ids(vocab_size):
                model(input_ids=torch.tensor([seq], device=dev), use_cache=False)
    finally:
        CALIBRATION["on"] = False
    return len(states)
