"""The packed layout of a streamed ``ops.parquet`` (schema v3): one Parquet row per recorded op call
(an op over one micro-batch of tokens), its per-token columns as little-endian byte blobs, written
as they come out of the recorder's arena (no Python per token row, no hex strings, no compression
of data that cannot compress: digests and stats). Readers never see it: :func:`unpack` turns it
into the one ``ops`` table (one row per op and token, ``mismatch_probe.run.schema.OPS_V1`` plus
the top-k columns) with the same content the per-row writer wrote (same digests, stats, values and
top-k per (op, seq_id, pos); tested against a golden table of the per-row writer).

Columns of a packed row (``n`` = its tokens, ``s`` = those of them kept in ``stats`` or ``full``):

- ``op``, ``layer``, ``dtype``, ``shape`` (of one token's row), ``width`` (its elements),
  ``itemsize`` (bytes per element), ``n``;
- ``runs``: int32 [r, 4]: ``seq_id``, first ``pos``, token count, mode (1 digest, 2 stats, 3 full)
  of each stretch of consecutive positions of one sequence in one mode, in row order;
- ``digest``: uint64 [n], the ``mp64`` digest of each row;
- ``stats``: float64 [s, 2] (``sum, sum_sq``), ``abs_max``: [s] values of ``am_width`` bytes each (2: the
  bits of a bfloat16, the op's dtype, whose rows' maxima are bf16 values; 8: float64), and ``counts``:
  int32 [s, 2] (``n_nan, n_inf``), null when s = 0 or (packed-v3) when none of the row's stats rows has a
  NaN or an Inf: read as zeros;
- ``values``: the raw bytes of the ``full`` rows, concatenated in row order, null when none;
- ``topk_ids`` / ``topk_values``: int32 / float32 [s, topk_k] of ``logits`` rows, null when none.

Layouts: ``packed-v3`` (schema v5, written now); ``packed-v2`` (schema v4, read as before): ``counts`` of
every stats row (8 bytes of zeros nearly always); ``packed-v1`` (schema v3, read as before): ``stats``
float64 [s, 3] with ``abs_max`` as its third column, no ``am_width`` / ``abs_max`` columns. v2 writes 6
fewer bytes per stats row of a bf16 op (26 instead of 32 with the digest); v3 skips the 8 bytes of counts
where they are all zero (the writer's time per stats row, not only the file's size: BENCHMARKS.md).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

LAYOUT_KEY = b"mismatch_probe.ops_layout"
PACKED = b"packed-v3"  # the layout written
PACKED_V2 = b"packed-v2"  # schema v4's: counts of every stats row
PACKED_V1 = b"packed-v1"  # schema v3's: stats [s, 3] float64
_LAYOUTS = (PACKED, PACKED_V2, PACKED_V1)
FULL, STATS = 3, 2

PACKED_SCHEMA = pa.schema([
    ("op", pa.string()),
    ("layer", pa.int32()),
    ("dtype", pa.string()),
    ("shape", pa.list_(pa.int64())),
    ("width", pa.int64()),
    ("itemsize", pa.int32()),
    ("n", pa.int64()),
    ("runs", pa.binary()),
    ("digest", pa.large_binary()),
    ("stats", pa.large_binary()),
    ("am_width", pa.int8()),
    ("abs_max", pa.large_binary()),
    ("counts", pa.large_binary()),
    ("values", pa.large_binary()),
    ("topk_k", pa.int32()),
    ("topk_ids", pa.large_binary()),
    ("topk_values", pa.large_binary()),
])
# blobs of random-looking bits: compressing them costs time and saves nothing
_RAW = ("digest", "stats", "abs_max", "values", "topk_ids", "topk_values")
_COMPRESSION = {f.name: ("NONE" if f.name in _RAW else "SNAPPY") for f in PACKED_SCHEMA if f.name != "shape"}


def fresh(tmp: str) -> str:
    """``tmp``, a temp name reserved by ``mkstemp`` (an empty file), removed so that the Parquet writer
    creates the file anew instead of truncating it: ext4 (``auto_da_alloc``, on by default) writes back at
    ``close()`` the data of a file that was truncated and rewritten, and the writer waited for it (the
    packed ``ops.parquet``'s close 27-45 ms for 90 MB on the dev box, 0.5 ms for a new file); a new file's
    pages are written back later, as any file's. A non-empty file is left as it is."""
    try:
        if os.path.getsize(tmp) == 0:
            os.unlink(tmp)
    except FileNotFoundError:
        pass
    return tmp


def is_packed(schema: pa.Schema) -> bool:
    return (schema.metadata or {}).get(LAYOUT_KEY) in _LAYOUTS


class PackedWriter:
    """``ops.parquet`` in the packed layout, written in row groups while it is produced, atomically
    (a temp file beside ``path``, renamed into place by :meth:`close`, removed by :meth:`abort`)."""

    def __init__(self, path: Path, meta: dict[bytes, bytes], tmp: str | None = None) -> None:
        """``meta``: the file's key-value metadata, the schema version and kind included (see
        ``probes/ops_table.py`` ``packed_writer``; this module imports nothing of ``schema``, which
        imports it)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tmp is None:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            os.close(fd)
        self._tmp = tmp
        m = {**meta, LAYOUT_KEY: PACKED}
        self.schema = PACKED_SCHEMA.with_metadata(m)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            fresh(self._tmp), self.schema, compression=_COMPRESSION, use_dictionary=["op", "dtype"],
            write_statistics=["op", "layer", "n"])
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        assert self._writer is not None, "PackedWriter already closed"
        self._writer.write_table(table.replace_schema_metadata(self.schema.metadata))
        self.rows += int(np.asarray(table.column("n")).sum()) if table.num_rows else 0

    def close(self) -> Path:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(self._tmp, 0o666 & ~mask)
            os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        Path(self._tmp).unlink(missing_ok=True)


# ---- reading ------------------------------------------------------------------------------------
def blob(col: Any, dtype: Any) -> np.ndarray:
    """The concatenated bytes of a binary column (all rows, in order; nulls are empty) as ``dtype``."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0 or arr.buffers()[2] is None:
        return np.zeros(0, dtype)
    otype = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    off = np.frombuffer(arr.buffers()[1], otype)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], np.uint8)[int(off[0]) : int(off[-1])]
    return data.view(dtype)


