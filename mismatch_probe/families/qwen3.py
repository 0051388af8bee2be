"""Qwen3: Llama's structure plus per-head RMSNorm on q and k (before rotary)."""

from __future__ import annotations

from mismatch_probe.families.base import (
    DENSE_HF,
    DENSE_OPS,
    DENSE_REPLAY,
    DENSE_VLLM,
    DENSE_VLLM_FUSED,
    QK_NORM_OPS,
    FamilySpec,
)

_OPS = DENSE_OPS[:4] + QK_NORM_OPS + DENSE_OPS[4:]

SPEC = FamilySpec(
    model_type="qwen3",
    label="Qwen3",
    tiny="tiny-qwen3",
    layer_ops=_OPS,
    hf_layer={**DENSE_HF, "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"},
    vllm_layer={**DENSE_VLLM, "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"},
    vllm_fused=DENSE_VLLM_FUSED,
    replay_inputs={**DENSE_REPLAY, "attn.q_norm": ("attn.q",), "attn.k_norm": ("attn.k",),
                   "attn.rope_q": ("attn.q_norm", "attn.k_norm"), "attn.rope_k": ("attn.q_norm", "attn.k_norm")},
)
