"""The rows of the ``ops`` table from a chunk of recorded ops: the segment records the recorder
keeps per op call (:class:`_Seg`, :class:`_Rows`) and the column-wise table build (no Python per
row), shared by the recorder's writer thread and its writer process (``recorder_writer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.families.opnames import split_op
from mismatch_probe.probes.digest import hex_array, hex_chars

FULL, STATS, DIGEST = 3, 2, 1


@dataclass
class _Rows:
    """Which rows of a (batch, op) are written, and how (computed once per batch and op)."""

    keep: np.ndarray  # row indices kept (not padding, mode > off)
    seq: np.ndarray
    pos: np.ndarray
    modes: np.ndarray  # of the kept rows
    full: np.ndarray  # row indices (into the tensor) kept in full mode, ascending
    full_dev: Any = None
    stats: bool = True  # any row kept in stats or full mode (else the device kernel computes digests only)
    runs: Any = None  # the packed layout's runs (see run/ops_packed.py), made once per row set
    counts: Any = None  # (rows in stats or full mode, rows in full mode, stats mask or None if all/none)

    def mode_counts(self) -> tuple[int, int, np.ndarray | None]:
        """(rows kept with stats, rows kept full, the per-row stats mask where only some rows have
        stats, else None): computed once per row set, so a chunk's table costs per op call, not per row."""
        if self.counts is None:
            on = self.modes >= STATS
            n = int(on.sum())
            self.counts = (n, int((self.modes == FULL).sum()), on if 0 < n < on.size else None)
        return self.counts

    def __getstate__(self) -> dict[str, Any]:
        """What the writer process gets (pickled with each chunk's segments): what its packed table reads
        (``_build_packed``: the kept rows, their mode counts and runs), not the per-row ``seq`` / ``pos`` /
        ``modes`` (the runs hold them) nor the device copy; the kept rows as their count where they are
        ``0 .. k-1`` (a batch without padding). A 4,096-token row set pickles to ~0.3 KB instead of ~100 KB,
        and the feeder thread holds the engine process's GIL that much shorter for each chunk."""
        self.mode_counts()
        self.packed_runs()
        k = self.keep.size
        whole = k == 0 or (int(self.keep[0]) == 0 and int(self.keep[-1]) == k - 1)  # keep ascends: 0 .. k-1
        return {"keep": k if whole else self.keep, "full": self.full, "stats": self.stats, "runs": self.runs,
                "counts": self.counts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # seq, pos and modes stay unset: the runs and counts are what the writer reads
        if isinstance(self.keep, int):
            self.keep = np.arange(self.keep, dtype=np.int64)
        self.full_dev = None

    def packed_runs(self) -> np.ndarray:
        """int32 [r, 4]: seq_id, first pos, count, mode of each stretch of consecutive positions of
        one sequence in one mode (computed once per row set: every op of a batch shares it)."""
        if self.runs is None:
            s, p, m = self.seq, self.pos, self.modes.astype(np.int64)
            cut = np.ones(s.size, bool)
            if s.size > 1:
                cut[1:] = (s[1:] != s[:-1]) | (p[1:] != p[:-1] + 1) | (m[1:] != m[:-1])
            start = np.nonzero(cut)[0]
            cnt = np.diff(np.append(start, s.size))
            self.runs = np.ascontiguousarray(np.stack([s[start], p[start], cnt, m[start]], axis=1).astype("<i4"))
        return self.runs


@dataclass(slots=True)
class _Seg:
    op: str
    dtype: str
    shape: list[int]
    width: int
    itemsize: int
    rows: _Rows
    arena_off: int  # arena row of the tensor's first row (batched) or of the first kept row (CPU)
    batched: bool  # arena rows: arena_off + rows.keep (batched) or arena_off + arange(kept)
    has_topk: bool = False
    topk_rows: np.ndarray | None = None  # row of each kept row in this chunk's top-k block


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dt: Any) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).removeprefix("torch.")
    return name


def _ops_schema() -> pa.Schema:
    from mismatch_probe.run.schema import OPS_OPTIONAL, OPS_V1

    return pa.schema(list(OPS_V1) + [pa.field(k, v) for k, v in OPS_OPTIONAL.items()])


