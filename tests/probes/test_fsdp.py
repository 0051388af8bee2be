"""FSDP learner: real FSDP2 over gloo with 2 ranks on CPU (no mocks).

Bitwise tests assert exact equality (np.array_equal, atol=rtol=0): the FSDP ranks cut the
micro-batches exactly as the single-process HfLearner does (same composition, same right-padded
width) and all-gather the bf16 weights exactly, so the forward runs the same kernels on the same
values; measured max |difference| on tiny-llama and tiny-qwen3-moe: 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from mp_testlib import cli, load_json

from mismatch_probe.probes.capture import CapturePlan
from mismatch_probe.probes.fsdp.runner import FsdpLearner, FsdpRankError, merge_rank_dataset
from mismatch_probe.probes.fsdp.worker import FAULT_ENV, rank_steps
from mismatch_probe.probes.hf.runner import HfLearner
from mismatch_probe.probes.models import resolve_model
from mismatch_probe.run.schema import read_table, write_table

MICRO_BATCH = 2  # 7 sequences -> 4 micro-batches -> 2 per rank; the odd one tests the dummy step


def _seqs(vocab: int, n: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=int(rng.integers(4, 20))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe"])
def scored(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Single-process HF and 2-rank FSDP logprobs of the same sequences, plus the rank dataset."""
    m = resolve_model(request.param)
    seqs = _seqs(m.vocab_size)
    meta = [(100 + i, i // 2, 3) for i in range(len(seqs))]  # seq_ids that are not indices
    sids = [m_[0] for m_ in meta]
    with HfLearner(m.path, m.vocab_size, micro_batch_size=MICRO_BATCH) as hf:
        hf.capture = CapturePlan("stats")
        ref = hf.score(seqs, sids)
        ref_ops = hf.ops
    dest = tmp_path_factory.mktemp("fsdp")
    with FsdpLearner(m.path, m.vocab_size, micro_batch_size=MICRO_BATCH, nproc=2, timeout_s=240) as f:
        f.capture = CapturePlan("stats")
        f.seq_meta, f.dataset_dest, f.ops_dataset_dest = meta, dest / "tokens_by_rank", dest / "ops_by_rank"
        got = f.score(seqs, sids)
        ops, info = f.ops, f.info
    return {
        "model": request.param, "seqs": seqs, "meta": meta, "ref": ref, "got": got, "dest": dest / "tokens_by_rank",
        "ops_dest": dest / "ops_by_rank", "ref_ops": ref_ops, "ops": ops, "info": info,
    }


def test_fsdp_logprobs_bitwise_equal_single_process_hf(scored: dict) -> None:
    ref, got = scored["ref"], scored["got"]
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(ref, got, strict=True)]
    assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), (scored["model"], diffs)
    assert scored["info"].settings["world_size"] == 2 and scored["info"].settings["backend"] == "gloo"
    # the default MixedPrecisionPolicy: parameters in the model's dtype, gradients reduced in fp32
    assert scored["info"].settings["mp_param_dtype"] == "bfloat16" and scored["info"].settings["mp_reduce_dtype"] == "float32"


def test_fsdp_rank_dataset_has_every_seq_pos_exactly_once(scored: dict) -> None:
    table = ds.dataset(scored["dest"], format="parquet", partitioning="hive").to_table()
    df = table.to_pandas()
    assert sorted(df["rank"].unique().tolist()) == [0, 1]  # both ranks scored real sequences
    assert not df.duplicated(["seq_id", "pos"]).any()
    want = {(sid, p) for (sid, _, _), s in zip(scored["meta"], scored["seqs"], strict=True) for p in range(1, len(s))}
    assert set(zip(df["seq_id"], df["pos"], strict=True)) == want
    # rank R holds exactly the micro-batches k with k % 2 == R
    for r in (0, 1):
        mine = {k for step in rank_steps(len(scored["seqs"]), MICRO_BATCH, r, 2) if step for k in step}
        assert set(df[df["rank"] == r]["seq_id"]) == {scored["meta"][k][0] for k in mine}
    # the merged logprobs are the dataset's rows
    lp = {(s, p): v for s, p, v in zip(df["seq_id"], df["pos"], df["logprob"], strict=True)}
    for (sid, _, _), arr in zip(scored["meta"], scored["got"], strict=True):
        assert np.array_equal(arr, [lp[(sid, p)] for p in range(1, arr.size + 1)])


