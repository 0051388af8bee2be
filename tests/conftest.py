"""Shared fixtures. Real engines run in subprocesses (vLLM keeps global state per process)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from mp_testlib import cli

# Tiny models are built into a per-session cache (subprocesses inherit it); nothing downloads.
if "MISMATCH_PROBE_CACHE" not in os.environ:
    os.environ["MISMATCH_PROBE_CACHE"] = tempfile.mkdtemp(prefix="mp-cache-")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Property tests: "ci" (the default under pytest) draws the same examples on every run (derandomized,
# no example database), so CI never fails at random on a change that touches nothing there; "dev"
# searches with fresh random examples and keeps failures in the local database:
#   HYPOTHESIS_PROFILE=dev python -m pytest -q tests/kernels/test_kernels_properties.py
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _compare(tmp_path_factory: pytest.TempPathFactory, model: str, *extra: str) -> Path:
    out = tmp_path_factory.mktemp(f"run-{model}") / "run"
    cli("compare", "--model", model, "--out", str(out), *extra, check=True)
    return out


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete ``compare`` run on tiny-llama with real vLLM and HF (shared by the suite)."""
    return _compare(tmp_path_factory, "tiny-llama")


@pytest.fixture(scope="session")
def real_run_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete ``compare`` run on tiny-qwen3 with real vLLM and HF."""
    return _compare(tmp_path_factory, "tiny-qwen3")


@pytest.fixture(scope="session")
def rollouts_run(tmp_path_factory: pytest.TempPathFactory, real_run_qwen3: Path) -> Path:
    """``compare --rollouts`` on tiny-qwen3: real_run_qwen3's 16 rollouts (its decode logprobs as the
    recorded sampler logprobs, its learner logprobs as the trainer's), four of them cut to one
    response token, written in verl's naming with padding and masks (Parquet). Op capture off, top-5."""
    from mismatch_probe.steps.rollouts import rollouts_from_run, write_rollouts

    rows = rollouts_from_run(real_run_qwen3)
    for i in (0, 5, 9, 13):
        for k in ("response_token_ids", "rollout_logprobs", "old_logprobs"):
            rows[i][k] = rows[i][k][:1]
    wp = max(len(r["prompt_token_ids"]) for r in rows)
    wr = max(len(r["response_token_ids"]) for r in rows)
    verl = []
    for r in rows:
        lp, rp = wp - len(r["prompt_token_ids"]), wr - len(r["response_token_ids"])
        verl.append(
            {
                "uid": str(r["prompt_id"]),
                "prompts": [0] * lp + r["prompt_token_ids"],
                "responses": r["response_token_ids"] + [0] * rp,
                "rollout_log_probs": r["rollout_logprobs"] + [0.0] * rp,
                "old_log_probs": r["old_logprobs"] + [0.0] * rp,
                "attention_mask": [0] * lp + [1] * (len(r["prompt_token_ids"]) + len(r["response_token_ids"])) + [0] * rp,
                "response_mask": [1] * len(r["response_token_ids"]) + [0] * rp,
            }
        )
    base = tmp_path_factory.mktemp("rollouts")
    write_rollouts(base / "verl_batch.parquet", verl)
    path = str(base / "verl_batch.parquet")
    return _compare(tmp_path_factory, "tiny-qwen3", "--rollouts", path, "--capture", "off", "--topk", "5")
