"""Run-directory Parquet schema (versioned) and atomic readers/writers.

Every Parquet file carries ``mismatch_probe.schema_version`` in its key-value metadata. Readers
check it first and upgrade older versions step by step (``_UPGRADES``, empty while v1 is the
only version); a version newer than the reader, or one without an upgrade, is an error.
Schema history is append-only: never edit a released version, add one.

History:
  v1  sequences, tokens, token_gaps, ops, op_errors. Optional tokens columns
      (``TOKENS_OPTIONAL``) may be added within a version: readers keep the ones they know.
  v2  ops: ``digest`` is the ``mp64`` row digest (probes/digest.py, one definition on every device;
      v1's were blake2b-64: the upgrade prefixes them ``blake2b:`` so they never compare equal to
      an mp64 digest); optional ``topk_ids`` / ``topk_values`` (logits rows); ops.parquet is
      streamed in row groups (:class:`StreamWriter`). Other kinds are unchanged.
  v3  ops.parquet streamed by the recorder may be in the packed layout (run/ops_packed.py: one row
      per op call, per-token blobs); :func:`read_table` unpacks it into the same ``ops`` table.
      Tables of every kind are otherwise unchanged (the v2 -> v3 step is the identity).
  v4  the packed layout ``packed-v2``: a stats row's abs_max in its own blob, 2 bytes (bf16 bits) for a
      bfloat16 op, else 8; ``packed-v1`` files (v3) read as before. The unpacked ``ops`` table and every
      other kind are unchanged (the v3 -> v4 step is the identity).
  v5  the packed layout ``packed-v3``: a packed row's NaN / Inf ``counts`` null where they are all zero
      (read as zeros); ``packed-v2`` and ``packed-v1`` files read as before. The unpacked ``ops`` table
      and every other kind are unchanged (the v4 -> v5 step is the identity).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.errors import SchemaError
from mismatch_probe.run.ops_packed import fresh

SCHEMA_VERSION = 5
VERSION_KEY = b"mismatch_probe.schema_version"
KIND_KEY = b"mismatch_probe.kind"
DIGEST_KEY = b"mismatch_probe.digest"

TOKENS_V1 = pa.schema(
    [
        ("seq_id", pa.int32()),
        ("prompt_id", pa.int32()),
        ("pos", pa.int32()),
        ("token_id", pa.int32()),
        ("is_response", pa.bool_()),
        ("logprob", pa.float64()),
        ("source", pa.string()),  # decode | prefill | learner
    ]
)
TOKENS_OPTIONAL = {
    "topk_ids": pa.list_(pa.int32()),
    "topk_logprobs": pa.list_(pa.float64()),
    "entropy": pa.float64(),
    # compare --topk, learner rows: rank of the scored token in the learner's distribution (1 = top),
    # and the learner's logprobs at the sampler's top-K ids of the position (prefill's, decode's)
    "sampled_rank": pa.int32(),
    "lp_at_prefill_topk": pa.list_(pa.float64()),
    "lp_at_decode_topk": pa.list_(pa.float64()),
}

TOKEN_GAPS_V1 = pa.schema(
    [
        ("seq_id", pa.int32()),
        ("prompt_id", pa.int32()),
        ("pos", pa.int32()),
        ("token_id", pa.int32()),
        ("is_response", pa.bool_()),
        ("lp_learner", pa.float64()),
        ("lp_prefill", pa.float64()),
        ("lp_decode", pa.float64()),  # null where the sampler did not decode the token (prompt)
        ("d_learner_decode", pa.float64()),
        ("d_learner_prefill", pa.float64()),
        ("d_prefill_decode", pa.float64()),
    ]
)

OPS_V1 = pa.schema(
    [
        ("op", pa.string()),
        ("layer", pa.int32()),  # -1 for ops outside the decoder layers
        ("seq_id", pa.int32()),
        ("pos", pa.int32()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("numel", pa.int64()),
        ("sum", pa.float64()),
        ("sum_sq", pa.float64()),
        ("abs_max", pa.float64()),
        ("n_nan", pa.int64()),
        ("n_inf", pa.int64()),
        ("digest", pa.string()),
        ("values", pa.binary()),  # raw bytes in the op's dtype (full mode), else null
    ]
)

OPS_OPTIONAL = {
    "topk_ids": pa.list_(pa.int32()),  # logits rows: ids of the k largest logits, largest first
    "topk_values": pa.list_(pa.float32()),  # their values (exact for bf16/fp16/fp32 logits)
}
OPTIONAL = {"tokens": TOKENS_OPTIONAL, "ops": OPS_OPTIONAL}

OP_ERRORS_V1 = pa.schema(
    [
        ("op", pa.string()),
        ("layer", pa.int32()),
        ("kind", pa.string()),
        ("exec_order", pa.int32()),
        ("dtype", pa.string()),
        ("n_rows", pa.int64()),
        ("bitwise_equal_frac", pa.float64()),
        ("max_abs_diff", pa.float64()),
        ("mean_abs_diff", pa.float64()),
        ("rel_l2", pa.float64()),
        ("cosine", pa.float64()),
        ("sqnr_db", pa.float64()),
        ("max_ulp", pa.float64()),
    ]
)

SEQUENCES_V1 = pa.schema(
    [
        ("seq_id", pa.int32()),
        ("prompt_id", pa.int32()),
        ("n_prompt", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "sequences": SEQUENCES_V1,
    "tokens": TOKENS_V1,
    "token_gaps": TOKEN_GAPS_V1,
    "ops": OPS_V1,
    "op_errors": OP_ERRORS_V1,
}



def _v1_to_v2(table: pa.Table, kind: str) -> pa.Table:
    """v1 ops digests were blake2b-64 hex: mark them so they are never taken for mp64 digests."""
    if kind != "ops" or "digest" not in table.column_names:
        return table
    import pyarrow.compute as pc

    i = table.column_names.index("digest")
    col = table.column(i).cast(pa.string())
    return table.set_column(i, "digest", pc.if_else(pc.is_null(col), col, pc.binary_join_element_wise("blake2b:", col, "")))


# version -> function upgrading a table of that version to version + 1
_UPGRADES: dict[int, Callable[[pa.Table, str], pa.Table]] = {1: _v1_to_v2, 2: lambda table, kind: table,
                                                              3: lambda table, kind: table, 4: lambda table, kind: table}


def _family(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list:" + _family(t.value_type)
    return str(t)


# casts a reader accepts (same family, or an integer column where floats are expected)
_WIDENS = {("int", "float"), ("list:int", "list:float")}


def _cast(table: pa.Table, name: str, typ: pa.DataType, kind: str) -> pa.ChunkedArray:
    col = table.column(name)
    src, dst = _family(col.type), _family(typ)
    if src != dst and src != "null" and (src, dst) not in _WIDENS:
        raise SchemaError(f"{kind} table: column {name} has type {col.type}, expected {typ}")
    try:
        return col.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise SchemaError(f"{kind} table: column {name} ({col.type}) does not convert to {typ}: {e}") from None


def conform(table: pa.Table, kind: str) -> pa.Table:
    """Cast ``table`` to the schema of ``kind``: required columns in order, optional ones kept.
    A column of another type family (text where numbers belong, ...) is a :class:`SchemaError`."""
    schema = SCHEMAS[kind]
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise SchemaError(f"{kind} table lacks required columns: {', '.join(missing)}")
    cols = [_cast(table, f.name, f.type, kind) for f in schema]
    fields = list(schema)
    for name, typ in OPTIONAL.get(kind, {}).items():
        if name in table.column_names:
            cols.append(_cast(table, name, typ, kind))
            fields.append(pa.field(name, typ))
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _umask_mode()  # temp files are created 0600; results get the usual permissions


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def write_table(path: Path, table: pa.Table, kind: str) -> None:
    """Validate ``table`` against ``kind``'s schema and write it atomically with version metadata."""
    table = conform(table, kind)
    meta = dict(table.schema.metadata or {})
    meta[VERSION_KEY] = str(SCHEMA_VERSION).encode()
    meta[KIND_KEY] = kind.encode()
    table = table.replace_schema_metadata(meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, fresh(tmp))  # a new file, not the reserved one truncated (ops_packed.fresh)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _stamp(schema: pa.Schema, kind: str, extra: dict[bytes, bytes] | None = None) -> pa.Schema:
    meta = dict(schema.metadata or {})
    meta[VERSION_KEY] = str(SCHEMA_VERSION).encode()
    meta[KIND_KEY] = kind.encode()
    meta.update(extra or {})
    return schema.with_metadata(meta)


