"""Canonical-op capture for HF Llama / Qwen3 / Qwen3-MoE (also FSDP-wrapped: same module tree).

Rows are ``[batch, time, ...]`` (or flattened ``[batch * time, ...]`` inside the MoE block);
:meth:`HfCapture.set_batch` tells which sequence each batch row holds and its true length, so
right-padding is dropped and every row lands on its (seq_id, pos).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from mismatch_probe.probes.capture import OpRecorder
from mismatch_probe.probes.hooks import HookSet, first

# Every canonical op is observable in HF: rotary is a function call inside attention, observed by
# wrapping the modeling module's ``apply_rotary_pos_emb`` for the duration of the capture.
UNOBSERVABLE: tuple[str, ...] = ()


class HfCapture:
    """Context manager: installs the hooks on enter, removes them on exit."""

    unobservable = UNOBSERVABLE

    def __init__(self, model: Any, recorder: OpRecorder) -> None:
        self.model = model
        self.rec = recorder
        self.hooks = HookSet()
        self._seq = np.zeros(0, np.int64)
        self._pos = np.zeros(0, np.int64)
        self._layer = -1
        self._rope_patch: tuple[Any, Any] | None = None

    def set_batch(self, seq_ids: list[int], lengths: list[int], width: int) -> None:
        """The next forward holds ``len(seq_ids)`` rows padded to ``width`` tokens."""
        seq = np.full((len(seq_ids), width), -1, np.int64)
        for i, (s, n) in enumerate(zip(seq_ids, lengths, strict=True)):
            seq[i, :n] = s
        self._seq = seq.reshape(-1)
        self._pos = np.tile(np.arange(width), len(seq_ids))

    def _rec(self, op: str, t: Any) -> None:
        n = self._seq.shape[0]
        self.rec.record(op, t.reshape(n, -1) if t.dim() > 1 else t.reshape(n), self._seq, self._pos)

    def _on(self, module: Any, op: str, pick: Any = first) -> None:
        self.hooks.fwd(module, lambda out: self._rec(op, pick(out)))

    def _on_input(self, module: Any, op: str) -> None:
        self.hooks.pre(module, lambda args, kw: self._rec(op, args[0] if args else next(iter(kw.values()))))

    def _wrap_rope(self, attn: Any) -> None:
        """Observe rotary: wrap ``apply_rotary_pos_emb`` of the attention's modeling module."""
        mod = sys.modules[type(attn).__module__]
        orig = getattr(mod, "apply_rotary_pos_emb", None)
        if orig is None:
            return

        def observed(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
            qe, ke = orig(q, k, *args, **kwargs)
            if self._layer >= 0:  # [batch, heads, time, dim] -> [batch, time, heads * dim]
                self._rec(f"{self._layer}.attn.rope_q", qe.transpose(1, 2))
                self._rec(f"{self._layer}.attn.rope_k", ke.transpose(1, 2))
            return qe, ke

        mod.apply_rotary_pos_emb = observed
        self._rope_patch = (mod, orig)

    def __enter__(self) -> HfCapture:
        m = self.model.model
        self._on(m.embed_tokens, "embed")
        self._wrap_rope(m.layers[0].self_attn)
        for i, layer in enumerate(m.layers):
            self.hooks.pre(layer, lambda _a, _k, i=i: setattr(self, "_layer", i))
            a = layer.self_attn
            self._on(layer.input_layernorm, f"{i}.input_norm")
            self._on(a.q_proj, f"{i}.attn.q")
            self._on(a.k_proj, f"{i}.attn.k")
            self._on(a.v_proj, f"{i}.attn.v")
            if hasattr(a, "q_norm"):
                self._on(a.q_norm, f"{i}.attn.q_norm")
                self._on(a.k_norm, f"{i}.attn.k_norm")
            self._on_input(a.o_proj, f"{i}.attn.core")
            self._on(a.o_proj, f"{i}.attn.o")
            self._on_input(layer.post_attention_layernorm, f"{i}.resid_mid")
            self._on(layer.post_attention_layernorm, f"{i}.post_attn_norm")
            mlp = layer.mlp
            if hasattr(mlp, "gate_proj"):
                self._on(mlp.gate_proj, f"{i}.mlp.gate")
                self._on(mlp.up_proj, f"{i}.mlp.up")
                self._on_input(mlp.down_proj, f"{i}.mlp.act")
                self._on(mlp.down_proj, f"{i}.mlp.down")
            else:  # Qwen3-MoE: the router returns (logits, top-k weights, top-k ids)
                self._on(mlp.gate, f"{i}.moe.router_logits", lambda o: o[0])
                self._on(mlp.gate, f"{i}.moe.topk_weights", lambda o: o[1])
                self._on(mlp.gate, f"{i}.moe.topk_ids", lambda o: o[2])
                self._on(mlp, f"{i}.moe.out")
            self._on(layer, f"{i}.out")
        self._on(m.norm, "final_norm")
        self._on(self.model.lm_head, "logits")
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.remove()
        if self._rope_patch is not None:
            mod, orig = self._rope_patch
            mod.apply_rotary_pos_emb = orig
            self._rope_patch = None
