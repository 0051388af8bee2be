"""Per-op capture and bisect against the real engines (vLLM on CPU, HF): observer effect, token
mapping, ground-truth planted perturbations, and the first divergent op confirmed directly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from mp_testlib import REPO, cli, load_json, plant

from mismatch_probe.probes.models import resolve_model
from mismatch_probe.run.schema import validate_file

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_checks() -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "engine_checks.py"), "tiny-qwen3"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_observer_effect_logprobs_bitwise_equal_with_and_without_hooks(engine_checks):
    assert engine_checks["vllm_observer_equal"] is True
    assert engine_checks["hf_observer_equal"] is True
    # hooks are removed afterwards: the engines compute exactly as before
    assert engine_checks["vllm_after_remove_equal"] is True
    assert engine_checks["hf_after_remove_equal"] is True


def test_the_samplers_release_does_not_wait_for_the_llm_object(engine_checks):
    # the engine core is shut down at release even while something still holds vLLM's LLM object:
    # the start-up gc.freeze is undone, so the weights and KV cache in reference cycles can be freed
    assert engine_checks["vllm_release_unfroze"] is True


def test_token_mapping_of_a_chunked_batch_of_seven_sequences(engine_checks):
    # 7 sequences of lengths 3..41 in one batch, chunked prefill at 32 tokens per step
    assert engine_checks["vllm_unmatched_rows"] == 0
    assert engine_checks["duplicate_rows"] == 0
    assert engine_checks["mapping_rows"] == engine_checks["n_tokens"] == 115
    # independent check: each captured embedding row is the embedding of the token at (seq_id, pos)
    assert engine_checks["mapping_embed_ok"] is True
    # and each sequence scored alone gives the same rows (vLLM's CPU math is batch-invariant here)
    assert engine_checks["alone_rows_matched"] is True
    assert all(v == 1.0 for v in engine_checks["alone_equal_by_kind"].values()), engine_checks["alone_equal_by_kind"]


def test_capture_files_and_op_errors(real_run_qwen3):
    for side in ("learner", "sampler"):
        t = validate_file(real_run_qwen3 / side / "ops.parquet", "ops").to_pandas()
        assert not t.duplicated(["op", "seq_id", "pos"]).any()
    errs = validate_file(real_run_qwen3 / "compare/op_errors.parquet", "op_errors").to_pandas()
    assert {"embed", "0.input_norm", "0.attn.rope_q", "0.attn.core", "3.out", "final_norm", "logits"} <= set(errs.op)
    assert errs.exec_order.is_monotonic_increasing
    parity = load_json(real_run_qwen3 / "compare/weight_parity.json")
    assert parity["ok"] and parity["n_equal"] == parity["n_params"]


def test_first_divergent_op_confirmed_by_calling_both_engines_directly(real_run_qwen3, engine_checks):
    proc = cli("bisect", str(real_run_qwen3), check=True)
    bis = load_json(real_run_qwen3 / "bisect.json")
    fd = bis["first_divergent"]["bitwise"]
    assert fd["op"] == "0.attn.rope_q", proc.stdout
    # top contributors: local errors (rope and the fused add+norm introduce error on equal inputs)
    top_kinds = {r["kind"] for r in bis["local_errors"][:12]}
    assert top_kinds <= {"attn.rope_q", "attn.rope_k", "attn.core", "input_norm", "post_attn_norm", "final_norm"}, top_kinds
    # the attention core is replayed (whole prefill sequences, each engine's own attention)
    core = [r for r in bis["local_errors"] if r["kind"] == "attn.core"]
    assert len(core) == 4 and all(r["n_rows"] > 0 and r["local_error"] >= 0 for r in core), core
    assert not any(o.endswith("attn.core") for o in bis["not_replayed"])
    # the dominant divergence (first op where most rows differ) is named in bisect.json and the CLI table
    dom = bis["first_divergent"]["dominant"]
    assert dom is not None and dom["bitwise_equal_frac"] < 0.5 and dom["exec_order"] >= fd["exec_order"]
    assert "dominant divergence" in proc.stdout
    assert all(r["local_error"] == 0 for r in bis["local_errors"] if r["kind"] in ("attn.q", "attn.k", "mlp.down"))
    # ablation: aligning everything closes the gap exactly; rope leads the op classes
    assert bis["gap_engine"] > 0 and bis["gap_all_aligned"] == 0.0
    kinds = [r for r in bis["ablation"] if r["kind"] == "op_kind"]
    assert kinds and kinds[0]["group"] == "rope" and 0 < kinds[0]["share"] <= 1
    assert bis["ablation_passes"] < 2 + 2 * 8  # halving, not one pass per class and layer
    errs = pd.read_parquet(real_run_qwen3 / "compare/op_errors.parquet")
    before = errs[errs.exec_order < fd["exec_order"]]
    assert (before.bitwise_equal_frac == 1.0).all()
    # independently: the norm modules agree bitwise on the same input, the rotary embeddings do not
    assert engine_checks["direct_norm_equal"] is True
    assert engine_checks["direct_rope_equal"] is False and engine_checks["direct_rope_max_diff"] > 0


def _compare_and_bisect(tmp_path: Path, model: str, sampler_model: str) -> tuple[dict, dict]:
    out = tmp_path / "run"
    cli("compare", "--model", model, "--sampler-model", sampler_model, "--n", "1", "--max-tokens", "6",
        "--out", str(out), check=True)
    cli("bisect", str(out), check=True)
    return load_json(out / "bisect.json"), load_json(out / "compare/weight_parity.json")


@pytest.mark.parametrize(
    ("model", "sampler_plant", "learner_plant", "first", "top"),
    [
        # the sampler serves a checkpoint whose layer-0 input norm was scaled, and a deeper MLP weight
        ("tiny-qwen3", {"model.layers.0.input_layernorm.weight": 1.01, "model.layers.2.mlp.down_proj.weight": 1.05}, {},
         "0.input_norm", {"0.input_norm", "2.mlp.down"}),
        # both sides planted: the learner's k projection, the sampler's v projection
        ("tiny-llama", {"model.layers.0.self_attn.v_proj.weight": 1.05}, {"model.layers.0.self_attn.k_proj.weight": 1.05},
         "0.attn.k", {"0.attn.k", "0.attn.v"}),
    ],
)
def test_bisect_finds_planted_perturbations(tmp_path, model, sampler_plant, learner_plant, first, top):
    clean = resolve_model(model).path
    sampler = plant(clean, tmp_path / "sampler-planted", sampler_plant)
    learner = plant(clean, tmp_path / "learner-planted", learner_plant)
    bis, parity = _compare_and_bisect(tmp_path, str(learner), str(sampler))
    assert bis["first_divergent"]["bitwise"]["op"] == first
    ranked = [r["op"] for r in bis["local_errors"]]
    assert set(ranked[: len(top)]) == top, ranked[:5]
    # the pre-flight weight parity names exactly the planted parameters
    assert sorted(d["param"] for d in parity["differences"]) == sorted(sampler_plant | learner_plant)
