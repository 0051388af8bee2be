"""Why does the first divergent quantized linear differ? (``bisect`` on NVFP4 runs)

For a linear that diverges first while the two sides run different NVFP4 recipes, quantize the
op's captured input (the learner's, equal on both sides up to here) and its weight with each
side's *live* NVFP4 state (the learner's patch, the sampler's vLLM layer, static scales as
calibrated), then swap one factor at a time: the output error caused by the activation scaling
alone and by the weight quantization alone. The reason names the larger first, and the other too
when it causes at least a tenth as much.
"""

from __future__ import annotations

from typing import Any

from mismatch_probe.families.opnames import split_op

_HF = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
       "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
_VLLM = {"attn.q": ("self_attn.qkv_proj", 0), "attn.k": ("self_attn.qkv_proj", 1), "attn.v": ("self_attn.qkv_proj", 2),
         "attn.o": ("self_attn.o_proj", 0), "mlp.gate": ("mlp.gate_up_proj", 0), "mlp.up": ("mlp.gate_up_proj", 1),
         "mlp.down": ("mlp.down_proj", 0)}
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def explain_linear(op: str, x: Any, engines: Any) -> dict[str, Any] | None:
    """Reason for ``op`` (a linear) diverging, or None when the sides are not both NVFP4."""
    import torch

    from mismatch_probe.kernels.nvfp4.ref import nvfp4_dequantize_ref, nvfp4_quantize_ref

    layer, kind = split_op(op)
    if kind not in _HF:
        return None
    prefix = f"model.layers.{layer}."
    st_l = engines.learner.nvfp4_state(prefix + _HF[kind])
    if st_l is None:
        return None
    vpath, part = _VLLM[kind]
    st_s = engines.sampler.nvfp4_state(prefix + vpath)
    if st_s is None:
        return None
    w = engines.learner.linear_weight(prefix + _HF[kind])
    w_fused = torch.cat([engines.learner.linear_weight(prefix + p) for p in _FUSED[vpath]]) if vpath in _FUSED else w

    def act(st: Any) -> Any:
        amax = st.static_amax if st.scheme.static and st.static_amax is not None else None
        return nvfp4_dequantize_ref(nvfp4_quantize_ref(x, per_token=st.scheme.per_token, amax=amax))

    a_l, a_s = act(st_l), act(st_s)
    w_l = nvfp4_dequantize_ref(st_l.weight(w, key="explain")[0])
    w_s = nvfp4_dequantize_ref(st_s.weight(w_fused, key="explain")[part])
    ref = a_l @ w_l.T

    def err(y: Any) -> float:
        return float((y - ref).norm() / ref.norm()) if ref.norm() > 0 else 0.0

    e_act, e_w = err(a_s @ w_l.T), err(a_l @ w_s.T)
    causes = sorted({"activation scaling": e_act, "weight quantization": e_w}.items(), key=lambda kv: -kv[1])
    top = causes[0][1]
    reason = " and ".join(c for c, e in causes if e > 0.1 * top) if top > 0 else "none"
    return {
        "op": op,
        "schemes": {"learner": st_l.scheme.name, "sampler": st_s.scheme.name},
        "activation_codes_differ_frac": float((a_l != a_s).float().mean()),
        "weight_codes_differ_frac": float((w_l != w_s).float().mean()),
        "rel_error_from_activation_scaling": e_act,
        "rel_error_from_weight_quantization": e_w,
        "rel_error_both": err(a_s @ w_s.T),
        "reason": reason,
    }