def _rank_ops(root: Path) -> pd.DataFrame:
    """Each rank's ops file read through read_table (a streamed capture is in the packed layout), with its rank."""
    return pd.concat([read_table(p, "ops").to_pandas().assign(rank=int(p.parent.name.partition("=")[2]))
                      for p in sorted(Path(root).glob("rank=*/part.parquet"))], ignore_index=True)


def test_fsdp_ops_every_op_seq_pos_once_and_bitwise_equal_hf(scored: dict) -> None:
    parts = _rank_ops(scored["ops_dest"])
    assert sorted(parts["rank"].unique().tolist()) == [0, 1]
    assert not parts.duplicated(["op", "seq_id", "pos"]).any()
    keys = ["op", "seq_id", "pos"]
    got = scored["ops"].to_pandas().set_index(keys).sort_index()
    ref = scored["ref_ops"].to_pandas().set_index(keys).sort_index()
    assert len(got) == len(parts) and not got.index.duplicated().any()
    assert got.index.equals(ref.index)  # the same (op, seq_id, pos) set as the single-process capture
    assert {"0.attn.q", "3.out", "logits"} <= set(got.index.get_level_values("op"))
    assert (got["digest"] == ref["digest"]).all()  # every op output bitwise equal (blake2b of raw bytes)


def test_rank_steps_same_count_on_every_rank() -> None:
    for n, mb, world in [(7, 2, 2), (1, 8, 2), (9, 3, 4), (16, 4, 2)]:
        plans = [rank_steps(n, mb, r, world) for r in range(world)]
        assert len({len(p) for p in plans}) == 1
        covered = sorted(k for p in plans for step in p if step for k in step)
        assert covered == list(range(n))


def _part(root: Path, rank: int, rows: list[tuple[int, int]]) -> None:
    t = pa.table(
        {
            "seq_id": [r[0] for r in rows],
            "prompt_id": [0] * len(rows),
            "pos": [r[1] for r in rows],
            "token_id": [5] * len(rows),
            "is_response": [True] * len(rows),
            "logprob": [-1.0] * len(rows),
            "source": ["learner"] * len(rows),
        }
    )
    write_table(root / f"rank={rank}" / "part.parquet", t, "tokens")


def test_merge_rejects_duplicate_and_missing_rows(tmp_path: Path) -> None:
    seqs, meta = [[5, 6, 7]], [(0, 0, 1)]
    _part(tmp_path / "dup", 0, [(0, 1), (0, 2)])
    _part(tmp_path / "dup", 1, [(0, 2)])
    with pytest.raises(FsdpRankError, match=r"seq_id 0, pos 2\) was scored by more than one rank \(\[0, 1\]\)"):
        merge_rank_dataset(tmp_path / "dup", seqs, meta, 2)
    _part(tmp_path / "gap", 0, [(0, 1)])
    _part(tmp_path / "gap", 1, [])
    with pytest.raises(FsdpRankError, match="incomplete"):
        merge_rank_dataset(tmp_path / "gap", seqs, meta, 2)


