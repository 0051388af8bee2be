"""`compare` against the real engines (vLLM on CPU, HF transformers): files, metrics, determinism."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mp_testlib import cli, load_json

from mismatch_probe.run.schema import SCHEMA_VERSION, validate_file

pytestmark = pytest.mark.vllm


def _check_run_files(run: Path) -> None:
    m = load_json(run / "manifest.json")
    assert m["status"] == "complete" and m["schema_version"] == SCHEMA_VERSION
    assert m["engines"]["sampler"]["engine"] == "vllm"
    assert m["engines"]["learner"]["micro_batch_size"] == 8
    assert m["engines"]["learner"]["padding_side"] == "right"
    for rel, kind in (
        ("sampler/tokens.parquet", "tokens"),
        ("learner/tokens.parquet", "tokens"),
        ("compare/token_gaps.parquet", "token_gaps"),
    ):
        validate_file(run / rel, kind)
        assert pq.read_schema(run / rel).metadata[b"mismatch_probe.schema_version"] == str(SCHEMA_VERSION).encode()
    assert not list(run.parent.glob(".*partial*"))
    # where the wait went: every stage's wall seconds, in order, within the whole command's
    t = m["timings"]
    assert {"comparing token logprobs", "learner forward (teacher-forced)"} <= set(t["stages_s"])
    assert all(v >= 0 for v in t["stages_s"].values()) and sum(t["stages_s"].values()) <= t["total_s"]


def _independent_metrics(run: Path) -> dict[str, dict[str, float]]:
    """Recompute headline metrics from the Parquet token tables with plain numpy (no project code)."""
    s = pq.read_table(run / "sampler/tokens.parquet").to_pydict()
    lt = pq.read_table(run / "learner/tokens.parquet").to_pydict()
    learner = {(a, b): (lp, r) for a, b, lp, r in zip(lt["seq_id"], lt["pos"], lt["logprob"], lt["is_response"])}
    views: dict[str, dict] = {"decode": {}, "prefill": {}}
    for a, b, lp, src in zip(s["seq_id"], s["pos"], s["logprob"], s["source"]):
        views[src][(a, b)] = lp
    out = {}
    for pair, (x, y) in {
        "learner_vs_decode": ("learner", "decode"),
        "learner_vs_prefill": ("learner", "prefill"),
        "prefill_vs_decode": ("prefill", "decode"),
    }.items():
        keys = sorted(k for k, (_, resp) in learner.items() if resp and k in views["decode"] | views["prefill"])
        keys = [k for k in keys if (y != "decode" or k in views["decode"])]
        get = {"learner": lambda k: learner[k][0], "decode": views["decode"].get, "prefill": views["prefill"].get}
        a = np.array([get[x](k) for k in keys])
        b = np.array([get[y](k) for k in keys])
        d = a - b
        r = np.exp(d)
        seq = np.array([k[0] for k in keys])
        sums = np.array([d[seq == i].sum() for i in np.unique(seq)])
        out[pair] = {
            "n_tokens": float(len(keys)),
            "mean_abs_dlogp": float(np.mean(np.abs(d))),
            "max_abs_dlogp": float(np.max(np.abs(d))),
            "p90_abs_dlogp": float(np.percentile(np.abs(d), 90)),
            "mean_abs_dprob": float(np.mean(np.abs(np.exp(a) - np.exp(b)))),
            "k1": float(np.mean(-d)),
            "k3": float(np.mean(r - 1 - d)),
            "clip_frac": float(np.mean((r < 0.8) | (r > 1.2))),
            "seq_max_abs_logratio": float(np.max(np.abs(sums))),
        }
    return out


@pytest.mark.parametrize("fixture", ["real_run", "real_run_qwen3"])
def test_compare_files_validate_and_metrics_recompute(fixture, request):
    run: Path = request.getfixturevalue(fixture)
    _check_run_files(run)
    summary = load_json(run / "compare/summary.json")
    mine = _independent_metrics(run)
    for pair, metrics in mine.items():
        for k, v in metrics.items():
            got = summary["pairs"][pair][k]
            assert got == pytest.approx(v, rel=1e-9, abs=1e-15), (pair, k)
    # the HF-vs-vLLM gap on these random tiny models is real (different kernels), not zero
    assert summary["pairs"]["learner_vs_prefill"]["max_abs_dlogp"] > 0
    assert summary["n_response_tokens"] > 0


def test_same_command_twice_gives_identical_token_tables(real_run, tmp_path):
    # the suite's run was forked from the tests' pre-imported server (mp_zygote); this one starts a
    # fresh interpreter (``env`` given), as a user's command does: the fork changes no bit either
    again = tmp_path / "again"
    cli("compare", "--model", "tiny-llama", "--out", str(again), check=True, env={})
    for rel in ("sampler/tokens.parquet", "learner/tokens.parquet", "compare/token_gaps.parquet",
                "sampler/ops.parquet", "learner/ops.parquet"):
        a = pq.read_table(real_run / rel)
        b = pq.read_table(again / rel)
        assert a.schema.equals(b.schema), rel
        for name in a.column_names:
            assert _same_bits(a[name], b[name]), (rel, name)


def _same_bits(a, b) -> bool:
    """Column equality bit for bit: Arrow's ``equals`` says NaN != NaN, and the top-K columns hold NaN
    where the sampler gave no top-K (e.g. prompt positions of the decode view)."""
    import numpy as np

    if a.equals(b):
        return True
    for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True):
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        xa, ya = np.asarray(x), np.asarray(y)
        if xa.dtype != ya.dtype or xa.shape != ya.shape:
            return False
        if xa.dtype.kind == "f":
            xa, ya = xa.view(f"i{xa.itemsize}"), ya.view(f"i{ya.itemsize}")
        if not np.array_equal(xa, ya):
            return False
    return True


def test_given_responses_are_scored_not_generated(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt_token_ids": [1, 10, 11, 12], "response_token_ids": [40, 41, 42]}\n'
        '{"prompt": "the quick brown fox", "response_token_ids": [7, 8]}\n'
    )
    out = tmp_path / "run"
    proc = cli("compare", "--model", "tiny-qwen3", "--prompts", str(prompts), "--out", str(out), check=True)
    assert "learner vs prefill" in proc.stdout
    summary = load_json(out / "compare/summary.json")
    assert summary["pairs"]["learner_vs_decode"] is None  # no decode view: nothing was generated
    assert summary["pairs"]["learner_vs_prefill"]["n_tokens"] == 5
    gaps = pq.read_table(out / "compare/token_gaps.parquet").to_pydict()
    resp = [t for t, r in zip(gaps["token_id"], gaps["is_response"]) if r]
    assert resp == [40, 41, 42, 7, 8]
    assert not math.isnan(summary["pairs"]["learner_vs_prefill"]["mean_abs_dlogp"])
