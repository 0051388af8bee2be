"""``compare --rollouts``: the three column namings, bad files, and decode views bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mp_testlib import cli

from mismatch_probe.errors import UsageError
from mismatch_probe.steps.rollouts import load_rollouts, write_rollouts

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
RESPONSES = [[20, 21], [22], [23, 24, 25]]
LPS = [[-0.1234567890123, -2.5e-7], [-3.0000000000000004], [-1e-300, -0.5, -7.25]]
OLD = [[-0.12, -1e-7], [-3.0], [-0.0, -0.5, -7.0]]


def ours() -> list[dict]:
    return [
        {"prompt_token_ids": p, "response_token_ids": r, "rollout_logprobs": lp, "old_logprobs": o, "prompt_id": i // 2}
        for i, (p, r, lp, o) in enumerate(zip(PROMPTS, RESPONSES, LPS, OLD))
    ]


def verl(pad: int = 0) -> list[dict]:
    """verl's batch keys, left-padded prompts and right-padded responses with their masks."""
    width_p, width_r = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    rows = []
    for p, r, lp, o in zip(PROMPTS, RESPONSES, LPS, OLD):
        lpad, rpad = width_p - len(p), width_r - len(r)
        rows.append(
            {
                "prompts": [pad] * lpad + p,
                "responses": r + [pad] * rpad,
                "rollout_log_probs": lp + [0.0] * rpad,
                "old_log_probs": o + [0.0] * rpad,
                "attention_mask": [0] * lpad + [1] * (len(p) + len(r)) + [0] * rpad,
                "response_mask": [1] * len(r) + [0] * rpad,
                "uid": f"u{len(p)}",
            }
        )
    return rows


def slime() -> list[dict]:
    return [
        {"tokens": p + r, "response_length": len(r), "rollout_log_probs": lp, "log_probs": o, "loss_mask": [1] * len(r)}
        for p, r, lp, o in zip(PROMPTS, RESPONSES, LPS, OLD)
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize(("naming", "rows"), [("ours", ours), ("verl", verl), ("slime", slime)])
def test_each_naming_reads_the_same_rollouts(tmp_path: Path, naming: str, rows, suffix: str) -> None:
    path = tmp_path / f"r{suffix}"
    write_rollouts(path, rows())
    recs, found = load_rollouts(path, vocab_size=100)
    assert found == naming
    assert [r.prompt_ids for r in recs] == PROMPTS
    assert [r.response_ids for r in recs] == RESPONSES
    for r, lp, old in zip(recs, LPS, OLD):
        assert r.logprobs.dtype == np.float64 and r.logprobs.tolist() == lp  # bit for bit
        assert r.old_logprobs is not None and r.old_logprobs.tolist() == old


def test_decode_view_is_the_files_logprobs_bit_for_bit(tmp_path: Path) -> None:
    """From the file to the decode rows of sampler/tokens.parquet, without an engine."""
    from mismatch_probe.analysis.token_gaps import decode_table
    from mismatch_probe.steps.compare import Prepared
    from mismatch_probe.steps.compare_stages import recorded_rollouts

    for rows in (ours(), verl(), slime()):
        path = tmp_path / "r.parquet"
        write_rollouts(path, rows)
        recs, _ = load_rollouts(path, vocab_size=100)
        prep = Prepared(model=None, sampler_model=None, specs=[], prompt_ids=PROMPTS, recorded=recs)  # type: ignore[arg-type]
        t = decode_table(recorded_rollouts(prep))
        got = t.column("logprob").to_numpy()
        assert np.array_equal(got.view(np.int64), np.concatenate(LPS).view(np.int64))
        assert t.column("source").to_pylist() == ["decode"] * got.size


def _bad(tmp_path: Path, rows: list[dict], name: str = "bad.jsonl") -> Path:
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _drop(rows: list[dict], i: int, key: str) -> list[dict]:
    rows[i] = {k: v for k, v in rows[i].items() if k != key}
    return rows


BAD = {
    "missing_columns": (lambda: [{"prompt_token_ids": [1], "response_token_ids": [2]}], "line 1: ours naming without"),
    "missing_in_a_row": (lambda: _drop(ours(), 2, "rollout_logprobs"), "line 3: missing 'rollout_logprobs'"),
    "unknown_naming": (lambda: [{"input_ids": [1, 2]}], "line 1: missing columns; expected one naming"),
    "length": (lambda: [*ours()[:1], {**ours()[1], "rollout_logprobs": [-1.0, -2.0]}], "line 2: 1 response tokens but 2"),
    "old_length": (lambda: [{**ours()[0], "old_logprobs": [-1.0]}], "line 1: 2 response tokens but 1 values in 'old_logprobs'"),
    "vocab": (
        lambda: [*ours()[:2], {**ours()[2], "response_token_ids": [23, 10**9, 25]}],
        "line 3: token id 1000000000 is outside",
    ),
    "negative_id": (lambda: [{**ours()[0], "prompt_token_ids": [-1, 2]}], "line 1: token id -1 is outside"),
    "not_logprob": (lambda: [{**ours()[0], "rollout_logprobs": [-0.1, 0.5]}], "line 1: 'rollout_logprobs' holds 0.5"),
    "slime_length": (lambda: [{**slime()[0], "response_length": 5}], "line 1: 'response_length' 5 must be"),
    "verl_mask": (lambda: [{**verl()[1], "response_mask": [0, 1, 0]}], "line 1: 'response_mask' must be ones then zeros"),
    "old_in_some_rows": (lambda: _drop(ours(), 1, "old_logprobs"), "line 2: trainer logprobs missing"),
    "empty_response": (lambda: [{**ours()[0], "response_token_ids": [], "rollout_logprobs": []}], "line 1: empty response"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_name_the_row(tmp_path: Path, case: str) -> None:
    rows, msg = BAD[case]
    with pytest.raises(UsageError, match=msg.replace("(", r"\(")):
        load_rollouts(_bad(tmp_path, rows()), vocab_size=100)


def test_bad_parquet_names_the_row(tmp_path: Path) -> None:
    rows = verl()
    rows[2]["rollout_log_probs"] = rows[2]["rollout_log_probs"][:1]
    with pytest.raises(UsageError, match=r"bad.parquet row 3: 3 response tokens but 1 values"):
        load_rollouts(_bad(tmp_path, rows, "bad.parquet"), vocab_size=100)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(UsageError, match="neither JSONL"):
        load_rollouts(tmp_path / "junk.parquet")


@pytest.mark.parametrize("case", ["length", "vocab", "missing_columns"])
def test_cli_bad_rollouts_one_line_exit_2(tmp_path: Path, case: str) -> None:
    rows, msg = BAD[case]
    path = _bad(tmp_path, rows())
    proc = cli("compare", "--rollouts", str(path), "--model", "tiny-qwen3", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert msg in err[0]
    assert not (tmp_path / "run").exists()


def test_rollouts_and_prompts_exclusive(tmp_path: Path) -> None:
    path = _bad(tmp_path, ours(), "r.jsonl")
    proc = cli("compare", "--rollouts", str(path), "--prompts", str(path), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "either --prompts or --rollouts" in proc.stderr
