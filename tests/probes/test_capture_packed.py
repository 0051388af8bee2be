"""The packed ops.parquet (schema v5, run/ops_packed.py) reads back as the same ops table the
per-row writer wrote: the frozen golden of the per-row recorder (capture_golden.py, written before
the packed layout) equals today's streamed table (writer process and writer thread) and today's
in-memory table, row for row, digests, stats, values and top-k included."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import capture_golden as G  # noqa: E402

from mismatch_probe.probes.recorder import OpRecorder  # noqa: E402
from mismatch_probe.run.ops_packed import LAYOUT_KEY, PACKED, PACKED_V1, PACKED_V2, abs_max_values, blob, unpack  # noqa: E402
from mismatch_probe.run.schema import SCHEMA_VERSION, VERSION_KEY, read_table, validate_file  # noqa: E402

# the CPU kernel sums with its vector lanes reassociated (probes/digest_numba.py), as wide as the host's SIMD: a
# row's sum and sum_sq may differ in their last bits between hosts (the golden was written on another one)
_SUMS = ("sum", "sum_sq")


def assert_same_rows(got: pa.Table, want: pa.Table) -> None:
    """Equal column by column; float columns bit for bit where not NaN, NaN where NaN, but for the row
    sums, equal to float64 rounding (their order follows the host's vector width)."""
    assert got.num_rows == want.num_rows
    for c in G.COLS:
        a, b = got.column(c), want.column(c)
        if pa.types.is_floating(b.type):
            x, y = a.to_numpy(), b.to_numpy()
            assert np.array_equal(np.isnan(x), np.isnan(y)), c
            x, y = x[~np.isnan(x)], y[~np.isnan(y)]
            if c in _SUMS:
                assert np.allclose(x, y, rtol=1e-12, atol=0), c
            else:
                assert np.array_equal(x.view(np.uint64), y.view(np.uint64)), c
        else:
            assert a.to_pylist() == b.to_pylist(), c


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_packed_stream_equals_the_per_row_golden(tmp_path, monkeypatch, writer):
    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", writer)
    dest = tmp_path / "ops.parquet"
    rec = OpRecorder(G.plan(), sink=dest, buffer_rows=64)  # several chunks, several row groups
    G.record(rec)
    rec.close()
    meta = pq.read_schema(dest).metadata
    assert meta[LAYOUT_KEY] == PACKED and meta[VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert rec.rows_written == pq.read_table(G.GOLDEN).num_rows
    assert_same_rows(G.sorted_rows(read_table(dest, "ops")), pq.read_table(G.GOLDEN))
    validate_file(dest, "ops")


def test_in_memory_table_equals_the_per_row_golden():
    rec = OpRecorder(G.plan(), sink=None)
    G.record(rec)
    assert_same_rows(G.sorted_rows(rec.table()), pq.read_table(G.GOLDEN))


def test_batched_path_packed_equals_its_in_memory_table_and_the_golden_digests(tmp_path):
    pytest.importorskip("triton")
    dest = tmp_path / "ops.parquet"
    rec = OpRecorder(G.plan(), sink=dest, batched=True)  # the CUDA path through Triton's interpreter
    G.record(rec)
    rec.close()
    got = G.sorted_rows(read_table(dest, "ops"))
    mem = OpRecorder(G.plan(), sink=None, batched=True)
    G.record(mem)
    assert_same_rows(got, G.sorted_rows(mem.table()))
    # against the (numba) golden: digests, counts, values and top-k exact; sums to float64 rounding
    want = pq.read_table(G.GOLDEN)
    for c in ("op", "seq_id", "pos", "digest", "numel", "n_nan", "n_inf", "values", "topk_ids", "topk_values"):
        assert got.column(c).to_pylist() == want.column(c).to_pylist(), c
    for c in ("sum", "sum_sq", "abs_max"):
        np.testing.assert_allclose(got.column(c).to_numpy(), want.column(c).to_numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("many_chunks", [False, True])
def test_batched_path_staged_into_the_writers_memory_writes_the_same_rows(tmp_path, monkeypatch, many_chunks):
    # chunks copied straight into the writer process's shared memory (WriterProcess.stage; on CUDA the
    # device writes them there): the same rows, values and top-k as the in-memory recorder's
    pytest.importorskip("triton")
    from mismatch_probe.probes import recorder as recmod

    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "process")
    monkeypatch.setattr(recmod, "_D2H_TO_SLOT", True)
    from mismatch_probe.probes import recorder_writer as rw

    staged = []
    orig = rw.WriterProcess.stage
    monkeypatch.setattr(rw.WriterProcess, "stage", lambda self, parts: staged.append(orig(self, parts)) or staged[-1])
    times = []
    orig_close = rw.WriterProcess.close
    monkeypatch.setattr(rw.WriterProcess, "close", lambda self: (orig_close(self), times.extend(self.times)))
    dest = tmp_path / "ops.parquet"
    # many chunks: slots reused, the feeder bounded by the writer's acks
    rec = OpRecorder(G.plan(), sink=dest, batched=True, buffer_rows=64 if many_chunks else None)
    assert rec.writer_mode == "process"
    G.record(rec)
    rec.close()
    monkeypatch.setattr(recmod, "_D2H_TO_SLOT", False)
    mem = OpRecorder(G.plan(), sink=None, batched=True)
    G.record(mem)
    assert_same_rows(G.sorted_rows(read_table(dest, "ops")), G.sorted_rows(mem.table()))
    assert rec.rows_written == mem.rows_written
    # abs_max at 2 bytes (the device's bf16 bits) for the bf16 ops' stats rows, float64 for the others: read back
    # bit for bit above
    packed = pq.read_table(dest)
    width: dict[str, set[int]] = {}
    for dt, w in zip(packed.column("dtype").to_pylist(), packed.column("am_width").to_pylist(), strict=True):
        if w:  # a packed row with stats rows
            width.setdefault(dt, set()).add(w)
    assert width["bfloat16"] == {2} and width["float32"] == {8} and width["float16"] == {8}
    assert staged and all(s is not None for s in staged) and (len(staged) > 1) == many_chunks
    # the manifest says which path the chunks took
    assert rec.summary()["device_chunks"] == {"staged": len(staged), "pinned": 0}
    assert mem.summary()["device_chunks"] == {"staged": 0, "pinned": mem.chunks_pinned} and mem.chunks_pinned >= 1
    # the process's own times (the bench's timeline): per chunk received <= built <= written, in order, then
    # the close (received, closed) after the last chunk was written
    chunks, close = times[:-1], times[-1]
    assert len(chunks) == len(staged) and all(len(t) == 3 and t[0] <= t[1] <= t[2] for t in chunks)
    assert all(a[2] <= b[0] for a, b in zip(chunks, chunks[1:])) and len(close) == 2
    assert chunks[-1][2] <= close[0] <= close[1]


def _as_packed_v1(t: pa.Table) -> pa.Table:
    """A packed-v2 table as schema v3 wrote it (packed-v1): abs_max back into ``stats`` [s, 3] float64."""
    n = np.asarray(t.column("n"), np.int64)
    has = np.asarray(t.column("stats").is_valid(), bool)
    st2 = blob(t.column("stats"), "<f8").reshape(-1, 2)
    # stats rows per packed row: its stats blob's bytes / 16
    ns = np.array([0 if v is None else len(v) // 16 for v in t.column("stats").to_pylist()], np.int64)
    st3 = np.column_stack([st2, abs_max_values(t, ns)]) if st2.size else np.zeros((0, 3))
    off = np.zeros(len(n) + 1, np.int64)
    np.cumsum(ns * 24, out=off[1:])
    col = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(n), [pa.py_buffer(np.packbits(has, bitorder="little")),
                                                                      pa.py_buffer(off), pa.py_buffer(st3.tobytes())])
    t = t.set_column(t.schema.get_field_index("stats"), "stats", col).drop_columns(["am_width", "abs_max"])
    return t.replace_schema_metadata({**t.schema.metadata, LAYOUT_KEY: PACKED_V1, VERSION_KEY: b"3"})


def test_packed_v1_file_of_schema_v3_reads_unchanged(tmp_path):
    # an ops.parquet written before abs_max had its own blob (schema v3, packed-v1) reads as the same table
    pytest.importorskip("triton")
    dest = tmp_path / "ops.parquet"
    rec = OpRecorder(G.plan(), sink=dest, batched=True)
    G.record(rec)
    rec.close()
    old = tmp_path / "old.parquet"
    pq.write_table(_as_packed_v1(pq.read_table(dest)), old)
    assert pq.read_schema(old).metadata[LAYOUT_KEY] == PACKED_V1
    assert_same_rows(G.sorted_rows(read_table(old, "ops")), G.sorted_rows(read_table(dest, "ops")))
    validate_file(old, "ops")


def _as_packed_v2(t: pa.Table) -> pa.Table:
    """A packed-v3 table as schema v4 wrote it (packed-v2): the counts of every stats row, zeros included."""
    ns = np.array([0 if v is None else len(v) // 16 for v in t.column("stats").to_pylist()], np.int64)
    old = t.column("counts").to_pylist()
    vals = [None if k == 0 else (c if c is not None else bytes(8 * k)) for k, c in zip(ns, old, strict=True)]
    t = t.set_column(t.schema.get_field_index("counts"), "counts", pa.array(vals, pa.large_binary()))
    return t.replace_schema_metadata({**t.schema.metadata, LAYOUT_KEY: PACKED_V2, VERSION_KEY: b"4"})


@pytest.mark.parametrize("batched", [False, True])
def test_counts_stored_only_where_a_row_is_not_finite_and_v2_reads_unchanged(tmp_path, batched):
    # packed-v3: a packed row's NaN / Inf counts are stored only where one of its stats rows has one (the
    # golden's embeddings of two micro-batches do); every other stats row reads 0, as a packed-v2 file (the
    # counts of every stats row) still does
    if batched:
        pytest.importorskip("triton")
    dest = tmp_path / "ops.parquet"
    rec = OpRecorder(G.plan(), sink=dest, batched=batched, buffer_rows=64)
    G.record(rec)
    rec.close()
    packed = pq.read_table(dest)
    ns = np.array([0 if v is None else len(v) // 16 for v in packed.column("stats").to_pylist()], np.int64)
    counts = packed.column("counts").to_pylist()
    stored = [c is not None for c in counts]
    nonzero = [c is not None and any(np.frombuffer(c, "<i4")) for c in counts]
    assert stored == nonzero and any(stored) and sum(ns > 0) > sum(stored)
    assert all(len(c) == 8 * k for c, k in zip(counts, ns, strict=True) if c is not None)
    got = G.sorted_rows(read_table(dest, "ops"))
    want = pq.read_table(G.GOLDEN)
    for c in ("n_nan", "n_inf"):
        assert got.column(c).to_pylist() == want.column(c).to_pylist(), c
    assert sum(got.column("n_nan").to_pylist()) >= 1
    old = tmp_path / "old.parquet"
    pq.write_table(_as_packed_v2(packed), old)
    assert pq.read_schema(old).metadata[LAYOUT_KEY] == PACKED_V2
    assert_same_rows(G.sorted_rows(read_table(old, "ops")), got)
    validate_file(old, "ops")


def test_empty_packed_file_reads_as_an_empty_ops_table(tmp_path):
    dest = tmp_path / "ops.parquet"
    rec = OpRecorder(G.plan(), sink=dest)
    rec.close()
    t = read_table(dest, "ops")
    assert t.num_rows == 0 and "digest" in t.column_names


def test_v2_per_row_file_reads_unchanged(tmp_path):
    # a v2 ops.parquet (per-row, as written before the packed layout) reads through the upgrade chain
    want = pq.read_table(G.GOLDEN)
    p = tmp_path / "ops.parquet"
    pq.write_table(want.replace_schema_metadata({VERSION_KEY: b"2", b"mismatch_probe.kind": b"ops"}), p)
    assert_same_rows(G.sorted_rows(read_table(p, "ops")), want)
    assert unpack(want) is want  # not packed: returned as it is


def _assert_same_errors(got, want) -> None:
    import pandas as pd

    pd.testing.assert_frame_equal(got.reset_index(drop=True), want.reset_index(drop=True), check_exact=True,
                                  check_dtype=False)


@pytest.mark.parametrize("join", ["dense", "sort"])
def test_vectorized_op_errors_equal_the_per_row_golden(monkeypatch, join):
    from mismatch_probe.analysis import op_errors as O
    from mismatch_probe.analysis.op_errors import op_errors

    if join == "sort":  # the sort-merge join of key spaces too large for the dense index
        monkeypatch.setattr(O, "_DENSE_MAX", 0)

    want = pq.read_table(G.GOLDEN)
    other = G.perturbed(want)
    golden = pq.read_table(G.OP_ERRORS_GOLDEN).to_pandas()
    _assert_same_errors(op_errors(want.to_pandas(), other, num_layers=2), golden)  # pandas in
    _assert_same_errors(op_errors(want, pa.Table.from_pandas(other, preserve_index=False), num_layers=2), golden)


def test_op_errors_of_packed_files_equal_the_unpacked_comparison(tmp_path):
    # a run whose two sides streamed packed files: compared without unpacking, same figures as the
    # per-row comparison of the unpacked tables (and as the golden where the data is the golden's)
    from mismatch_probe.analysis.op_errors import op_errors, op_errors_run

    for side in ("learner", "sampler"):
        rec = OpRecorder(G.plan(), sink=tmp_path / side / "ops.parquet", buffer_rows=100)
        G.record(rec)
        rec.close()
    got = op_errors_run(tmp_path, num_layers=2)
    assert (got.bitwise_equal_frac == 1.0).all() and len(got) == 15
    ref = op_errors(read_table(tmp_path / "learner/ops.parquet", "ops"), read_table(tmp_path / "sampler/ops.parquet", "ops"), 2)
    _assert_same_errors(got, ref)
    # the sampler side per-row (as an in-memory capture writes it), perturbed: packed vs per-row join
    from mismatch_probe.run.schema import write_table

    other = G.perturbed(pq.read_table(G.GOLDEN))
    (tmp_path / "sampler/ops.parquet").unlink()
    write_table(tmp_path / "sampler/ops.parquet", pa.Table.from_pandas(other, preserve_index=False), "ops")
    _assert_same_errors(op_errors_run(tmp_path, num_layers=2), pq.read_table(G.OP_ERRORS_GOLDEN).to_pandas())


@pytest.mark.parametrize("dense_max", [0, 1 << 27])
def test_op_errors_rejects_a_row_twice_on_one_side(monkeypatch, dense_max):
    from mismatch_probe.analysis import op_errors as O

    monkeypatch.setattr(O, "_DENSE_MAX", dense_max)
    t = pq.read_table(G.GOLDEN)
    for a, b in ((pa.concat_tables([t, t.slice(0, 1)]), t), (t, pa.concat_tables([t.slice(5, 1), t]))):
        with pytest.raises(ValueError, match="twice"):
            O.op_errors(a, b, num_layers=2)


@pytest.mark.parametrize("batched", [False, True])
def test_packed_stream_without_padding_equals_in_memory(tmp_path, batched):
    # no padding: the arena rows of a chunk are one slice (written without a gather)
    if batched:
        pytest.importorskip("triton")
    import torch

    from mismatch_probe.probes.capture import CapturePlan

    def rec_all(rec: OpRecorder) -> None:
        g = torch.Generator().manual_seed(7)
        rec.begin([0, 1], [5, 5])
        seq, pos = np.repeat([0, 1], 5), np.tile(np.arange(5), 2)
        for op in ("embed", "0.attn.q", "0.out", "logits"):
            rec.record_rows(op, torch.randn(2, 5, 12, generator=g).to(torch.bfloat16), seq, pos)

    for plan in (CapturePlan("stats"), CapturePlan("digest"), CapturePlan("stats", full_rows=3, topk=2)):
        dest = tmp_path / "ops.parquet"
        rec = OpRecorder(plan, sink=dest, batched=batched)
        rec_all(rec)
        rec.close()
        mem = OpRecorder(plan, sink=None, batched=batched)
        rec_all(mem)
        assert_same_rows(G.sorted_rows(read_table(dest, "ops")), G.sorted_rows(mem.table()))


def test_op_errors_of_rank_partitioned_sides(tmp_path):
    # FSDP writes one ops file per rank: the ranks of a side are merged before the join
    from mismatch_probe.analysis.op_errors import op_errors_run
    from mismatch_probe.run.schema import write_table

    want = pq.read_table(G.GOLDEN)
    seq = np.asarray(want.column("seq_id"))
    for r, keep in enumerate((seq < 3, seq >= 3)):
        write_table(tmp_path / "learner/ops_by_rank" / f"rank={r}" / "part.parquet", want.filter(pa.array(keep)), "ops")
    rec = OpRecorder(G.plan(), sink=tmp_path / "sampler/ops_by_rank/rank=0/part.parquet")
    G.record(rec)
    rec.close()
    OpRecorder(G.plan(), sink=tmp_path / "sampler/ops_by_rank/rank=1/part.parquet").close()  # a rank with no rows
    got = op_errors_run(tmp_path, num_layers=2)
    assert len(got) == 15 and (got.bitwise_equal_frac == 1.0).all() and got.n_rows.sum() == want.num_rows
    assert got.rel_l2.notna().sum() > 0  # the full rows compared across the merged ranks


@pytest.mark.parametrize("padded", [False, True])
def test_a_row_set_reaches_the_writer_process_as_what_its_table_reads(padded: bool) -> None:
    """A row set (``_Rows``) pickled for the writer process carries its kept rows, mode counts and runs (the
    packed table's inputs), not its per-row seq / pos / modes: a batch of 4 x 1,024 tokens in ~2 KB (its 256 full
    rows' indices) instead of ~100 KB; the kept rows as a count where they are 0 .. k-1, as the indices where
    padding is dropped."""
    import pickle

    from mismatch_probe.probes.ops_table import FULL, STATS, _Rows

    n = 4096
    seq, pos = np.repeat(np.arange(4), 1024), np.tile(np.arange(1024), 4)
    keep = np.nonzero(pos < 1000)[0] if padded else np.arange(n)
    modes = np.full(keep.size, STATS, np.int8)
    modes[:256] = FULL
    rows = _Rows(keep, seq[keep], pos[keep], modes, keep[:256], stats=True)
    blob_ = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    got = pickle.loads(blob_)
    assert np.array_equal(got.keep, rows.keep) and got.keep.dtype == np.int64
    assert np.array_equal(got.full, rows.full) and got.stats is True
    assert np.array_equal(got.packed_runs(), rows.packed_runs())
    assert got.mode_counts()[:2] == rows.mode_counts()[:2] == (keep.size, 256)
    assert not hasattr(got, "seq") and got.full_dev is None
    assert len(blob_) < rows.full.nbytes + (keep.nbytes if padded else 0) + 1024  # the kept-full indices, the kept rows
