"""``--learner fsdp`` takes recipes through the CLI: FSDP2 over gloo with 2 ranks, the strict
recipe on both engines gives exactly the sampler's logprobs (prefill and decode) and every
captured op bitwise equal."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mp_testlib import cli, load_json


@pytest.mark.vllm
@pytest.mark.parametrize("flags", [("--align", "strict"), ("--recipe", "strict")], ids=["align", "recipe"])
def test_fsdp_learner_strict_exactly_equals_the_sampler(tmp_path: Path, flags: tuple[str, str]) -> None:
    out = tmp_path / "run"
    cli("compare", "--learner", "fsdp", "--nproc", "2", "--model", "tiny-qwen3", "--n", "1", "--max-tokens", "8",
        "--micro-batch-size", "4", *flags, "--out", str(out), check=True, timeout=900)
    m = load_json(out / "manifest.json")
    learner = m["engines"]["learner"]
    assert learner["engine"] == "fsdp" and learner["world_size"] == 2 and learner["backend"] == "gloo"
    assert learner["recipe"]["name"] == "strict" and learner["recipe"]["patched_ops"]  # applied on the ranks
    pairs = load_json(out / "compare" / "summary.json")["pairs"]
    for pair in ("learner_vs_prefill", "learner_vs_decode"):
        assert pairs[pair]["n_tokens"] > 0
        assert pairs[pair]["max_abs_dlogp"] == 0.0, (pair, pairs[pair]["max_abs_dlogp"])  # exactly, not approximately
    errs = pd.read_parquet(out / "compare" / "op_errors.parquet")
    assert len(errs) > 0 and (errs.bitwise_equal_frac == 1.0).all(), errs[errs.bitwise_equal_frac < 1].op.tolist()[:5]
