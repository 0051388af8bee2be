"""Independent reference implementations of the RL frameworks' mismatch metrics, for the tests.

Written from ../shared/METRICS.md and the frameworks' published formulas, on the frameworks' own
data layout (a padded [B, T] batch with a response mask, as verl/slime/NeMo RL hold it), and
sharing no code with ``mismatch_probe.analysis.conventions`` (which works on flat token arrays).
"""

from __future__ import annotations

import numpy as np


def padded(lp_l: np.ndarray, lp_s: np.ndarray, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat token arrays -> padded [B, T] learner, sampler and mask (sequence order of first appearance)."""
    order = list(dict.fromkeys(seq_ids.tolist()))
    rows = [np.flatnonzero(seq_ids == s) for s in order]
    t = max(len(r) for r in rows)
    L = np.zeros((len(rows), t))
    S = np.zeros((len(rows), t))
    M = np.zeros((len(rows), t))
    for i, r in enumerate(rows):
        L[i, : len(r)] = lp_l[r]
        S[i, : len(r)] = lp_s[r]
        M[i, : len(r)] = 1.0
    return L, S, M


def _vmean(x, m, axis=None):  # verl_F.masked_mean
    return (x * m).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def verl_ref(L, S, M, is_thr=2.0, rs_hi=2.0, rs_lo=None):
    rs_lo = 1.0 / rs_hi if rs_lo is None else rs_lo
    out = {}
    ml = _vmean(L, M, axis=-1)
    ms = _vmean(S, M, axis=-1)
    out["training_ppl"] = np.mean(np.exp(-ml))
    out["training_log_ppl"] = np.mean(-ml)
    out["kl"] = _vmean(S - L, M)
    lr = L - S
    out["k3_kl"] = _vmean(np.exp(lr) - lr - 1, M)
    out["rollout_ppl"] = np.mean(np.exp(-ms))
    out["rollout_log_ppl"] = np.mean(-ms)
    diff = ms - ml
    out["log_ppl_diff"] = diff.mean()
    out["log_ppl_abs_diff"] = np.abs(diff).mean()
    out["log_ppl_diff_max"] = diff.max()
    out["log_ppl_diff_min"] = diff.min()
    out["ppl_ratio"] = np.exp(diff).mean()
    rho = np.exp(np.clip(lr, -20, 20))
    out["chi2_token"] = _vmean(rho**2, M) - 1.0
    ssum = np.clip((lr * M).sum(-1), -20, 20)
    out["chi2_seq"] = np.exp(2 * ssum).mean() - 1.0
    for prefix, hi, lo in (("rollout_is", is_thr, 1.0 / is_thr), ("rollout_rs", rs_hi, rs_lo)):
        w = rho * M if prefix == "rollout_is" else rho
        out[f"{prefix}_mean"] = _vmean(w, M)
        out[f"{prefix}_ratio_fraction_high"] = _vmean((w > hi).astype(float), M)
        out[f"{prefix}_ratio_fraction_low"] = _vmean((w < lo).astype(float), M)
        out[f"{prefix}_max"] = np.where(M > 0, w, -np.inf).max()
        out[f"{prefix}_min"] = np.where(M > 0, w, np.inf).min()
        wc = np.clip(w, lo, hi)
        if M.sum() > 1:
            out[f"{prefix}_std"] = np.sqrt(max(_vmean(wc**2, M) - _vmean(wc, M) ** 2, 0.0))
        else:
            out[f"{prefix}_std"] = 0.0
        nw = wc / (_vmean(wc, M) + 1e-8)
        out[f"{prefix}_eff_sample_size"] = 1.0 / _vmean(nw**2, M)
        sm = _vmean(w, M, axis=-1)
        out[f"{prefix}_seq_mean"] = sm.mean()
        out[f"{prefix}_seq_std"] = sm.std(ddof=1) if sm.size > 1 else 0.0
        out[f"{prefix}_seq_max"] = sm.max()
        out[f"{prefix}_seq_min"] = sm.min()
        out[f"{prefix}_seq_max_deviation"] = np.abs(sm - 1).max()
        out[f"{prefix}_seq_fraction_high"] = (sm > hi).mean()
        out[f"{prefix}_seq_fraction_low"] = (sm < lo).mean()
    keep = ((rho >= rs_lo) & (rho <= rs_hi)).astype(float)
    out["rollout_rs_masked_fraction"] = _vmean(1 - keep, M)
    out["rollout_rs_seq_masked_fraction"] = (((1 - keep) * M).sum(-1) > 0).mean()
    pdiff = np.abs(np.exp(L) - np.exp(S))[M > 0]
    out["rollout_probs_diff_mean"] = pdiff.mean()
    out["rollout_probs_diff_max"] = pdiff.max()
    out["rollout_probs_diff_std"] = pdiff.std(ddof=1) if pdiff.size > 1 else 0.0
    return out


def _smean(x, M):  # slime sum_of_sample_mean: per-sequence masked mean (denominator >= 1), then mean
    return np.mean((x * M).sum(-1) / np.maximum(M.sum(-1), 1))


def slime_ref(L, S, M, tis_cap=2.0):
    lr = L - S
    r = np.exp(lr)
    ml = (L * M).sum(-1) / np.maximum(M.sum(-1), 1)
    ms = (S * M).sum(-1) / np.maximum(M.sum(-1), 1)
    lc = np.clip(lr, -20, 20)
    # sequence-level values expanded to every token of the sequence, then averaged the same way
    expand = lambda v: np.repeat(v[:, None], L.shape[1], axis=1)  # noqa: E731
    return {
        "train_rollout_logprob_abs_diff": _smean(np.abs(L - S), M),
        "mis_kl": _smean(S - L, M),
        "mis_k3_kl": _smean(np.exp(lr) - lr - 1, M),
        "mis_chi2_token": _smean(r**2 - 1, M),
        "tis_clipfrac": _smean((np.clip(r, 0, tis_cap) != r).astype(float), M),
        "mis_mean_is_weight_before_clip": _smean(np.exp(lc), M),
        "mis_training_log_ppl": _smean(expand(-ml), M),
        "mis_training_ppl": _smean(expand(np.exp(-ml)), M),
        "mis_rollout_log_ppl": _smean(expand(-ms), M),
        "mis_rollout_ppl": _smean(expand(np.exp(-ms)), M),
        "mis_log_ppl_diff": _smean(expand(ms - ml), M),
        "mis_log_ppl_abs_diff": _smean(expand(np.abs(ms - ml)), M),
        "mis_ppl_ratio": _smean(expand(np.exp(ms - ml)), M),
        "train_rollout_kl": _smean(np.clip(np.exp(lc) - lc - 1, -10, 10), M),
    }


def nemo_ref(L, S, M, is_min=0.5, is_max=5.0):
    n = M.sum()
    tm = lambda x: (x * M).sum() / n  # noqa: E731  masked_mean with global_normalization_factor
    lp_err = np.abs(S - L)
    gen_kl_log_ratio = L - S  # calculate_kl(logprobs=gen, reference=prev), k3
    pol_log_ratio = S - L
    log_mix = np.log(0.5 * np.exp(L) + 0.5 * np.exp(S))
    kl_prev = np.exp(L - log_mix) - (L - log_mix) - 1
    kl_gen = np.exp(S - log_mix) - (S - log_mix) - 1
    w = np.nan_to_num(np.exp(L - S), nan=0.0, posinf=0.0, neginf=0.0)
    kept = ((w >= is_min) & (w <= is_max)).astype(float)
    seq_err = (np.exp(lp_err * M) * M).sum(-1) / np.maximum(M.sum(-1), 1)
    return {
        "token_mult_prob_error": tm(np.exp(lp_err * M)),
        "gen_kl_error": tm(np.exp(gen_kl_log_ratio) - gen_kl_log_ratio - 1),
        "policy_kl_error": tm(np.exp(pol_log_ratio) - pol_log_ratio - 1),
        "js_divergence_error": tm(0.5 * kl_prev + 0.5 * kl_gen),
        "sampling_importance_ratio": tm(w),
        "is_oob_ratio": 1.0 - tm(kept),
        "approx_entropy": -tm(np.exp(L - S) * L),
        "max_seq_mult_prob_error": seq_err.max(),
        "mean_seq_mult_prob_error": seq_err.mean(),
        "min_seq_mult_prob_error": seq_err.min(),
    }


def reference(lp_l: np.ndarray, lp_s: np.ndarray, seq_ids: np.ndarray) -> dict[str, dict[str, float]]:
    L, S, M = padded(np.asarray(lp_l, float), np.asarray(lp_s, float), np.asarray(seq_ids))
    with np.errstate(over="ignore", invalid="ignore"):
        return {"verl": verl_ref(L, S, M), "slime": slime_ref(L, S, M), "nemo_rl": nemo_ref(L, S, M)}


def assert_close(got: dict[str, dict[str, float]], want: dict[str, dict[str, float]], rtol: float = 1e-9) -> int:
    """Every key of ``want`` equals ``got`` to ``rtol`` relative (absolute 1e-15 for values at 0);
    the same key sets. Returns the number of values compared."""
    n = 0
    for fw, ref in want.items():
        assert set(got[fw]) == set(ref), (fw, set(got[fw]) ^ set(ref))
        for k, v in ref.items():
            g = got[fw][k]
            assert np.isclose(g, v, rtol=rtol, atol=1e-15, equal_nan=True), f"{fw}.{k}: {g!r} vs reference {v!r}"
            n += 1
    return n
