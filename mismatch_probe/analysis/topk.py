"""Full-distribution comparison over the sampler's top-K support (pure numpy; no engine imports).

``compare --topk K`` makes the sampler (vLLM) return the K most likely tokens of every position
with their logprobs (decode: ``SamplingParams(logprobs=K)``, prefill rescoring:
``prompt_logprobs=K``) and the learner record, from its full distribution: its own top-K, its
entropy, the rank of the sampled token, and its logprobs at the sampler's top-K ids. Per position
(row), with ``S`` the sampler's top-K ids, ``q`` the sampler's logprobs on S and ``l`` the
other side's logprobs on S, both renormalized over S (``p_s = softmax(q)``, ``p_l = softmax(l)``):

=======================  ===================================================================
``kl_fwd``               mean over positions of KL(p_s || p_l) on S (the direction k1/k3 estimate)
``kl_rev``               mean of KL(p_l || p_s) on S
``top1_agree``           share of positions where the sampler's most likely token is also the
                         other side's (ties count as agreement: its logprob there equals its max)
``topk_overlap``         mean Jaccard overlap of the two top-K sets, i / (2K - i), where i counts
                         sampler top-K tokens at or above the other side's K-th logprob (tie-robust)
``sampled_rank_mean``    mean rank of the sampled token in the learner's full distribution (1 = top)
``sampled_rank_max``     its max
``sampled_in_topk_frac`` share of sampled tokens inside the sampler's top-K
``entropy_learner``      mean entropy of the learner's full distribution (nats)
``entropy_sampler``      mean entropy of the sampler's top-K renormalized (a top-K view: the
                         sampler returns no full distribution)
``n_positions``          positions compared
=======================  ===================================================================

Equal logits on both sides give exactly ``kl_fwd = kl_rev = 0``, ``top1_agree = 1``,
``topk_overlap = 1``. For ``prefill_vs_decode`` the other side is the sampler's prefill, which only
holds its own top-K: the KLs run over the ids both top-K lists hold.

Relation to the sampled-token estimators: on tokens sampled from the sampler at temperature 1,
``k3 = mean(r - 1 - log r)`` is an unbiased estimate of the full-vocabulary KL(sampler || learner),
and ``kl_fwd`` is the same divergence restricted to the sampler's top-K and renormalized. For
small logit perturbations both are about half the variance of the log-ratio under the sampler's
distribution, so they agree in magnitude (within the sampling noise of k3 and the top-K
truncation); tests bound their ratio.
"""

from __future__ import annotations

import numpy as np

TOPK_METRICS = (
    "kl_fwd", "kl_rev", "top1_agree", "topk_overlap", "sampled_rank_mean", "sampled_rank_max",
    "sampled_in_topk_frac", "entropy_learner", "entropy_sampler", "n_positions",
)  # fmt: skip


def stack(lists: object, k: int) -> np.ndarray:
    """A column of equal-length lists (Parquet list column as numpy objects) -> [N, k] float64."""
    arr = list(lists)  # type: ignore[call-overload]
    if not arr:
        return np.zeros((0, k))
    return np.vstack([np.asarray(a, dtype=np.float64) for a in arr]).reshape(len(arr), k)


def _log_renorm(x: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax over the known entries (others -inf)."""
    x = np.where(known, x, -np.inf)
    m = np.max(x, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.sum(np.exp(x - m), axis=1, keepdims=True))
    return x - lse


def _kl(logp: np.ndarray, logq: np.ndarray, known: np.ndarray) -> np.ndarray:
    p = np.exp(logp)
    terms = np.where(known & (p > 0), p * (logp - logq), 0.0)
    return terms.sum(axis=1)


def topk_metrics(
    s_ids: np.ndarray,
    s_lps: np.ndarray,
    o_at: np.ndarray,
    o_max: np.ndarray,
    o_kth: np.ndarray,
    sampled: np.ndarray,
    rank: np.ndarray | None = None,
    entropy_learner: np.ndarray | None = None,
) -> dict[str, float]:
    """Full-distribution metrics over rows (positions).

    Args:
        s_ids, s_lps: the sampler's top-K ids and logprobs, [N, K], most likely first.
        o_at: the other side's logprobs at ``s_ids`` ([N, K]; NaN where unknown).
        o_max, o_kth: the other side's largest and K-th largest logprob per row.
        sampled: the sampled (scored) token id of each row.
        rank, entropy_learner: the learner's rank of the sampled token and entropy (or None).
    """
    n, k = s_ids.shape
    out: dict[str, float] = {"n_positions": float(n)}
    if n == 0:
        return out | {m: float("nan") for m in TOPK_METRICS if m != "n_positions"}
    known = ~np.isnan(o_at)
    ls = _log_renorm(s_lps, known)
    lo = _log_renorm(np.nan_to_num(o_at, nan=-np.inf), known)
    with np.errstate(invalid="ignore"):
        out["kl_fwd"] = float(np.maximum(_kl(ls, lo, known), 0.0).mean())
        out["kl_rev"] = float(np.maximum(_kl(lo, ls, known), 0.0).mean())
    out["top1_agree"] = float((o_at[:, 0] == o_max).mean())
    i = np.minimum((known & (np.nan_to_num(o_at, nan=-np.inf) >= o_kth[:, None])).sum(axis=1), k)
    out["topk_overlap"] = float((i / (2 * k - i)).mean())
    if rank is not None:
        out["sampled_rank_mean"] = float(np.mean(rank))
        out["sampled_rank_max"] = float(np.max(rank))
    else:
        out["sampled_rank_mean"] = out["sampled_rank_max"] = float("nan")
    out["sampled_in_topk_frac"] = float((s_ids == sampled[:, None]).any(axis=1).mean())
    out["entropy_learner"] = float(np.mean(entropy_learner)) if entropy_learner is not None else float("nan")
    full = np.ones_like(known)
    lsf = _log_renorm(s_lps, full)
    out["entropy_sampler"] = float((-(np.exp(lsf) * lsf).sum(axis=1)).mean())
    return out


def lookup(ids: np.ndarray, own_ids: np.ndarray, own_lps: np.ndarray) -> np.ndarray:
    """``own_lps`` of the ids in ``ids`` (row-wise lookup in another top-K list; NaN if absent)."""
    hit = ids[:, :, None] == own_ids[:, None, :]  # [N, K, K2]
    found = hit.any(axis=2)
    vals = np.where(hit, own_lps[:, None, :], 0.0).sum(axis=2)
    return np.where(found, vals, np.nan)
