"""Replay of single canonical ops in each engine, on given input tensors (input substitution).

``OP_INPUTS`` says which captured op feeds each replayable op; ``hf_replay`` / ``vllm_replay``
run the engine's own module for that op. Attention (needs the whole sequence, and in vLLM its
paged KV cache and forward context), the residual adds and the embedding are not replayed.
Norms that follow a residual add are replayed with their add (vLLM fuses the two).
"""

from __future__ import annotations

from typing import Any

from mismatch_probe.families.opnames import split_op

REPLAYABLE = (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.rope_q", "attn.rope_k",
    "attn.o", "post_attn_norm",
    "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "moe.router_logits", "moe.out", "final_norm", "logits",
)


def op_inputs(op: str, num_layers: int, available: set[str]) -> list[str] | None:
    """Canonical ops whose captured outputs are the inputs of ``op`` (None: not replayable).

    Norms after a residual add take ``[branch output, residual]``: vLLM fuses the add into the
    norm (and may normalize the unrounded sum), so the norm is replayed together with its add."""
    layer, kind = split_op(op)
    if kind not in REPLAYABLE:
        return None
    mlp_out = "moe.out" if any(".moe." in o for o in available) else "mlp.down"
    if kind == "final_norm":
        return [f"{num_layers - 1}.{mlp_out}", f"{num_layers - 1}.resid_mid"]
    if kind == "logits":
        return ["final_norm"]
    L = layer
    prev_out = f"{L - 1}.out" if L > 0 else "embed"
    qk = [f"{L}.attn.q_norm", f"{L}.attn.k_norm"] if f"{L}.attn.q_norm" in available else [f"{L}.attn.q", f"{L}.attn.k"]
    return {
        "attn.rope_q": qk,
        "attn.rope_k": qk,
        "input_norm": [f"{L - 1}.{mlp_out}", f"{L - 1}.resid_mid"] if L > 0 else ["embed"],
        "attn.q": [f"{L}.input_norm"],
        "attn.k": [f"{L}.input_norm"],
        "attn.v": [f"{L}.input_norm"],
        "attn.q_norm": [f"{L}.attn.q"],
        "attn.k_norm": [f"{L}.attn.k"],
        "attn.o": [f"{L}.attn.core"],
        "post_attn_norm": [f"{L}.attn.o", prev_out],
        "mlp.gate": [f"{L}.post_attn_norm"],
        "mlp.up": [f"{L}.post_attn_norm"],
        "mlp.act": [f"{L}.mlp.gate", f"{L}.mlp.up"],
        "mlp.down": [f"{L}.mlp.act"],
        "moe.router_logits": [f"{L}.post_attn_norm"],
        "moe.out": [f"{L}.post_attn_norm"],
    }[kind]


def _heads(x: Any, head_dim: int) -> Any:
    return x.reshape(x.shape[0], -1, head_dim)


def _hf_rope(model: Any, attn: Any, xs: list[Any], pos: Any, which: int) -> Any:
    import sys

    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = (_heads(x, attn.head_dim).transpose(0, 1).unsqueeze(0) for x in xs)  # [1, heads, tokens, dim]
    rotary = model.model.rotary_emb
    per_type = (attn.layer_type,) if getattr(rotary, "layer_types", None) else ()  # a table per layer type (Gemma 3)
    cos, sin = rotary(q, pos.unsqueeze(0), *per_type)
    out = rope(q, k, cos, sin)[which]
    return out.squeeze(0).transpose(0, 1)


def hf_replay(model: Any, op: str, xs: list[Any], pos: Any) -> Any:
    """The HF model's implementation of ``op`` on inputs ``xs`` ([tokens, ...] each) at positions ``pos``."""
    import torch

    layer, kind = split_op(op)
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
        out = {
            "input_norm": lambda: ly.input_layernorm(resid(xs)),
            "attn.q": lambda: a.q_proj(x),
            "attn.k": lambda: a.k_proj(x),
            "attn.v": lambda: a.v_proj(x),
            "attn.q_norm": lambda: a.q_norm(_heads(x, a.head_dim)),
            "attn.k_norm": lambda: a.k_norm(_heads(x, a.head_dim)),
            "attn.rope_q": lambda: _hf_rope(model, a, xs, pos, 0),
            "attn.rope_k": lambda: _hf_rope(model, a, xs, pos, 1),
            "attn.o": lambda: a.o_proj(x),
            "post_attn_norm": lambda: ly.post_attention_layernorm(resid(xs)),
            "mlp.gate": lambda: mlp.gate_proj(x),
            "mlp.up": lambda: mlp.up_proj(x),
            "mlp.act": lambda: mlp.act_fn(x) * xs[1],
            "mlp.down": lambda: mlp.down_proj(x),
            "moe.router_logits": lambda: mlp.gate(x)[0],
            "moe.out": lambda: mlp(x.unsqueeze(0)).squeeze(0),
        }[kind]()
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


def vllm_replay(model: Any, op: str, xs: list[Any], pos: Any) -> Any:
    """vLLM's implementation of ``op`` (run inside ``LLM.apply_model``)."""
    import torch

    def t(o: Any) -> Any:
        return o[0] if isinstance(o, tuple) else o

    def norm(mod: Any, xs: list[Any]) -> Any:  # vLLM: fused add + norm when there is a residual
        return t(mod(xs[0].clone(), xs[1].clone())) if len(xs) == 2 else t(mod(xs[0]))

    layer, kind = split_op(op)
    m = model.model
    with torch.inference_mode():
        if kind == "final_norm":
            return norm(m.norm, xs).clone()
        if kind == "logits":
            return model.logits_processor(model.lm_head, xs[0])
        ly = m.layers[layer]
        a, mlp = ly.self_attn, ly.mlp
        x = xs[0]

        def qkv(i: int) -> Any:
            return t(a.qkv_proj(x)).split([a.q_size, a.kv_size, a.kv_size], -1)[i]

        out = {
            "input_norm": lambda: norm(ly.input_layernorm, xs),
            "attn.q": lambda: qkv(0),
            "attn.k": lambda: qkv(1),
            "attn.v": lambda: qkv(2),
            "attn.q_norm": lambda: a.q_norm(_heads(x, a.head_dim)),
            "attn.k_norm": lambda: a.k_norm(_heads(x, a.head_dim)),
            "attn.rope_q": lambda: a.rotary_emb(pos, xs[0].clone(), xs[1].clone())[0],
            "attn.rope_k": lambda: a.rotary_emb(pos, xs[0].clone(), xs[1].clone())[1],
            "attn.o": lambda: t(a.o_proj(x)),
            "post_attn_norm": lambda: norm(ly.post_attention_layernorm, xs),
            "mlp.gate": lambda: t(mlp.gate_up_proj(x)).chunk(2, -1)[0],
            "mlp.up": lambda: t(mlp.gate_up_proj(x)).chunk(2, -1)[1],
            "mlp.act": lambda: mlp.act_fn(torch.cat([x, xs[1]], -1)),
            "mlp.down": lambda: t(mlp.down_proj(x)),
            "moe.router_logits": lambda: t(mlp.gate(x)),
            "moe.out": lambda: _with_forward_context(m, x.shape[0], lambda: t(mlp(x))),
        }[kind]()
        return out.reshape(out.shape[0], -1).clone()
