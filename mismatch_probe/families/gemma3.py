"""Gemma 3 text (``gemma3_text``): four norms per layer, (1 + w) RMSNorm, q/k norms, GELU-tanh,
an embedding scaled by sqrt(hidden), sliding-window (local) and global layers with their own
rope bases.

Per layer: ``input_layernorm`` -> attention (q/k normalized per head, heads first in HF) ->
``post_attention_layernorm`` on the attention output (``attn.o_norm``) -> residual add
(``resid_mid``) -> ``pre_feedforward_layernorm`` (``post_attn_norm``, the MLP's input norm as in
Llama) -> GELU-tanh MLP -> ``post_feedforward_layernorm`` on its output (``mlp.down_norm``) ->
residual add (``out``). vLLM fuses the residual adds into ``input_layernorm`` and
``pre_feedforward_layernorm``; the two branch-output norms are plain. vLLM multiplies the
embedding by sqrt(hidden) in the model's forward (captured at the first layer's input), HF inside
its embedding module. The norms, the activation, the embedding scale, the per-layer-type rope
bases and the sliding window are reproduced by the strict recipe in both engines.
"""

from __future__ import annotations

from mismatch_probe.families.base import DENSE_HF, DENSE_REPLAY, DENSE_VLLM, DENSE_VLLM_FUSED, FamilySpec

_OPS = (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.rope_q", "attn.rope_k",
    "attn.core", "attn.o", "attn.o_norm", "resid_mid", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act",
    "mlp.down", "mlp.down_norm", "out",
)
_NORMS = {
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "attn.o_norm": "post_attention_layernorm",
    "mlp.down_norm": "post_feedforward_layernorm",
}

SPEC = FamilySpec(
    model_type="gemma3_text",
    label="Gemma 3",
    tiny="tiny-gemma3",
    layer_ops=_OPS,
    hf_layer={**DENSE_HF, **_NORMS, "resid_mid": "pre_feedforward_layernorm:in",
              "post_attn_norm": "pre_feedforward_layernorm"},
    hf_heads_first=("attn.q_norm", "attn.k_norm"),  # HF normalizes q/k as [batch, heads, time, dim]
    vllm_layer={**DENSE_VLLM, **_NORMS},
    vllm_fused=DENSE_VLLM_FUSED,
    vllm_add_norms={"input_layernorm": ("input_norm", "-1.out"),
                    "pre_feedforward_layernorm": ("post_attn_norm", "resid_mid")},
    replay_inputs={**DENSE_REPLAY, "input_norm": ("-1.mlp.down_norm", "-1.resid_mid"),
                   "attn.q_norm": ("attn.q",), "attn.k_norm": ("attn.k",),
                   "attn.rope_q": ("attn.q_norm", "attn.k_norm"), "attn.rope_k": ("attn.q_norm", "attn.k_norm"),
                   "attn.o_norm": ("attn.o",), "post_attn_norm": ("attn.o_norm", "-1.out"),
                   "mlp.down_norm": ("mlp.down",)},
    final_norm_inputs=("mlp.down_norm", "resid_mid"),
    norm_unit_offset=True,
    activation="gelu_tanh",
    embed_scale=True,
    sliding_window=True,
    # 2 layers: one local (window 8, shorter than the test sequences, so it clips) then one global
    tiny_config={
        "num_hidden_layers": 2, "tie_word_embeddings": True, "query_pre_attn_scalar": 32, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    },
    tiny_random_init=("norm.weight",),  # HF starts Gemma's norm weights at 0 (scale 1 + 0)
)
