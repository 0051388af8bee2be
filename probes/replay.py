"""Replay of single canonical ops in each engine, on given input tensors (input substitution).

The family spec's ``replay_inputs`` say which captured ops feed each replayable op;
``hf_replay`` / ``vllm_replay`` run the engine's own module for that op (the module at the spec's
site; q/k norms, rotary, the activation and the MoE block by their engine's own attributes).
The attention core (``attn.core``) is replayed on whole sequences' prefill rows
(:mod:`.replay_attention`: HF's attention function, vLLM's attention backend on a private paged
KV cache). The residual adds and the embedding are not replayed. Norms that follow a residual add are replayed
with their add (vLLM fuses the two).
"""

from __future__ import annotations

from typing import Any

from mismatch_probe.families import registry
from mismatch_probe.families.base import FamilySpec, parse_site, resolve_path
from mismatch_probe.families.opnames import split_op


def family_of(model_type: str | None, available: set[str]) -> FamilySpec:
    """The run's family spec (from the manifest's ``model_type``); without one, the registered
    family whose layer ops best cover the ops the run captured."""
    if model_type:
        return registry.get(model_type)
    kinds = {split_op(o)[1] for o in available if split_op(o)[0] >= 0}
    return max(registry.families().values(),
               key=lambda s: (len(kinds & set(s.layer_ops)), -len(set(s.layer_ops) - kinds)))


def op_inputs(op: str, num_layers: int, available: set[str], model_type: str | None = None) -> list[str] | None:
    """Canonical ops whose captured outputs are the inputs of ``op`` (None: not replayable), from
    the family spec's ``replay_inputs`` (see :mod:`mismatch_probe.families.base`): an op is
    replayable iff its family lists its inputs (plus ``final_norm`` and ``logits``).

    Norms after a residual add take ``[branch output, residual]``: vLLM fuses the add into the
    norm (and may normalize the unrounded sum), so the norm is replayed together with its add."""
    spec = family_of(model_type, available)
    layer, kind = split_op(op)
    if kind == "final_norm":
        return [f"{num_layers - 1}.{r}" for r in spec.final_norm_inputs]
    if kind == "logits":
        return ["final_norm"]
    if kind == "attn.core":  # whole sequences: the rows after rotary (q, k) and v
        ins = [f"{layer}.attn.rope_q", f"{layer}.attn.rope_k", f"{layer}.attn.v"]
        return ins if all(i in available for i in ins) else None
    refs = spec.replay_inputs.get(kind)
    if refs is None:
        return None
    out: list[str] = []
    for r in refs:
        if r.startswith("-1."):
            name = f"{layer - 1}.{r[3:]}" if layer > 0 else "embed"
        else:
            name = f"{layer}.{r}"
        if name not in out:
            out.append(name)
    return out


def _heads(x: Any, head_dim: int) -> Any:
    return x.reshape(x.shape[0], -1, head_dim)


def _qk_norms(attn: Any, x: Any) -> dict[str, Any]:
    """The q/k norm replays, alike in both engines: the attention's norm module per head."""
    return {"attn.q_norm": lambda: attn.q_norm(_heads(x, attn.head_dim)),
            "attn.k_norm": lambda: attn.k_norm(_heads(x, attn.head_dim))}


def _hf_rope(model: Any, attn: Any, xs: list[Any], pos: Any, which: int) -> Any:
    import sys

    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = (_heads(x, attn.head_dim).transpose(0, 1).unsqueeze(0) for x in xs)  # [1, heads, tokens, dim]
    rotary = model.model.rotary_emb
    per_type = (attn.layer_type,) if getattr(rotary, "layer_types", None) else ()  # a table per layer type (Gemma 3)
    cos, sin = rotary(q, pos.unsqueeze(0), *per_type)
    out = rope(q, k, cos, sin)[which]
    return out.squeeze(0).transpose(0, 1)


def _on_model_device(fn: Any) -> Any:
    """Inputs to the model's device, the result back on the host: captured rows live on the host,
    and an engine's CUDA kernels given host pointers fault (vLLM's own ops do not check devices)."""
    import functools

    @functools.wraps(fn)
    def run(model: Any, op: str, xs: list[Any], pos: Any) -> Any:
        dev = next(model.parameters()).device
        out = fn(model, op, [x.to(dev) for x in xs], pos.to(dev))
        return out.cpu() if dev.type != "cpu" else out

    return run


