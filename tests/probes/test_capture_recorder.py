"""The on-device recorder without engines: the mp64 digest bit-exact across implementations (numpy
reference, torch ops, the numba CPU kernel, the Triton kernel through its interpreter), stats
merged across ranks and tensor-parallel slices, streamed and atomic ops.parquet, the full-rows
window and logits top-k, and v1 run directories read through the schema upgrade."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mismatch_probe.analysis.op_errors import op_errors
from mismatch_probe.probes import digest as D
from mismatch_probe.probes.capture import CapturePlan, build_plan, decode_values
from mismatch_probe.probes.recorder import OpRecorder
from mismatch_probe.run.schema import VERSION_KEY, read_table

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool)


def _rand(dtype: torch.dtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 50
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.uint8:
        return x.abs().clamp(max=255).to(dtype)
    x = x.to(dtype)
    if dtype.is_floating_point and rows > 2 and cols > 3:
        x[0, 1], x[1, 2], x[2, 3] = float("nan"), float("inf"), float("-inf")
        if rows > 3:  # a NaN in the last column (the Triton kernel's masked tail block)
            x[3, -1] = float("nan")
    return x


def _ref(x: torch.Tensor, col_offset: int = 0) -> np.ndarray:
    raw = D.word_view(x.contiguous()).numpy().view(np.uint8).reshape(x.shape[0], -1)
    return D.digest_bytes_ref(raw, x.element_size(), col_offset)


def test_digest_known_answer_freezes_the_definition():
    # two bf16 rows; any change to the mp64 definition changes these hex digits
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    assert D.hex_digests(_ref(x)) == ["49dcb2de63bd0f42", "575da3bc9ce078f2"]
    m = (1 << 64) - 1

    def term(w: int, i: int) -> int:  # the README's definition in Python integers
        v = (w ^ (i * D.GOLDEN)) & m
        v ^= v >> 30
        v = (v * D.MIX1) & m
        v ^= v >> 27
        v = (v * D.MIX2) & m
        return v ^ (v >> 31)

    for row, want in zip(x.view(torch.int16).tolist(), _ref(x), strict=True):
        assert sum(term(w & m, i + 1) for i, w in enumerate(row)) & m == int(want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.bool], ids=str)
def test_numba_rows_split_over_threads_is_bitwise_one_call(dtype, monkeypatch):
    """A large tensor's rows go to a pool of plain threads (the engine's cores while it waits on the
    hook): digests and stats are bitwise those of one call over all rows, for every split."""
    from mismatch_probe.probes import digest_numba as N

    x = _rand(dtype, 37, 700, seed=3)
    dig1, st1 = np.zeros(37, np.uint64), np.zeros((37, 5))
    N._one(x, dig1, st1, np.int64(0))
    assert np.array_equal(dig1, _ref(x))
    monkeypatch.setattr(N, "SPLIT_ELEMENTS", 1)
    for threads in (2, 3, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        dig, st = np.zeros(37, np.uint64), np.zeros((37, 5))
        N.rows(x, dig, st)
        assert np.array_equal(dig, dig1) and np.array_equal(st.view(np.int64), st1.view(np.int64)), threads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_bitwise_equal_numpy_torch_numba_triton(dtype):
    from mismatch_probe.probes import digest_triton

    x = _rand(dtype, 9, 1500, seed=1)  # wider than the Triton block: several column chunks
    ref = _ref(x)
    assert np.array_equal(D.digest_torch(x).numpy().view(np.uint64), ref)
    dig, st = np.zeros(9, np.uint64), np.zeros((9, 5))
    D.digest_stats_cpu(x, dig, st)
    assert np.array_equal(dig, ref)
    # the recorder's device arena: the kernel writes the file's parts (float64 sums and abs_max, int32 counts,
    # abs_max's bf16 bits: the float32 nearest abs_max's high half)
    tdig, tst = torch.zeros(9, dtype=torch.int64), digest_triton.split_arena(9, "cpu")
    digest_triton.launch([(x, 0, 0)], tdig, tst)
    assert np.array_equal(tdig.numpy().view(np.uint64), ref)
    vals = x.double().numpy() if dtype != torch.bool else x.numpy().astype(float)
    sref = D.stats_ref(vals)
    np.testing.assert_allclose(st, sref, rtol=1e-12)
    np.testing.assert_allclose(digest_triton.stats_rows(tst).numpy(), sref, rtol=1e-12)
    assert torch.equal(tst[3], (tst[1].float().view(torch.int32) >> 16).to(torch.int16))
    # one changed element always changes the digest
    y = x.clone()
    y[4, 7] = ~y[4, 7] if dtype == torch.bool else y[4, 7] + 1
    assert _ref(y)[4] != ref[4] and np.array_equal(_ref(y)[:4], ref[:4])


def test_digest_and_stats_merge_across_tensor_parallel_slices_and_ranks():
    # values whose float64 sums are exact, so merged == whole holds bit for bit
    g = torch.Generator().manual_seed(3)
    x = (torch.randint(-64, 64, (6, 300), generator=g).float() / 8).to(torch.bfloat16)
    whole_d = _ref(x)
    a, b = x[:, :120], x[:, 120:]  # two TP slices of every row
    with np.errstate(over="ignore"):
        merged_d = _ref(a, 0) + _ref(b, 120)
    assert np.array_equal(merged_d, whole_d)
    sa, sb, sw = (D.stats_ref(t.double().numpy()) for t in (a, b, x))
    assert np.array_equal(sa[:, :2] + sb[:, :2], sw[:, :2]) and np.array_equal(np.maximum(sa[:, 2], sb[:, 2]), sw[:, 2])
    # two ranks each record half of the tokens: their rows together are the whole capture's rows
    seq, pos = np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 2, 0, 1, 2])
    whole = OpRecorder(CapturePlan("stats"))
    whole.record("0.mlp.down", x, seq, pos)
    ranks = [OpRecorder(CapturePlan("stats")) for _ in range(2)]
    ranks[0].record("0.mlp.down", x[:3], seq[:3], pos[:3])
    ranks[1].record("0.mlp.down", x[3:], seq[3:], pos[3:])
    cols = ["seq_id", "pos", "numel", "sum", "sum_sq", "abs_max", "n_nan", "n_inf", "digest"]
    merged = pd.concat([r.table().to_pandas()[cols] for r in ranks], ignore_index=True)
    pd.testing.assert_frame_equal(merged, whole.table().to_pandas()[cols])
    per_seq = merged.groupby("seq_id")[["numel", "sum", "sum_sq"]].sum()
    assert per_seq.loc[0, "sum"] == float(x[:3].double().sum())


def test_streamed_ops_parquet_row_groups_atomic_and_equal_to_memory(tmp_path):
    plan = CapturePlan("stats", full_rows=5, topk=3)
    dest = tmp_path / "learner" / "ops.parquet"
    streamed = OpRecorder(plan, sink=dest, buffer_rows=40)
    mem = OpRecorder(plan)
    seq_ids, lengths = [7, 2], [3, 4]
    for r in (streamed, mem):
        r.begin(seq_ids, lengths)
    seq = np.array([7, 7, 7, -1, 2, 2, 2, 2])  # one padding row
    pos = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    for layer in range(6):
        x = _rand(torch.bfloat16, 8, 16, seed=layer)
        for r in (streamed, mem):
            r.record(f"{layer}.mlp.down", x, seq, pos)
    logits = _rand(torch.float32, 8, 50, seed=9)
    for r in (streamed, mem):
        r.record("logits", logits, seq, pos)
    assert not dest.exists() and list(dest.parent.glob(".ops.parquet.*.tmp"))  # not final before close
    streamed.close()
    assert dest.exists() and not list(dest.parent.glob("*.tmp"))
    assert pq.ParquetFile(dest).num_row_groups > 1  # written while recording, not at the end
    got = read_table(dest, "ops").to_pandas()
    want = mem.table().to_pandas()
    pd.testing.assert_frame_equal(got, want)
    # the window: the first 5 tokens in (seq_id, pos) order = seq 2 pos 0..3 and seq 7 pos 0
    down = got[got.op == "0.mlp.down"]
    full = set(zip(down[down["values"].notna()].seq_id, down[down["values"].notna()].pos))
    assert full == {(2, 0), (2, 1), (2, 2), (2, 3), (7, 0)} and len(down) == 7
    row = down[(down.seq_id == 2) & (down.pos == 1)].iloc[0]
    assert torch.equal(decode_values(row["values"], "bfloat16", [16]), _rand(torch.bfloat16, 8, 16, seed=0)[5])
    lg = got[got.op == "logits"].sort_values(["seq_id", "pos"])
    top = lg[(lg.seq_id == 2) & (lg.pos == 3)].iloc[0]
    tv, ti = torch.topk(logits[7], 3)
    assert list(top.topk_ids) == ti.tolist() and np.array_equal(np.asarray(top.topk_values, np.float32), tv.numpy())


def test_abort_leaves_no_file(tmp_path):
    dest = tmp_path / "ops.parquet"
    r = OpRecorder(CapturePlan("stats"), sink=dest)
    r.record("embed", _rand(torch.bfloat16, 2, 4, 0), np.array([0, 0]), np.array([0, 1]))
    r.abort()
    assert not any(tmp_path.iterdir())


def test_default_plan_keeps_logits_as_stats_and_topk():
    plan = build_plan("stats", [], full_rows=2, topk=4)
    r = OpRecorder(plan)
    r.begin([0], [3])
    seq, pos = np.zeros(3, np.int64), np.arange(3)
    r.record("logits", _rand(torch.bfloat16, 3, 40, 1), seq, pos)
    r.record("final_norm", _rand(torch.bfloat16, 3, 8, 2), seq, pos)
    t = r.table().to_pandas()
    lg, fn = t[t.op == "logits"], t[t.op == "final_norm"]
    assert lg["values"].isna().all() and lg.topk_ids.map(len).tolist() == [4, 4, 4]
    assert fn["values"].notna().tolist() == [True, True, False] and fn.topk_ids.isna().all()
    full = build_plan("stats", [], full_rows=2, topk=4, full_logits=True)
    r2 = OpRecorder(full)
    r2.begin([0], [3])
    r2.record("logits", _rand(torch.bfloat16, 3, 40, 1), seq, pos)
    assert r2.table().to_pandas()["values"].notna().tolist() == [True, True, False]


def test_v1_ops_files_read_and_compare_by_values(tmp_path):
    """A run directory of schema v1 (blake2b digests, no top-k columns) still reads; against a new
    capture its digests are not taken for mp64 ones: equality comes from the values."""
    x = _rand(torch.bfloat16, 2, 4, 0)
    raw = [x[i].view(torch.uint8).numpy().tobytes() for i in range(2)]
    from mismatch_probe.run.schema import OPS_V1

    old = pa.table({"op": ["embed"] * 2, "layer": [-1, -1], "seq_id": [0, 0], "pos": [0, 1], "dtype": ["bfloat16"] * 2,
                    "shape": [[4], [4]], "numel": [4, 4], "sum": [0.0, 0.0], "sum_sq": [0.0, 0.0], "abs_max": [0.0, 0.0],
                    "n_nan": [0, 0], "n_inf": [0, 0], "digest": ["00aa", "00bb"], "values": raw}, schema=OPS_V1)
    p = tmp_path / "ops.parquet"
    pq.write_table(old.replace_schema_metadata({VERSION_KEY: b"1", b"mismatch_probe.kind": b"ops"}), p)
    back = read_table(p, "ops").to_pandas()
    assert back.digest.tolist() == ["blake2b:00aa", "blake2b:00bb"]
    new = OpRecorder(CapturePlan("full"))
    new.record("embed", x, np.array([0, 0]), np.array([0, 1]))
    errs = op_errors(back, new.table().to_pandas(), num_layers=1)
    assert errs.bitwise_equal_frac.tolist() == [1.0]


def test_batched_device_path_equals_the_cpu_path(tmp_path, monkeypatch):
    """The CUDA code path (queued tensors, one Triton launch per dtype, device arena, chunked host
    copies), run on CPU tensors through Triton's interpreter, writes the same rows as the numba path,
    whether the rows are kept in memory, streamed by the writer process (the default beside CUDA) or by a thread."""
    plan = build_plan("stats", ["0.mlp.*=digest"], full_rows=4, topk=2)
    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "process")
    recs = [OpRecorder(plan, buffer_rows=30), OpRecorder(plan, buffer_rows=30, batched=True),
            OpRecorder(plan, sink=tmp_path / "p" / "ops.parquet", buffer_rows=30, batched=True)]
    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "thread")
    recs.append(OpRecorder(plan, sink=tmp_path / "t" / "ops.parquet", buffer_rows=30, batched=True))
    assert [r.writer_mode for r in recs] == ["memory", "memory", "process", "thread"]
    seq = np.array([5, 5, 5, 6, 6, -1])
    pos = np.array([0, 1, 2, 0, 1, 2])
    for r in recs:
        r.begin([5, 6], [3, 2])
        for layer in range(3):
            r.record(f"{layer}.mlp.down", _rand(torch.bfloat16, 6, 33, layer), seq, pos)
            r.record(f"{layer}.attn.q", _rand(torch.float32, 6, 12, layer)[:, ::2], seq, pos)  # strided rows
        r.record("logits", _rand(torch.bfloat16, 6, 20, 7), seq, pos)
    a, b = (r.table().to_pandas() for r in recs[:2])
    for r in recs[2:]:
        r.close()
    c, d = (read_table(tmp_path / x / "ops.parquet", "ops").to_pandas() for x in ("p", "t"))
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(a, c)
    pd.testing.assert_frame_equal(a, d)
    assert len(a) == 7 * 5 and a[a.op == "0.mlp.down"]["numel"].eq(0).all()
    assert recs[2].summary()["writer"] == "process" and recs[2].summary()["rows"] == len(a)


def test_writer_auto_is_the_thread_without_cuda(tmp_path, monkeypatch):
    monkeypatch.delenv("MISMATCH_PROBE_CAPTURE_WRITER", raising=False)
    r = OpRecorder(CapturePlan("stats"), sink=tmp_path / "ops.parquet")
    assert r.writer_mode == ("process" if torch.cuda.is_available() else "thread")
    r.abort()


def test_writer_process_abort_leaves_no_files_and_is_reused(tmp_path, monkeypatch):
    from mismatch_probe.probes.recorder_writer import _shm_dir

    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "process")

    dest = tmp_path / "ops.parquet"
    r = OpRecorder(CapturePlan("stats"), sink=dest, buffer_rows=4)
    pid = r._proc.proc.pid
    for i in range(3):  # several chunks handed to the process
        r.record(f"{i}.out", _rand(torch.bfloat16, 4, 8, i), np.zeros(4, np.int64), np.arange(4))
    r.abort()
    assert not any(tmp_path.iterdir())
    assert not list(Path(_shm_dir()).glob(f"mp-ops-{os.getpid()}-*"))
    r2 = OpRecorder(CapturePlan("stats"), sink=dest)  # the next recorder writes through the same process
    assert r2._proc.proc.pid == pid
    r2.record("0.out", _rand(torch.bfloat16, 4, 8, 0), np.zeros(4, np.int64), np.arange(4))
    r2.close()
    assert read_table(dest, "ops").num_rows == 4 and r2.summary()["rows"] == 4


def _slot_files() -> list[Path]:
    from mismatch_probe.probes.recorder_writer import _shm_dir

    return list(Path(_shm_dir()).glob(f"mp-ops-{os.getpid()}-*"))


def test_writer_process_reuses_its_shared_memory_slots(tmp_path, monkeypatch):
    """Chunks go through a few slots of shared memory that both processes map once: the slots of one
    file serve the next recorder's chunks, the rows stay those of the in-memory path, a slot larger than
    _SLOT_KEEP is unmapped on both sides after its chunk, and no slot file stays in /dev/shm."""
    from mismatch_probe.probes import recorder_writer

    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "process")
    seq, pos = np.zeros(4, np.int64), np.arange(4)
    ref = OpRecorder(CapturePlan("stats"), buffer_rows=4)
    for i in range(6):
        ref.record(f"{i}.out", _rand(torch.bfloat16, 4, 8, i), seq, pos)
    want = ref.table().to_pandas()
    slots = []
    for k in range(2):
        r = OpRecorder(CapturePlan("stats"), sink=tmp_path / f"ops{k}.parquet", buffer_rows=4)
        child = r._proc.child
        for i in range(6):  # six chunks of 4 rows
            r.record(f"{i}.out", _rand(torch.bfloat16, 4, 8, i), seq, pos)
        r.close()
        pd.testing.assert_frame_equal(read_table(tmp_path / f"ops{k}.parquet", "ops").to_pandas(), want)
        # up to queue_chunks with the process and queue_chunks staged (WriterProcess.stage), and one more
        assert not child.busy and 1 <= len(child.free) <= 2 * r.queue_chunks + 1
        assert _mapped_slots(child.proc.pid) == len(child.free)
        slots.append({id(s) for s in child.free})
        assert not _slot_files()
    assert slots[0] == slots[1]  # the second file went through the first one's slots
    monkeypatch.setattr(recorder_writer, "_SLOT_KEEP", 0)  # every slot is dropped after its chunk
    r = OpRecorder(CapturePlan("stats"), sink=tmp_path / "ops2.parquet", buffer_rows=4)
    child = r._proc.child
    for i in range(6):
        r.record(f"{i}.out", _rand(torch.bfloat16, 4, 8, i), seq, pos)
    r.close()
    pd.testing.assert_frame_equal(read_table(tmp_path / "ops2.parquet", "ops").to_pandas(), want)
    assert not child.free and not child.busy and not _slot_files()
    assert _mapped_slots(child.proc.pid) == 0  # the idle process unmapped them too (told at close)


def _mapped_slots(pid: int) -> int:
    """Slot mappings of process ``pid`` (their files are removed once mapped: '(deleted)' entries)."""
    return len({ln.split()[-2] for ln in Path(f"/proc/{pid}/maps").read_text().splitlines() if "mp-ops-" in ln})


def test_writer_process_death_is_an_error_and_leaves_no_files(tmp_path, monkeypatch):
    """The writer process killed while chunks are in flight: close() raises (no file that reads as
    complete), the temp file and every slot file are gone, and the next recorder gets a new process."""
    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "process")
    seq, pos = np.zeros(4, np.int64), np.arange(4)
    r = OpRecorder(CapturePlan("stats"), sink=tmp_path / "ops.parquet", buffer_rows=4)
    pid = r._proc.proc.pid
    r.record("0.out", _rand(torch.bfloat16, 4, 8, 0), seq, pos)
    r._proc.proc.kill()
    r._proc.proc.wait()
    with pytest.raises(RuntimeError, match="op writer process"):
        for i in range(1, 6):
            r.record(f"{i}.out", _rand(torch.bfloat16, 4, 8, i), seq, pos)
        r.close()
    r.abort()
    assert not any(tmp_path.iterdir()) and not _slot_files()
    r2 = OpRecorder(CapturePlan("stats"), sink=tmp_path / "ops.parquet", buffer_rows=4)
    assert r2._proc.proc.pid != pid
    r2.record("0.out", _rand(torch.bfloat16, 4, 8, 0), seq, pos)
    r2.close()
    assert read_table(tmp_path / "ops.parquet", "ops").num_rows == 4


def test_writer_process_full_shared_memory_is_one_clear_error(tmp_path, monkeypatch):
    """No room for a slot (a full /dev/shm): one clear error (a ProbeError: the CLI prints one line) naming
    the folder and the way out, no file left behind (the slot's pages are allocated when it is made, so a full file
    system cannot surface later as a SIGBUS inside the engine's process)."""
    import errno

    from mismatch_probe.probes import recorder_writer

    def full(fd, offset, length):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "process")
    monkeypatch.setattr(recorder_writer, "_IDLE", [])  # a new process and so new slots
    monkeypatch.setattr(recorder_writer.os, "posix_fallocate", full)
    r = OpRecorder(CapturePlan("stats"), sink=tmp_path / "ops.parquet", buffer_rows=4)
    from mismatch_probe.errors import ProbeError

    with pytest.raises(ProbeError, match=r"no room for a 1 MiB writer buffer .*\[Errno 28\].*CAPTURE_WRITER=thread"):
        for i in range(3):
            r.record(f"{i}.out", _rand(torch.bfloat16, 4, 8, i), np.zeros(4, np.int64), np.arange(4))
        r.close()
    r.abort()
    assert not any(tmp_path.iterdir()) and not _slot_files()


