"""Op-level comparison of two captures (sampler vs learner on the same tokens), numpy only.

Per canonical op, over the tokens both sides captured: bitwise-equal fraction (from digests, any
mode), and where both sides kept values (``full`` mode): max/mean abs diff, relative L2
``||s - l|| / ||l||``, cosine, SQNR in dB, and the max ULP distance in the op's dtype.
The learner is the reference (``l``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pandas as pd

from mismatch_probe.analysis import pair_stats
from mismatch_probe.families.opnames import DEFAULT_RTOL, exec_order, split_op
from mismatch_probe.run import reader as layout

_INT_VIEW = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}
_SIGN = {np.uint16: 0x8000, np.uint32: 0x80000000, np.uint64: 1 << 63}


def decode_rows(values: pd.Series, dtype: str) -> np.ndarray:
    """Raw ``values`` bytes of equal-shaped rows -> float64 matrix [rows, numel]."""
    return decode_buffer(b"".join(values.tolist()), len(values), dtype)


def decode_buffer(buf: Any, n: int, dtype: str) -> np.ndarray:
    """The concatenated raw bytes of ``n`` equal-shaped rows -> float64 matrix [rows, numel]."""
    if dtype == "bfloat16":
        u = np.frombuffer(buf, np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).astype(np.float64).reshape(n, -1)
    if dtype == "bool":
        return np.frombuffer(buf, np.uint8).astype(np.float64).reshape(n, -1)
    return np.frombuffer(buf, np.dtype(dtype)).astype(np.float64).reshape(n, -1)


def _ordered(raw: np.ndarray, ut: type) -> np.ndarray:
    sign = _SIGN[ut]
    mag = (raw & (sign - 1)).astype(np.int64) if ut is not np.uint64 else (raw & (sign - 1)).astype(np.int64)
    return np.where(raw & sign, -mag, mag)


def ulp_distance(a: pd.Series, b: pd.Series, dtype: str) -> float:
    return ulp_distance_buffers(b"".join(a.tolist()), b"".join(b.tolist()), dtype)


def ulp_distance_buffers(a: Any, b: Any, dtype: str) -> float:
    """Max ULP distance between two buffers of the same rows' raw bytes."""
    ut = _INT_VIEW.get(dtype)
    if ut is None:
        return math.nan
    ra = np.frombuffer(a, ut)
    rb = np.frombuffer(b, ut)
    d = np.abs(_ordered(ra, ut) - _ordered(rb, ut))
    return float(d.max()) if d.size else 0.0