def token_keys(table: pa.Table) -> dict[str, np.ndarray]:
    """Per token row of a packed table, in row order: ``row`` (its packed row), ``seq_id``,
    ``pos``, ``mode``; and ``n`` per packed row."""
    n = np.asarray(table.column("n"), np.int64)
    runs = blob(table.column("runs"), np.int32).reshape(-1, 4).astype(np.int64)
    cnt = runs[:, 2]
    total = int(cnt.sum())
    start = np.zeros(runs.shape[0], np.int64)
    np.cumsum(cnt[:-1], out=start[1:])
    pos = np.arange(total, dtype=np.int64) - np.repeat(start - runs[:, 1], cnt)
    return {"n": n, "row": np.repeat(np.arange(len(n)), n), "seq_id": np.repeat(runs[:, 0], cnt), "pos": pos,
            "mode": np.repeat(runs[:, 3], cnt)}


def digests_u64(table: pa.Table) -> np.ndarray:
    return blob(table.column("digest"), "<u8")


# byte -> its two lowercase hex digits as one little-endian uint16 (first digit in the low byte)
_HEX2 = np.array([ord(f"{i:02x}"[0]) | ord(f"{i:02x}"[1]) << 8 for i in range(256)], "<u2")


def hex_chars(d: np.ndarray) -> np.ndarray:
    """uint64 digests -> their 16 lowercase hex digits, uint8 [n, 16] (one table lookup per byte)."""
    be = np.ascontiguousarray(np.asarray(d).view("<u8").astype(">u8")).view(np.uint8)
    return _HEX2[be].view(np.uint8).reshape(-1, 16)


def hex_strings(d: np.ndarray) -> pa.Array:
    """uint64 digests -> Arrow strings of their 16 lowercase hex digits (array ops only)."""
    c = hex_chars(d)
    offsets = np.arange(0, 16 * (c.shape[0] + 1), 16, dtype=np.int32)
    return pa.StringArray.from_buffers(c.shape[0], pa.py_buffer(offsets), pa.py_buffer(c))


def unpack(table: pa.Table) -> pa.Table:
    """A packed ``ops`` table as the ``ops`` table, one row per op and token (tables not in the
    packed layout are returned as they are)."""
    if not is_packed(table.schema):
        return table
    k = token_keys(table)
    row, modes = k["row"], k["mode"]
    total = row.size
    stats_on = modes >= STATS
    width = np.asarray(table.column("width"), np.int64)
    s5 = np.zeros((total, 5))
    if (table.schema.metadata or {}).get(LAYOUT_KEY) == PACKED_V1:
        st = blob(table.column("stats"), "<f8").reshape(-1, 3)
    else:
        st2 = blob(table.column("stats"), "<f8").reshape(-1, 2)
        st = np.column_stack([st2, abs_max_values(table, np.bincount(row[stats_on], minlength=table.num_rows))]) \
            if st2.size else st2
    if st.size:
        s5[stats_on, :3] = st
        s5[stats_on, 3:] = _counts(table, row[stats_on])
    nan = np.where(stats_on[:, None], s5, np.nan)
    values = unpack_values(table, k)
    # shape: the packed row's list, once per token
    shape = table.column("shape").combine_chunks().take(pa.array(row))
    cols = {
        "op": table.column("op").combine_chunks().take(pa.array(row)),
        "layer": np.asarray(table.column("layer"), np.int32)[row],
        "seq_id": k["seq_id"].astype(np.int32),
        "pos": k["pos"].astype(np.int32),
        "dtype": table.column("dtype").combine_chunks().take(pa.array(row)),
        "shape": shape,
        "numel": np.where(stats_on, width[row], 0).astype(np.int64),
        "sum": nan[:, 0],
        "sum_sq": nan[:, 1],
        "abs_max": nan[:, 2],
        "n_nan": np.where(stats_on, s5[:, 3], 0).astype(np.int64),
        "n_inf": np.where(stats_on, s5[:, 4], 0).astype(np.int64),
        "digest": hex_strings(digests_u64(table)),
        "values": values,
    }
    cols["topk_ids"], cols["topk_values"] = _topk(table, row, stats_on)
    return pa.table(cols)


