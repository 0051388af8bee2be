"""Qwen2 / Qwen2.5 (``qwen2``): Llama's structure with biased q/k/v projections, no q/k norms.

The architecture of Qwen2.5 and of most RL math models. The biases travel inside vLLM's fused
``qkv_proj`` and are split back with the weights (capture, weight parity); the strict linear adds
a bias in fp32 before its one rounding, in both engines. The tiny model draws its biases at
random (HF initializes them to 0, which would hide a dropped bias) and, since transformers loads
``qwen2`` folders with its byte-level BPE tokenizer class, gets a byte-level BPE vocabulary.
"""

from __future__ import annotations

from mismatch_probe.families.base import DENSE_HF, DENSE_OPS, DENSE_REPLAY, DENSE_VLLM, DENSE_VLLM_FUSED, FamilySpec

SPEC = FamilySpec(
    model_type="qwen2",
    label="Qwen2",
    tiny="tiny-qwen2",
    layer_ops=DENSE_OPS,
    hf_layer=DENSE_HF,
    vllm_layer=DENSE_VLLM,
    vllm_fused=DENSE_VLLM_FUSED,
    replay_inputs=DENSE_REPLAY,
    tiny_config={"num_hidden_layers": 2},
    tiny_random_init=("q_proj.bias", "k_proj.bias", "v_proj.bias"),
    tiny_tokenizer="byte-bpe",
)