def test_writer_falls_back_to_a_thread_when_no_process_can_start(tmp_path, monkeypatch):
    import subprocess

    from mismatch_probe.probes import recorder_writer

    def no_process(*a, **k):
        raise OSError("no fork here")

    monkeypatch.setattr(recorder_writer, "_IDLE", [])
    monkeypatch.setattr(subprocess, "Popen", no_process)
    r = OpRecorder(CapturePlan("stats"), sink=tmp_path / "ops.parquet")
    assert r.writer_mode == "thread" and len(list(tmp_path.iterdir())) == 1  # the thread's temp file only
    r.record("0.out", _rand(torch.bfloat16, 4, 8, 0), np.zeros(4, np.int64), np.arange(4))
    r.close()
    assert read_table(tmp_path / "ops.parquet", "ops").num_rows == 4 and r.summary()["writer"] == "thread"


def test_batched_digest_only_chunks_equal_the_cpu_path(tmp_path):
    """Chunks of digest-only rows go to the writer process without the stats arena and with raw
    digests (the process makes the hex digits): the same table as the CPU path; record_rows' fast
    path (flat lists, segments as tuples) included."""
    plan = CapturePlan("digest")
    recs = [OpRecorder(plan, buffer_rows=24),
            OpRecorder(plan, sink=tmp_path / "ops.parquet", buffer_rows=24, batched=True)]
    seq = np.array([5, 5, 5, 6, 6, -1])
    pos = np.array([0, 1, 2, 0, 1, 2])
    for r in recs:
        for step in range(3):
            for layer in range(2):
                r.record_rows(f"{layer}.mlp.down", _rand(torch.bfloat16, 6, 33, layer + step), seq, pos)
                r.record_rows(f"{layer}.attn.q", _rand(torch.float32, 6, 12, layer).reshape(2, 3, 12), seq, pos)
    a = recs[0].table().to_pandas()
    recs[1].close()
    b = read_table(tmp_path / "ops.parquet", "ops").to_pandas()
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == 3 * 4 * 5 and a["sum"].isna().all() and a.digest.str.len().eq(16).all()


