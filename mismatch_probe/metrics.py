"""Token-level gap metrics between a learner and a sampler, defined once.

Usable straight from an RL training loop: ``logprob_gap(learner_lp, sampler_lp, mask)`` takes
numpy arrays (or anything ``np.asarray`` accepts, e.g. CPU torch tensors) and returns a dict of
floats. No engine imports.

Definitions, over the tokens selected by ``mask`` (response tokens), with
``d = logp_learner - logp_sampler`` and ``r = exp(d)`` (the importance ratio pi_learner/pi_sampler):

==========================  ==================================================================
``n_tokens``                tokens in the mask
``mean_abs_dlogp``          mean |d|
``max_abs_dlogp``           max |d|
``p50/p90/p99_abs_dlogp``   percentiles of |d| (linear interpolation)
``mean_dlogp``              mean d (signed bias)
``mean_abs_dprob``          mean |exp(lp_l) - exp(lp_s)| (the probability gap RL frameworks log)
``max_abs_dprob``           max of the same
``k1``                      mean(-d): estimator of KL(sampler || learner)
``k2``                      mean(d^2 / 2)
``k3``                      mean(r - 1 - log r): low-variance, non-negative KL estimator
``chi2``                    mean(r^2) - 1
``clip_frac``               share of tokens with r outside [1 - eps, 1 + eps] (PPO clip, eps 0.2)
``tis_frac``                share of tokens with r > C (truncated importance sampling cap, C 2)
``seq_mean_abs_logratio``   mean over sequences of |sum_t d_t| (needs ``seq_ids``)
``seq_max_abs_logratio``    max over sequences of the same
``pearson_prob``            Pearson correlation of exp(lp_l) and exp(lp_s)
``ppl_learner/sampler``     exp(-mean logp) of each side
``n_nonfinite``             masked tokens where either logprob is not finite (NaN, -inf)
==========================  ==================================================================

Non-finite logprobs are reported, never a crash: tokens where exactly one side is -inf make the
gap infinite (``max_abs_dlogp = inf``); the other metrics are computed over the finite tokens,
and ``n_nonfinite`` says how many were left out. Equal inputs give exactly 0 for every gap metric.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GAP_METRICS = (
    "mean_abs_dlogp",
    "max_abs_dlogp",
    "p50_abs_dlogp",
    "p90_abs_dlogp",
    "p99_abs_dlogp",
    "mean_dlogp",
    "mean_abs_dprob",
    "max_abs_dprob",
    "k1",
    "k2",
    "k3",
    "chi2",
    "clip_frac",
    "tis_frac",
    "seq_mean_abs_logratio",
    "seq_max_abs_logratio",
)


def _as_f64(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def logprob_gap(
    learner_lp: Any,
    sampler_lp: Any,
    mask: Any | None = None,
    *,
    seq_ids: Any | None = None,
    clip_eps: float = 0.2,
    tis_cap: float = 2.0,
) -> dict[str, float]:
    """Gap metrics between learner and sampler token logprobs (see the module docstring).

    Args:
        learner_lp: learner logprob of each token (any shape; flattened).
        sampler_lp: sampler logprob of the same tokens, same shape.
        mask: which tokens count (e.g. response tokens); default all.
        seq_ids: sequence id of each token, for the sequence-level log-ratio sums.
        clip_eps: PPO clip range for ``clip_frac``.
        tis_cap: truncation cap C for ``tis_frac``.
    """
    lp_l = _as_f64(learner_lp)
    lp_s = _as_f64(sampler_lp)
    if lp_l.shape != lp_s.shape:
        raise ValueError(f"learner_lp has {lp_l.size} tokens, sampler_lp {lp_s.size}")
    m = np.ones(lp_l.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool).reshape(-1)
    if m.shape != lp_l.shape:
        raise ValueError(f"mask has {m.size} entries, logprobs {lp_l.size}")
    sid = None if seq_ids is None else np.asarray(seq_ids).reshape(-1)
    if sid is not None and sid.shape != lp_l.shape:
        raise ValueError(f"seq_ids has {sid.size} entries, logprobs {lp_l.size}")

    lp_l, lp_s = lp_l[m], lp_s[m]
    sid = None if sid is None else sid[m]
    finite = np.isfinite(lp_l) & np.isfinite(lp_s)
    # exactly one side -inf (the other finite): the ratio is 0 or infinite
    one_inf = (np.isinf(lp_l) ^ np.isinf(lp_s)) & ~np.isnan(lp_l) & ~np.isnan(lp_s)
    out: dict[str, float] = {"n_tokens": float(m.sum()), "n_nonfinite": float((~finite).sum())}
    a, b = lp_l[finite], lp_s[finite]
    n = a.size
    if n == 0:
        out.update({k: (float("inf") if k == "max_abs_dlogp" and one_inf.any() else float("nan")) for k in GAP_METRICS})
        out.update(pearson_prob=float("nan"), ppl_learner=float("nan"), ppl_sampler=float("nan"))
        return out
    d = a - b
    ad = np.abs(d)
    r = np.exp(d)
    pa_, pb = np.exp(a), np.exp(b)
    dp = np.abs(pa_ - pb)
    out["mean_abs_dlogp"] = float(ad.mean())
    out["max_abs_dlogp"] = float("inf") if one_inf.any() else float(ad.max())
    for q in (50, 90, 99):
        out[f"p{q}_abs_dlogp"] = float(np.percentile(ad, q))
    out["mean_dlogp"] = float(d.mean())
    out["mean_abs_dprob"] = float(dp.mean())
    out["max_abs_dprob"] = float(dp.max())
    out["k1"] = float((-d).mean())
    out["k2"] = float((0.5 * d * d).mean())
    # r - 1 - d is exactly 0 when d == 0; clamp the tiny negative rounding to 0 (k3 >= 0)
    out["k3"] = float(np.maximum(r - 1.0 - d, 0.0).mean())
    out["chi2"] = float((r * r).mean() - 1.0) if np.any(d != 0) else 0.0
    out["clip_frac"] = float(((r < 1 - clip_eps) | (r > 1 + clip_eps)).mean())
    out["tis_frac"] = float((r > tis_cap).mean())
    if sid is not None:
        fs = sid[finite]
        uniq, inv = np.unique(fs, return_inverse=True)
        sums = np.zeros(uniq.size)
        np.add.at(sums, inv, d)
        out["seq_mean_abs_logratio"] = float(np.abs(sums).mean())
        out["seq_max_abs_logratio"] = float(np.abs(sums).max())
    else:
        out["seq_mean_abs_logratio"] = float("nan")
        out["seq_max_abs_logratio"] = float("nan")
    if n > 1 and pa_.std() > 0 and pb.std() > 0:
        out["pearson_prob"] = float(np.corrcoef(pa_, pb)[0, 1])
    else:
        out["pearson_prob"] = 1.0 if np.array_equal(pa_, pb) else float("nan")
    out["ppl_learner"] = float(np.exp(-a.mean()))
    out["ppl_sampler"] = float(np.exp(-b.mean()))
    return out
