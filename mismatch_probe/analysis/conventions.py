"""RL frameworks' train-inference mismatch metrics, under their own names and aggregations.

Pure numpy, no engine imports. Given the learner's (trainer's) and the sampler's (rollout
engine's) logprob of each response token and the sequence each token belongs to, compute what
verl, slime and NeMo RL log on their dashboards, so their numbers can be compared one for one.
Definitions: ``../shared/METRICS.md``, re-read from the frameworks' sources (2026):

* verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_offpolicy_metrics``,
  ``compute_is_metrics``, ``compute_rs_metrics``): dashboard keys ``rollout_corr/<name>``.
  Its masked means divide by ``count + 1e-8`` (``verl_F.masked_mean``), per-sequence means too;
  log-ratios are clamped to +-20 before ``exp`` where verl does (IS/RS weights, chi2).
  IS and RS in token mode, with the configured thresholds (default 2, lower bound 1/upper).
* slime ``examples/train_infer_mismatch_helper/mis.py`` and its loss (``tis_clipfrac``,
  ``train_rollout_logprob_abs_diff``): dashboard keys ``train/<name>``; every value is averaged
  within each sequence first (masked mean, denominator at least 1), then over sequences
  (slime's default ``calculate_per_token_loss=False``). ``train_rollout_kl`` is miles' (a slime
  fork) k3 with the log-ratio clamped to +-20 and the value to [-10, 10].
* NeMo RL ``nemo_rl/algorithms/loss_functions.py`` (``ClippedPGLoss``): dashboard keys
  ``train/<name>``; token means over all response tokens; ``gen_kl_error`` and
  ``policy_kl_error`` with the default k3 estimator; ``is_oob_ratio`` as ICE-POP (token ratio
  outside [min, max]); the per-sequence multiplicative error (token mean of exp(|d|) within a
  sequence) gives ``max/mean/min_seq_mult_prob_error``.

Notation: ``d = lp_learner - lp_sampler`` per token, ``r = exp(d)``. The learner is the
frameworks' "training"/"old"/"prev" logprob, the sampler their "rollout"/"generation" logprob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FRAMEWORKS = ("verl", "slime", "nemo_rl")
SAFETY_BOUND = 20.0  # verl and slime clamp log-ratios to +-20 before exponentiating
VERL_EPS = 1e-8  # verl_F.masked_mean: sum / (count + 1e-8)

# dashboard prefix of each framework's keys (documentation; the keys below are bare)
DASHBOARD_PREFIX = {"verl": "rollout_corr/", "slime": "train/", "nemo_rl": "train/"}


@dataclass(frozen=True)
class ConventionConfig:
    """Thresholds the frameworks' metrics depend on (their defaults)."""

    verl_is_threshold: float = 2.0  # rollout_is_threshold (token TIS cap; lower bound 1/threshold)
    verl_rs_threshold: float = 2.0  # rollout_rs_threshold (token rejection upper bound)
    verl_rs_threshold_lower: float | None = None  # default 1 / upper, as verl
    slime_tis_cap: float = 2.0  # slime --tis-clip (upper cap of clamp(r, 0, C))
    nemo_is_min: float = 0.5  # ICE-POP truncated_importance_sampling_ratio_min (reference bound)
    nemo_is_max: float = 5.0  # ICE-POP truncated_importance_sampling_ratio (reference bound)

    def validate(self) -> None:
        for name, v in (
            ("verl_is_threshold", self.verl_is_threshold),
            ("verl_rs_threshold", self.verl_rs_threshold),
            ("verl_rs_threshold_lower", 1.0 if self.verl_rs_threshold_lower is None else self.verl_rs_threshold_lower),
            ("slime_tis_cap", self.slime_tis_cap),
            ("nemo_is_max", self.nemo_is_max),
        ):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if not 0 <= self.nemo_is_min < self.nemo_is_max:
            raise ValueError(f"nemo_is_min must be in [0, nemo_is_max), got {self.nemo_is_min}")

    @property
    def verl_rs_lower(self) -> float:
        return self.verl_rs_threshold_lower if self.verl_rs_threshold_lower is not None else 1.0 / self.verl_rs_threshold


@dataclass
class _Seqs:
    """Tokens grouped by sequence: ``inv[i]`` is the sequence index (0..S-1) of token i."""

    inv: np.ndarray
    count: np.ndarray  # tokens per sequence (float)

    @property
    def n(self) -> int:
        return int(self.count.size)

    def sum(self, x: np.ndarray) -> np.ndarray:
        return np.bincount(self.inv, weights=x, minlength=self.n)

    def max(self, x: np.ndarray) -> np.ndarray:
        out = np.full(self.n, -np.inf)
        np.maximum.at(out, self.inv, x)
        return out


def group(seq_ids: np.ndarray) -> _Seqs:
    _, inv = np.unique(seq_ids, return_inverse=True)
    inv = inv.reshape(-1)
    return _Seqs(inv=inv, count=np.bincount(inv).astype(np.float64))