def _build_table(segs: list[Any], dig: np.ndarray, st: np.ndarray | None, vals: np.ndarray | None, tv: Any, ti: Any) -> pa.Table:
    """One chunk's rows as an Arrow table, built column-wise (no Python per row). ``segs``: _Seg
    objects or tuples of their fields (the recorder's fast path: cheaper to make and to pickle)."""
    segs = [s if isinstance(s, _Seg) else _Seg(*s) for s in segs]
    ops = {s.op: None for s in segs}
    op_code = {o: i for i, o in enumerate(ops)}
    dtypes = {s.dtype: None for s in segs}
    dt_code = {d: i for i, d in enumerate(dtypes)}
    ks = np.array([s.rows.keep.size for s in segs], np.int64)
    arena = np.concatenate([s.arena_off + (s.rows.keep if s.batched else np.arange(s.rows.keep.size)) for s in segs])
    seq = np.concatenate([s.rows.seq for s in segs])
    pos = np.concatenate([s.rows.pos for s in segs])
    modes = np.concatenate([s.rows.modes for s in segs])
    width = np.repeat([s.width for s in segs], ks)
    stats_on = modes >= STATS
    hexc = dig[arena] if dig.ndim == 2 else hex_chars(dig[arena])
    # st None: a chunk of digest-only rows (their stats columns are null, the counts 0)
    s5 = st[arena] if st is not None else np.zeros((arena.size, 5))
    nan = np.where(stats_on[:, None], s5, np.nan)
    n_total = int(ks.sum())
    # values: full rows, concatenated in row order (= the order they were gathered)
    vlen = np.where(modes == FULL, width * np.repeat([s.itemsize for s in segs], ks), 0)
    voff = np.zeros(n_total + 1, np.int64)
    np.cumsum(vlen, out=voff[1:])
    valid = pa.py_buffer(np.packbits(modes == FULL, bitorder="little"))
    data = pa.py_buffer(vals if vals is not None else b"")
    if voff[-1] < 1 << 31:  # int32 offsets: the column's own type, no cast (a copy of every value byte)
        values = pa.BinaryArray.from_buffers(pa.binary(), n_total, [valid, pa.py_buffer(voff.astype(np.int32)), data])
    else:
        values = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n_total, [valid, pa.py_buffer(voff), data])
        values = values.cast(pa.binary())
    # shape: one list per row
    slen = np.repeat([len(s.shape) for s in segs], ks)
    soff = np.zeros(n_total + 1, np.int32)
    np.cumsum(slen, out=soff[1:])
    svals = np.concatenate([np.tile(np.asarray(s.shape, np.int64), s.rows.keep.size) for s in segs])
    cols = {
        "op": pa.DictionaryArray.from_arrays(np.repeat([op_code[s.op] for s in segs], ks).astype(np.int32),
                                             list(ops)).dictionary_decode(),
        "layer": np.repeat([split_op(s.op)[0] for s in segs], ks).astype(np.int32),
        "seq_id": seq.astype(np.int32),
        "pos": pos.astype(np.int32),
        "dtype": pa.DictionaryArray.from_arrays(np.repeat([dt_code[s.dtype] for s in segs], ks).astype(np.int32),
                                                list(dtypes)).dictionary_decode(),
        "shape": pa.ListArray.from_arrays(soff, svals),
        "numel": np.where(stats_on, width, 0).astype(np.int64),
        "sum": nan[:, 0],
        "sum_sq": nan[:, 1],
        "abs_max": nan[:, 2],
        "n_nan": np.where(stats_on, s5[:, 3], 0).astype(np.int64),
        "n_inf": np.where(stats_on, s5[:, 4], 0).astype(np.int64),
        "digest": hex_array(None, hexc),
        "values": values,
    }
    cols["topk_ids"], cols["topk_values"] = _topk_cols(segs, ks, stats_on, tv, ti)
    return pa.table(cols, schema=_ops_schema())


def _topk_cols(segs: list[_Seg], ks: np.ndarray, stats_on: np.ndarray, tv: Any, ti: Any) -> tuple[pa.Array, pa.Array]:
    n = int(ks.sum())
    has = np.repeat([s.has_topk for s in segs], ks) & stats_on
    if tv is None or not has.any():
        return pa.nulls(n, pa.list_(pa.int32())), pa.nulls(n, pa.list_(pa.float32()))
    k = tv.shape[1]
    src = np.concatenate([s.topk_rows if s.has_topk else np.zeros(s.rows.keep.size, np.int64) for s in segs])
    rows = src[has]
    off = np.zeros(n + 1, np.int32)
    np.cumsum(np.where(has, k, 0), out=off[1:])
    mask = pa.array(~has)
    ids = pa.ListArray.from_arrays(pa.array(off), pa.array(ti[rows].reshape(-1).astype(np.int32)), mask=mask)
    vals = pa.ListArray.from_arrays(pa.array(off), pa.array(tv[rows].reshape(-1).astype(np.float32)), mask=mask)
    return ids, vals


