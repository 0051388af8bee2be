"""Qwen3-MoE: Qwen3 attention, a sparse MoE block (router + experts) instead of the dense MLP."""

from __future__ import annotations

from mismatch_probe.families.base import FamilySpec
from mismatch_probe.families.qwen3 import SPEC as QWEN3

_ATTN = QWEN3.layer_ops[: QWEN3.layer_ops.index("post_attn_norm") + 1]
_MOE = ("moe.router_logits", "moe.topk_ids", "moe.topk_weights", "moe.out")
_DENSE_MLP = ("mlp.gate", "mlp.up", "mlp.act", "mlp.down")

SPEC = FamilySpec(
    model_type="qwen3_moe",
    label="Qwen3-MoE",
    tiny="tiny-qwen3-moe",
    moe=True,
    layer_ops=(*_ATTN, *_MOE, "out"),
    hf_layer={
        **{k: v for k, v in QWEN3.hf_layer.items() if k not in _DENSE_MLP},
        # the router returns (logits, top-k weights, top-k ids)
        "moe.router_logits": "mlp.gate:out0",
        "moe.topk_weights": "mlp.gate:out1",
        "moe.topk_ids": "mlp.gate:out2",
        "moe.out": "mlp",
    },
    vllm_layer={
        **{k: v for k, v in QWEN3.vllm_layer.items() if k not in _DENSE_MLP and k != "mlp.act"},
        "moe.router_logits": "mlp.gate",
        "moe.out": "mlp",
    },
    vllm_fused={"self_attn.qkv_proj": ("attn.q", "attn.k", "attn.v")},
    # vLLM computes top-k routing inside its fused-MoE kernel: not observable from modules
    vllm_unobservable=("moe.topk_ids", "moe.topk_weights"),
    vllm_param_renames={
        "experts.routed_experts.w13_weight": "experts.gate_up_proj",
        "experts.routed_experts.w2_weight": "experts.down_proj",
    },
    replay_inputs={
        **{k: v for k, v in QWEN3.replay_inputs.items() if k not in _DENSE_MLP},
        "input_norm": ("-1.moe.out", "-1.resid_mid"),
        "moe.router_logits": ("post_attn_norm",),
        "moe.out": ("post_attn_norm",),
    },
    final_norm_inputs=("moe.out", "resid_mid"),
    tiny_config={
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
)