# --------------------------------------------------------------------------- verl


def _verl_weight_stats(w: np.ndarray, s: _Seqs, upper: float, lower: float, prefix: str) -> dict[str, float]:
    """verl's compute_is_metrics / compute_rs_metrics in token mode (weights already exp(clip(d)))."""
    n = w.size
    mean = lambda x: float(x.sum() / (n + VERL_EPS))  # noqa: E731
    out = {
        f"{prefix}_mean": mean(w),
        f"{prefix}_ratio_fraction_high": mean((w > upper).astype(np.float64)),
        f"{prefix}_ratio_fraction_low": mean((w < lower).astype(np.float64)),
        f"{prefix}_max": float(w.max()),
        f"{prefix}_min": float(w.min()),
    }
    wc = np.clip(w, lower, upper)
    if n > 1:
        var = mean(wc * wc) - mean(wc) ** 2
        out[f"{prefix}_std"] = float(np.sqrt(max(var, 0.0)))
    else:
        out[f"{prefix}_std"] = 0.0
    norm = wc / (mean(wc) + VERL_EPS)
    out[f"{prefix}_eff_sample_size"] = 1.0 / mean(norm * norm)
    seq_mean = s.sum(w) / (s.count + VERL_EPS)
    out[f"{prefix}_seq_mean"] = float(seq_mean.mean())
    out[f"{prefix}_seq_std"] = float(seq_mean.std(ddof=1)) if s.n > 1 else 0.0  # torch .std() is unbiased
    out[f"{prefix}_seq_max"] = float(seq_mean.max())
    out[f"{prefix}_seq_min"] = float(seq_mean.min())
    out[f"{prefix}_seq_max_deviation"] = float(np.abs(seq_mean - 1.0).max())
    out[f"{prefix}_seq_fraction_high"] = float((seq_mean > upper).mean())
    out[f"{prefix}_seq_fraction_low"] = float((seq_mean < lower).mean())
    return out


def verl(lp_l: np.ndarray, lp_s: np.ndarray, s: _Seqs, cfg: ConventionConfig) -> dict[str, float]:
    """verl rollout-correction metrics (``rollout_corr/...``), token-mode IS and RS, plus the
    probability-difference debug metrics verl logs as ``training/rollout_probs_diff_*``."""
    n = lp_l.size
    mean = lambda x: float(x.sum() / (n + VERL_EPS))  # noqa: E731
    d = lp_l - lp_s
    m_l = s.sum(lp_l) / (s.count + VERL_EPS)  # per-sequence mean logprob
    m_s = s.sum(lp_s) / (s.count + VERL_EPS)
    lpd = m_s - m_l  # log_ppl_diff per sequence
    out = {
        "training_ppl": float(np.exp(-m_l).mean()),
        "training_log_ppl": float((-m_l).mean()),
        "kl": mean(lp_s - lp_l),
        "k3_kl": mean(np.exp(d) - d - 1.0),
        "rollout_ppl": float(np.exp(-m_s).mean()),
        "rollout_log_ppl": float((-m_s).mean()),
        "log_ppl_diff": float(lpd.mean()),
        "log_ppl_abs_diff": float(np.abs(lpd).mean()),
        "log_ppl_diff_max": float(lpd.max()),
        "log_ppl_diff_min": float(lpd.min()),
        "ppl_ratio": float(np.exp(lpd).mean()),
    }
    rho = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
    out["chi2_token"] = mean(rho * rho) - 1.0
    seq_sum = np.clip(s.sum(d), -SAFETY_BOUND, SAFETY_BOUND)
    out["chi2_seq"] = float(np.exp(2.0 * seq_sum).mean() - 1.0)
    # importance sampling (rollout_is=token), then rejection sampling (rollout_rs=token)
    c = cfg.verl_is_threshold
    out.update(_verl_weight_stats(rho, s, c, 1.0 / c, "rollout_is"))
    hi, lo = cfg.verl_rs_threshold, cfg.verl_rs_lower
    out.update(_verl_weight_stats(rho, s, hi, lo, "rollout_rs"))
    rejected = ((rho < lo) | (rho > hi)).astype(np.float64)
    out["rollout_rs_masked_fraction"] = mean(rejected)
    out["rollout_rs_seq_masked_fraction"] = float((s.sum(rejected) > 0).mean())
    # training/rollout_probs_diff_* and training/rollout_actor_probs_pearson_corr (metric_utils)
    p_l, p_s = np.exp(lp_l), np.exp(lp_s)
    pd_ = np.abs(p_l - p_s)
    out["rollout_probs_diff_mean"] = float(pd_.mean())
    out["rollout_probs_diff_max"] = float(pd_.max())
    out["rollout_probs_diff_std"] = float(pd_.std(ddof=1)) if n > 1 else 0.0
    return out


# --------------------------------------------------------------------------- slime