def test_copy_on_record_keeps_what_the_hook_saw_when_the_engine_overwrites_in_place():
    """vLLM's CUDA kernels overwrite tensors in place after the hook (fused add + RMSNorm rewrites the
    residual and its input, rotary rewrites q and k). On the batched (CUDA) path a queued reference
    would be digested after that; ``copy_on_record`` queues the values the hook saw, so its rows equal
    the immediate (numba) path's, and the plain batched recorder's do not (the hazard this guards)."""
    plan = build_plan("stats", [])
    seq, pos = np.array([0, 0, 1]), np.array([0, 1, 0])
    recs = [OpRecorder(plan), OpRecorder(plan, batched=True, copy_on_record=True), OpRecorder(plan, batched=True)]
    for r in recs:
        r.begin([0, 1], [2, 1])
        x = _rand(torch.bfloat16, 3, 40, 1)
        qkv = _rand(torch.bfloat16, 3, 48, 2)
        r.record("embed", x, seq, pos)
        r.record("0.attn.q", qkv[:, :16], seq, pos)  # a strided view, as vLLM's split of qkv
        x.add_(1.0)  # the engine's in-place kernels, after the hooks
        qkv[:, :16].mul_(-2.0)
    ref, copied, referenced = (r.table().to_pandas() for r in recs)
    pd.testing.assert_frame_equal(ref, copied)
    assert (ref["digest"] != referenced["digest"]).all()


