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
        self._rope_ops: list[tuple[str, str]] = []
        self._rope_patch: tuple[Any, str, Any] | None = None

    def set_batch(self, seq_ids: list[int], lengths: list[int], width: int) -> None:
        """The next forward holds ``len(seq_ids)`` rows padded to ``width`` tokens."""
        seq = np.full((len(seq_ids), width), -1, np.int64)
        for i, (s, n) in enumerate(zip(seq_ids, lengths, strict=True)):
            seq[i, :n] = s
        self._seq = seq.reshape(-1)
        self._pos = np.tile(np.arange(width), len(seq_ids))

    def _rec(self, op: str, t: Any) -> None:
        self.rec.record_rows(op, t, self._seq, self._pos)

    def _hook(self, module: Any, ins: list[str], outs: list[tuple[str, Any]]) -> None:
        """One hook per module for all its sites: ``ins`` (ops = the module's first input) and
        ``outs`` (op, pick: the op from the module's output). A module with both (o_proj,
        post_attention_layernorm, down_proj) gets one forward hook that records its input after it
        ran (the modules at these sites read their input, never write it), not a pre-hook and a hook."""
        # the hooks call the recorder directly (one Python frame per op: the host is what limits a
        # small model's forward, and every frame counts there)
        rec, cap = self.rec.record_rows, self

        def inp(args: tuple, kw: dict) -> Any:
            return args[0] if args else next(iter(kw.values()))

        if not outs:
            def before(_m: Any, args: tuple, kw: dict) -> None:
                for op in ins:
                    rec(op, inp(args, kw), cap._seq, cap._pos)

            self.hooks.add(module.register_forward_pre_hook(before, with_kwargs=True))
        elif not ins and len(outs) == 1 and outs[0][1] is first:
            op = outs[0][0]

            def after(_m: Any, _a: tuple, out: Any) -> None:
                rec(op, out[0] if isinstance(out, tuple | list) else out, cap._seq, cap._pos)

            self.hooks.add(module.register_forward_hook(after))
        else:
            def both(_m: Any, args: tuple, kw: dict, out: Any) -> None:
                for op in ins:
                    rec(op, inp(args, kw), cap._seq, cap._pos)
                for op, pick in outs:
                    rec(op, pick(out), cap._seq, cap._pos)

            self.hooks.add(module.register_forward_hook(both, with_kwargs=True))

    def _wrap_rope(self, attn: Any, fn_name: str) -> None:
        """Observe rotary: wrap the rope function (``fn_name``) of the attention's modeling module."""
        mod = sys.modules[type(attn).__module__]
        orig = getattr(mod, fn_name, None)
        if orig is None:
            return

        def observed(q: Any, k: Any, *args: Any, **kwargs: Any) -> Any:
            qe, ke = orig(q, k, *args, **kwargs)
            if self._layer >= 0:  # [batch, heads, time, dim] -> [batch, time, heads * dim]
                nq, nk = self._rope_ops[self._layer]
                self._rec(nq, qe.transpose(1, 2))
                self._rec(nk, ke.transpose(1, 2))
            return qe, ke

        setattr(mod, fn_name, observed)
        self._rope_patch = (mod, fn_name, orig)

    @staticmethod
    def _site(sites: dict[int, tuple[Any, list, list]], root: Any, site: str, op: str, heads_first: bool = False) -> None:
        """Add op ``op`` at ``site`` (under ``root``) to ``sites`` (id(module) -> module, ins, outs)."""
        path, what = parse_site(site)
        module = resolve_path(root, path)
        if module is None:
            return  # this checkpoint's variant lacks the module (a spec lists the family's superset)
        _, ins, outs = sites.setdefault(id(module), (module, [], []))
        if what == "in":
            ins.append(op)
        elif heads_first:  # [batch, heads, time, dim] -> [batch, time, heads, dim]
            outs.append((op, lambda o: first(o).transpose(1, 2)))
        elif what == "out":
            outs.append((op, first))
        else:
            n = int(what[3:])
            outs.append((op, lambda o, n=n: o[n]))

    def __enter__(self) -> HfCapture:
        spec = registry.get(self.model.config.model_type)
        m = self.model.model
        sites: dict[int, tuple[Any, list, list]] = {}
        self._site(sites, self.model, spec.hf_model["embed"], "embed")
        if spec.hf_rope_fn:
            self._wrap_rope(m.layers[0].self_attn, spec.hf_rope_fn)
        self._rope_ops = [(f"{i}.attn.rope_q", f"{i}.attn.rope_k") for i in range(len(m.layers))]
        for i, layer in enumerate(m.layers):
            self.hooks.add(layer.register_forward_pre_hook(lambda _m, _a, i=i: setattr(self, "_layer", i)))
            for kind in spec.layer_ops:
                site = spec.hf_layer.get(kind)
                if site is not None:
                    self._site(sites, layer, site, f"{i}.{kind}", kind in spec.hf_heads_first)
        self._site(sites, self.model, spec.hf_model["final_norm"], "final_norm")
        self._site(sites, self.model, spec.hf_model["logits"], "logits")
        for module, ins, outs in sites.values():
            self._hook(module, ins, outs)
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.remove()
        if self._rope_patch is not None:
            mod, fn_name, orig = self._rope_patch
            setattr(mod, fn_name, orig)
            self._rope_patch = None