def slime(lp_l: np.ndarray, lp_s: np.ndarray, s: _Seqs, cfg: ConventionConfig) -> dict[str, float]:
    """slime's mismatch metrics: per-sequence token mean first, then mean over sequences."""
    denom = np.maximum(s.count, 1.0)

    def seq_mean(x: np.ndarray) -> float:
        return float((s.sum(x) / denom).mean())

    d = lp_l - lp_s
    r = np.exp(d)
    m_l = s.sum(lp_l) / denom
    m_s = s.sum(lp_s) / denom
    lpd = m_s - m_l
    dc = np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)
    return {
        "train_rollout_logprob_abs_diff": seq_mean(np.abs(d)),
        "mis_kl": seq_mean(lp_s - lp_l),
        "mis_k3_kl": seq_mean(r - d - 1.0),
        "mis_chi2_token": seq_mean(r * r - 1.0),
        "tis_clipfrac": seq_mean((np.clip(r, 0.0, cfg.slime_tis_cap) != r).astype(np.float64)),
        "mis_mean_is_weight_before_clip": seq_mean(np.exp(dc)),
        # sequence-level values expanded over the sequence: the per-sequence mean is the value
        "mis_training_log_ppl": float((-m_l).mean()),
        "mis_training_ppl": float(np.exp(-m_l).mean()),
        "mis_rollout_log_ppl": float((-m_s).mean()),
        "mis_rollout_ppl": float(np.exp(-m_s).mean()),
        "mis_log_ppl_diff": float(lpd.mean()),
        "mis_log_ppl_abs_diff": float(np.abs(lpd).mean()),
        "mis_ppl_ratio": float(np.exp(lpd).mean()),
        "train_rollout_kl": seq_mean(np.clip(np.exp(dc) - dc - 1.0, -10.0, 10.0)),  # miles
    }


# --------------------------------------------------------------------------- NeMo RL


def nemo_rl(lp_l: np.ndarray, lp_s: np.ndarray, s: _Seqs, cfg: ConventionConfig) -> dict[str, float]:
    """NeMo RL's ClippedPGLoss mismatch metrics: token means over all response tokens."""
    d = lp_l - lp_s
    r = np.exp(d)
    log_m = np.log(0.5 * np.exp(lp_l) + 0.5 * np.exp(lp_s))
    a, b = lp_l - log_m, lp_s - log_m
    js = 0.5 * (np.exp(a) - a - 1.0) + 0.5 * (np.exp(b) - b - 1.0)
    e = np.exp(np.abs(d))
    seq_err = s.sum(e) / np.maximum(s.count, 1.0)
    r_safe = np.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0)
    kept = (r_safe >= cfg.nemo_is_min) & (r_safe <= cfg.nemo_is_max)
    return {
        "token_mult_prob_error": float(e.mean()),
        "gen_kl_error": float((r - d - 1.0).mean()),
        "policy_kl_error": float((np.exp(-d) + d - 1.0).mean()),
        "js_divergence_error": float(js.mean()),
        "sampling_importance_ratio": float(r_safe.mean()),
        "is_oob_ratio": float(1.0 - kept.mean()),
        "approx_entropy": float(-(r * lp_l).mean()),
        "max_seq_mult_prob_error": float(seq_err.max()),
        "mean_seq_mult_prob_error": float(seq_err.mean()),
        "min_seq_mult_prob_error": float(seq_err.min()),
    }


_FUNCS = {"verl": verl, "slime": slime, "nemo_rl": nemo_rl}


def framework_metrics(
    lp_l: np.ndarray,
    lp_s: np.ndarray,
    seq_ids: np.ndarray,
    frameworks: tuple[str, ...] = FRAMEWORKS,
    config: ConventionConfig | None = None,
) -> dict[str, dict[str, float]]:
    """Each framework's metrics (``{framework: {name: value}}``) over finite, selected tokens.

    ``lp_l``, ``lp_s`` and ``seq_ids`` are 1-D and already masked to response tokens. With no
    tokens every framework's block is empty.
    """
    cfg = config or ConventionConfig()
    cfg.validate()
    unknown = [f for f in frameworks if f not in _FUNCS]
    if unknown:
        raise ValueError(f"unknown convention {unknown[0]!r}; choose one of {', '.join(FRAMEWORKS)}")
    if lp_l.size == 0:
        return {f: {} for f in frameworks}
    s = group(np.asarray(seq_ids))
    with np.errstate(over="ignore", invalid="ignore"):
        return {f: _FUNCS[f](lp_l, lp_s, s, cfg) for f in frameworks}


def with_prefix(metrics: dict[str, float], framework: str, prefix: str | None) -> dict[str, Any]:
    """Keys as the framework's dashboard shows them (``prefix=None``) or with a given prefix."""
    p = DASHBOARD_PREFIX[framework] if prefix is None else prefix
    return {f"{p}{k}": v for k, v in metrics.items()}