def test_batched_chunks_are_smaller_where_the_plan_keeps_stats():
    """CUDA (batched) recorders of a plan with stats rows cut chunks of STATS_BUFFER_ROWS (the rows reach
    the writer during the forward); digest-only plans, CPU recorders and an explicit buffer_rows keep theirs.
    Same table either way."""
    from mismatch_probe.probes import recorder as R

    assert CapturePlan("stats").keeps_stats() and build_plan("digest", [], full_rows=8).keeps_stats()
    assert not CapturePlan("digest").keeps_stats() and not build_plan("digest", ["*=off"]).keeps_stats()
    assert build_plan("digest", ["logits=stats"]).keeps_stats()
    x, seq, pos = _rand(torch.float32, 6, 8, 1), np.zeros(6, np.int64), np.arange(6)
    got = {}
    for name, rec in {"stats": OpRecorder(CapturePlan("stats"), batched=True),
                      "digest": OpRecorder(CapturePlan("digest"), batched=True),
                      "cpu": OpRecorder(CapturePlan("stats")),
                      "given": OpRecorder(CapturePlan("stats"), batched=True, buffer_rows=1 << 19)}.items():
        rec.record("0.out", x, seq, pos)
        got[name] = rec.buffer_rows
        rec.table()
    assert got == {"stats": R.STATS_BUFFER_ROWS, "digest": R.BUFFER_ROWS, "cpu": R.BUFFER_ROWS, "given": 1 << 19}
    assert R.STATS_BUFFER_ROWS < R.BUFFER_ROWS


