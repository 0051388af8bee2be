"""Canonical op names shared by every engine adapter, their execution order and tolerances.

Per decoder layer ``L``: ``L.input_norm``, ``L.attn.q`` ... ``L.out`` (see ``LAYER_OPS``); outside
the layers: ``embed`` first, then ``final_norm`` and ``logits``. Each adapter maps its modules onto
these names and lists the ones it cannot observe.
"""

from __future__ import annotations

import fnmatch

PRE_OPS = ("embed",)
LAYER_OPS = (
    "input_norm",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.q_norm",
    "attn.k_norm",
    "attn.rope_q",
    "attn.rope_k",
    "attn.core",
    "attn.o",
    "attn.o_norm",  # a norm on the attention output before its residual add (Gemma 3)
    "resid_mid",
    "post_attn_norm",
    "mlp.gate",
    "mlp.up",
    "mlp.act",
    "mlp.down",
    "mlp.down_norm",  # a norm on the MLP output before its residual add (Gemma 3)
    "moe.router_logits",
    "moe.topk_ids",
    "moe.topk_weights",
    "moe.out",
    "out",
)
POST_OPS = ("final_norm", "logits")

# Default tolerance on relative L2 error, by dtype (one tolerance for all dtypes is wrong).
DEFAULT_RTOL = {"bfloat16": 1e-2, "float16": 1e-3, "float32": 1e-5, "float64": 1e-12}


def layer_op(layer: int, kind: str) -> str:
    return f"{layer}.{kind}"


def split_op(op: str) -> tuple[int, str]:
    """``"3.mlp.down"`` -> ``(3, "mlp.down")``; ops outside the layers -> ``(-1, op)``."""
    head, _, rest = op.partition(".")
    if head.isdigit() and rest:
        return int(head), rest
    return -1, op


def exec_order(op: str, num_layers: int = 10_000) -> int:
    """Position of ``op`` in the forward pass (embed, layer 0 ops, ..., final_norm, logits)."""
    layer, kind = split_op(op)
    if layer < 0:
        if kind in PRE_OPS:
            return PRE_OPS.index(kind)
        base = len(PRE_OPS) + num_layers * len(LAYER_OPS)
        return base + (POST_OPS.index(kind) if kind in POST_OPS else len(POST_OPS))
    idx = LAYER_OPS.index(kind) if kind in LAYER_OPS else len(LAYER_OPS) - 1
    return len(PRE_OPS) + layer * len(LAYER_OPS) + idx


def canonical_ops(num_layers: int, moe: bool) -> list[str]:
    """Every canonical op of a model, in execution order."""
    dense_only = {"mlp.gate", "mlp.up", "mlp.act", "mlp.down", "mlp.down_norm"}
    moe_only = {k for k in LAYER_OPS if k.startswith("moe.")}
    kinds = [k for k in LAYER_OPS if k not in (dense_only if moe else moe_only)]
    return [*PRE_OPS, *(layer_op(i, k) for i in range(num_layers) for k in kinds), *POST_OPS]


def matches(op: str, pattern: str) -> bool:
    """Glob match of a canonical op name (``*.mlp.*``, ``3.*``, ``logits``)."""
    return fnmatch.fnmatchcase(op, pattern)