class StreamWriter:
    """A Parquet table written in row groups while it is produced, atomically: rows go to a temp
    file beside ``path``; :meth:`close` renames it into place, :meth:`abort` removes it (an
    interrupted run never leaves a file that reads as complete)."""

    def __init__(self, path: Path, kind: str, schema: pa.Schema, meta: dict[bytes, bytes] | None = None,
                 tmp: str | None = None) -> None:
        self.path = Path(path)
        self.kind = kind
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = tmp if tmp is not None else self.temp_path(self.path)
        self.schema = _stamp(schema, kind, meta)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(fresh(self._tmp), self.schema)  # see ops_packed.fresh
        self.rows = 0

    @staticmethod
    def temp_path(path: Path) -> str:
        """A new temp file beside ``path`` (created empty), the name :meth:`close` renames."""
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        return tmp

    def write(self, table: pa.Table) -> None:
        assert self._writer is not None, "StreamWriter already closed"
        table = conform(table, self.kind)
        self._writer.write_table(table.replace_schema_metadata(self.schema.metadata))
        self.rows += table.num_rows

    def close(self) -> Path:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            os.chmod(self._tmp, _FILE_MODE)
            os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        Path(self._tmp).unlink(missing_ok=True)


def read_schema_version(path: Path) -> int:
    path = Path(path)
    if not path.exists():
        raise SchemaError(f"corrupt run: {path}: missing file")
    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise SchemaError(f"corrupt run: {path}: corrupt Parquet file: {e}") from None
    raw = meta.get(VERSION_KEY)
    if raw is None:
        raise SchemaError(f"{path} is not a mismatch-probe table (no {VERSION_KEY.decode()} metadata)")
    try:
        return int(raw)
    except ValueError:
        raise SchemaError(f"{path}: unreadable schema version {raw!r}") from None