def _counts(table: pa.Table, stats_row: np.ndarray) -> np.ndarray:
    """int32 [s, 2] NaN / Inf counts of every stats row (``stats_row``: each one's packed row): packed-v3
    leaves a packed row's counts null where all are zero."""
    c = blob(table.column("counts"), "<i4").reshape(-1, 2)
    if c.shape[0] == stats_row.size:  # every stats row's counts stored (v1, v2; v3 with a NaN in each)
        return c
    out = np.zeros((stats_row.size, 2), np.int32)
    if c.size:
        has = pc.is_valid(table.column("counts")).to_numpy(zero_copy_only=False)
        out[has[stats_row]] = c
    return out


def abs_max_values(table: pa.Table, n_stats: np.ndarray) -> np.ndarray:
    """float64 abs_max of every stats row of a packed-v2 table (``n_stats``: stats rows per packed row):
    each packed row's values are ``am_width`` bytes wide (2: bf16 bits, widened exactly; 8: float64)."""
    raw = blob(table.column("abs_max"), np.uint8)
    w = np.repeat(np.asarray(table.column("am_width"), np.int64), n_stats)
    if (w == 2).all():  # a table of bf16 ops only (none: an empty array)
        return _bf16_bits_to_f64(raw.view("<u2"))
    if (w == 8).all():
        return raw.view("<f8").astype(np.float64)
    off = np.zeros(w.size, np.int64)
    np.cumsum(w[:-1], out=off[1:])
    out = np.empty(w.size)
    two = w == 2
    out[two] = _bf16_bits_to_f64(raw[off[two][:, None] + np.arange(2)].reshape(-1).view("<u2"))
    out[~two] = raw[off[~two][:, None] + np.arange(8)].reshape(-1).view("<f8")
    return out


def _bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> their float64 values (exact: a bf16 is the high half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def unpack_values(table: pa.Table, k: dict[str, np.ndarray]) -> pa.Array:
    """The ``values`` column, one entry per token row (null where the row is not ``full``); ``k``:
    :func:`token_keys` of ``table``."""
    row, modes = k["row"], k["mode"]
    total = row.size
    width = np.asarray(table.column("width"), np.int64)
    itemsize = np.asarray(table.column("itemsize"), np.int64)
    vlen = np.where(modes == FULL, width[row] * itemsize[row], 0)
    voff = np.zeros(total + 1, np.int64)
    np.cumsum(vlen, out=voff[1:])
    vdata = blob(table.column("values"), np.uint8)
    valid = pa.py_buffer(np.packbits(modes == FULL, bitorder="little"))
    if voff[-1] < 1 << 31:
        return pa.BinaryArray.from_buffers(pa.binary(), total, [valid, pa.py_buffer(voff.astype(np.int32)),
                                                                pa.py_buffer(vdata)])
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), total, [valid, pa.py_buffer(voff),
                                                                      pa.py_buffer(vdata)]).cast(pa.binary())


def _topk(table: pa.Table, row: np.ndarray, stats_on: np.ndarray) -> tuple[pa.Array, pa.Array]:
    total = row.size
    kk = np.asarray(table.column("topk_k"), np.int64)
    has = (kk[row] > 0) & stats_on
    if not has.any():
        return pa.nulls(total, pa.list_(pa.int32())), pa.nulls(total, pa.list_(pa.float32()))
    off = np.zeros(total + 1, np.int32)
    np.cumsum(np.where(has, kk[row], 0), out=off[1:])
    mask = pa.array(~has)
    ids = pa.ListArray.from_arrays(pa.array(off), pa.array(blob(table.column("topk_ids"), "<i4")), mask=mask)
    vals = pa.ListArray.from_arrays(pa.array(off), pa.array(blob(table.column("topk_values"), "<f4")), mask=mask)
    return ids, vals
