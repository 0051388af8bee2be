"""Canonical-op capture for HF models (also FSDP-wrapped: same module tree), at the sites the
model's family spec names (:attr:`FamilySpec.hf_layer`, ``hf_model``, ``hf_rope_fn``).

Rows are ``[batch, time, ...]`` (or flattened ``[batch * time, ...]`` inside the MoE block);
:meth:`HfCapture.set_batch` tells which sequence each batch row holds and its true length, so
right-padding is dropped and every row lands on its (seq_id, pos).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from mismatch_probe.families import registry
from mismatch_probe.families.base import parse_site, resolve_path
from mismatch_probe.probes.hooks import HookSet, first
from mismatch_probe.probes.recorder import OpRecorder

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
        self._rope_patch: tuple[Any, str, Any] | None = None

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

    def _wrap_rope(self, attn: Any, fn_name: str) -> None:
        """Observe rotary: wrap the rope function (``fn_name``) of the attention's modeling module."""
        mod = sys.modules[type(attn).__module__]
        orig = getattr(mod, fn_name, None)
        if orig is None:
            return

        def observed(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
            qe, ke = orig(q, k, *args, **kwargs)
            if self._layer >= 0:  # [batch, heads, time, dim] -> [batch, time, heads * dim]
                self._rec(f"{self._layer}.attn.rope_q", qe.transpose(1, 2))
                self._rec(f"{self._layer}.attn.rope_k", ke.transpose(1, 2))
            return qe, ke

        setattr(mod, fn_name, observed)
        self._rope_patch = (mod, fn_name, orig)

    def _site(self, root: Any, site: str, op: str, heads_first: bool = False) -> None:
        path, what = parse_site(site)
        module = resolve_path(root, path)
        if module is None:
            return  # this checkpoint's variant lacks the module (a spec lists the family's superset)
        if what == "in":
            self._on_input(module, op)
        elif heads_first:  # [batch, heads, time, dim] -> [batch, time, heads, dim]
            self._on(module, op, lambda o: first(o).transpose(1, 2))
        elif what == "out":
            self._on(module, op)
        else:
            n = int(what[3:])
            self._on(module, op, lambda o, n=n: o[n])

    def __enter__(self) -> HfCapture:
        spec = registry.get(self.model.config.model_type)
        m = self.model.model
        self._site(self.model, spec.hf_model["embed"], "embed")
        if spec.hf_rope_fn:
            self._wrap_rope(m.layers[0].self_attn, spec.hf_rope_fn)
        for i, layer in enumerate(m.layers):
            self.hooks.pre(layer, lambda _a, _k, i=i: setattr(self, "_layer", i))
            for kind in spec.layer_ops:
                site = spec.hf_layer.get(kind)
                if site is not None:
                    self._site(layer, site, f"{i}.{kind}", kind in spec.hf_heads_first)
        self._site(self.model, spec.hf_model["final_norm"], "final_norm")
        self._site(self.model, spec.hf_model["logits"], "logits")
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.remove()
        if self._rope_patch is not None:
            mod, fn_name, orig = self._rope_patch
            setattr(mod, fn_name, orig)
            self._rope_patch = None