def _blob_col(data: np.ndarray, nbytes: np.ndarray) -> pa.Array:
    """A large_binary column of one value per segment: ``data``'s bytes cut into pieces of
    ``nbytes`` (null where 0), without copying per value."""
    n = nbytes.size
    off = np.zeros(n + 1, np.int64)
    np.cumsum(nbytes, out=off[1:])
    valid = pa.py_buffer(np.packbits(nbytes > 0, bitorder="little"))
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8) if data is not None and data.size else np.zeros(0, np.uint8)
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [valid, pa.py_buffer(off), pa.py_buffer(raw)])


def packed_writer(path: Any, meta: dict[bytes, bytes] | None = None, tmp: str | None = None) -> Any:
    """A :class:`~mismatch_probe.run.ops_packed.PackedWriter` for ``ops.parquet`` stamped with the
    schema version and kind."""
    from pathlib import Path

    from mismatch_probe.run.ops_packed import PackedWriter
    from mismatch_probe.run.schema import KIND_KEY, SCHEMA_VERSION, VERSION_KEY

    stamp = {**(meta or {}), VERSION_KEY: str(SCHEMA_VERSION).encode(), KIND_KEY: b"ops"}
    return PackedWriter(Path(path), stamp, tmp=tmp)


def _contiguous(segs: list[_Seg], ks: np.ndarray) -> slice | None:
    """The chunk's arena rows as one slice when they are (every segment's kept rows consecutive,
    segments back to back: no padding dropped), so digests and stats are written without a gather."""
    nxt = segs[0].arena_off
    for s, k in zip(segs, ks, strict=True):
        keep = s.rows.keep
        if s.arena_off != nxt or (s.batched and (keep[0] != 0 or keep[-1] != k - 1)):
            return None
        nxt += int(k)
    return slice(segs[0].arena_off, nxt)


