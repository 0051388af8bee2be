"""User mistakes: one-line error, exit code 2, and no run directory that reads as complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mp_testlib import cli

from mismatch_probe.probes.models import resolve_model


def _assert_clean_failure(proc, out: Path, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial*"))


def test_missing_model_dir(tmp_path):
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--model", str(tmp_path / "nope"), "--out", str(out)), out, "model not found")


def test_folder_that_is_not_an_hf_model(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights.txt").write_text("hi")
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--model", str(tmp_path / "m"), "--out", str(out)), out, "config.json")


def test_malformed_prompts_line_names_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hello"}\n\n{"prompt": oops}\n')
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--prompts", str(p), "--out", str(out)), out, "p.jsonl:3")


def test_prompt_longer_than_context(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [5] * 600}) + "\n")
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--prompts", str(p), "--out", str(out)), out, "line 1", "context")


def test_empty_prompts_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n")
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--prompts", str(p), "--out", str(out)), out, "empty")


def test_tokenizer_that_does_not_fit_the_model(tmp_path):
    src = resolve_model("tiny-llama").path
    bad = tmp_path / "bad-model"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 256  # the tokenizer has 512 tokens
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--model", str(bad), "--out", str(out)), out, "tokenizer", "vocabulary")


def test_bad_flag_values(tmp_path):
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--n", "0", "--out", str(out)), out, "--n")


@pytest.mark.parametrize("content", ['{"prompt_token_ids": [1, "a"]}', '[1, 2]', '{"text": "x"}'])
def test_prompt_shape_errors(tmp_path, content):
    p = tmp_path / "p.jsonl"
    p.write_text(content + "\n")
    out = tmp_path / "run"
    _assert_clean_failure(cli("compare", "--prompts", str(p), "--out", str(out)), out, "p.jsonl:1")