@_on_model_device
def hf_replay(model: Any, op: str, xs: list[Any], pos: Any) -> Any:
    """The HF model's implementation of ``op`` on inputs ``xs`` ([tokens, ...] each) at positions ``pos``."""
    import torch

    layer, kind = split_op(op)
    if kind == "attn.core":
        from mismatch_probe.probes.replay_attention import hf_attention

        return hf_attention(model, layer, xs, pos)
    m = model.model

    def resid(xs: list[Any]) -> Any:  # HF: hidden = residual + hidden (rounded), then norm
        return xs[1] + xs[0] if len(xs) == 2 else xs[0]

    with torch.inference_mode():
        if kind == "final_norm":
            return m.norm(resid(xs))
        if kind == "logits":
            return model.lm_head(xs[0])
        ly = m.layers[layer]
        a, mlp = ly.self_attn, ly.mlp
        x = xs[0]
        special = {
            **_qk_norms(a, x),
            "attn.rope_q": lambda: _hf_rope(model, a, xs, pos, 0),
            "attn.rope_k": lambda: _hf_rope(model, a, xs, pos, 1),
            "mlp.act": lambda: mlp.act_fn(x) * xs[1],
            "moe.router_logits": lambda: mlp.gate(x)[0],
            "moe.out": lambda: mlp(x.unsqueeze(0)).squeeze(0),
        }
        if kind in special:
            out = special[kind]()
        else:  # the module at the family spec's HF site: a norm (after its residual add) or a linear
            spec = registry.get(model.config.model_type)
            mod = resolve_path(ly, parse_site(spec.hf_layer[kind])[0])
            out = mod(resid(xs)) if kind.endswith("norm") else mod(x)
        return out.reshape(out.shape[0], -1)


def _with_forward_context(m: Any, num_tokens: int, fn: Any) -> Any:
    """vLLM's MoE layer looks itself up in the forward context, set only inside the engine's own
    forward: set one (no attention metadata) around a replayed call."""
    cfg = getattr(m, "vllm_config", None)
    if cfg is None:
        return fn()
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, cfg, num_tokens=num_tokens):
        return fn()


@_on_model_device
def vllm_replay(model: Any, op: str, xs: list[Any], pos: Any) -> Any:
    """vLLM's implementation of ``op`` (run inside ``LLM.apply_model``)."""
    import torch

    def t(o: Any) -> Any:
        return o[0] if isinstance(o, tuple) else o

    def norm(mod: Any, xs: list[Any]) -> Any:  # vLLM: fused add + norm when there is a residual
        return t(mod(xs[0].clone(), xs[1].clone())) if len(xs) == 2 else t(mod(xs[0]))

    layer, kind = split_op(op)
    if kind == "attn.core":
        from mismatch_probe.probes.replay_attention import vllm_attention

        return vllm_attention(model, layer, xs, pos)
    m = model.model
    with torch.inference_mode():
        if kind == "final_norm":
            return norm(m.norm, xs).clone()
        if kind == "logits":
            return model.logits_processor(model.lm_head, xs[0])
        ly = m.layers[layer]
        a, mlp = ly.self_attn, ly.mlp
        x = xs[0]

        special = {
            **_qk_norms(a, x),
            "attn.rope_q": lambda: a.rotary_emb(pos, xs[0].clone(), xs[1].clone())[0],
            "attn.rope_k": lambda: a.rotary_emb(pos, xs[0].clone(), xs[1].clone())[1],
            "mlp.act": lambda: mlp.act_fn(torch.cat([x, xs[1]], -1)),
            "moe.router_logits": lambda: t(mlp.gate(x)),
            "moe.out": lambda: _with_forward_context(m, x.shape[0], lambda: t(mlp(x))),
        }
        if kind in special:
            out = special[kind]()
        else:
            out = _vllm_site(model, ly, kind, xs, t, norm)
        return out.reshape(out.shape[0], -1).clone()


def _vllm_site(model: Any, ly: Any, kind: str, xs: list[Any], t: Any, norm: Any) -> Any:
    """``kind`` computed by the module the family spec names: a fused linear's part, an add-norm,
    or a plain module."""
    cfg = getattr(model, "config", None) or getattr(model.model, "config", None)
    spec = registry.get(cfg.model_type)
    for path, parts in spec.vllm_fused.items():
        if kind in parts:
            mod, parent = resolve_path(ly, path), resolve_path(ly, path.rpartition(".")[0])
            y = t(mod(xs[0]))
            if len(parts) == 3 and hasattr(parent, "q_size"):
                return y.split([parent.q_size, parent.kv_size, parent.kv_size], -1)[parts.index(kind)]
            return y.chunk(len(parts), -1)[parts.index(kind)]
    for path, (normed, _resid) in spec.vllm_add_norms.items():
        if kind == normed:
            return norm(resolve_path(ly, path), xs)
    mod = resolve_path(ly, parse_site(spec.vllm_layer[kind])[0])
    return norm(mod, xs) if kind.endswith("norm") else t(mod(xs[0]))
