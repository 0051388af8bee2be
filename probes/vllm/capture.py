"""Canonical-op capture inside vLLM (installed through ``LLM.apply_model``).

vLLM flattens the tokens of all scheduled requests into one ``[num_tokens, ...]`` dimension and
fuses modules; this adapter undoes both:

- token mapping: hooks on the embedding and on decoder layer 0 read the step's token ids and positions
  and cut them into per-request segments (from the attention metadata's ``query_start_loc`` when
  available, else where positions stop increasing by one). Each segment is matched to the one
  sequence being scored whose next uncomputed position is the segment's first position and whose
  tokens there are the segment's tokens. This holds under chunked prefill (a request's chunks
  arrive in order) and when several sequences share a step. Sequences with identical tokens are
  interchangeable: their rows are the same computation. Unmatched rows (padding) are dropped.
  ``embed`` is the first decoder layer's input (after any embedding scale outside the module).
- modules and fused modules come from the model's family spec (``vllm_layer``, ``vllm_fused``,
  ``vllm_add_norms``): ``qkv_proj`` is split into q, k, v; ``gate_up_proj`` into gate, up; a fused
  add + RMSNorm returns ``(normed, residual)`` where ``residual`` is the true residual stream, so
  ``L.resid_mid`` is taken from ``post_attention_layernorm`` and ``L.out`` from the next layer's
  ``input_layernorm`` (the last layer's from the final norm).
- logits: ``LogitsProcessor`` is called on subsets of rows (sampling, prompt logprobs); its input
  rows are matched to their token by the digest of the final-norm row they are (equal rows, from
  shared prefixes, are handed out in order: they hold the same values).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from mismatch_probe.families import registry
from mismatch_probe.families.base import FamilySpec, parse_site, resolve_path
from mismatch_probe.probes.capture import row_digests
from mismatch_probe.probes.hooks import HookSet, first
from mismatch_probe.probes.recorder import OpRecorder


def _segments(positions: np.ndarray, qsl: np.ndarray | None) -> list[tuple[int, int]]:
    n = positions.shape[0]
    if qsl is not None and qsl.size >= 2 and int(qsl[-1]) <= n:
        return [(int(a), int(b)) for a, b in zip(qsl[:-1], qsl[1:], strict=True) if b > a]
    cuts = [0] + [i for i in range(1, n) if positions[i] != positions[i - 1] + 1] + [n]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _query_start_loc() -> np.ndarray | None:
    try:
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
    except Exception:
        return None
    if isinstance(md, dict):
        md = next(iter(md.values()), None)
    if isinstance(md, list):
        md = md[0] if md else None
    q = getattr(md, "query_start_loc", None)
    return None if q is None else q.detach().cpu().numpy()


class VllmCapture:
    """Hooks on a vLLM model (call :meth:`install` inside ``apply_model``)."""

    def __init__(self, recorder: OpRecorder, seqs: list[list[int]], seq_ids: list[int]) -> None:
        self.rec = recorder
        self.seqs = [np.asarray(s, np.int64) for s in seqs]
        self.seq_ids = list(seq_ids)
        self.next_pos = [0] * len(seqs)
        self.hooks = HookSet()
        self._seq = np.zeros(0, np.int64)
        self._pos = np.zeros(0, np.int64)
        self._norm_rows: dict[str, deque[tuple[int, int]]] = {}
        self.unmatched_rows = 0
        self.unobservable: list[str] = []
        self.num_layers = 0
        self._cur_layer = -1
        self._shared: set[int] = set()  # ids of modules shared by layers (hooked once, named by _cur_layer)
        self._pending_ids: Any = None

    # ---- token mapping -------------------------------------------------------------------
    def _map_step(self, args: tuple, kwargs: dict) -> None:
        # a pre-hook on decoder layer 0: forward(positions, hidden_states, residual). (The decoder
        # stack itself is called around nn.Module hooks by vLLM's compile wrapper.)
        positions = kwargs.get("positions", args[0] if args else None)
        ids = self._pending_ids
        if ids is None or positions is None:
            raise RuntimeError("vLLM capture: cannot see this step's token ids / positions")
        ids_np = ids.detach().cpu().numpy().astype(np.int64)
        pos_np = positions.detach().cpu().numpy().astype(np.int64).reshape(-1)
        n = ids_np.shape[0]
        seq = np.full(n, -1, np.int64)
        used: set[int] = set()
        for a, b in _segments(pos_np, _query_start_loc()):
            p0, toks = int(pos_np[a]), ids_np[a:b]
            for k, s in enumerate(self.seqs):
                if k in used or self.next_pos[k] != p0 or p0 + (b - a) > s.shape[0]:
                    continue
                if np.array_equal(s[p0 : p0 + (b - a)], toks):
                    used.add(k)
                    self.next_pos[k] = p0 + (b - a)
                    seq[a:b] = self.seq_ids[k]
                    break
        self.unmatched_rows += int((seq < 0).sum())
        self._seq, self._pos = seq, pos_np
        self._norm_rows = {}
        # the embedding as the first layer receives it: after any scaling outside the embedding
        # module (Gemma multiplies by sqrt(hidden) in the model's forward; HF inside the module)
        hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        if hidden is not None and hidden.shape[0] == n:
            self._rec("embed", hidden)
        self._pending_ids = None

    def _rec(self, op: str, t: Any) -> None:
        n = self._seq.shape[0]
        self.rec.record(op, t.reshape(n, -1), self._seq, self._pos)

    # ---- hooks ----------------------------------------------------------------------------
    def install(self, model: Any) -> None:
        m = model.model
        cfg = getattr(model, "config", None) or getattr(m, "config", None)
        spec = registry.get(cfg.model_type)
        self.num_layers = len(m.layers)
        self.unobservable = list(spec.vllm_unobservable)
        self.hooks.pre(m.layers[0], self._map_step)
        # vLLM may embed the tokens before the model's forward: keep ids and output until mapped
        self.hooks.pre(m.embed_tokens, lambda a, k: setattr(self, "_pending_ids", a[0] if a else k.get("input_ids")))
        # modules several layers share (one activation module, one rotary table) are hooked once and
        # name their ops after the calling layer
        seen: dict[int, int] = {}
        for layer in m.layers:
            for site in (*spec.vllm_layer.values(), *spec.vllm_fused, *spec.vllm_add_norms, spec.vllm_rope or ""):
                mod = resolve_path(layer, parse_site(site)[0]) if site else None
                if mod is not None and mod is not layer:
                    seen[id(mod)] = seen.get(id(mod), 0) + 1
        shared = {k for k, n in seen.items() if n > 1}
        for i, layer in enumerate(m.layers):
            self.hooks.pre(layer, lambda _a, _k, i=i: setattr(self, "_cur_layer", i))
            self._layer(i, layer, spec, shared)
            rope = resolve_path(layer, spec.vllm_rope) if spec.vllm_rope else None
            if rope is not None:
                self._hook(rope, self._rope)

        def final(out: Any) -> None:
            if isinstance(out, tuple):
                normed, resid = out[0], out[1]
                self._rec(f"{self.num_layers - 1}.out", resid)
            else:
                normed = out
            self._rec("final_norm", normed)
            for r, d in enumerate(row_digests(normed)):
                if self._seq[r] >= 0:  # equal rows (shared prefixes) queue up: each is consumed once
                    self._norm_rows.setdefault(d, deque()).append((int(self._seq[r]), int(self._pos[r])))

        self.hooks.fwd(resolve_path(model, spec.vllm_final_norm), final)
        lp = getattr(model, "logits_processor", None)
        if lp is not None:
            pending: list[np.ndarray] = []

            def logits_in(args: tuple, kwargs: dict) -> None:
                hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
                keys = []
                for d in row_digests(hidden):
                    q = self._norm_rows.get(d)
                    keys.append(q.popleft() if q else (-1, -1))  # a row scored twice is dropped
                pending.append(np.array(keys, np.int64).reshape(-1, 2))

            def logits_out(out: Any) -> None:
                keys = pending.pop()
                seq, pos = keys[:, 0].copy(), keys[:, 1].copy()
                t = first(out)
                if t is not None:  # None on TP ranks > 0 when vLLM gathers the logits to rank 0
                    self.rec.record("logits", t.reshape(t.shape[0], -1), seq, pos)

            self.hooks.pre(lp, logits_in)
            self.hooks.fwd(lp, logits_out)

    def _rope(self, out: Any) -> None:
        if isinstance(out, tuple) and len(out) == 2:
            self._rec(f"{self._cur_layer}.attn.rope_q", out[0])
            self._rec(f"{self._cur_layer}.attn.rope_k", out[1])

    def _name(self, i: int, kind: str, shared: bool) -> Any:
        """Op-name function for a hook: fixed layer ``i``, or the calling layer for a module that
        several layers share (hooked once); ``-1.kind`` is the previous layer's op."""
        def name() -> str:
            layer = self._cur_layer if shared else i
            return f"{layer - 1}.{kind[3:]}" if kind.startswith("-1.") else f"{layer}.{kind}"
        return name

    def _hook(self, module: Any, fn: Any) -> bool:
        """Hook ``module`` once (several layers may share it); False if it was hooked already."""
        if id(module) in self._shared:
            return False
        self._shared.add(id(module))
        self.hooks.fwd(module, fn)
        return True

    def _layer(self, i: int, layer: Any, spec: FamilySpec, shared: set[int]) -> None:
        # norms that fuse the residual add: norm(x, residual) -> (normed, x + residual)
        for path, (normed, resid) in spec.vllm_add_norms.items():
            mod = resolve_path(layer, path)
            if mod is None:
                continue
            nn, rn = self._name(i, normed, id(mod) in shared), self._name(i, resid, id(mod) in shared)

            def add_norm(out: Any, nn: Any = nn, rn: Any = rn) -> None:
                if isinstance(out, tuple):
                    self._rec(nn(), out[0])
                    self._rec(rn(), out[1])
                else:
                    self._rec(nn(), out)

            self._hook(mod, add_norm)
        # fused linears: the output splits into canonical ops (q/k/v by the attention's sizes)
        for path, parts in spec.vllm_fused.items():
            mod = resolve_path(layer, path)
            if mod is None:
                continue
            parent = resolve_path(layer, path.rpartition(".")[0])
            sizes = None
            if len(parts) == 3 and hasattr(parent, "q_size"):
                sizes = [int(parent.q_size), int(parent.kv_size), int(parent.kv_size)]
            names = [self._name(i, k, id(mod) in shared) for k in parts]

            def fused(out: Any, names: list[Any] = names, sizes: list[int] | None = sizes) -> None:
                t = first(out)
                pieces = t.split(sizes, dim=-1) if sizes else t.chunk(len(names), dim=-1)
                for nm, piece in zip(names, pieces, strict=True):
                    self._rec(nm(), piece)

            self._hook(mod, fused)
        # modules that compute one op each
        for kind, site in spec.vllm_layer.items():
            path, what = parse_site(site)
            mod = resolve_path(layer, path)
            if mod is None:
                continue
            nm = self._name(i, kind, id(mod) in shared)
            if what == "in":
                if id(mod) not in self._shared:
                    self._shared.add(id(mod))
                    self.hooks.pre(mod, lambda a, k, nm=nm: self._rec(nm(), a[0] if a else next(iter(k.values()))))
                continue
            n = 0 if what == "out" else int(what[3:])
            self._hook(mod, lambda o, nm=nm, n=n: self._rec(nm(), o[n] if n else first(o)))

    def remove(self) -> None:
        self.hooks.remove()
