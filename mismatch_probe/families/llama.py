"""Llama: pre-norm decoder, fused q/k/v and gate/up in vLLM, SiLU, no q/k norms."""

from __future__ import annotations

from mismatch_probe.families.base import DENSE_HF, DENSE_OPS, DENSE_REPLAY, DENSE_VLLM, DENSE_VLLM_FUSED, FamilySpec

SPEC = FamilySpec(
    model_type="llama",
    label="Llama",
    tiny="tiny-llama",
    layer_ops=DENSE_OPS,
    hf_layer=DENSE_HF,
    vllm_layer=DENSE_VLLM,
    vllm_fused=DENSE_VLLM_FUSED,
    replay_inputs=DENSE_REPLAY,
)
