"""Full-distribution (top-K) metrics: hand-made distributions, the engine run's relation to k3,
and the learner's top-K recording leaving its logprobs unchanged."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mp_testlib import load_json

from mismatch_probe.analysis.topk import lookup, topk_metrics


def _dist(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    x = rng.normal(0, 2, (n, v))
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def _topk(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(lp, ids, 1)


def test_equal_distributions_give_zero_kl_full_agreement() -> None:
    lp = _dist(np.random.default_rng(0), 50, 40)
    ids, vals = _topk(lp, 8)
    m = topk_metrics(ids, vals, vals.copy(), vals[:, 0], vals[:, -1], ids[:, 2], rank=np.full(50, 3))
    assert m["kl_fwd"] == 0.0 and m["kl_rev"] == 0.0 and m["top1_agree"] == 1.0 and m["topk_overlap"] == 1.0
    assert m["sampled_in_topk_frac"] == 1.0 and m["sampled_rank_mean"] == 3.0 and m["n_positions"] == 50


def test_kl_matches_direct_computation_and_overlap_counts() -> None:
    rng = np.random.default_rng(1)
    s = _dist(rng, 30, 50)
    o = s + rng.normal(0, 0.3, s.shape)
    o -= np.log(np.exp(o).sum(1, keepdims=True))
    k = 10
    ids, vals = _topk(s, k)
    at = np.take_along_axis(o, ids, 1)
    oids, ovals = _topk(o, k)
    m = topk_metrics(ids, vals, at, ovals[:, 0], ovals[:, -1], ids[:, 0])
    ps = np.exp(vals) / np.exp(vals).sum(1, keepdims=True)
    po = np.exp(at) / np.exp(at).sum(1, keepdims=True)
    assert m["kl_fwd"] == pytest.approx(np.mean(np.sum(ps * np.log(ps / po), 1)), rel=1e-10)
    assert m["kl_rev"] == pytest.approx(np.mean(np.sum(po * np.log(po / ps), 1)), rel=1e-10)
    inter = np.array([len(set(a) & set(b)) for a, b in zip(ids, oids)])
    assert m["topk_overlap"] == pytest.approx(np.mean(inter / (2 * k - inter)))
    assert m["top1_agree"] == pytest.approx(np.mean(ids[:, 0] == oids[:, 0]))
    assert 0 < m["top1_agree"] < 1 and 0 < m["topk_overlap"] < 1


def test_lookup_in_another_topk_list() -> None:
    ids = np.array([[3, 1, 2]])
    own = np.array([[2, 3, 9]])
    got = lookup(ids, own, np.array([[-0.5, -1.0, -2.0]]))
    assert got[0, 0] == -1.0 and math.isnan(got[0, 1]) and got[0, 2] == -0.5


@pytest.mark.vllm
def test_engine_recipe_topk_kl_consistent_with_k3(real_run_qwen3: Path, tmp_path: Path) -> None:
    """tiny-qwen3, bf16 engine recipe, --topk 20 by default (capture on): the sampler's top-K KL and
    the sampled-token k3 estimate the same KL(sampler || learner); bound their ratio to [1/3, 3]."""
    s = load_json(real_run_qwen3 / "compare/summary.json")
    m = load_json(real_run_qwen3 / "manifest.json")
    assert m["config"]["topk_resolved"] == 20
    for pair in ("learner_vs_decode", "learner_vs_prefill"):
        fv, k3 = s["pairs"][pair]["full_vocab"], s["pairs"][pair]["k3"]
        assert fv["n_positions"] == s["pairs"][pair]["n_tokens"]
        assert fv["kl_fwd"] > 0 and k3 > 0
        assert 1 / 3 <= fv["kl_fwd"] / k3 <= 3, (fv["kl_fwd"], k3)
        assert 1 / 3 <= fv["kl_rev"] / fv["kl_fwd"] <= 3  # small perturbations: KL nearly symmetric
        assert fv["top1_agree"] > 0.9 and fv["topk_overlap"] > 0.8
        assert fv["entropy_learner"] > 0 and fv["sampled_rank_mean"] >= 1
    tok = pd.read_parquet(real_run_qwen3 / "learner/tokens.parquet")
    assert {"topk_ids", "topk_logprobs", "entropy", "sampled_rank", "lp_at_prefill_topk", "lp_at_decode_topk"} <= set(tok)
    st = pd.read_parquet(real_run_qwen3 / "sampler/tokens.parquet")
    assert st["topk_ids"].map(len).eq(20).all()
    # the learner's rank of the scored token agrees with its own top-K where the token is in it
    r = tok[tok.sampled_rank <= 20]
    assert all(ids[rk - 1] == t or vals[rk - 1] == vals[list(ids).index(t)] if t in ids else False
               for ids, vals, rk, t in zip(r.topk_ids, r.topk_logprobs, r.sampled_rank, r.token_id))  # fmt: skip
    from mismatch_probe.reports import build_report

    html = build_report(real_run_qwen3, tmp_path / "r.html")[0].read_text()
    assert 'id="full-distribution"' in html and "top-1 agreement" in html


def test_learner_topk_recording_leaves_logprobs_unchanged(tmp_path: Path) -> None:
    """Observer effect: the HF learner's token logprobs are bitwise the same with --topk on."""
    from mismatch_probe.probes.hf.runner import HfLearner
    from mismatch_probe.probes.models import resolve_model

    m = resolve_model("tiny-qwen3")
    seqs = [[1, 5, 9, 13, 2], [7, 3, 3], [4, 4, 8, 1, 1, 6, 2]]
    with HfLearner(m.path, m.vocab_size, micro_batch_size=2, device="cpu") as plain:
        a = plain.score(seqs, [0, 1, 2])
    with HfLearner(m.path, m.vocab_size, micro_batch_size=2, device="cpu") as top:
        top.topk = 5
        top.topk_support = {1: {"prefill": np.array([[3, 0, 1, 2, 4], [-1] * 5])}}
        b = top.score(seqs, [0, 1, 2])
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    rec = top.topk_out
    assert rec[2]["topk_ids"].shape == (6, 5) and rec[2]["entropy"].shape == (6,)
    assert np.all(rec[2]["topk_logprobs"][:, :-1] >= rec[2]["topk_logprobs"][:, 1:])
    # logprob at the support ids equals the learner's own logprob of those tokens
    at = rec[1]["lp_at_prefill_topk"]
    assert at[0, 0] == b[1][0]  # support id 3 is the scored token seqs[1][1]: the same value, bitwise
    assert np.isnan(at[1]).all() and np.isnan(rec[0]["lp_at_prefill_topk"]).all()  # no support: NaN
    ent = rec[0]["entropy"]
    assert np.all(ent > 0) and np.all(ent <= math.log(m.vocab_size) + 1e-5)
    # slices of 3 positions (memory bound) record the same values as one slice
    import mismatch_probe.probes.hf.runner as hr

    old_chunk = hr.TOPK_CHUNK_ELEMS
    hr.TOPK_CHUNK_ELEMS = 3 * m.vocab_size
    try:
        with HfLearner(m.path, m.vocab_size, micro_batch_size=2, device="cpu") as sliced:
            sliced.topk = 5
            sliced.topk_support = top.topk_support
            sliced.score(seqs, [0, 1, 2])
    finally:
        hr.TOPK_CHUNK_ELEMS = old_chunk
    for sid, arrays in rec.items():
        for key, val in arrays.items():
            assert np.array_equal(sliced.topk_out[sid][key], val, equal_nan=True), (sid, key)


