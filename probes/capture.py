"""Engine-agnostic op capture: per canonical op and per token, a digest, mergeable stats and
(in ``full`` mode) the raw values in the op's own dtype.

Modes, chosen per op glob and token range by a :class:`CapturePlan`:

- ``digest``: the ``mp64`` digest of the row's raw bits (probes/digest.py: bit-exact, the same on
  CUDA, CPU and in the numpy reference; bitwise equality across engines);
- ``stats``: digest + ``numel, sum, sum_sq, abs_max, n_nan, n_inf`` (mergeable: sums and maxima
  combine across shards and ranks);
- ``full``: stats + ``values`` (the row's raw bytes, decoded with ``dtype`` and ``shape``);
- ``off``: nothing.

Besides per-op rules, a plan can keep ``full`` values for a bounded window of rows
(``full_rows``: the first N tokens in (seq_id, pos) order, the rows ``bisect`` replays) and the
top-k (values, ids) of ``logits`` rows (``topk``).

Engine adapters call :meth:`OpRecorder.record` (probes/recorder.py) with a tensor whose leading
dimension is tokens and the (seq_id, pos) of each of its rows. Recording only reads tensors: it
never changes what the engine computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mismatch_probe.errors import UsageError
from mismatch_probe.families.opnames import matches

MODES = ("off", "digest", "stats", "full")
_RANK = {m: i for i, m in enumerate(MODES)}


@dataclass(frozen=True)
class CaptureRule:
    pattern: str  # glob over canonical op names
    mode: str
    pos_range: tuple[int, int] | None = None  # [start, end) token positions

    @classmethod
    def parse(cls, text: str) -> CaptureRule:
        """``GLOB=MODE`` or ``GLOB=MODE@START:END`` (e.g. ``*.mlp.*=full@0:64``)."""
        pat, sep, rest = text.partition("=")
        if not sep or not pat:
            raise UsageError(f"capture rule {text!r}: expected GLOB=MODE[@START:END]")
        mode, _, rng = rest.partition("@")
        if mode not in MODES:
            raise UsageError(f"capture rule {text!r}: mode must be one of {', '.join(MODES)}")
        pos_range = None
        if rng:
            a, colon, b = rng.partition(":")
            try:
                pos_range = (int(a or 0), int(b) if b else 1 << 31)
            except ValueError:
                raise UsageError(f"capture rule {text!r}: token range must be START:END") from None
            if not colon or pos_range[0] >= pos_range[1]:
                raise UsageError(f"capture rule {text!r}: token range must be START:END with START < END")
        return cls(pat, mode, pos_range)


@dataclass
class CapturePlan:
    """Default mode, then the ``full_rows`` window (rows in it are kept ``full`` where the mode so
    far is not ``off``), then the rules in order: the last matching rule wins. ``topk``: keep the
    k largest logits (values and ids) of every ``logits`` row captured in ``stats`` or ``full``."""

    default: str = "full"
    rules: list[CaptureRule] = field(default_factory=list)
    full_rows: int = 0
    topk: int = 0

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise UsageError(f"capture mode must be one of {', '.join(MODES)}, got {self.default!r}")
        if self.full_rows < 0 or self.topk < 0:
            raise UsageError("capture full_rows and topk must be >= 0")
        self._matching: dict[str, list[CaptureRule]] = {}
        self._keys: dict[str, tuple[int, ...]] = {}

    def keeps_stats(self) -> bool:
        """Some rows may be kept in ``stats`` or ``full`` (40 host bytes a row or more; ``digest`` 8)."""
        return self.full_rows > 0 or any(_RANK[m] >= _RANK["stats"] for m in [self.default, *(r.mode for r in self.rules)])

    def op_modes(self, op: str) -> list[tuple[str, tuple[int, int] | None]]:
        out: list[tuple[str, tuple[int, int] | None]] = [(self.default, None)]
        out += [(r.mode, r.pos_range) for r in self._rules_for(op)]
        return out

    def _rules_for(self, op: str) -> list[CaptureRule]:
        hit = self._matching.get(op)
        if hit is None:
            hit = self._matching[op] = [r for r in self.rules if matches(op, r.pattern)]
        return hit

    def rule_key(self, op: str) -> tuple[int, ...]:
        """The indices of the rules that match ``op``: ops with the same key get the same modes
        (:meth:`modes_for` depends on the op only through them)."""
        key = self._keys.get(op)
        if key is None:
            key = self._keys[op] = tuple(i for i, r in enumerate(self.rules) if matches(op, r.pattern))
        return key

    def modes_for(self, op: str, pos: np.ndarray, window: np.ndarray | None = None) -> np.ndarray:
        """Mode index (into MODES) for each token position of ``op`` (``window``: rows in the
        ``full_rows`` window)."""
        res = np.full(pos.shape, _RANK[self.default], dtype=np.int8)
        if window is not None:
            res[window & (res > 0)] = _RANK["full"]
        for r in self._rules_for(op):
            rng = r.pos_range
            if rng is None:
                res[:] = _RANK[r.mode]
            else:
                res[(pos >= rng[0]) & (pos < rng[1])] = _RANK[r.mode]
        return res

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "rules": [{"pattern": r.pattern, "mode": r.mode, "pos_range": r.pos_range}
                                                   for r in self.rules],
                "full_rows": self.full_rows, "topk": self.topk}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CapturePlan:
        rules = [CaptureRule(r["pattern"], r["mode"], tuple(r["pos_range"]) if r.get("pos_range") else None)
                 for r in d.get("rules", [])]
        return cls(d["default"], rules, int(d.get("full_rows", 0)), int(d.get("topk", 0)))


FULL_ROWS_DEFAULT = 256  # = bisect's --max-rows default: the rows its input substitution replays
TOPK_DEFAULT = 8
KEPT_NOTE = (
    "every op and token: mp64 digest + stats (numel, sum, sum_sq, abs_max, n_nan, n_inf); raw values "
    "only for the first full_rows tokens in (seq_id, pos) order (the rows bisect replays, its --max-rows); "
    "logits: digest + stats + top-k values and ids, not the vocabulary-wide row, unless full_logits"
)


def build_plan(mode: str, rules: list[str], full_rows: int | None = None, topk: int = 0,
               full_logits: bool = False) -> CapturePlan | None:
    """The plan of the command-line flags (None when capture is off). ``full_rows`` None: the
    default window (FULL_ROWS_DEFAULT) under ``stats``, none under the other modes (``digest``
    keeps no values unless asked; ``full`` keeps all). Unless ``full_logits``, a built-in rule
    ``logits=stats`` (``logits=digest`` under ``--capture digest``) comes before the user's rules,
    so the vocabulary-wide logits row is not kept (its top-k is)."""
    if full_rows is None:
        full_rows = FULL_ROWS_DEFAULT if mode == "stats" else 0
    parsed = [CaptureRule.parse(r) for r in rules]
    if mode == "off" and not parsed:
        return None
    builtin = [] if full_logits or mode == "off" else [CaptureRule("logits", "digest" if mode == "digest" else "stats")]
    return CapturePlan(mode, builtin + parsed, full_rows, topk)


def row_digests(t: Any) -> list[str]:
    """``mp64`` digest (probes/digest.py) of each row of a tensor [rows, ...] (computed on its
    device) or of a uint8 array of raw row bytes (the numpy reference, 1-byte words)."""
    from mismatch_probe.probes.digest import digest_bytes_ref, digest_torch, hex_digests

    if isinstance(t, np.ndarray):
        return hex_digests(digest_bytes_ref(t, 1))
    flat = t.detach().reshape(t.shape[0], -1)
    return hex_digests(digest_torch(flat).cpu().numpy())


__all__ = ["MODES", "CapturePlan", "CaptureRule", "decode_values", "row_digests"]  # the recorder: probes.recorder


def decode_values(values: bytes, dtype: str, shape: list[int]) -> Any:
    """Raw ``values`` bytes of one ops row back to a torch tensor of its dtype."""
    import torch

    dt = getattr(torch, dtype)
    buf = bytearray(values)
    if dt == torch.bool:
        return torch.frombuffer(buf, dtype=torch.uint8).to(torch.bool).reshape(shape)
    return torch.frombuffer(buf, dtype=dt).reshape(shape) if buf else torch.empty(shape, dtype=dt)