_TOK = 12  # the chunk-end tests' forwards: rows per op; 10 ops: 120 arena rows per forward


def _forwards(rec, cuts):
    """Three forwards of 10 ops of ``_TOK`` rows through ``rec`` (marked with ``start_batch``, the runner's early
    flush after each), the rows of the current chunk at every flush appended to ``cuts``; returns the table."""
    seq, pos = np.repeat(np.arange(3), 4), np.tile(np.arange(4), 3)
    xs = [_rand(torch.float32, _TOK, 8, i) for i in range(10)]
    orig = rec.flush
    rec.flush = lambda: (cuts.append(rec._used), orig())[1]
    for _ in range(3):
        rec.start_batch(_TOK)
        for i, x in enumerate(xs):
            rec.record_rows(f"{i}.out", x, seq, pos)
        rec.flush()
    return rec.table()


def test_batched_digest_chunk_ends_where_the_forwards_tail_is_left(monkeypatch):
    """Digest-only batched recorders whose caller marks its forwards (``start_batch``) end a forward's
    chunk where about _TAIL of its rows are left (that chunk at least BUFFER_ROWS), from the plan's rows per
    token of the forward before; the first forward, and the rest after that boundary, cut at BUFFER_ROWS.
    Same table either way."""
    from mismatch_probe.probes import recorder as R

    monkeypatch.setattr(R, "BUFFER_ROWS", 40)
    monkeypatch.setattr(R, "CUDA_BUFFER_ROWS", 400)
    monkeypatch.setattr(R, "_ROWS_PER_TOKEN", {})
    run, tok = _forwards, _TOK
    cuts: list[int] = []
    got = run(OpRecorder(CapturePlan("digest"), batched=True), cuts)
    # forward 1: chunks end before an op would cross BUFFER_ROWS (3 ops: 36 rows), its last op at the early
    # flush; forwards 2 and 3: one end at 0.78 x 120 = 93 rows (7 ops: 84), then BUFFER_ROWS again (the tail)
    assert [c for c in cuts if c] == [36, 36, 36, 12, 84, 36, 84, 36], cuts
    assert R._ROWS_PER_TOKEN and next(iter(R._ROWS_PER_TOKEN.values())) == 10.0
    # a chunk before the tail is never shorter than BUFFER_ROWS (_Cuts.least): 93 rows before the tail, 100 a
    # chunk: the first chunk ends at 100 (8 ops: 96), the tail of 2 ops at the early flush
    monkeypatch.setattr(R, "BUFFER_ROWS", 100)
    least: list[int] = []
    run(OpRecorder(CapturePlan("digest"), batched=True), least)
    assert [c for c in least if c] == [96, 24] * 3, least
    want = run(OpRecorder(CapturePlan("digest"), batched=True, buffer_rows=1 << 10), [])
    key = [("op", "ascending"), ("seq_id", "ascending"), ("pos", "ascending")]
    got, want = got.sort_by(key), want.sort_by(key)
    assert got.num_rows == want.num_rows == 3 * 10 * tok
    for c in ("op", "seq_id", "pos", "digest"):
        assert got.column(c).to_pylist() == want.column(c).to_pylist(), c


