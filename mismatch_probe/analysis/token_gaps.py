"""Token tables and the token-level comparison (pure pandas/numpy; no engine imports)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.analysis.conventions import framework_metrics
from mismatch_probe.analysis.metrics import logprob_gap
from mismatch_probe.run.schema import conform

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


# --------------------------------------------------------------------------- --topk


def list_column(arr: np.ndarray, typ: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    """[N, K] numpy -> a Parquet list column (null rows where ``valid`` is False)."""
    n, k = arr.shape
    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
    lists = pa.ListArray.from_arrays(offsets, pa.array(arr.reshape(-1)).cast(typ.value_type))
    if valid is None:
        return lists
    mask = pa.array(~np.asarray(valid, dtype=bool))
    return pa.ListArray.from_arrays(offsets, lists.values, mask=mask).cast(typ)


def with_topk(table: pa.Table, per_seq: dict[int, dict[str, np.ndarray]], columns: dict[str, pa.DataType]) -> pa.Table:
    """Append per-position arrays (``per_seq[seq_id][name]``: [len-1] or [len-1, K]) to a tokens
    table whose rows are (seq_id, pos >= 1) in any order. Rows without arrays get nulls."""
    sid = table.column("seq_id").to_numpy().astype(np.int64)
    pos = table.column("pos").to_numpy().astype(np.int64)
    for name, typ in columns.items():
        have = sorted(k for k, v in per_seq.items() if name in v)
        if not have:
            continue
        # one concatenated array; row (seq_id, pos) reads entry offset[seq_id] + pos - 1 (no per-row loop)
        keys = np.asarray(have, dtype=np.int64)
        lens = np.array([per_seq[k][name].shape[0] for k in have], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
        flat = np.concatenate([per_seq[k][name] for k in have])
        at = np.clip(np.searchsorted(keys, sid), 0, keys.size - 1)
        valid = (keys[at] == sid) & (pos >= 1) & (pos <= lens[at])
        idx = np.where(valid, offsets[at] + pos - 1, 0)
        arr = flat[idx]
        if arr.ndim == 2:
            col = list_column(arr, typ, valid)
        else:
            col = pa.array(arr, mask=~valid).cast(typ)
        table = table.append_column(name, col)
    return table


def _rows(df: pd.DataFrame, col: str) -> np.ndarray:
    return np.vstack(df[col].to_numpy()) if len(df) else np.zeros((0, 0))


def full_vocab(sampler_tokens: pd.DataFrame, learner_tokens: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Top-K full-distribution metrics per pair over response tokens (see :mod:`mismatch_probe.analysis.topk`);
    empty when the run has no top-K columns."""
    from mismatch_probe.analysis.topk import lookup, topk_metrics

    if "topk_ids" not in sampler_tokens or "topk_ids" not in learner_tokens:
        return {}
    key = ["seq_id", "pos"]
    lrn = learner_tokens[learner_tokens.is_response & learner_tokens.topk_ids.notna()]
    out: dict[str, dict[str, float]] = {}
    views = {}
    for src in ("decode", "prefill"):
        v = sampler_tokens[(sampler_tokens.source == src) & sampler_tokens.is_response & sampler_tokens.topk_ids.notna()]
        views[src] = v[key + ["token_id", "topk_ids", "topk_logprobs"]]
    for pair, src in (("learner_vs_decode", "decode"), ("learner_vs_prefill", "prefill")):
        col = f"lp_at_{src}_topk"
        if col not in lrn:
            continue
        j = views[src].merge(lrn[key + ["topk_logprobs", "sampled_rank", "entropy", col]], on=key, suffixes=("", "_l"))
        j = j[j[col].notna()]
        if j.empty:
            continue
        ltop = _rows(j, "topk_logprobs_l")
        out[pair] = topk_metrics(
            _rows(j, "topk_ids").astype(np.int64),
            _rows(j, "topk_logprobs"),
            _rows(j, col),
            ltop[:, 0],
            ltop[:, -1],
            j["token_id"].to_numpy(),
            rank=j["sampled_rank"].to_numpy(),
            entropy_learner=j["entropy"].to_numpy(),
        )
    j = views["decode"].merge(views["prefill"], on=key, suffixes=("", "_p"))
    if not j.empty:
        d_ids = _rows(j, "topk_ids").astype(np.int64)
        p_lps = _rows(j, "topk_logprobs_p")
        out["prefill_vs_decode"] = topk_metrics(
            d_ids,
            _rows(j, "topk_logprobs"),
            lookup(d_ids, _rows(j, "topk_ids_p").astype(np.int64), p_lps),
            p_lps[:, 0],
            p_lps[:, -1],
            j["token_id"].to_numpy(),
        )
    return out
