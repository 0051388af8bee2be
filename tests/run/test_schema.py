"""Schema v1: version metadata, atomic writes, clear errors for bad files."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import SchemaError
from mismatch_probe.run.schema import SCHEMA_VERSION, VERSION_KEY, read_schema_version, read_table, write_table


def _tokens() -> pa.Table:
    return pa.table(
        {
            "seq_id": [0, 0],
            "prompt_id": [0, 0],
            "pos": [1, 2],
            "token_id": [5, 6],
            "is_response": [False, True],
            "logprob": [-1.0, -2.0],
            "source": ["learner", "learner"],
        }
    )


def test_roundtrip_has_version_and_no_temp_files(tmp_path):
    p = tmp_path / "tokens.parquet"
    write_table(p, _tokens(), "tokens")
    assert read_schema_version(p) == SCHEMA_VERSION
    assert read_table(p, "tokens").num_rows == 2
    assert [x.name for x in tmp_path.iterdir()] == ["tokens.parquet"]


def test_missing_column_is_rejected(tmp_path):
    with pytest.raises(SchemaError, match="logprob"):
        write_table(tmp_path / "t.parquet", _tokens().drop(["logprob"]), "tokens")


def test_newer_version_is_rejected(tmp_path):
    p = tmp_path / "t.parquet"
    t = _tokens().replace_schema_metadata({VERSION_KEY: str(SCHEMA_VERSION + 1).encode()})
    pq.write_table(t, p)
    with pytest.raises(SchemaError, match="newer"):
        read_table(p, "tokens")


def test_version_without_upgrade_is_rejected(tmp_path):
    """An older version with no upgrade step is a one-line SchemaError, not a KeyError."""
    from mismatch_probe.run import schema

    # the README: v1 -> v2, v2 -> v3 (ops.parquet's packed layout), v3 -> v4 (its packed-v2 layout), v4 -> v5
    # (packed-v3)
    assert sorted(schema._UPGRADES) == [1, 2, 3, 4]
    p = tmp_path / "t.parquet"
    pq.write_table(_tokens().replace_schema_metadata({VERSION_KEY: b"0"}), p)
    with pytest.raises(SchemaError, match="cannot read or upgrade"):
        read_table(p, "tokens")


def test_corrupt_and_missing_files(tmp_path):
    p = tmp_path / "t.parquet"
    p.write_bytes(b"PAR1 not really")
    with pytest.raises(SchemaError, match="corrupt"):
        read_table(p, "tokens")
    with pytest.raises(SchemaError, match="missing"):
        read_table(tmp_path / "nope.parquet", "tokens")


def test_stream_writers_make_their_temp_file_anew(tmp_path, monkeypatch):
    """The Parquet writers (streamed and one-shot) open their temp file (an empty name reserved by mkstemp) as a new file, not by
    truncating it (ext4 writes back a truncated-and-rewritten file's data at close, and the writer waited
    for it); a non-empty file is never removed; the table still lands, complete, at its path."""
    import os

    from mismatch_probe.run import ops_packed
    from mismatch_probe.run.schema import StreamWriter

    keep = tmp_path / "data.bin"
    keep.write_bytes(b"x")
    assert ops_packed.fresh(str(keep)) == str(keep) and keep.read_bytes() == b"x"
    assert ops_packed.fresh(str(tmp_path / "gone")) == str(tmp_path / "gone")
    opened = []
    real = pq.ParquetWriter.__init__

    def spy(self, where, *a, **k):
        opened.append(os.path.exists(where))
        real(self, where, *a, **k)

    monkeypatch.setattr(pq.ParquetWriter, "__init__", spy)
    w = StreamWriter(tmp_path / "tokens.parquet", "tokens", pa.schema([("seq_id", pa.int64())]))
    assert w.close() == tmp_path / "tokens.parquet"
    p = ops_packed.PackedWriter(tmp_path / "ops.parquet", {b"k": b"v"})
    assert p.close() == tmp_path / "ops.parquet"
    assert opened == [False, False]  # each temp file existed (mkstemp) and was removed before the writer opened it
    made = []
    real_write = pq.write_table

    def spy_write(table, where, *a, **k):
        made.append(os.path.exists(where))
        real_write(table, where, *a, **k)

    monkeypatch.setattr(pq, "write_table", spy_write)
    write_table(tmp_path / "whole.parquet", _tokens(), "tokens")  # the one-shot writer too
    assert made == [False] and read_table(tmp_path / "whole.parquet", "tokens").num_rows == 2
    assert sorted(f.name for f in tmp_path.iterdir()) == ["data.bin", "ops.parquet", "tokens.parquet", "whole.parquet"]