def test_batched_stats_chunk_ends_spread_over_the_forward_before_a_small_tail(monkeypatch):
    """Stats batched recorders whose caller marks its forwards cut a forward's rows before its last
    _STATS_TAIL into the fewest even chunks of at most STATS_BUFFER_ROWS (from the plan's rows per token
    of the forward before), so its last chunk is the tail; the first forward cuts at STATS_BUFFER_ROWS.
    The same table as one chunk per forward; _STATS_TAIL = 0 cuts at STATS_BUFFER_ROWS only."""
    from mismatch_probe.probes import recorder as R

    monkeypatch.setattr(R, "STATS_BUFFER_ROWS", 40)
    monkeypatch.setattr(R, "_ROWS_PER_TOKEN", {})
    monkeypatch.setattr(R, "_STATS_TAIL", 0.3)
    run, tok = _forwards, _TOK
    cuts: list[int] = []
    got = run(OpRecorder(CapturePlan("stats"), batched=True), cuts)
    # forward 1: cut before an op would cross 40 rows (3 ops: 36), its last op at the early flush; forwards 2
    # and 3: 84 rows before the tail (0.7 x 120) in 3 chunks of at most 28 (2 ops), 60 in 2 of 30 (2 ops), 36
    # in 1 (3 ops), then the tail of 3 ops at the early flush
    assert [c for c in cuts if c] == [36, 36, 36, 12] + [24, 24, 36, 36] * 2, cuts
    # 0.15: 102 rows before the tail; after 96 of them (24, 36, 12, 24) the 6 left, under one op call's 12 rows,
    # join the tail (24 rows), not a chunk of one op of their own (the plan's rows per token known from the start)
    monkeypatch.setattr(R, "_STATS_TAIL", 0.15)
    rem: list[int] = []
    run(OpRecorder(CapturePlan("stats"), batched=True), rem)
    assert [c for c in rem if c] == [24, 36, 12, 24, 24] * 3, rem
    monkeypatch.setattr(R, "_STATS_TAIL", 0.0)
    fixed: list[int] = []
    run(OpRecorder(CapturePlan("stats"), batched=True), fixed)
    assert [c for c in fixed if c] == [36, 36, 36, 12] * 3, fixed
    want = run(OpRecorder(CapturePlan("stats"), batched=True, buffer_rows=1 << 10), [])
    key = [("op", "ascending"), ("seq_id", "ascending"), ("pos", "ascending")]
    got, want = got.sort_by(key), want.sort_by(key)
    assert got.num_rows == want.num_rows == 3 * 10 * tok
    for c in got.column_names:
        assert got.column(c).to_pylist() == want.column(c).to_pylist(), c


