"""Token tables and the token-level comparison (pure pandas/numpy; no engine imports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.conventions import framework_metrics
from mismatch_probe.metrics import logprob_gap
from mismatch_probe.schema import conform

# pair name -> (column of side A, column of side B); d = A - B
PAIRS = {
    "learner_vs_decode": ("lp_learner", "lp_decode"),
    "learner_vs_prefill": ("lp_learner", "lp_prefill"),
    "prefill_vs_decode": ("lp_prefill", "lp_decode"),
}
DIFF_COLUMNS = {
    "learner_vs_decode": "d_learner_decode",
    "learner_vs_prefill": "d_learner_prefill",
    "prefill_vs_decode": "d_prefill_decode",
}


def tokens_table(rollouts: Sequence[Any], scores: Sequence[np.ndarray], source: str) -> pa.Table:
    """One row per scored token (pos >= 1) of each rollout; ``scores[i][j]`` is the logprob of
    token ``j + 1`` of rollout ``i``."""
    cols: dict[str, list] = {k: [] for k in ("seq_id", "prompt_id", "pos", "token_id", "is_response", "logprob")}
    for r, lp in zip(rollouts, scores, strict=True):
        ids = r.token_ids
        n_prompt = len(r.prompt_ids)
        pos = np.arange(1, len(ids))
        cols["seq_id"].append(np.full(pos.size, r.seq_id))
        cols["prompt_id"].append(np.full(pos.size, r.prompt_id))
        cols["pos"].append(pos)
        cols["token_id"].append(np.asarray(ids[1:]))
        cols["is_response"].append(pos >= n_prompt)
        cols["logprob"].append(np.asarray(lp, dtype=np.float64))
    types = {"is_response": bool, "logprob": np.float64}
    data = {k: np.concatenate(v) if v else np.array([], dtype=types.get(k, np.int32)) for k, v in cols.items()}
    t = pa.table(data)
    return conform(t.append_column("source", pa.array([source] * t.num_rows, pa.string())), "tokens")


def decode_table(rollouts: Sequence[Any]) -> pa.Table:
    """Rows for the sampler's decode-time logprobs (response tokens only)."""
    rows = [r for r in rollouts if r.decode_logprobs is not None]
    scores = []
    for r in rows:
        lp = np.full(len(r.token_ids) - 1, np.nan)
        lp[len(r.prompt_ids) - 1 :] = r.decode_logprobs
        scores.append(lp)
    t = tokens_table(rows, scores, "decode")
    return t.filter(pc.field("is_response"))


def token_gaps(sampler_tokens: pd.DataFrame, learner_tokens: pd.DataFrame) -> pd.DataFrame:
    """Join learner, sampler-prefill and sampler-decode logprobs on (seq_id, pos)."""
    key = ["seq_id", "pos"]
    base = learner_tokens[["seq_id", "prompt_id", "pos", "token_id", "is_response", "logprob"]].rename(
        columns={"logprob": "lp_learner"}
    )
    pre = sampler_tokens[sampler_tokens.source == "prefill"][key + ["token_id", "logprob"]].rename(
        columns={"logprob": "lp_prefill", "token_id": "_tok_prefill"}
    )
    dec = sampler_tokens[sampler_tokens.source == "decode"][key + ["logprob"]].rename(columns={"logprob": "lp_decode"})
    df = base.merge(pre, on=key, how="outer", validate="one_to_one").merge(dec, on=key, how="left", validate="one_to_one")
    if df["lp_learner"].isna().any() or df["lp_prefill"].isna().any():
        missing = df[df["lp_learner"].isna() | df["lp_prefill"].isna()][key].head(3).to_dict("records")
        raise ValueError(f"learner and sampler scored different tokens, e.g. {missing}")
    if not (df["_tok_prefill"] == df["token_id"]).all():
        raise ValueError("learner and sampler disagree on token ids at the same (seq_id, pos)")
    df = df.drop(columns=["_tok_prefill"]).sort_values(key, kind="stable").reset_index(drop=True)
    for pair, (a, b) in PAIRS.items():
        df[DIFF_COLUMNS[pair]] = df[a] - df[b]
    return df


def pair_metrics(lp_a: np.ndarray, lp_b: np.ndarray, seq_ids: np.ndarray) -> dict[str, Any]:
    """Our metrics of one pair plus, under ``conventions``, each RL framework's (A is the
    learner/trainer side, B the sampler/rollout side)."""
    out: dict[str, Any] = dict(logprob_gap(lp_a, lp_b, seq_ids=seq_ids))
    finite = np.isfinite(lp_a) & np.isfinite(lp_b)
    out["conventions"] = framework_metrics(lp_a[finite], lp_b[finite], seq_ids[finite])
    return out


def summarize(gaps: pd.DataFrame) -> dict[str, Any]:
    """Every token-level metric for the three pairs, over response tokens."""
    resp = gaps[gaps.is_response]
    pairs: dict[str, Any] = {}
    for pair, (a, b) in PAIRS.items():
        sub = resp[resp[b].notna() & resp[a].notna()] if b == "lp_decode" else resp
        if sub.empty:
            pairs[pair] = None  # e.g. no decode view when responses were given, not generated
            continue
        pairs[pair] = pair_metrics(sub[a].to_numpy(), sub[b].to_numpy(), sub["seq_id"].to_numpy())
    return {
        "n_sequences": int(gaps["seq_id"].nunique()),
        "n_tokens": int(len(gaps)),
        "n_response_tokens": int(len(resp)),
        "pairs": pairs,
    }


# pairs of a --rollouts run that recorded the trainer's logprobs (A - B as above)
TRAINER_PAIRS = {
    "trainer_vs_decode": ("lp_trainer", "lp_decode"),  # the gap the training run saw
    "learner_vs_trainer": ("lp_learner", "lp_trainer"),  # does this learner reproduce the trainer
}


def trainer_pairs(gaps: pd.DataFrame, trainer_tokens: pd.DataFrame) -> dict[str, Any]:
    """Metrics of the training run's own gap (trainer vs recorded sampler logprobs) and of this
    learner against the trainer, over the response tokens of ``gaps``."""
    key = ["seq_id", "pos"]
    t = trainer_tokens[key + ["logprob"]].rename(columns={"logprob": "lp_trainer"})
    df = gaps[gaps.is_response].merge(t, on=key, how="left", validate="one_to_one")
    out: dict[str, Any] = {}
    for pair, (a, b) in TRAINER_PAIRS.items():
        sub = df[df[a].notna() & df[b].notna()]
        out[pair] = pair_metrics(sub[a].to_numpy(), sub[b].to_numpy(), sub["seq_id"].to_numpy()) if len(sub) else None
    return out
