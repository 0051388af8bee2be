"""Engine-agnostic op capture: per canonical op and per token, a digest, mergeable stats and
(in ``full`` mode) the raw values in the op's own dtype.

Modes, chosen per op glob and token range by a :class:`CapturePlan`:

- ``digest``: blake2b-64 of the row's raw bytes (bitwise equality across engines);
- ``stats``: digest + ``numel, sum, sum_sq, abs_max, n_nan, n_inf`` (mergeable: sums and maxima
  combine across shards and ranks);
- ``full``: stats + ``values`` (the row's raw bytes, decoded with ``dtype`` and ``shape``);
- ``off``: nothing.

Engine adapters call :meth:`OpRecorder.record` with a tensor whose leading dimension is tokens
and the (seq_id, pos) of each of its rows. Recording only reads tensors (``detach().cpu()``): it
never changes what the engine computes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.errors import UsageError
from mismatch_probe.families.opnames import matches, split_op

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
    """Default mode plus rules; the last matching rule wins."""

    default: str = "full"
    rules: list[CaptureRule] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise UsageError(f"capture mode must be one of {', '.join(MODES)}, got {self.default!r}")

    def op_modes(self, op: str) -> list[tuple[str, tuple[int, int] | None]]:
        out: list[tuple[str, tuple[int, int] | None]] = [(self.default, None)]
        out += [(r.mode, r.pos_range) for r in self.rules if matches(op, r.pattern)]
        return out

    def modes_for(self, op: str, pos: np.ndarray) -> np.ndarray:
        """Mode index (into MODES) for each token position of ``op``."""
        res = np.full(pos.shape, _RANK[self.default], dtype=np.int8)
        for mode, rng in self.op_modes(op)[1:]:
            sel = np.ones(pos.shape, bool) if rng is None else (pos >= rng[0]) & (pos < rng[1])
            res[sel] = _RANK[mode]
        return res

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "rules": [r.__dict__ for r in self.rules]}


def row_digests(t: Any) -> list[str]:
    """blake2b-64 of each row's raw bytes (``t``: a CPU tensor [rows, ...] or a uint8 array)."""
    raw = t if isinstance(t, np.ndarray) else _raw_bytes(t)
    return [hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in raw]


def _raw_bytes(t: Any) -> np.ndarray:
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(t.shape[0], -1)
    return flat.view(torch.uint8).numpy() if flat.dtype != torch.bool else flat.to(torch.uint8).numpy()


class OpRecorder:
    """Accumulates op rows; :meth:`table` gives the ``ops`` table (schema v1)."""

    def __init__(self, plan: CapturePlan | None = None) -> None:
        self.plan = plan or CapturePlan()
        self._chunks: list[dict[str, Any]] = []
        self.seen_ops: list[str] = []

    def record(self, op: str, tensor: Any, seq_ids: np.ndarray, pos: np.ndarray) -> None:
        """Record ``tensor[i]`` as op ``op`` of token (``seq_ids[i]``, ``pos[i]``); rows whose
        ``seq_id`` is negative (padding) are dropped."""
        import torch

        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        pos = np.asarray(pos, dtype=np.int64)
        keep = seq_ids >= 0
        if not keep.any():
            return
        t = tensor.detach()
        if t.shape[0] != seq_ids.shape[0]:
            raise RuntimeError(f"capture of {op}: {t.shape[0]} rows for {seq_ids.shape[0]} tokens")
        modes = self.plan.modes_for(op, pos)
        keep &= modes > 0
        if not keep.any():
            return
        idx = np.nonzero(keep)[0]
        t = t[torch.from_numpy(idx).to(t.device)].to("cpu").contiguous()
        if op not in self.seen_ops:
            self.seen_ops.append(op)
        n = t.shape[0]
        flat = t.reshape(n, -1)
        raw = _raw_bytes(flat)
        f64 = flat.double()
        finite = torch.isfinite(f64)
        clean = torch.where(finite, f64, torch.zeros_like(f64))
        m = modes[idx]
        full = m >= _RANK["full"]
        values: list[bytes | None] = [raw[i].tobytes() if full[i] else None for i in range(n)]
        stats_on = m >= _RANK["stats"]
        self._chunks.append(
            {
                "op": [op] * n,
                "layer": [split_op(op)[0]] * n,
                "seq_id": seq_ids[idx],
                "pos": pos[idx],
                "dtype": [str(t.dtype).removeprefix("torch.")] * n,
                "shape": [list(t.shape[1:])] * n,
                "numel": np.where(stats_on, flat.shape[1], 0),
                "sum": np.where(stats_on, clean.sum(1).numpy(), np.nan),
                "sum_sq": np.where(stats_on, (clean * clean).sum(1).numpy(), np.nan),
                "abs_max": np.where(stats_on, clean.abs().amax(1).numpy() if flat.shape[1] else 0.0, np.nan),
                "n_nan": np.where(stats_on, torch.isnan(f64).sum(1).numpy(), 0),
                "n_inf": np.where(stats_on, torch.isinf(f64).sum(1).numpy(), 0),
                "digest": row_digests(raw),
                "values": values,
            }
        )

    def table(self) -> pa.Table:
        from mismatch_probe.run.schema import OPS_V1

        if not self._chunks:
            return OPS_V1.empty_table()
        cols = {}
        for name in OPS_V1.names:
            parts = [c[name] for c in self._chunks]
            if isinstance(parts[0], np.ndarray):
                cols[name] = pa.array(np.concatenate(parts), OPS_V1.field(name).type)
            else:
                cols[name] = pa.array([x for p in parts for x in p], OPS_V1.field(name).type)
        return pa.table(cols, schema=OPS_V1)


def decode_values(values: bytes, dtype: str, shape: list[int]) -> Any:
    """Raw ``values`` bytes of one ops row back to a torch tensor of its dtype."""
    import torch

    dt = getattr(torch, dtype)
    buf = bytearray(values)
    if dt == torch.bool:
        return torch.frombuffer(buf, dtype=torch.uint8).to(torch.bool).reshape(shape)
    return torch.frombuffer(buf, dtype=dt).reshape(shape) if buf else torch.empty(shape, dtype=dt)