@pytest.mark.vllm
def test_topk_changes_no_logprob(real_run_qwen3: Path, tmp_path: Path) -> None:
    """Observer effect: the shared tiny-qwen3 run (capture full, --topk 20 by default) against the same
    command with --topk 0 --capture off: the same sampled tokens and bitwise the same logprobs."""
    from mp_testlib import cli

    out = tmp_path / "plain"
    cli("compare", "--model", "tiny-qwen3", "--out", str(out), "--topk", "0", "--capture", "off", check=True)
    assert load_json(out / "manifest.json")["config"]["topk_resolved"] == 0
    for rel in ("sampler/tokens.parquet", "learner/tokens.parquet"):
        a = pd.read_parquet(real_run_qwen3 / rel)
        b = pd.read_parquet(out / rel)
        assert "topk_ids" in a and "topk_ids" not in b
        cols = ["seq_id", "pos", "token_id", "source", "logprob"]
        if not a[cols].equals(b[cols]):
            j = a[cols].merge(b[cols], on=["seq_id", "pos", "source"], how="outer", suffixes=("", "_off"), indicator=True)
            diff = j[(j._merge != "both") | (j.token_id != j.token_id_off) | (j.logprob != j.logprob_off)]
            auto = [load_json(r / "manifest.json")["auto"] for r in (real_run_qwen3, out)]
            pytest.fail(f"{rel}: {len(diff)} rows differ, e.g.\n{diff.head(5)}\nauto settings: {auto}")


def test_with_topk_places_arrays_by_seq_and_pos() -> None:
    import pyarrow as pa

    from mismatch_probe.analysis.token_gaps import with_topk

    t = pa.table({"seq_id": [7, 3, 7, 3, 9], "pos": [2, 1, 1, 2, 1]})
    per = {3: {"ids": np.array([[30, 31], [32, 33]]), "e": np.array([0.3, 0.4])}, 7: {"ids": np.array([[70, 71], [72, 73]])}}
    out = with_topk(t, per, {"ids": pa.list_(pa.int32()), "e": pa.float64(), "absent": pa.float64()})
    assert out.column("ids").to_pylist() == [[72, 73], [30, 31], [70, 71], [32, 33], None]
    assert out.column("e").to_pylist() == [None, 0.3, None, 0.4, None]
    assert "absent" not in out.column_names
