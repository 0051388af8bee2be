"""Rollouts recorded by an RL training run (``compare --rollouts FILE``): read, validate, export.

A rollouts file is Parquet or JSONL, one row per sequence: prompt token ids, response token ids,
the sampler's logprob of each response token as the RL run recorded it, and optionally the
trainer's ("old") logprobs of the same tokens. Three column namings are accepted:

* ours: ``prompt_token_ids``, ``response_token_ids``, ``rollout_logprobs``, ``old_logprobs``;
* verl: ``prompts``, ``responses``, ``rollout_log_probs``, ``old_log_probs``;
* slime: ``tokens`` (prompt + response; its last ``response_length`` ids are the response),
  ``response_length``, ``rollout_log_probs``, ``log_probs``.

verl: the keys of its training batch (``DataProto``): ``prompts`` (left-padded), ``responses``
(right-padded), ``rollout_log_probs`` (vLLM/SGLang rollout with ``calculate_log_probs``),
``old_log_probs`` (the actor's recompute), with the optional ``attention_mask`` (over prompt +
response: drops the prompt's left padding) and ``response_mask`` (drops the response padding).
slime: the fields of its ``Sample`` (``slime/utils/types.py``) as ``--save-debug-rollout-data``
writes them (``tokens``, ``response_length``, ``rollout_log_probs``, optional ``loss_mask``);
``log_probs`` is the trainer's logprob in its train data. An optional ``prompt_id`` (ours),
``uid`` (verl) or ``group_index`` (slime) groups samples of one prompt.

Every problem is a :class:`UsageError` naming the row (``FILE row N``, 1-based; JSONL: line N).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import UsageError
from mismatch_probe.steps.prompts import check_readable, jsonl_objects

NAMINGS: dict[str, dict[str, str]] = {
    "ours": {"prompt": "prompt_token_ids", "response": "response_token_ids", "lp": "rollout_logprobs", "old": "old_logprobs"},
    "verl": {"prompt": "prompts", "response": "responses", "lp": "rollout_log_probs", "old": "old_log_probs"},
    "slime": {"prompt": "tokens", "response": "response_length", "lp": "rollout_log_probs", "old": "log_probs"},
}
GROUP_KEYS = ("prompt_id", "uid", "group_index")


@dataclass
class RecordedRollout:
    """One recorded sequence, checked."""

    row: int  # 1-based row (JSONL: line) of the file
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: np.ndarray  # float64, the file's values unchanged
    old_logprobs: np.ndarray | None
    group: Any = None


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], list[int], str]:
    """(rows, their 1-based row/line numbers, 'row' or 'line')."""
    path = check_readable(path, "rollouts file")
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        objs = list(jsonl_objects(path, lambda n: f"{path} line {n}"))
        return [o for _, o in objs], [n for n, _ in objs], "line"
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for non-Parquet files
        raise UsageError(f"{path}: neither JSONL (.jsonl) nor a readable Parquet file ({str(e).splitlines()[0]})") from None
    return rows, list(range(1, len(rows) + 1)), "row"


def detect_naming(row: dict[str, Any], where: str) -> str:
    for name, cols in NAMINGS.items():
        if cols["prompt"] in row and cols["response"] in row:
            if cols["lp"] not in row:
                raise UsageError(f"{where}: {name} naming without its sampler logprobs column {cols['lp']!r}")
            return name
    wanted = "; ".join(f"{n}: {c['prompt']}, {c['response']}, {c['lp']}" for n, c in NAMINGS.items())
    raise UsageError(f"{where}: missing columns; expected one naming ({wanted}); found {', '.join(sorted(row)) or 'none'}")


def _ints(v: Any, key: str, where: str) -> list[int]:
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if not isinstance(v, list | tuple) or not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in v):
        raise UsageError(f"{where}: {key!r} must be a list of integer token ids")
    return [int(t) for t in v]


def _floats(v: Any, key: str, where: str) -> np.ndarray:
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if not isinstance(v, list | tuple) or not all(
        isinstance(t, int | float | np.floating) and not isinstance(t, bool) for t in v
    ):
        raise UsageError(f"{where}: {key!r} must be a list of numbers")
    a = np.asarray(v, dtype=np.float64)
    bad = np.flatnonzero(np.isnan(a) | (a > 0))
    if bad.size:
        raise UsageError(f"{where}: {key!r} holds {a[bad[0]]} at position {int(bad[0])}, not a logprob (<= 0)")
    return a


def _mask(row: dict[str, Any], key: str, n: int, where: str) -> list[int] | None:
    if row.get(key) is None:
        return None
    m = _ints(row[key], key, where)
    if len(m) != n:
        raise UsageError(f"{where}: {key!r} has {len(m)} entries for {n} tokens")
    return m


def _parse(row: dict[str, Any], naming: str, where: str) -> RecordedRollout:
    cols = NAMINGS[naming]
    for key in (cols["prompt"], cols["response"], cols["lp"]):
        if row.get(key) is None:
            raise UsageError(f"{where}: missing {key!r}")
    lp = _floats(row[cols["lp"]], cols["lp"], where)
    old = None if row.get(cols["old"]) is None else _floats(row[cols["old"]], cols["old"], where)
    if naming == "slime":
        tokens = _ints(row["tokens"], "tokens", where)
        n_resp = row["response_length"]
        if not isinstance(n_resp, int | np.integer) or isinstance(n_resp, bool) or not 0 < n_resp < len(tokens):
            raise UsageError(f"{where}: 'response_length' {n_resp!r} must be an integer in [1, {len(tokens) - 1}]")
        prompt, resp = tokens[: len(tokens) - n_resp], tokens[len(tokens) - n_resp :]
        loss_mask = _mask(row, "loss_mask", len(resp), where)
        if loss_mask is not None and 0 in loss_mask:
            raise UsageError(f"{where}: 'loss_mask' masks response tokens (multi-turn tool output); not supported yet")
    else:
        prompt = _ints(row[cols["prompt"]], cols["prompt"], where)
        resp = _ints(row[cols["response"]], cols["response"], where)
        if naming == "verl":
            att = _mask(row, "attention_mask", len(prompt) + len(resp), where)
            if att is not None:
                prompt = [t for t, a in zip(prompt, att[: len(prompt)]) if a]
            rmask = _mask(row, "response_mask", len(resp), where)
            if rmask is not None:
                keep = sum(1 for m in rmask if m)
                if rmask != [1] * keep + [0] * (len(resp) - keep):
                    raise UsageError(f"{where}: 'response_mask' must be ones then zeros (right padding)")
                padded = len(resp)
                resp = resp[:keep]
                lp = lp[:keep] if lp.size == padded else lp
                old = None if old is None else (old[:keep] if old.size == padded else old)
    if not prompt:
        raise UsageError(f"{where}: empty prompt")
    if not resp:
        raise UsageError(f"{where}: empty response")
    if lp.size != len(resp):
        raise UsageError(f"{where}: {len(resp)} response tokens but {lp.size} values in {cols['lp']!r}")
    if old is not None and old.size != len(resp):
        raise UsageError(f"{where}: {len(resp)} response tokens but {old.size} values in {cols['old']!r}")
    group = next((row[k] for k in GROUP_KEYS if row.get(k) is not None), None)
    return RecordedRollout(row=0, prompt_ids=prompt, response_ids=resp, logprobs=lp, old_logprobs=old, group=group)


def load_rollouts(path: Path, vocab_size: int | None = None) -> tuple[list[RecordedRollout], str]:
    """Read and check a rollouts file; returns the rollouts and the naming found."""
    path = Path(path)
    rows, nums, unit = _read_rows(path)
    if not rows:
        raise UsageError(f"rollouts file is empty: {path}")
    naming = detect_naming(rows[0], f"{path} {unit} {nums[0]}")
    out: list[RecordedRollout] = []
    for row, n in zip(rows, nums, strict=True):
        where = f"{path} {unit} {n}"
        r = _parse(row, naming, where)
        r.row = n
        if vocab_size is not None:
            ids = np.asarray(r.prompt_ids + r.response_ids)
            bad = ids[(ids < 0) | (ids >= vocab_size)]
            if bad.size:
                raise UsageError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary [0, {vocab_size})")
        out.append(r)
    has_old = {r.old_logprobs is not None for r in out}
    if len(has_old) > 1:
        first = next(r for r in out if r.old_logprobs is None)
        raise UsageError(f"{path} {unit} {first.row}: trainer logprobs missing (other rows have them)")
    return out, naming


def prompt_ids_of(rollouts: list[RecordedRollout]) -> list[int]:
    """A prompt id per rollout: the file's group column where given (in order of first
    appearance), else the row index."""
    if any(r.group is None for r in rollouts):
        return list(range(len(rollouts)))
    ids: dict[Any, int] = {}
    return [ids.setdefault(json.dumps(r.group, default=str), len(ids)) for r in rollouts]


def rollouts_from_run(run: Path, *, with_old: bool = True) -> list[dict[str, Any]]:
    """Rows (ours naming) from a finished run: its sequences, the sampler's decode logprobs and,
    with ``with_old``, the learner's logprobs as the trainer's. For re-running a run's rollouts."""
    from mismatch_probe.run.reader import RunDir

    rd = RunDir(run)
    seqs = rd.sequences().to_pandas()
    s = rd.tokens("sampler").to_pandas()
    dec = s[s.source == "decode"].sort_values(["seq_id", "pos"])
    lrn = rd.tokens("learner").to_pandas()
    lrn = lrn[lrn.is_response].sort_values(["seq_id", "pos"])
    dec_by = {k: g["logprob"].to_numpy() for k, g in dec.groupby("seq_id")}
    lrn_by = {k: g["logprob"].to_numpy() for k, g in lrn.groupby("seq_id")}
    rows = []
    for r in seqs.itertuples():
        ids = [int(t) for t in r.token_ids]
        if r.seq_id not in dec_by:
            continue
        row = {
            "prompt_id": int(r.prompt_id),
            "prompt_token_ids": ids[: r.n_prompt],
            "response_token_ids": ids[r.n_prompt :],
            "rollout_logprobs": [float(x) for x in dec_by[r.seq_id]],
        }
        if with_old:
            row["old_logprobs"] = [float(x) for x in lrn_by[r.seq_id]]
        rows.append(row)
    return rows


def write_rollouts(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSONL (``.jsonl``) or Parquet (anything else), atomically."""
    from mismatch_probe.run.schema import atomic_write_bytes

    path = Path(path)
    if path.suffix == ".jsonl":
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())
        return
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    atomic_write_bytes(path, buf.getvalue())
