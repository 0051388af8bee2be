"""Framework conventions (verl, slime, NeMo RL) against independent numpy references, and our
added metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from convention_ref import assert_close, reference

from mismatch_probe.analysis.conventions import FRAMEWORKS, ConventionConfig, framework_metrics
from mismatch_probe.analysis.metrics import GAP_METRICS, logprob_gap


def _batch(rng: np.random.Generator, n_seq: int = 16, scale: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lens = rng.integers(1, 12, n_seq)
    lens[[0, 3, 7]] = 1  # one-token sequences weigh as much as long ones under slime
    sid = np.repeat(np.arange(n_seq) * 3 + 5, lens)  # ids need not be 0..S-1
    lp_s = np.log(rng.uniform(0.01, 1.0, sid.size))
    lp_l = lp_s + rng.normal(0, scale, sid.size)
    return lp_l, lp_s, sid


@pytest.mark.parametrize("scale", [1e-4, 0.05, 1.5])
def test_frameworks_equal_independent_reference(scale: float) -> None:
    lp_l, lp_s, sid = _batch(np.random.default_rng(7), scale=scale)
    got = framework_metrics(lp_l, lp_s, sid)
    assert assert_close(got, reference(lp_l, lp_s, sid)) > 60


def test_slime_averages_per_sequence_first() -> None:
    # one long sequence with a small gap, one one-token sequence with a large gap
    lp_s = np.array([-1.0] * 9 + [-2.0])
    lp_l = np.array([-1.0] * 9 + [-1.0])
    sid = np.array([0] * 9 + [1])
    got = framework_metrics(lp_l, lp_s, sid)
    assert got["slime"]["train_rollout_logprob_abs_diff"] == pytest.approx(0.5)  # (0 + 1) / 2
    assert got["verl"]["kl"] == pytest.approx(-0.1, rel=1e-7)  # token mean: -1 / 10 (verl's eps)
    assert got["nemo_rl"]["gen_kl_error"] == pytest.approx((math.e - 2) / 10)


def test_all_equal_logprobs_give_each_frameworks_no_gap_value() -> None:
    lp = np.log(np.array([0.1, 0.5, 0.9, 0.3, 0.7]))
    sid = np.array([0, 0, 1, 2, 2])
    got = framework_metrics(lp, lp.copy(), sid)
    n = lp.size
    v, s, nr = got["verl"], got["slime"], got["nemo_rl"]
    # verl divides by count + 1e-8: its "no gap" chi2 is slightly below 0, its IS mean below 1
    assert v["kl"] == 0.0 and v["k3_kl"] == 0.0
    assert v["chi2_token"] == n / (n + 1e-8) - 1.0 and v["chi2_token"] < 0
    assert v["rollout_is_mean"] == n / (n + 1e-8)
    assert v["chi2_seq"] == 0.0 and v["ppl_ratio"] == 1.0 and v["log_ppl_diff"] == 0.0
    assert v["rollout_rs_masked_fraction"] == 0.0 and v["rollout_is_ratio_fraction_high"] == 0.0
    assert v["rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-7)
    assert v["rollout_probs_diff_max"] == 0.0
    for k in ("train_rollout_logprob_abs_diff", "mis_kl", "mis_k3_kl", "mis_chi2_token", "tis_clipfrac", "mis_log_ppl_diff"):
        assert s[k] == 0.0, k
    assert s["mis_ppl_ratio"] == 1.0 and s["mis_mean_is_weight_before_clip"] == 1.0
    assert nr["token_mult_prob_error"] == 1.0 and nr["sampling_importance_ratio"] == 1.0
    assert nr["gen_kl_error"] == 0.0 and nr["policy_kl_error"] == 0.0 and nr["is_oob_ratio"] == 0.0
    assert nr["max_seq_mult_prob_error"] == 1.0
    assert abs(nr["js_divergence_error"]) < 1e-15  # log(exp(lp)) rounds; NeMo RL's formula as written
    assert_close(got, reference(lp, lp.copy(), sid))


def test_thresholds_are_configurable() -> None:
    lp_s = np.log(np.full(4, 0.5))
    lp_l = lp_s + np.log(np.array([1.0, 1.5, 2.5, 0.3]))
    sid = np.array([0, 0, 1, 1])
    loose = framework_metrics(lp_l, lp_s, sid, config=ConventionConfig(verl_rs_threshold=3.0, nemo_is_min=0.2))
    tight = framework_metrics(lp_l, lp_s, sid)
    assert tight["verl"]["rollout_rs_masked_fraction"] == pytest.approx(0.5, rel=1e-7)  # 2.5 > 2, 0.3 < 0.5
    assert loose["verl"]["rollout_rs_masked_fraction"] == pytest.approx(0.25, rel=1e-7)  # 0.3 < 1/3
    assert tight["nemo_rl"]["is_oob_ratio"] == pytest.approx(0.25) and loose["nemo_rl"]["is_oob_ratio"] == 0.0
    with pytest.raises(ValueError, match="verl_rs_threshold"):
        framework_metrics(lp_l, lp_s, sid, config=ConventionConfig(verl_rs_threshold=0.0))
    with pytest.raises(ValueError, match="unknown convention"):
        framework_metrics(lp_l, lp_s, sid, frameworks=("trl",))


def test_logprob_gap_convention_for_a_training_loop() -> None:
    """2-D [batch, time] tensors with a response mask, as a training loop holds them."""
    import torch  # part of every install: a missing torch fails, never skips
    rng = np.random.default_rng(3)
    lp_s = np.log(rng.uniform(0.05, 1, (4, 6)))
    lp_l = lp_s + rng.normal(0, 0.02, (4, 6))
    mask = np.ones((4, 6), bool)
    mask[1, 2:] = False
    mask[3, 1:] = False
    out = logprob_gap(torch.tensor(lp_l), torch.tensor(lp_s), torch.tensor(mask), convention="verl", prefix="mp/")
    rows = np.repeat(np.arange(4), 6).reshape(4, 6)
    want = reference(lp_l[mask], lp_s[mask], rows[mask])["verl"]
    assert set(out) == {f"mp/{k}" for k in want}
    for k, v in want.items():
        assert out[f"mp/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-15)
    assert all(isinstance(v, float) for v in out.values())
    for fw in FRAMEWORKS:
        assert logprob_gap(lp_l, lp_s, mask, convention=fw)  # every framework, numpy in
    # 2-D input: rows are sequences for our sequence metrics too
    m = logprob_gap(lp_l, lp_s, mask)
    assert m["seq_max_abs_logratio"] == pytest.approx(np.abs(((lp_l - lp_s) * mask).sum(1)).max())


def test_added_metrics_hand_computed() -> None:
    d = np.array([0.1, -0.2, 0.8, 0.0, -0.9])
    lp_s = np.log(np.array([0.5, 0.4, 0.3, 0.2, 0.6]))
    lp_l = lp_s + d
    sid = np.array([0, 0, 1, 2, 2])
    m = logprob_gap(lp_l, lp_s, seq_ids=sid, reject_token=(0.5, 2.0), reject_seq=(0.8, 1.25), reject_geo=(0.9, 1.1))
    r = np.exp(d)
    assert m["is_mean"] == pytest.approx(r.mean()) and m["is_std"] == pytest.approx(r.std())
    assert m["is_min"] == pytest.approx(r.min()) and m["is_max"] == pytest.approx(r.max())
    assert m["ess"] == pytest.approx(r.sum() ** 2 / (5 * (r**2).sum()))
    assert m["reject_token_frac"] == pytest.approx(2 / 5)  # exp(0.8) = 2.23 > 2, exp(-0.9) = 0.41 < 0.5
    assert m["reject_seq_frac_token"] == pytest.approx(2 / 3)
    sums = np.array([-0.1, 0.8, -0.9])
    means = np.array([-0.05, 0.8, -0.45])
    assert m["reject_seq_frac_product"] == pytest.approx(2 / 3)  # exp(-0.1) = 0.905 kept
    assert m["reject_seq_frac_geo"] == pytest.approx(2 / 3)  # exp(-0.05) = 0.951 kept
    assert m["seq_product_ratio_max"] == pytest.approx(math.exp(0.8))
    assert m["seq_geo_ratio_min"] == pytest.approx(math.exp(-0.45))
    assert m["seq_log_ppl_diff_mean"] == pytest.approx((-means).mean())
    assert m["seq_log_ppl_diff_max_abs"] == pytest.approx(0.8)
    assert m["chi2_seq"] == pytest.approx(np.exp(2 * sums).mean() - 1)
    assert m["kl_rev_k3"] == pytest.approx(np.mean(np.exp(-d) - 1 + d))
    p, q = np.exp(lp_l), np.exp(lp_s)
    mix = (p + q) / 2
    js = 0.5 * (p / mix - np.log(p / mix) - 1) + 0.5 * (q / mix - np.log(q / mix) - 1)
    assert m["js"] == pytest.approx(js.mean())


def test_added_metrics_no_gap_and_no_seq_ids() -> None:
    lp = np.log(np.array([0.1, 0.5, 0.9, 0.3]))
    m = logprob_gap(lp, lp.copy(), seq_ids=[0, 0, 1, 1])
    for k in GAP_METRICS:
        assert m[k] == 0.0, k
    for k in ("is_mean", "is_min", "is_max", "ess", "seq_product_ratio_mean", "seq_geo_ratio_max"):
        assert m[k] == 1.0, k
    assert m["is_std"] == 0.0
    flat = logprob_gap(lp, lp.copy())
    assert math.isnan(flat["chi2_seq"]) and math.isnan(flat["reject_seq_frac_geo"])
    with pytest.raises(ValueError, match="reject_token"):
        logprob_gap(lp, lp, reject_token=(2.0, 0.5))


def test_gate_accepts_framework_keys() -> None:
    from mismatch_probe.analysis import gate as g
    from mismatch_probe.errors import UsageError

    lp_l, lp_s, sid = _batch(np.random.default_rng(1))
    from mismatch_probe.analysis.token_gaps import pair_metrics

    summ = {"schema_version": 1, "pairs": {p: pair_metrics(lp_l, lp_s, sid) for p in g.PAIRS}}
    checks = [
        "conventions.verl.k3_kl<=1",
        "learner_vs_prefill.conventions.slime.mis_kl<=1",
        "conventions.nemo_rl.token_mult_prob_error>=1",
        "conventions.verl.rollout_is_eff_sample_size<0.5",
        "ess<=1",
        "full_vocab.kl_fwd<=1",
    ]
    cfg = g.build_config(checks=checks)
    res = {r.check.name: r for r in g.evaluate(cfg, summ) if r.check}
    want = summ["pairs"]["learner_vs_decode"]["conventions"]["verl"]["k3_kl"]
    assert res["learner_vs_decode.conventions.verl.k3_kl <= 1"].value == want
    assert res["learner_vs_prefill.conventions.slime.mis_kl <= 1"].verdict == "pass"
    assert res["learner_vs_decode.conventions.nemo_rl.token_mult_prob_error >= 1"].verdict == "pass"
    assert res["learner_vs_decode.conventions.verl.rollout_is_eff_sample_size < 0.5"].verdict == "fail"
    assert res["learner_vs_decode.full_vocab.kl_fwd <= 1"].verdict == "skip"
    for bad, msg in (
        ("conventions.trl.kl<=1", "unknown framework"),
        ("conventions.verl.mis_kl<=1", "unknown metric 'mis_kl' of verl"),
        ("conventions.verl<=1", "conventions.FRAMEWORK.NAME"),
        ("nowhere.conventions.verl.kl<=1", "unknown pair"),
    ):
        with pytest.raises(UsageError, match=msg):
            g.parse_check(bad, "learner_vs_decode")
