"""`capture` (one engine) and `diff` (two captures) against the real engines."""

from __future__ import annotations

import pytest
from mp_testlib import cli, load_json

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(("engine", "side"), [("hf", "learner"), ("vllm", "sampler"), ("fsdp", "learner")])
def test_capture_one_engine_reproduces_the_run_bitwise(real_run_qwen3, tmp_path, engine, side):
    cap = tmp_path / f"cap-{engine}"
    cli("capture", "--engine", engine, "--from", str(real_run_qwen3), "--out", str(cap), check=True)
    assert load_json(cap / "manifest.json")["status"] == "complete"
    proc = cli("diff", f"{real_run_qwen3}:{side}", str(cap), "--out", str(tmp_path / "d"), check=True)
    s = load_json(tmp_path / "d" / "summary.json")
    assert s["bitwise_equal_logprobs"] is True, proc.stdout
    assert s["first_divergent"]["bitwise"] is None  # every captured op equal


def test_diff_learner_vs_sampler_finds_the_runs_divergence(real_run_qwen3, tmp_path):
    cli("diff", f"{real_run_qwen3}:learner", f"{real_run_qwen3}:sampler", "--out", str(tmp_path / "d"), check=True)
    s = load_json(tmp_path / "d" / "summary.json")
    assert s["bitwise_equal_logprobs"] is False
    assert s["first_divergent"]["bitwise"]["op"] == "0.attn.rope_q"


def test_capture_bad_input(tmp_path):
    proc = cli("capture", "--engine", "tpu", "--from", str(tmp_path), "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--engine" in proc.stderr
    proc = cli("capture", "--engine", "hf", "--from", str(tmp_path / "none"), "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "not found" in proc.stderr
