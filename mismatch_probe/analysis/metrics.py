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
``is_mean/std/min/max``     of the token importance ratios r (std: population)
``ess``                     effective sample size (sum r)^2 / (N sum r^2), in (0, 1]
``reject_token_frac``       share of tokens with r outside ``reject_token`` = [lo, hi] (0.5, 2)
``reject_seq_frac_token``   share of sequences holding at least one such token
``reject_seq_frac_product`` share of sequences with exp(sum_t d) outside ``reject_seq`` (0.5, 2)
``reject_seq_frac_geo``     share of sequences with exp(mean_t d) outside ``reject_geo``
                            (0.999, 1.001)
``seq_product_ratio_*``     mean/min/max over sequences of exp(sum_t d) (sequence IS weight)
``seq_geo_ratio_*``         mean/min/max over sequences of exp(mean_t d) (geometric mean ratio)
``seq_log_ppl_diff_*``      per sequence mean_t(lp_s) - mean_t(lp_l) (the learner's log-ppl minus
                            the sampler's); ``mean``, ``abs_mean``, ``max_abs`` over sequences
``chi2_seq``                mean over sequences of exp(2 sum_t d) - 1
``kl_rev_k3``               mean(1/r - 1 + log r): k3 form of KL(learner || sampler) on the
                            sampled tokens (NeMo RL's policy_kl_error)
``js``                      Jensen-Shannon term on the sampled tokens (NeMo RL's
                            js_divergence_error): with m = (p_l + p_s) / 2,
                            mean(k3(p_l/m) + k3(p_s/m)) / 2
==========================  ==================================================================

Sequence metrics need ``seq_ids`` (or 2-D inputs, whose rows are the sequences); without them
they are NaN. ``convention="verl" | "slime" | "nemo_rl"`` returns that framework's metrics under
its own names and aggregation instead (see :mod:`mismatch_probe.analysis.conventions`), for a training
loop to log next to its own.

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
    "reject_token_frac",
    "reject_seq_frac_token",
    "reject_seq_frac_product",
    "reject_seq_frac_geo",
    "seq_log_ppl_diff_mean",
    "seq_log_ppl_diff_abs_mean",
    "seq_log_ppl_diff_max_abs",
    "chi2_seq",
    "kl_rev_k3",
    "js",
)
# metrics whose "no gap" value is not 0 (ratios: 1)
RATIO_METRICS = (
    "is_mean",
    "is_std",
    "is_min",
    "is_max",
    "ess",
    "seq_product_ratio_mean",
    "seq_product_ratio_min",
    "seq_product_ratio_max",
    "seq_geo_ratio_mean",
    "seq_geo_ratio_min",
    "seq_geo_ratio_max",
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
    reject_token: tuple[float, float] = (0.5, 2.0),
    reject_seq: tuple[float, float] = (0.5, 2.0),
    reject_geo: tuple[float, float] = (0.999, 1.001),
    convention: str | None = None,
    convention_config: Any | None = None,
    prefix: str | None = None,
) -> dict[str, float]:
    """Gap metrics between learner and sampler token logprobs (see the module docstring).

    Args:
        learner_lp: learner logprob of each token (any shape; flattened).
        sampler_lp: sampler logprob of the same tokens, same shape.
        mask: which tokens count (e.g. response tokens); default all.
        seq_ids: sequence id of each token, for the sequence-level metrics; default: the rows
            of 2-D inputs, else none.
        clip_eps: PPO clip range for ``clip_frac``.
        tis_cap: truncation cap C for ``tis_frac``.
        reject_token, reject_seq, reject_geo: [lo, hi] bounds of the rejection fractions (token
            ratio, sequence product, sequence geometric mean).
        convention: ``verl`` | ``slime`` | ``nemo_rl``: return that framework's metrics instead.
        convention_config: a :class:`mismatch_probe.analysis.conventions.ConventionConfig` (thresholds).
        prefix: with ``convention``, prefix of the keys (default: none; e.g. ``"mismatch/"``).
    """
    if seq_ids is None and np.ndim(learner_lp) == 2:
        rows, cols = np.shape(learner_lp)
        seq_ids = np.repeat(np.arange(rows), cols)
    for name, (lo, hi) in (("reject_token", reject_token), ("reject_seq", reject_seq), ("reject_geo", reject_geo)):
        if not 0 <= lo < hi:
            raise ValueError(f"{name} must be (lo, hi) with 0 <= lo < hi, got {(lo, hi)}")
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
    if convention is not None:
        from mismatch_probe.analysis import conventions as conv

        fs = sid[finite] if sid is not None else np.zeros(n, dtype=np.int64)
        block = conv.framework_metrics(a, b, fs, (convention,), convention_config)[convention]
        return {f"{prefix or ''}{k}": v for k, v in block.items()}
    if n == 0:
        out.update({k: (float("inf") if k == "max_abs_dlogp" and one_inf.any() else float("nan")) for k in GAP_METRICS})
        out.update({k: float("nan") for k in RATIO_METRICS})
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
    out["is_mean"] = float(r.mean())
    out["is_std"] = float(r.std())
    out["is_min"] = float(r.min())
    out["is_max"] = float(r.max())
    out["ess"] = float(r.sum() ** 2 / (n * (r * r).sum()))
    bad = (r < reject_token[0]) | (r > reject_token[1])
    out["reject_token_frac"] = float(bad.mean())
    out["kl_rev_k3"] = float(np.maximum(1.0 / r - 1.0 + d, 0.0).mean())
    log_m = np.log(0.5 * pa_ + 0.5 * pb)
    ja, jb = a - log_m, b - log_m
    js = 0.5 * (np.exp(ja) - ja - 1.0) + 0.5 * (np.exp(jb) - jb - 1.0)
    out["js"] = float(np.where(d == 0, 0.0, np.maximum(js, 0.0)).mean())
    out.update(_seq_metrics(d, bad, None if sid is None else sid[finite], reject_seq, reject_geo))
    if n > 1 and pa_.std() > 0 and pb.std() > 0:
        out["pearson_prob"] = float(np.corrcoef(pa_, pb)[0, 1])
    else:
        out["pearson_prob"] = 1.0 if np.array_equal(pa_, pb) else float("nan")
    out["ppl_learner"] = float(np.exp(-a.mean()))
    out["ppl_sampler"] = float(np.exp(-b.mean()))
    return out


SEQ_METRICS = (
    "seq_mean_abs_logratio", "seq_max_abs_logratio", "reject_seq_frac_token", "reject_seq_frac_product",
    "reject_seq_frac_geo", "seq_product_ratio_mean", "seq_product_ratio_min", "seq_product_ratio_max",
    "seq_geo_ratio_mean", "seq_geo_ratio_min", "seq_geo_ratio_max", "seq_log_ppl_diff_mean",
    "seq_log_ppl_diff_abs_mean", "seq_log_ppl_diff_max_abs", "chi2_seq",
)  # fmt: skip


def _seq_metrics(
    d: np.ndarray, bad: np.ndarray, sid: np.ndarray | None, reject_seq: tuple[float, float], reject_geo: tuple[float, float]
) -> dict[str, float]:
    """Sequence-level metrics from the token log-ratios ``d`` (NaN without sequence ids)."""
    if sid is None:
        return {k: float("nan") for k in SEQ_METRICS}
    _, inv = np.unique(sid, return_inverse=True)
    inv = inv.reshape(-1)
    count = np.bincount(inv).astype(np.float64)
    sums = np.bincount(inv, weights=d, minlength=count.size)
    means = sums / count
    prod, geo = np.exp(sums), np.exp(means)
    with np.errstate(over="ignore"):
        chi2 = np.exp(2.0 * sums).mean() - 1.0 if np.any(sums != 0) else 0.0
    return {
        "seq_mean_abs_logratio": float(np.abs(sums).mean()),
        "seq_max_abs_logratio": float(np.abs(sums).max()),
        "reject_seq_frac_token": float((np.bincount(inv, weights=bad.astype(np.float64), minlength=count.size) > 0).mean()),
        "reject_seq_frac_product": float(((prod < reject_seq[0]) | (prod > reject_seq[1])).mean()),
        "reject_seq_frac_geo": float(((geo < reject_geo[0]) | (geo > reject_geo[1])).mean()),
        "seq_product_ratio_mean": float(prod.mean()),
        "seq_product_ratio_min": float(prod.min()),
        "seq_product_ratio_max": float(prod.max()),
        "seq_geo_ratio_mean": float(geo.mean()),
        "seq_geo_ratio_min": float(geo.min()),
        "seq_geo_ratio_max": float(geo.max()),
        "seq_log_ppl_diff_mean": float((-means).mean()),
        "seq_log_ppl_diff_abs_mean": float(np.abs(means).mean()),
        "seq_log_ppl_diff_max_abs": float(np.abs(means).max()),
        "chi2_seq": float(chi2),
    }
