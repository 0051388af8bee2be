"""Report sections in the RL frameworks' terms: one framework's view (``report --convention``),
the training run's own gap (``compare --rollouts``), and the full-distribution (top-K) comparison."""

from __future__ import annotations

from typing import Any

from mismatch_probe.analysis.conventions import DASHBOARD_PREFIX, FRAMEWORKS
from mismatch_probe.reports.html import esc, missing, table, td, td_num
from mismatch_probe.reports.load import RunData

PAIR_TITLES = {
    "learner_vs_decode": "learner vs sampler-decode",
    "learner_vs_prefill": "learner vs sampler-prefill",
    "prefill_vs_decode": "sampler-prefill vs sampler-decode",
    "trainer_vs_decode": "trainer vs recorded sampler (training run)",
    "learner_vs_trainer": "learner now vs trainer",
}
AGGREGATION = {
    "verl": "token means divide by N + 1e-8; perplexities and log-ppl differences are per-sequence values "
    "averaged over sequences; IS/RS weights exp(clamp(d, +-20)) in token mode; chi2_seq over sequence products.",
    "slime": "every value is averaged within each sequence first, then over sequences (seq-mean-token-mean): "
    "a one-token sequence weighs as much as a long one.",
    "nemo_rl": "token means over all response tokens; KLs are k3 estimators on the sampled tokens; "
    "the seq_mult_prob_error values are per-sequence token means of exp(|d|), then max/mean/min over sequences.",
}
# a few headline keys per framework for the overview (all keys: report --convention NAME)
HEADLINE = {
    "verl": ("kl", "k3_kl", "chi2_token", "log_ppl_abs_diff", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction"),
    "slime": ("train_rollout_logprob_abs_diff", "mis_kl", "mis_k3_kl", "tis_clipfrac"),
    "nemo_rl": ("token_mult_prob_error", "gen_kl_error", "js_divergence_error", "max_seq_mult_prob_error"),
}


def _pairs(data: RunData) -> list[str]:
    return [p for p in PAIR_TITLES if isinstance(data.summary["pairs"].get(p), dict) and data.summary["pairs"][p]]


def _conv(data: RunData, pair: str, fw: str) -> dict[str, Any]:
    return ((data.summary["pairs"].get(pair) or {}).get("conventions") or {}).get(fw) or {}


def convention_view(data: RunData) -> str:
    """All metrics of the framework picked with ``report --convention``, else an overview of all three."""
    pairs = [p for p in _pairs(data) if any(_conv(data, p, fw) for fw in FRAMEWORKS)]
    if not pairs:
        return missing("RL frameworks' view", "summary.json has no conventions (a run made before framework conventions)")
    fw = getattr(data, "convention", None)
    heads = ["dashboard key"] + [PAIR_TITLES[p] for p in pairs]
    num_cols = range(1, len(heads))
    if fw:
        keys = sorted({k for p in pairs for k in _conv(data, p, fw)})
        rows = [[td(DASHBOARD_PREFIX[fw] + k)] + [td_num(_conv(data, p, fw).get(k)) for p in pairs] for k in keys]
        return (
            f'<p id="convention-name">Framework: <b>{esc(fw)}</b>. Aggregation: {esc(AGGREGATION[fw])}</p>'
            + table(heads, rows, numeric=num_cols, cls="sortable", tid="convention-table")
        )
    rows = []
    for f in FRAMEWORKS:
        for k in HEADLINE[f]:
            rows.append([td(f"{f}: {DASHBOARD_PREFIX[f]}{k}")] + [td_num(_conv(data, p, f).get(k)) for p in pairs])
    note = (
        "<p class='muted'>Headline metrics of each framework under its own name and aggregation; "
        "<code>mismatch-probe report RUN --convention verl|slime|nemo_rl</code> shows all of one framework's metrics.</p>"
    )
    return note + table(heads, rows, numeric=num_cols, tid="convention-overview")


TRAINING_ROWS = ("n_tokens", "mean_abs_dlogp", "max_abs_dlogp", "k3", "chi2", "clip_frac", "is_mean", "ess")


def training_run(data: RunData) -> str:
    """The gap the training run saw (trainer vs recorded sampler) next to the engines' gap now."""
    s = data.summary["pairs"]
    if not s.get("trainer_vs_decode"):
        if data.manifest.get("rollouts"):
            return missing("Training-run gap", "the rollouts file had no trainer logprobs")
        return ""  # not a `compare --rollouts` run: no section
    pairs = [p for p in ("trainer_vs_decode", "learner_vs_decode", "learner_vs_prefill", "learner_vs_trainer") if s.get(p)]
    rows = [[td(k)] + [td_num(s[p].get(k)) for p in pairs] for k in TRAINING_ROWS]
    ro = data.manifest.get("rollouts") or {}
    return (
        f"<p>Rollouts from <code>{esc(ro.get('file', '?'))}</code> ({esc(ro.get('naming', '?'))} column names): "
        "the first column is the gap the training run saw (its trainer's logprobs against the sampler logprobs it "
        "recorded); the others are what the engines give now on the same tokens.</p>"
        + table(["metric"] + [PAIR_TITLES[p] for p in pairs], rows, numeric=range(1, len(pairs) + 1), tid="training-run")
    )


FULL_ROWS = (
    ("n_positions", "positions"),
    ("kl_fwd", "KL(sampler || other) on the sampler's top-K"),
    ("kl_rev", "KL(other || sampler) on the sampler's top-K"),
    ("top1_agree", "top-1 agreement"),
    ("topk_overlap", "top-K overlap (Jaccard)"),
    ("sampled_rank_mean", "mean rank of the sampled token (learner)"),
    ("sampled_rank_max", "max rank of the sampled token (learner)"),
    ("sampled_in_topk_frac", "sampled tokens inside the sampler's top-K"),
    ("entropy_learner", "learner entropy (full vocabulary, nats)"),
    ("entropy_sampler", "sampler entropy (top-K renormalized, nats)"),
)


def full_distribution(data: RunData) -> str:
    """The top-K comparison of whole distributions (``compare --topk K``)."""
    pairs = [p for p in PAIR_TITLES if isinstance((data.summary["pairs"].get(p) or {}).get("full_vocab"), dict)]
    if not pairs:
        return ""  # compare ran without --topk: no section
    k = (data.manifest.get("config") or {}).get("topk_resolved", "K")
    rows = [
        [td(label)] + [td_num(data.summary["pairs"][p]["full_vocab"].get(key)) for p in pairs] for key, label in FULL_ROWS
    ]
    return (
        f"<p>Each position's top-{esc(k)} tokens of the sampler, renormalized, against the other side's "
        "logprobs of the same tokens. k3 on the sampled tokens estimates the full-vocabulary KL(sampler || learner); "
        "the top-K KL is the same divergence on the sampler's most likely tokens, so the two should agree in size.</p>"
        + table(["metric"] + [PAIR_TITLES[p] for p in pairs], rows, numeric=range(1, len(pairs) + 1), tid="full-distribution")
    )