def _counts_blob(counts: np.ndarray, n_stats: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The NaN / Inf counts of the chunk's stats rows as the packed-v3 layout stores them: only for the
    segments with a non-finite element in some row (null for the others: read as zeros), and each segment's
    stats rows kept. Nearly every chunk has none: one pass over the counts (as int64 pairs), no blob written
    (0.4 ms of the writer's 2.4 ms per 256 Ki stats rows: the Parquet writer copies a blob of zeros as fast as
    any other, and compressing it costs as much)."""
    nz = counts.view("<i8").reshape(-1) != 0
    if not nz.any():
        return None, np.zeros(n_stats.size, np.int64)
    cut = np.zeros(n_stats.size + 1, np.int64)
    np.cumsum(n_stats, out=cut[1:])
    some = np.add.reduceat(nz.astype(np.int64), np.minimum(cut[:-1], nz.size - 1)) > 0
    some &= n_stats > 0  # reduceat reads one row for an empty segment
    keep = np.repeat(some, n_stats)
    return counts[keep], np.where(some, n_stats, 0)


def _abs_max_blob(segs: list[_Seg], n_stats: np.ndarray, amf: np.ndarray, amb: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The abs_max of the chunk's stats rows as the packed-v2 (and v3) layout stores them, and each segment's bytes
    per value: the bf16 bits (2 bytes) for a bfloat16 op where the device made them (``amb``: the maximum
    of a bf16 row is a bf16 value, so its bits are exact), else the float64 (8). No arithmetic here: the
    writer's host time is the capture's limit; a chunk of bf16 ops only is a view of ``amb``."""
    w = np.where(np.array([s.dtype == "bfloat16" for s in segs]) & (amb is not None), 2, 8).astype(np.int64)
    w[n_stats == 0] = 0
    used = w[n_stats > 0]
    if (used == 2).all():
        return np.ascontiguousarray(amb, "<i2"), w
    if (used == 8).all():
        return np.ascontiguousarray(amf, "<f8"), w
    cut = np.zeros(len(segs) + 1, np.int64)
    np.cumsum(n_stats, out=cut[1:])
    pieces = [np.ascontiguousarray(amb[cut[i] : cut[i + 1]], "<i2").view(np.uint8) if wi == 2
              else np.ascontiguousarray(amf[cut[i] : cut[i + 1]], "<f8").view(np.uint8) for i, wi in enumerate(w) if wi]
    return np.concatenate(pieces), w


def _build_packed(segs: list[Any], dig: np.ndarray, st: np.ndarray | None, vals: np.ndarray | None, tv: Any,
                  ti: Any) -> pa.Table:
    """One chunk's rows in the packed layout (``mismatch_probe.run.ops_packed``): one row per
    segment, its per-token columns as byte blobs gathered from the arena in whole-chunk array ops.
    ``dig``: uint64 digests (or int64: the same bits), never hex digits."""
    from mismatch_probe.run.ops_packed import PACKED_SCHEMA

    segs = [s if isinstance(s, _Seg) else _Seg(*s) for s in segs]
    ks = np.array([s.rows.keep.size for s in segs], np.int64)
    mc = [s.rows.mode_counts() for s in segs]  # per row set: nothing here is per row
    n_stats = np.array([c[0] for c in mc], np.int64)
    n_full = np.array([c[1] for c in mc], np.int64)
    width = np.array([s.width for s in segs], np.int64)
    itemsize = np.array([s.itemsize for s in segs], np.int64)
    runs = [s.rows.packed_runs() for s in segs]
    arena: Any = _contiguous(segs, ks)
    if arena is None:
        arena = np.concatenate([s.arena_off + (s.rows.keep if s.batched else np.arange(s.rows.keep.size)) for s in segs])
    d = np.ascontiguousarray(dig[arena]).view("<u8") if dig.ndim == 1 else None
    if d is None:
        raise ValueError("the packed layout takes raw digests, not hex digits")
    some = any(c[2] is not None for c in mc)  # a row set with stats on some rows only
    stats_on = np.concatenate([c[2] if c[2] is not None else np.full(k, c[0] > 0) for c, k in zip(mc, ks, strict=True)]) \
        if some else None
    am_w = np.zeros(len(segs), np.int64)  # bytes per abs_max of each segment's stats rows (packed-v2)
    if st is not None and n_stats.any():
        # st: the arena's [rows, 5] float64 (CPU), or split on the device: (float64 [rows, 2] sum and sum_sq,
        # float64 [rows] abs_max, int32 [rows, 2] counts, int16 [rows] abs_max's bf16 bits or None)
        parts = list(st) if isinstance(st, tuple) else [st[:, :2], st[:, 2], st[:, 3:], None]
        parts = [None if a is None else a[arena] for a in parts]  # views where the arena rows are one slice
        if some:
            parts = [None if a is None else a[stats_on] for a in parts]
        elif not (n_stats == ks).all():
            parts = [None if a is None else a[np.repeat(n_stats > 0, ks)] for a in parts]
        stats, counts = np.ascontiguousarray(parts[0], "<f8"), np.ascontiguousarray(parts[2], "<i4")
        abs_max, am_w = _abs_max_blob(segs, n_stats, parts[1], parts[3])
        counts, c_rows = _counts_blob(counts, n_stats)
    else:
        stats = counts = abs_max = None
        n_stats = c_rows = np.zeros(len(segs), np.int64)
    has_topk = np.array([s.has_topk for s in segs], bool)
    if tv is not None and has_topk.any():
        kk = int(tv.shape[1])
        take = np.concatenate([s.topk_rows if c[2] is None else s.topk_rows[c[2]]
                               for s, c in zip(segs, mc, strict=True) if s.has_topk and c[0] > 0] or [np.zeros(0, np.int64)])
        t_ids, t_vals = ti[take].astype("<i4"), tv[take].astype("<f4")
        topk_k = np.where(has_topk, kk, 0)
        t_rows = np.where(has_topk, n_stats, 0)
    else:
        t_ids = t_vals = None
        topk_k = t_rows = np.zeros(len(segs), np.int64)
    rlen = np.array([r.shape[0] * 16 for r in runs], np.int64)
    roff = np.zeros(len(segs) + 1, np.int32)
    np.cumsum(rlen, out=roff[1:])
    cols = [
        pa.array([s.op for s in segs], pa.string()),
        pa.array([split_op(s.op)[0] for s in segs], pa.int32()),
        pa.array([s.dtype for s in segs], pa.string()),
        pa.array([s.shape for s in segs], pa.list_(pa.int64())),
        pa.array(width),
        pa.array(itemsize.astype(np.int32)),
        pa.array(ks),
        pa.BinaryArray.from_buffers(pa.binary(), len(segs), [None, pa.py_buffer(roff), pa.py_buffer(np.concatenate(runs))]),
        _blob_col(d, ks * 8),
        _blob_col(stats, n_stats * 16),
        pa.array(am_w.astype(np.int8)),
        _blob_col(abs_max, n_stats * am_w),
        _blob_col(counts, c_rows * 8),
        _blob_col(vals, n_full * width * itemsize),
        pa.array(topk_k.astype(np.int32)),
        _blob_col(t_ids, t_rows * topk_k * 4),
        _blob_col(t_vals, t_rows * topk_k * 4),
    ]
    return pa.Table.from_arrays(cols, schema=PACKED_SCHEMA)