@pytest.mark.parametrize("nbytes", [1000, (4 << 20) + 3])
@pytest.mark.parametrize("threads", [False, True])
def test_writer_feeders_copy_into_a_slot_is_the_same_bytes(nbytes, threads):
    """The pinned path's copy into a slot (by torch's threads for a CUDA chunk's large pieces) moves the
    bytes unchanged and touches nothing beside them."""
    from mismatch_probe.probes.recorder_writer import _copy_into

    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    buf = np.full(nbytes + 16, 7, np.uint8)
    _copy_into(buf[8 : 8 + nbytes], src, threads=threads)
    assert np.array_equal(buf[8 : 8 + nbytes], src)
    assert (buf[:8] == 7).all() and (buf[8 + nbytes :] == 7).all()


def test_writer_row_groups_thread_acks_in_order_and_reports_a_failed_write():
    """The writer process writes row groups on a thread while it builds the next table: acks come in order,
    after each write; a failed write is reported at once (the engine may be waiting for that ack) and raised
    by the receiving loop, and nothing after it is written."""
    from multiprocessing import Pipe

    from mismatch_probe.probes.recorder_writer import _RowGroups

    class Sink:
        def __init__(self) -> None:
            self.written: list[str] = []

        def write(self, table: str) -> None:
            if table == "bad":
                raise OSError("disk full")
            self.written.append(table)

    rx, tx = Pipe(duplex=False)
    groups, sink = _RowGroups(tx), Sink()
    for i, t in enumerate(["a", "b"]):
        groups.put((sink, t, f"slot{i}", 1, 0, 0.0, 0.0))
    groups.wait()
    assert [rx.recv()[3] for _ in range(2)] == ["slot0", "slot1"] and sink.written == ["a", "b"]
    groups.put((sink, "bad", "slot2", 1, 0, 0.0, 0.0))
    msg = rx.recv()
    assert msg[0] == "error" and "disk full" in msg[1]
    with pytest.raises(OSError, match="disk full"):
        groups.wait()
    groups.wait(check=False)
    with pytest.raises(OSError):
        groups.put((sink, "c", "slot3", 1, 0, 0.0, 0.0))
    assert sink.written == ["a", "b"]
