"""Metric unit tests against hand-computed values, and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_probe.analysis.metrics import GAP_METRICS, logprob_gap


def test_all_equal_logprobs_give_exact_zero_gaps():
    lp = np.log(np.array([0.1, 0.5, 0.9, 0.3]))
    m = logprob_gap(lp, lp.copy(), seq_ids=[0, 0, 1, 1])
    for k in GAP_METRICS:
        assert m[k] == 0.0, k
    assert m["pearson_prob"] == 1.0
    assert m["n_tokens"] == 4


def test_hand_computed_two_tokens():
    a = np.array([-1.0, -2.0])
    b = np.array([-1.5, -2.0])
    m = logprob_gap(a, b, seq_ids=[0, 1])
    d = np.array([0.5, 0.0])
    assert m["mean_abs_dlogp"] == 0.25
    assert m["max_abs_dlogp"] == 0.5
    assert m["mean_dlogp"] == 0.25
    assert m["k1"] == -0.25
    assert m["k2"] == pytest.approx(0.0625)
    assert m["k3"] == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert m["chi2"] == pytest.approx(np.mean(np.exp(2 * d)) - 1)
    assert m["clip_frac"] == 0.5  # exp(0.5) = 1.65 > 1.2
    assert m["tis_frac"] == 0.0  # 1.65 < 2
    assert m["mean_abs_dprob"] == pytest.approx(abs(math.exp(-1) - math.exp(-1.5)) / 2)
    assert m["seq_max_abs_logratio"] == 0.5
    assert m["ppl_learner"] == pytest.approx(math.exp(1.5))


def test_one_token():
    m = logprob_gap([-0.3], [-0.2])
    assert m["n_tokens"] == 1
    assert m["max_abs_dlogp"] == pytest.approx(0.1)
    assert m["p99_abs_dlogp"] == pytest.approx(0.1)
    assert math.isnan(m["pearson_prob"])  # undefined for one token


def test_masked_prompt_tokens_are_ignored():
    a = np.array([-9.0, -1.0, -2.0])
    b = np.array([-1.0, -1.0, -2.0])
    m = logprob_gap(a, b, mask=[False, True, True])
    assert m["n_tokens"] == 2
    assert m["max_abs_dlogp"] == 0.0


def test_neg_inf_logprob_is_reported_not_a_crash():
    m = logprob_gap([-np.inf, -1.0], [-0.5, -1.25], seq_ids=[0, 0])
    assert m["n_nonfinite"] == 1
    assert m["max_abs_dlogp"] == math.inf
    assert m["mean_abs_dlogp"] == 0.25  # over the finite token


def test_all_nonfinite():
    m = logprob_gap([-np.inf], [-np.inf])
    assert m["n_nonfinite"] == 1
    assert math.isnan(m["mean_abs_dlogp"])


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="tokens"):
        logprob_gap([1.0, 2.0], [1.0])


def test_accepts_torch_tensors():
    import torch  # part of every install: a missing torch fails, never skips
    m = logprob_gap(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.5]), torch.tensor([True, True]))
    assert m["max_abs_dlogp"] == 0.5
