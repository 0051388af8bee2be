"""``compare --rollouts`` against the real engines, and the framework conventions on that real run
(16 sequences, four of them one token long) against independent numpy references."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from convention_ref import assert_close, reference
from mp_testlib import load_json

from mismatch_probe.run.schema import validate_file

pytestmark = pytest.mark.vllm


def _file(run: Path) -> pd.DataFrame:
    m = load_json(run / "manifest.json")
    return pq.read_table(m["rollouts"]["file"]).to_pandas()


def test_decode_view_equals_the_files_logprobs_bit_for_bit(rollouts_run: Path) -> None:
    m = load_json(rollouts_run / "manifest.json")
    assert m["status"] == "complete"
    assert m["rollouts"] == {"file": m["rollouts"]["file"], "naming": "verl", "n_rollouts": 16, "trainer_logprobs": True}
    f = _file(rollouts_run)
    tok = validate_file(rollouts_run / "sampler/tokens.parquet", "tokens").to_pandas()
    dec = tok[tok.source == "decode"].sort_values(["seq_id", "pos"])
    gaps = validate_file(rollouts_run / "compare/token_gaps.parquet", "token_gaps").to_pandas()
    for sid, row in f.iterrows():
        keep = int(np.sum(row["response_mask"]))
        want = np.asarray(row["rollout_log_probs"][:keep], dtype=np.float64)
        got = dec[dec.seq_id == sid]["logprob"].to_numpy()
        assert np.array_equal(got.view(np.int64), want.view(np.int64)), sid
        g = gaps[(gaps.seq_id == sid) & gaps.is_response]["lp_decode"].to_numpy()
        assert np.array_equal(g.view(np.int64), want.view(np.int64)), sid
        assert dec[dec.seq_id == sid]["token_id"].tolist() == list(row["responses"][:keep])
    lens = dec.groupby("seq_id").size()
    assert len(lens) == 16 and int((lens == 1).sum()) == 4


def test_training_run_gap_next_to_the_engines_gap(rollouts_run: Path, real_run_qwen3: Path) -> None:
    s = load_json(rollouts_run / "compare/summary.json")
    pairs = s["pairs"]
    assert {"learner_vs_decode", "learner_vs_prefill", "prefill_vs_decode", "trainer_vs_decode", "learner_vs_trainer"} <= set(
        pairs
    )
    # the trainer's logprobs were the first run's learner, the recorded ones its decode: the training
    # run's gap is the first run's learner-vs-decode gap on the same tokens, exactly
    old = pd.read_parquet(real_run_qwen3 / "compare/token_gaps.parquet")
    old = old[old.is_response].set_index(["seq_id", "pos"])
    tr = pd.read_parquet(rollouts_run / "rollouts/tokens.parquet").set_index(["seq_id", "pos"])
    dec = pd.read_parquet(rollouts_run / "compare/token_gaps.parquet").set_index(["seq_id", "pos"]).loc[tr.index]
    d_now = (tr["logprob"] - dec["lp_decode"]).to_numpy()
    assert np.array_equal(d_now, old.loc[tr.index, "d_learner_decode"].to_numpy())
    assert pairs["trainer_vs_decode"]["n_tokens"] == len(tr)
    assert pairs["trainer_vs_decode"]["max_abs_dlogp"] == pytest.approx(np.abs(d_now).max(), rel=0, abs=0)


def test_conventions_on_the_real_run_equal_independent_numpy(rollouts_run: Path) -> None:
    """Acceptance: every conventions.{verl,slime,nemo_rl} value of every pair to 1e-9 relative."""
    s = load_json(rollouts_run / "compare/summary.json")
    g = pd.read_parquet(rollouts_run / "compare/token_gaps.parquet")
    g = g[g.is_response]
    tr = pd.read_parquet(rollouts_run / "rollouts/tokens.parquet")[["seq_id", "pos", "logprob"]]
    g = g.merge(tr.rename(columns={"logprob": "lp_trainer"}), on=["seq_id", "pos"], how="left")
    cols = {
        "learner_vs_decode": ("lp_learner", "lp_decode"),
        "learner_vs_prefill": ("lp_learner", "lp_prefill"),
        "prefill_vs_decode": ("lp_prefill", "lp_decode"),
        "trainer_vs_decode": ("lp_trainer", "lp_decode"),
        "learner_vs_trainer": ("lp_learner", "lp_trainer"),
    }
    n = 0
    for pair, (a, b) in cols.items():
        assert g["seq_id"].nunique() == 16
        want = reference(g[a].to_numpy(), g[b].to_numpy(), g["seq_id"].to_numpy())
        n += assert_close(s["pairs"][pair]["conventions"], want)
    assert n >= 5 * 70
    # slime's seq-mean-token-mean differs from the token mean here (one-token sequences)
    c = s["pairs"]["learner_vs_decode"]["conventions"]
    assert c["slime"]["train_rollout_logprob_abs_diff"] != pytest.approx(s["pairs"]["learner_vs_decode"]["mean_abs_dlogp"])


def test_report_shows_the_training_run_gap(rollouts_run: Path, tmp_path: Path) -> None:
    from mismatch_probe.reports import build_report

    out, _ = build_report(rollouts_run, tmp_path / "r.html", convention="nemo_rl")
    html = out.read_text()
    assert 'id="training-run"' in html and "trainer vs recorded sampler (training run)" in html
    assert 'id="convention-table"' in html and "train/token_mult_prob_error" in html


def test_rollouts_with_topk_compare_the_prefill_distribution(rollouts_run: Path) -> None:
    """The file holds no decode top-K: the full-distribution metrics exist for learner vs prefill only."""
    pairs = load_json(rollouts_run / "compare/summary.json")["pairs"]
    assert "full_vocab" not in pairs["learner_vs_decode"] and "full_vocab" not in pairs["prefill_vs_decode"]
    fv = pairs["learner_vs_prefill"]["full_vocab"]
    assert fv["n_positions"] == pairs["learner_vs_prefill"]["n_tokens"] and 0 <= fv["kl_fwd"] < 1e-2