def error_stats(s: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Error of ``s`` against the reference ``ref`` (same shape, float64)."""
    fin = np.isfinite(s) & np.isfinite(ref)
    s, ref = np.where(fin, s, 0.0), np.where(fin, ref, 0.0)
    diff = s - ref
    nd, nr, ns = float(np.linalg.norm(diff)), float(np.linalg.norm(ref)), float(np.linalg.norm(s))
    ad = np.abs(diff)
    return {
        "max_abs_diff": float(ad.max()) if diff.size else 0.0,
        "mean_abs_diff": float(ad.mean()) if diff.size else 0.0,
        "rel_l2": nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf),
        "cosine": 1.0 if nd == 0 else (float((s * ref).sum() / (ns * nr)) if ns > 0 and nr > 0 else 0.0),
        "sqnr_db": 10 * math.log10(nr**2 / nd**2) if nd > 0 and nr > 0 else math.inf,
    }


_KEYS = ("op", "seq_id", "pos", "dtype", "digest", "values")
# threads for the per-op arithmetic over the rows both sides kept in full (results do not depend on it)
OP_THREADS = min(8, os.cpu_count() or 1)


class _Side:
    """One capture's rows for the comparison: per token row its join key parts (``op`` code into
    the shared name list, ``seq_id``, ``pos``), ``dtype`` code, digest (uint64 for mp64 digests of
    a packed file, else an Arrow string array), and the rows kept in ``full``: ``full_idx`` (their
    row numbers, ascending) and ``full_vals`` (their bytes, an Arrow binary array in that order)."""

    kind = "mp64"
    digest: Any = None
    full_idx: np.ndarray = np.zeros(0, np.int64)
    full_vals: Any = None

    def size(self) -> int:
        raise NotImplementedError

    def seq_range(self) -> tuple[int, int]:
        raise NotImplementedError

    def pos_max(self) -> int:
        raise NotImplementedError

    def keys(self, smax: int, pmax: int) -> np.ndarray:
        raise NotImplementedError

    def dtype_at(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError

    def set_full(self, idx: np.ndarray, vals: Any) -> None:
        self.full_idx, self.full_vals = idx, vals

    def in_full(self, idx: np.ndarray) -> np.ndarray:
        """Whether each row ``idx`` was kept in ``full`` (a mask over the rows, then one gather: no
        search per joined row)."""
        if not self.full_idx.size:
            return np.zeros(idx.size, bool)
        mask = np.zeros(self.size(), bool)
        mask[self.full_idx] = True
        return mask[idx]

    def values_at(self, idx: np.ndarray) -> Any:
        """The kept bytes of rows ``idx`` (each one kept in ``full``): the side's own array where ``idx``
        is every full row in its order (the usual case: no copy of the window's bytes), else a take."""
        import pyarrow as pa

        at = np.searchsorted(self.full_idx, idx)
        if at.size == len(self.full_vals) and (at[1:] > at[:-1]).all():  # all of them, ascending: in order
            return self.full_vals
        return self.full_vals.take(pa.array(at))


class _RowSide(_Side):
    """A per-row ops table (one row per op and token)."""

    def __init__(self, op: np.ndarray, seq: np.ndarray, pos: np.ndarray, dtype: np.ndarray, digest: Any, values: Any,
                 kind: str) -> None:
        import pyarrow as pa

        self.op, self.seq, self.pos, self.dtype, self.digest, self.kind = op, seq, pos, dtype, digest, kind
        valid = np.asarray(values.is_valid(), bool) if len(values) else np.zeros(0, bool)
        idx = np.nonzero(valid)[0]
        self.set_full(idx, values.take(pa.array(idx)) if idx.size else None)

    def size(self) -> int:
        return self.op.size

    def seq_range(self) -> tuple[int, int]:
        return int(self.seq.min(initial=0)), int(self.seq.max(initial=0))

    def pos_max(self) -> int:
        return int(self.pos.max(initial=0))

    def keys(self, smax: int, pmax: int) -> np.ndarray:
        return (self.op * smax + self.seq) * pmax + self.pos

    def dtype_at(self, idx: np.ndarray) -> np.ndarray:
        return self.dtype[idx]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.op, self.seq, self.pos, self.dtype


class _PackedSide(_Side):
    """A packed ops table (run/ops_packed.py): keys made from its runs (one ``repeat`` per token),
    digests as uint64, the ``full`` rows' bytes cut from the values blob; nothing else per token."""

    def __init__(self, t: Any, ops: dict[str, int], dtypes: dict[str, int]) -> None:
        import pyarrow.compute as pc

        from mismatch_probe.run import ops_packed as P

        self.n = np.asarray(t.column("n"), np.int64)
        runs = P.blob(t.column("runs"), np.int32).reshape(-1, 4).astype(np.int64)
        nruns = np.asarray(pc.binary_length(t.column("runs")).fill_null(0), np.int64) // 16 if len(self.n) else \
            np.zeros(0, np.int64)
        self.run_row = np.repeat(np.arange(self.n.size), nruns)
        self.runs = runs
        self.start = np.zeros(runs.shape[0], np.int64)
        np.cumsum(runs[:-1, 2], out=self.start[1:])
        self.total = int(runs[:, 2].sum())
        self.opc = _codes(t.column("op"), ops) if len(self.n) else np.zeros(0, np.int64)
        self.dtc = _codes(t.column("dtype"), dtypes) if len(self.n) else np.zeros(0, np.int64)
        self.row_start = np.zeros(self.n.size + 1, np.int64)
        np.cumsum(self.n, out=self.row_start[1:])
        self.digest = P.digests_u64(t)
        full = np.nonzero(runs[:, 3] == P.FULL)[0]
        if full.size:  # the token rows of the full runs, ascending, and their bytes in that order
            idx = np.concatenate([np.arange(self.start[r], self.start[r] + runs[r, 2]) for r in full])
            row = self.run_row[full]
            width = np.asarray(t.column("width"), np.int64)[row] * np.asarray(t.column("itemsize"), np.int64)[row]
            lens = np.repeat(width, runs[full, 2])
            off = np.zeros(idx.size + 1, np.int64)
            np.cumsum(lens, out=off[1:])
            import pyarrow as pa

            data = P.blob(t.column("values"), np.uint8)
            self.set_full(idx, pa.LargeBinaryArray.from_buffers(pa.large_binary(), idx.size,
                                                                [None, pa.py_buffer(off), pa.py_buffer(data)]))

    def size(self) -> int:
        return self.total

    def seq_range(self) -> tuple[int, int]:
        s = self.runs[:, 0]
        return int(s.min(initial=0)), int(s.max(initial=0))

    def pos_max(self) -> int:
        r = self.runs
        return int((r[:, 1] + r[:, 2] - 1).max(initial=0))

    def keys(self, smax: int, pmax: int) -> np.ndarray:
        r = self.runs
        base = (self.opc[self.run_row] * smax + r[:, 0]) * pmax + r[:, 1] - self.start
        return np.repeat(base, r[:, 2]) + np.arange(self.total, dtype=np.int64)

    def dtype_at(self, idx: np.ndarray) -> np.ndarray:
        if self.dtc.size and (self.dtc == self.dtc[0]).all():  # one dtype (the usual case): no per-row lookup
            return np.full(idx.size, self.dtc[0], np.int64)
        return self.dtc[np.searchsorted(self.row_start, idx, side="right") - 1]

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per token row: op code, seq_id, pos, dtype code (the rank files of FSDP, merged)."""
        r, cnt = self.runs, self.runs[:, 2]
        row = np.repeat(self.run_row, cnt)
        pos = np.arange(self.total, dtype=np.int64) - np.repeat(self.start - r[:, 1], cnt)
        return self.opc[row], np.repeat(r[:, 0], cnt), pos, self.dtc[row]


def _codes(col: Any, names: dict[str, int]) -> np.ndarray:
    """Codes of an Arrow string column's values in ``names`` (extended with new ones): the column
    is dictionary-encoded once (a few hundred distinct ops), no Python per row."""
    import pyarrow as pa

    enc = col.dictionary_encode() if not pa.types.is_dictionary(col.type) else col
    enc = enc.combine_chunks() if isinstance(enc, pa.ChunkedArray) else enc
    local = np.array([names.setdefault(str(v), len(names)) for v in enc.dictionary.to_pylist()], np.int64)
    idx = np.asarray(enc.indices.fill_null(0), np.int64)
    return local[idx] if local.size else np.zeros(len(idx), np.int64)


def _side_from_table(t: Any, ops: dict[str, int], dtypes: dict[str, int]) -> _Side:
    """A per-row ops table (Arrow) -> :class:`_Side`."""
    d = t.column("digest")
    first = next((v for v in d.drop_null().slice(0, 1).to_pylist()), None) if len(d) else None
    kind = "blake2b" if first is not None and str(first).startswith("blake2b:") else "mp64"
    return _RowSide(_codes(t.column("op"), ops), np.asarray(t.column("seq_id"), np.int64),
                    np.asarray(t.column("pos"), np.int64), _codes(t.column("dtype"), dtypes), d.combine_chunks(),
                    t.column("values").combine_chunks(), kind)


_PACKED_COLUMNS = ("op", "dtype", "width", "itemsize", "n", "runs", "digest", "values")  # what _PackedSide reads
_DENSE_MAX = 1 << 27  # key-space size up to which the join uses a dense index (4 bytes an entry)


def _join(a: _Side, b: _Side, n_ops: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``a`` and ``b`` with the same (op, seq_id, pos), as index pairs in ``a``'s row order,
    and the op code of each pair (a dense index over the key space, or a sort-merge join on one
    int64 key; a key twice on one side is an error)."""
    (sa0, sa1), (sb0, sb1) = a.seq_range(), b.seq_range()
    smax = max(sa1, sb1) + 1
    pmax = max(a.pos_max(), b.pos_max()) + 1
    if float(n_ops) * smax * pmax >= 2.0**62 or min(sa0, sb0) < 0:
        raise ValueError("op rows: (op, seq_id, pos) out of the comparable range")
    ka = a.keys(smax, pmax)
    kb = b.keys(smax, pmax)
    ia, ib = _match(ka, kb, n_ops * smax * pmax)
    return ia, ib, ka[ia] // (smax * pmax)


def _match(ka: np.ndarray, kb: np.ndarray, space: int) -> tuple[np.ndarray, np.ndarray]:
    dup = "op rows: an (op, seq_id, pos) row appears twice on one side (merge validate: one_to_one)"
    if space <= _DENSE_MAX:  # one scatter, one gather, no sort
        where = np.full(space, -1, np.int32 if max(ka.size, kb.size) < 1 << 31 else np.int64)
        for k in (ka, kb):
            ar = np.arange(k.size, dtype=where.dtype)
            where[k] = ar
            if (where[k] != ar).any():
                raise ValueError(dup)
            if k is ka:
                where[k] = -1
        j = where[ka]
        ia = np.nonzero(j >= 0)[0]
        return ia, j[ia].astype(np.int64)
    ob = np.argsort(kb, kind="stable")
    sb = kb[ob]
    for k in (np.sort(ka), sb):
        if k.size > 1 and (k[1:] == k[:-1]).any():
            raise ValueError(dup)
    j = np.searchsorted(sb, ka)
    j = np.minimum(j, max(sb.size - 1, 0))
    hit = (sb[j] == ka) if sb.size else np.zeros(ka.size, bool)
    ia = np.nonzero(hit)[0]
    return ia, ob[j[hit]]


def _equal_digests(a: _Side, b: _Side, ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    da, db = a.digest, b.digest
    if isinstance(da, np.ndarray) and isinstance(db, np.ndarray):
        return da[ia] == db[ib]
    from mismatch_probe.run.ops_packed import hex_strings

    xa = hex_strings(da[ia]) if isinstance(da, np.ndarray) else da.take(pa.array(ia))
    xb = hex_strings(db[ib]) if isinstance(db, np.ndarray) else db.take(pa.array(ib))
    return np.asarray(pc.equal(xa, xb).fill_null(False), bool)


def _raw(sub: Any) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of a binary array's rows, concatenated (a view), and each row's length."""
    import pyarrow.compute as pc

    from mismatch_probe.run.ops_packed import blob

    return blob(sub, np.uint8), np.asarray(pc.binary_length(sub).fill_null(0), np.int64)


def _compare(a: _Side, b: _Side, op_names: list[str], dtype_names: list[str], num_layers: int) -> pd.DataFrame:
    n_ops = len(op_names)
    ia, ib, op = _join(a, b, n_ops)
    n_rows = np.bincount(op, minlength=n_ops)
    eq = _equal_digests(a, b, ia, ib)
    n_eq = np.bincount(op, weights=eq, minlength=n_ops)
    dl, ds = a.dtype_at(ia), b.dtype_at(ib)
    n_dt_diff = np.bincount(op, weights=dl != ds, minlength=n_ops)
    first = np.full(n_ops, -1, np.int64)  # each op's first joined row (in a's order): its dtype names the op's
    first[op[::-1]] = np.arange(op.size - 1, -1, -1)  # the last write of a repeated index wins: the first row
    present = np.nonzero(n_rows)[0]
    same_digest = a.kind == b.kind
    # the joined rows both sides kept in full, grouped by op (in a's order within one)
    fi = np.nonzero(a.in_full(ia) & b.in_full(ib))[0]
    fi = fi[np.argsort(op[fi], kind="stable")]
    fcut = np.searchsorted(op[fi], np.arange(n_ops + 1))
    # their bytes, taken once per side in that order; each op's rows are a slice of them
    va = a.values_at(ia[fi]) if fi.size else None
    vb = b.values_at(ib[fi]) if fi.size else None

    def one(c: int) -> dict[str, Any]:
        name = op_names[c]
        layer, kind = split_op(name)
        same_dtype = n_dt_diff[c] == 0
        f = first[c]
        dname_l, dname_s = dtype_names[dl[f]], dtype_names[ds[f]]
        row = {"op": name, "layer": layer, "kind": kind, "exec_order": exec_order(name, num_layers),
               "dtype": dname_l if same_dtype else f"{dname_l}|{dname_s}", "n_rows": int(n_rows[c]),
               "bitwise_equal_frac": float(n_eq[c] / n_rows[c]) if same_dtype else 0.0}
        lo, hi = fcut[c], fcut[c + 1]
        sel = fi[lo:hi]
        if sel.size:
            (bl, ll), (bs, ls) = _raw(va.slice(lo, hi - lo)), _raw(vb.slice(lo, hi - lo))
        if same_dtype and not same_digest:
            if sel.size:
                same = [x == y for x, y in zip(_split(bl, ll), _split(bs, ls), strict=True)]
                row["bitwise_equal_frac"] = float(np.mean(same))
            else:
                row["bitwise_equal_frac"] = math.nan
        if sel.size and same_dtype and pair_stats.supported(row["dtype"]) and np.array_equal(ll, ls) \
                and (ll.size == 0 or (ll == ll[0]).all()):  # one pass over the raw bits, no float64 copies
            row.update(pair_stats.pair_stats(bl, bs, row["dtype"]))
        elif sel.size:
            try:
                ref = decode_buffer(bl, sel.size, dtype_names[dl[sel[0]]])
                got = decode_buffer(bs, sel.size, dtype_names[ds[sel[0]]])
            except ValueError:  # rows of unequal lengths: no matrix (as decode_rows of them)
                ref = got = None
            row.update(error_stats(got, ref) if ref is not None and ref.shape == got.shape else {"rel_l2": math.nan})
            row["max_ulp"] = ulp_distance_buffers(bs, bl, row["dtype"]) if same_dtype else math.nan
        return row

    order = sorted(present, key=lambda c: first[c])  # the ops in the order of their first joined row
    if fi.size and len(order) > 1 and OP_THREADS > 1:  # the full rows' arithmetic: numpy releases the GIL
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(OP_THREADS, len(order))) as ex:
            rows = list(ex.map(one, order))
    else:
        rows = [one(c) for c in order]
    out = pd.DataFrame(rows, columns=OP_ERRORS_COLUMNS)
    return out.sort_values("exec_order", kind="stable").reset_index(drop=True)


def _split(buf: np.ndarray, lens: np.ndarray) -> list[bytes]:
    out, o = [], 0
    for n in lens.tolist():  # rows of v1 captures (blake2b digests), compared by their values
        out.append(buf[o : o + n].tobytes())
        o += n
    return out


OP_ERRORS_COLUMNS = ["op", "layer", "kind", "exec_order", "dtype", "n_rows", "bitwise_equal_frac", "max_abs_diff",
                     "mean_abs_diff", "rel_l2", "cosine", "sqnr_db", "max_ulp"]


def _arrow(df: Any) -> Any:
    import pyarrow as pa

    if isinstance(df, pa.Table):
        return df.select(list(_KEYS))
    t = pa.Table.from_pandas(df[list(_KEYS)], preserve_index=False)
    if pa.types.is_null(t.column("values").type):
        t = t.set_column(t.column_names.index("values"), "values", t.column("values").cast(pa.binary()))
    if pa.types.is_null(t.column("digest").type):
        t = t.set_column(t.column_names.index("digest"), "digest", t.column("digest").cast(pa.string()))
    return t


def op_errors(learner: Any, sampler: Any, num_layers: int) -> pd.DataFrame:
    """One row per op both sides captured, in execution order. ``learner``/``sampler``: ops tables
    (pandas or Arrow); compared by a join on (op, seq_id, pos) over whole columns, per-op figures
    by ``bincount``; only the rows both sides kept in ``full`` are decoded, op by op."""
    ops: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    a = _side_from_table(_arrow(learner), ops, dtypes)
    b = _side_from_table(_arrow(sampler), ops, dtypes)
    return _compare(a, b, list(ops), list(dtypes), num_layers)


def _read_side(path: Any, ops: dict[str, int], dtypes: dict[str, int]) -> _Side:
    import pyarrow.parquet as pq

    from mismatch_probe.run.ops_packed import is_packed
    from mismatch_probe.run.schema import SCHEMA_VERSION, read_schema_version, read_table

    if read_schema_version(path) <= SCHEMA_VERSION and is_packed(pq.read_schema(path)):
        # the columns the join and the full rows need: not the stats, counts or top-k blobs
        return _PackedSide(pq.read_table(path, columns=list(_PACKED_COLUMNS)), ops, dtypes)
    return _side_from_table(read_table(path, "ops").select(list(_KEYS)), ops, dtypes)


def _concat(parts: list[_Side]) -> _Side:
    """The rank files of one side as one :class:`_RowSide` (rows of all ranks, in rank order)."""
    import pyarrow as pa

    if len(parts) == 1:
        return parts[0]
    cols = [p.columns() for p in parts]
    out = object.__new__(_RowSide)
    out.op, out.seq, out.pos, out.dtype = (np.concatenate([c[i] for c in cols]) for i in range(4))
    digs = [p.digest for p in parts]
    if all(isinstance(d, np.ndarray) for d in digs):
        out.digest = np.concatenate(digs)
    else:
        from mismatch_probe.run.ops_packed import hex_strings

        out.digest = pa.concat_arrays([hex_strings(d) if isinstance(d, np.ndarray) else d.cast(pa.string()) for d in digs])
    base = np.cumsum([0] + [p.size() for p in parts])
    idx = np.concatenate([p.full_idx + b for p, b in zip(parts, base, strict=False)])
    vals = [p.full_vals.cast(pa.large_binary()) for p in parts if p.full_vals is not None]
    out.set_full(idx, pa.concat_arrays(vals) if vals else None)
    kinds = {p.kind for p in parts}
    out.kind = kinds.pop() if len(kinds) == 1 else "mixed"
    return out


def op_errors_run(run_dir: Any, num_layers: int) -> pd.DataFrame | None:
    """``op_errors`` of a run's two captures read from disk (``side/ops.parquet`` or the ranks of
    ``side/ops_by_rank``), packed files compared without unpacking them; None when a side has none."""
    from pathlib import Path

    sides = []
    ops: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    for side in ("learner", "sampler"):
        f = Path(run_dir) / layout.ops_file(side)
        d = Path(run_dir) / layout.ops_by_rank(side)
        files = [f] if f.exists() else sorted(d.rglob("*.parquet")) if d.is_dir() else []
        if not files:
            return None
        sides.append(_concat([_read_side(p, ops, dtypes) for p in files]))
    return _compare(sides[0], sides[1], list(ops), list(dtypes), num_layers)


DOMINANT_EQUAL_FRAC = 0.5  # "dominant divergence": the first op where most rows differ


def first_divergent(errs: pd.DataFrame) -> dict[str, Any]:
    """First op (execution order) not bitwise equal, first over its dtype's tolerance, and the
    dominant divergence: the first op where most rows (bitwise-equal fraction < 0.5) differ (a
    first op with a few 1-ulp rows, e.g. GEMM batch variance, is often not where the engines part),
    from an op-errors table (the one definition: bisect, gate and the report use it)."""
    errs = errs.sort_values("exec_order", kind="stable")

    def pick(mask: pd.Series) -> dict[str, Any] | None:
        hit = errs[mask]
        if hit.empty:
            return None
        r = hit.iloc[0]
        return {
            "op": r.op,
            "layer": int(r.layer),
            "exec_order": int(r.exec_order),
            "bitwise_equal_frac": float(r.bitwise_equal_frac),
            "rel_l2": None if pd.isna(r.rel_l2) else float(r.rel_l2),
            "dtype": r["dtype"],
        }

    tol = errs.dtype.map(lambda d: DEFAULT_RTOL.get(str(d), 1e-2))
    over = errs.rel_l2.notna() & (errs.rel_l2 > tol)
    return {"bitwise": pick(errs.bitwise_equal_frac < 1.0), "tolerance": pick(over),
            "dominant": pick(errs.bitwise_equal_frac < DOMINANT_EQUAL_FRAC), "dominant_equal_frac": DOMINANT_EQUAL_FRAC,
            "tolerances": DEFAULT_RTOL}


BY_KIND_COLUMNS = ["kind", "n_ops", "n_rows", "bitwise_equal_frac", "rel_l2_first", "rel_l2_median", "rel_l2_max",
                   "max_abs_diff", "max_ulp"]


def by_kind(errs: pd.DataFrame) -> pd.DataFrame:
    """The op-errors table summarized per op kind (``attn.o`` over all layers; ``embed``, ``logits``
    alone), in execution order: ops, rows, bitwise-equal fraction over all rows, relative L2 at the
    kind's first layer, its median and max over layers (NaN where no side kept values), max abs diff
    and max ULP distance."""
    if errs.empty:
        return pd.DataFrame(columns=BY_KIND_COLUMNS)
    errs = errs.sort_values("exec_order", kind="stable")
    rows = []
    for kind, g in errs.groupby("kind", sort=False):
        rel = g.rel_l2.dropna()
        rows.append({
            "kind": kind,
            "n_ops": len(g),
            "n_rows": int(g.n_rows.sum()),
            "bitwise_equal_frac": float((g.bitwise_equal_frac * g.n_rows).sum() / g.n_rows.sum()),
            "rel_l2_first": float(g.rel_l2.iloc[0]) if not pd.isna(g.rel_l2.iloc[0]) else math.nan,
            "rel_l2_median": float(rel.median()) if len(rel) else math.nan,
            "rel_l2_max": float(rel.max()) if len(rel) else math.nan,
            "max_abs_diff": float(g.max_abs_diff.max()) if g.max_abs_diff.notna().any() else math.nan,
            "max_ulp": float(g.max_ulp.max()) if g.max_ulp.notna().any() else math.nan,
        })
    return pd.DataFrame(rows, columns=BY_KIND_COLUMNS)