@pytest.mark.vllm
def test_compare_learner_fsdp_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli(
        "compare", "--learner", "fsdp", "--sampler", "vllm", "--nproc", "2", "--model", "tiny-llama",
        "--n", "1", "--max-tokens", "6", "--micro-batch-size", "4", "--out", str(out),
        "--fsdp-param-dtype", "float32", "--fsdp-reduce-dtype", "bfloat16",  # not the defaults
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = load_json(out / "manifest.json")
    assert m["status"] == "complete"
    learner = m["engines"]["learner"]
    assert learner["engine"] == "fsdp" and learner["world_size"] == 2 and learner["backend"] == "gloo"
    assert learner["mp_param_dtype"] == "float32" and learner["mp_reduce_dtype"] == "bfloat16"
    summary = load_json(out / "compare" / "summary.json")
    assert summary["pairs"]["learner_vs_prefill"]["n_tokens"] > 0
    parts = ds.dataset(out / "learner" / "tokens_by_rank", format="parquet", partitioning="hive").to_table()
    assert sorted(set(parts.column("rank").to_pylist())) == [0, 1]
    assert not parts.to_pandas().duplicated(["seq_id", "pos"]).any()
    ops = _rank_ops(out / "learner" / "ops_by_rank")
    assert sorted(ops["rank"].unique().tolist()) == [0, 1]
    assert len(ops) > 0 and not ops.duplicated(["op", "seq_id", "pos"]).any()
    assert set(ops["dtype"]) == {"float32"}  # the policy took effect: the forward computed in fp32


@pytest.mark.vllm
def test_killed_rank_stops_compare_names_rank_and_leaves_no_complete_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    timeout = 120
    t0 = time.monotonic()
    proc = cli(
        "compare", "--learner", "fsdp", "--nproc", "2", "--model", "tiny-llama", "--n", "1",
        "--max-tokens", "6", "--micro-batch-size", "2", "--fsdp-timeout", str(timeout),
        "--capture", "off", "--out", str(out),
        timeout=timeout + 120, env={FAULT_ENV: "rank:1:after_batches:1:kill"},  # injected by the test only
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "rank 1 killed by SIGKILL" in proc.stderr
    assert elapsed < timeout + 90  # sampler start-up + learner within its timeout
    assert not out.exists()  # never a folder at --out that reads as complete
    staged = list(tmp_path.glob(".run.partial-*"))
    assert len(staged) == 1
    m = json.loads((staged[0] / "manifest.json").read_text())
    assert m["status"] == "failed" and "rank 1" in m["error"]
    assert not (staged[0] / "learner").exists()  # no partial learner dataset


def test_hung_rank_is_stopped_within_timeout_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "rank:1:after_batches:0:hang")  # the ranks inherit it; no option carries it
    m = resolve_model("tiny-llama")
    # rank 0 must have loaded and entered its first forward before it: the whole two-rank job of this
    # model takes ~13 s on the 2-core box (2026-12-06), so 30 s leaves more than twice that
    timeout = 30.0
    t0 = time.monotonic()
    with pytest.raises(FsdpRankError, match=r"FSDP rank 1 of 2 hung") as e:
        with FsdpLearner(
            m.path, m.vocab_size, micro_batch_size=1, nproc=2, timeout_s=timeout
        ) as f:
            f.dataset_dest = tmp_path / "tokens_by_rank"
            f.score([[5, 6, 7], [5, 6, 8]])
    assert time.monotonic() - t0 < timeout + 20
    assert "rank 0: forward 1" in str(e.value)
    assert not (tmp_path / "tokens_by_rank").exists()


def test_bad_fsdp_settings_are_usage_errors(tmp_path: Path) -> None:
    from mismatch_probe.errors import UsageError
    from mismatch_probe.steps.compare import CompareConfig

    CompareConfig(out=tmp_path, learner="fsdp", nproc=2).validate()
    for kw, msg in [
        ({"nproc": 0}, "--nproc must be >= 1"),
        ({"fsdp_timeout_s": 0}, "--fsdp-timeout must be > 0"),
        ({"fsdp_param_dtype": "fp8"}, "--fsdp-param-dtype must be"),
        ({"fsdp_reduce_dtype": "int8"}, "--fsdp-reduce-dtype must be"),
    ]:
        with pytest.raises(UsageError, match=msg):
            CompareConfig(out=tmp_path, learner="fsdp", **kw).validate()