def read_table(path: Path, kind: str) -> pa.Table:
    """Read a table, check its schema version, upgrade it step by step to the current version."""
    path = Path(path)
    version = read_schema_version(path)
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{path} has schema version {version}, newer than this mismatch-probe reads "
            f"({SCHEMA_VERSION}); upgrade mismatch-probe"
        )
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise SchemaError(f"corrupt run: {path}: corrupt Parquet file: {e}") from None
    while version < SCHEMA_VERSION:
        if version not in _UPGRADES:
            raise SchemaError(f"{path} has schema version {version}, which this mismatch-probe cannot read or upgrade")
        table = _UPGRADES[version](table, kind)
        version += 1
    if kind == "ops":  # the packed layout of a streamed capture -> one row per op and token
        from mismatch_probe.run.ops_packed import unpack

        table = unpack(table)
    try:
        return conform(table, kind)
    except SchemaError as e:
        raise SchemaError(f"corrupt run: {path}: {e}") from None


def validate_file(path: Path, kind: str) -> pa.Table:
    """Read ``path`` and check it matches ``kind``'s schema exactly (types of required columns)."""
    table = read_table(path, kind)
    raw = pq.read_schema(path)
    if kind == "ops" and (raw.metadata or {}).get(b"mismatch_probe.ops_layout"):
        raw = table.schema  # packed on disk (run/ops_packed.py): the unpacked table is what is checked
    for f in SCHEMAS[kind]:
        if raw.field(f.name).type != f.type:
            raise SchemaError(f"{path}: column {f.name} has type {raw.field(f.name).type}, expected {f.type}")
    return table
