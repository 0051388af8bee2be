"""What a model family is, as data: :class:`FamilySpec` (one file per family in this folder).

A spec says, for one HF ``model_type``:

- which canonical ops (:mod:`.opnames`) a decoder layer computes, in execution order;
- where each engine computes each op (a *site*, see below), which vLLM modules are fused and
  what their outputs split into, which vLLM norms fuse the residual add, what an engine cannot
  observe;
- how vLLM's fused parameters map back to HF checkpoint names (vLLM's own
  ``packed_modules_mapping`` of the model class wins where it exists; ``packed_modules`` is the
  declared fallback) and how MoE expert weights are renamed;
- which captured ops feed each op when it is replayed alone (input substitution in ``bisect``);
- the numerics the recipe patches must reproduce (``(1 + w)`` RMSNorm, the activation, a scaled
  embedding, sliding-window layers) and the embedded tiny model's config.

Specs are pure data (no engine import): probes (capture, parity, replay, the HF patch and the
vLLM plugin) read them; nothing here reads an engine. Adding a family is one new module in this
package that defines ``SPEC = FamilySpec(...)``; :mod:`.registry` finds it by itself.

Sites
-----
A site is a dotted attribute path relative to the decoder layer (``"self_attn.q_proj"``), or
relative to the whole model for ``hf_model`` (``"model.norm"``), with an optional ``:what``
suffix saying which tensor of the module call is the op's value:

``path`` or ``path:out``   the module's output (first element if it returns a tuple)
``path:in``                its first positional input
``path:outN``              element ``N`` of a tuple output (``mlp.gate:out1``)

Replay references
-----------------
``replay_inputs[kind]`` lists the ops whose captured outputs are ``kind``'s inputs: ``"attn.q"``
is the same layer's op, ``"-1.out"`` the previous layer's; in layer 0 every ``-1.*`` reference
collapses to ``embed``. ``final_norm_inputs`` references the last layer (``"mlp.down"``). A norm
given two inputs is replayed with its residual add (``[branch, residual]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def parse_site(site: str) -> tuple[str, str]:
    """``"mlp.gate:out1"`` -> ``("mlp.gate", "out1")``; no suffix -> ``"out"``."""
    path, _, what = site.partition(":")
    what = what or "out"
    if what not in ("out", "in") and not (what.startswith("out") and what[3:].isdigit()):
        raise ValueError(f"bad site {site!r}: use path, path:in, path:out or path:outN")
    return path, what


def resolve_path(root: Any, path: str) -> Any:
    """The sub-module at dotted ``path`` of ``root`` (``""``: root itself; None if an attribute is missing)."""
    obj = root
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class FamilySpec:
    """One model family. See the module docstring for sites and replay references."""

    model_type: str  # HF ``config.model_type``
    label: str  # for people: "Qwen3-MoE"
    layer_ops: tuple[str, ...]  # canonical ops of one decoder layer, in execution order
    hf_layer: Mapping[str, str]  # canonical op kind -> HF site (relative to a decoder layer)
    vllm_layer: Mapping[str, str]  # canonical op kind -> vLLM site, for modules that are not fused
    moe: bool = False
    tiny: str | None = None  # embedded tiny model name ("tiny-llama")
    # kind -> HF site relative to the CausalLM model (embed, final_norm, logits)
    hf_model: Mapping[str, str] = field(
        default_factory=lambda: {"embed": "model.embed_tokens", "final_norm": "model.norm", "logits": "lm_head"}
    )
    hf_rope_fn: str | None = "apply_rotary_pos_emb"  # modeling-module function wrapped to observe rope
    hf_unobservable: tuple[str, ...] = ()
    # kinds whose HF module runs on [batch, heads, time, dim] (Gemma 3 normalizes q/k after moving
    # heads first): the capture moves heads back after time, so rows are tokens as everywhere
    hf_heads_first: tuple[str, ...] = ()
    # vLLM module path -> canonical kinds its output splits into (sizes from ``module.output_sizes``,
    # else equal parts)
    vllm_fused: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"self_attn.qkv_proj": ("attn.q", "attn.k", "attn.v")}
    )
    # vLLM norm path -> (normed kind, residual kind): called as norm(x, residual) it returns
    # (normed, x + residual); ``"-1.out"`` = the previous layer's output (the residual stream)
    vllm_add_norms: Mapping[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "input_layernorm": ("input_norm", "-1.out"),
            "post_attention_layernorm": ("post_attn_norm", "resid_mid"),
        }
    )
    vllm_final_norm: str = "model.norm"  # add-norm: its residual output is the last layer's ``out``
    vllm_rope: str | None = "self_attn.rotary_emb"  # returns (q, k) after rotary
    vllm_unobservable: tuple[str, ...] = ()
    # fallback for vLLM's ``packed_modules_mapping`` (fused parameter -> HF parts, in order)
    packed_modules: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    )
    vllm_param_renames: Mapping[str, str] = field(default_factory=dict)  # vLLM name suffix -> HF suffix
    replay_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    final_norm_inputs: tuple[str, ...] = ("mlp.down", "resid_mid")
    # numerics the recipe patches reproduce
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    activation: str = "silu"  # act(gate) * up: "silu" | "gelu_tanh"
    embed_scale: bool = False  # embedding multiplied by sqrt(hidden) (Gemma)
    sliding_window: bool = False  # some layers attend within a window (config.layer_types)
    tiny_config: Mapping[str, Any] = field(default_factory=dict)  # HF config kwargs added to the shared tiny base
    # parameter-name suffixes that HF initializes to a constant (biases to 0, Gemma's norm weights to
    # 0 = scale 1) and the tiny model draws at random instead, so an engine that drops them shows
    tiny_random_init: tuple[str, ...] = ()
    # the tiny model's tokenizer: "word" (a word-level vocabulary) or "byte-bpe" (byte-level BPE, for
    # families whose model_type transformers ties to a BPE tokenizer class, e.g. qwen2)
    tiny_tokenizer: str = "word"

    @property
    def ops(self) -> tuple[str, ...]:
        """Alias of ``layer_ops``."""
        return self.layer_ops

    def replay_refs(self, op_kind: str) -> tuple[str, ...] | None:
        return self.replay_inputs.get(op_kind)


# Residual-stream structure shared by the pre-norm dense families (Llama, Qwen2, Qwen3).
DENSE_REPLAY: dict[str, tuple[str, ...]] = {
    "input_norm": ("-1.mlp.down", "-1.resid_mid"),
    "attn.q": ("input_norm",),
    "attn.k": ("input_norm",),
    "attn.v": ("input_norm",),
    "attn.rope_q": ("attn.q", "attn.k"),
    "attn.rope_k": ("attn.q", "attn.k"),
    "attn.o": ("attn.core",),
    "post_attn_norm": ("attn.o", "-1.out"),
    "mlp.gate": ("post_attn_norm",),
    "mlp.up": ("post_attn_norm",),
    "mlp.act": ("mlp.gate", "mlp.up"),
    "mlp.down": ("mlp.act",),
}

DENSE_HF: dict[str, str] = {
    "input_norm": "input_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.core": "self_attn.o_proj:in",
    "attn.o": "self_attn.o_proj",
    "resid_mid": "post_attention_layernorm:in",
    "post_attn_norm": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.act": "mlp.down_proj:in",
    "mlp.down": "mlp.down_proj",
    "out": "",  # the decoder layer itself
}

DENSE_VLLM: dict[str, str] = {
    "attn.core": "self_attn.attn",
    "attn.o": "self_attn.o_proj",
    "mlp.act": "mlp.act_fn",
    "mlp.down": "mlp.down_proj",
}
DENSE_VLLM_FUSED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("attn.q", "attn.k", "attn.v"),
    "mlp.gate_up_proj": ("mlp.gate", "mlp.up"),
}

DENSE_OPS = (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.rope_q", "attn.rope_k", "attn.core", "attn.o",
    "resid_mid", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "out",
)
QK_NORM_OPS = ("attn.q_norm", "attn.k_norm")
