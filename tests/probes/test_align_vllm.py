"""Alignment against the real engines (vLLM on CPU in a fresh process per run, HF learner).

Acceptance 1: ``compare --align strict`` gives bitwise-equal logprobs (learner vs sampler prefill
and vs sampler decode) and bitwise-equal captured ops on tiny Llama, Qwen3 and Qwen3-MoE, with 8
sequences of different lengths generated in one batch. Acceptance 3 (sampler side): decode
logprobs equal prefill logprobs. Acceptance 2: the NVFP4 mismatch story. Acceptance 5 (sampler
side): the plugin puts vLLM's methods back exactly.

The runs are started once for the module, two engines at a time (vLLM serves with one thread).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from mp_forked import Forked, start
from mp_testlib import REPO, cli

pytestmark = pytest.mark.vllm

STRICT_MODELS = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2", "tiny-gemma3")
NVFP4 = {  # the bf16 `engine` baseline is conftest's shared tiny-qwen3 run (same defaults)
    "mismatched": ["--learner-recipe", "nvfp4-dynamic-tensor", "--sampler-recipe", "nvfp4-static"],
    "per-token": ["--recipe", "nvfp4-per-token"],
    "strict-per-token": ["--align", "strict", "--recipe", "nvfp4-per-token"],
}


def _specs(root: Path) -> dict[str, list[str]]:
    specs = {f"strict-{m}": ["--model", m, "--align", "strict", "--n", "1"] for m in STRICT_MODELS}
    for name, extra in NVFP4.items():
        # capture only layer 0 (cheap): enough for bisect to find the first quantized linear
        cap = ["--capture-rule", "embed=full", "--capture-rule", "0.*=full"] if name == "mismatched" else []
        specs[f"nvfp4-{name}"] = ["--model", "tiny-qwen3", "--capture", "off", *cap, *extra]
    return {k: ["compare", *v, "--out", str(root / k)] for k, v in specs.items()}


class Runs(dict):
    """run name -> run directory; a run that failed fails only the tests that use it."""

    failed: dict[str, str]

    def __missing__(self, name: str) -> Path:
        pytest.fail(f"compare run {name!r} failed:\n{self.failed.get(name, '(unknown run)')}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("align")
    todo = list(_specs(root).items())
    running: list[tuple[str, Forked]] = []
    failed: dict[str, str] = {}
    while todo or running:
        while todo and len(running) < 2:
            name, args = todo.pop(0)
            running.append((name, start(*args)))
        time.sleep(0.2)
        for item in list(running):
            name, proc = item
            if proc.poll() is not None:
                running.remove(item)
                done = proc.wait()
                if done.returncode != 0:
                    failed[name] = done.stderr[-3000:]
    out = Runs({name: root / name for name in _specs(root) if name not in failed})
    out.failed = failed
    return out


def _summary(run: Path) -> dict:
    return json.loads((run / "compare/summary.json").read_text())


def _max_gap(run: Path, pair: str) -> float:
    return _summary(run)["pairs"][pair]["max_abs_dlogp"]


@pytest.mark.parametrize("model", STRICT_MODELS)
def test_strict_bitwise_learner_equals_sampler_prefill_and_decode(runs: Runs, model: str) -> None:
    run = runs[f"strict-{model}"]
    s = _summary(run)
    assert s["n_sequences"] >= 8
    toks = pd.read_parquet(run / "sampler/tokens.parquet")
    lengths = toks[toks.source == "prefill"].groupby("seq_id").pos.max()
    assert lengths.nunique() > 1, "sequences of different lengths"
    for pair in ("learner_vs_prefill", "learner_vs_decode", "prefill_vs_decode"):
        assert s["pairs"][pair]["max_abs_dlogp"] == 0.0, (model, pair, s["pairs"][pair])
    m = json.loads((run / "manifest.json").read_text())
    assert m["config"]["align"] == "strict"
    assert m["config"]["recipes"] == {"learner": "strict", "sampler": "strict"}
    for side in ("learner", "sampler"):
        assert m["engines"][side]["recipe"]["name"] == "strict"
        assert m["engines"][side]["recipe"]["ops"]["attention"] == "strict"
    assert any("CPUAttentionBackendImpl.forward" in o for o in m["engines"]["sampler"]["recipe"]["plugin_overrides"])
    # where vLLM's CPU backend repacks its linear weights and drops them (its oneDNN path, on hosts whose ISA it
    # packs for), the recipes keep the loaded tensors ("own": no copy made); where it keeps them as loaded, the
    # recipes alias vLLM's own (as on CUDA: tests/gpu). Either way every linear has its weight, counted once
    w = m["engines"]["sampler"]["recipe"]["weights"]
    assert w["aliased"] + w["own"] > 4 and (w["own"] > 0) == (w["own_bytes"] > 0), w


@pytest.mark.parametrize("model", STRICT_MODELS)
def test_strict_bitwise_captured_ops_equal(runs: Runs, model: str) -> None:
    errs = runs[f"strict-{model}"] / "compare/op_errors.parquet"
    assert errs.exists(), "capture is on by default: a strict run without op_errors.parquet means capture broke"
    df = pd.read_parquet(errs)
    assert len(df) > 10
    bad = df[df.bitwise_equal_frac != 1.0]
    assert bad.empty, bad[["op", "bitwise_equal_frac", "max_abs_diff"]].to_string()




def assert_per_token_nvfp4_closes_gap(run: Path) -> None:
    """``--recipe nvfp4-per-token`` on both sides: exactly 0, learner vs sampler prefill, learner vs
    sampler decode and prefill vs decode (the NVFP4 recipes share the LM head and log-softmax too)."""
    pairs = _summary(run)["pairs"]
    for pair in ("learner_vs_prefill", "learner_vs_decode", "prefill_vs_decode"):
        assert pairs[pair]["max_abs_dlogp"] == 0.0, (pair, pairs[pair])


def test_topk_strict_alignment_exact_zero_kl(runs: Runs) -> None:
    """--topk 20 (the default with op capture on) on tiny Qwen3 under strict alignment: the learner's
    and the sampler's distributions are equal, so the top-K KL is exactly 0 and top-1 agreement and
    top-K overlap exactly 1; the learner's own top-K logprobs equal the sampler's, bitwise."""
    run = runs["strict-tiny-qwen3"]
    assert json.loads((run / "manifest.json").read_text())["config"]["topk_resolved"] == 20
    pairs = _summary(run)["pairs"]
    for pair in ("learner_vs_decode", "learner_vs_prefill", "prefill_vs_decode"):
        fv = pairs[pair]["full_vocab"]
        assert fv["n_positions"] == pairs[pair]["n_tokens"] > 0
        assert (fv["kl_fwd"], fv["kl_rev"], fv["top1_agree"], fv["topk_overlap"]) == (0.0, 0.0, 1.0, 1.0), (pair, fv)
    lrn = pd.read_parquet(run / "learner/tokens.parquet").set_index(["seq_id", "pos"])
    pre = pd.read_parquet(run / "sampler/tokens.parquet").query("source == 'prefill'").set_index(["seq_id", "pos"])
    for a, b in zip(lrn.loc[pre.index, "topk_logprobs"], pre["topk_logprobs"], strict=True):
        assert list(a) == list(b)


def test_nvfp4_story(runs: Runs, real_run_qwen3: Path) -> None:
    """dynamic-tensor (learner) vs static (sampler) >> bf16 engine baseline; per-token on both
    sides is exactly 0, and so is strict + per-token."""
    gap = {k: _summary(runs[f"nvfp4-{k}"])["pairs"]["learner_vs_prefill"] for k in NVFP4}
    gap["engine"] = _summary(real_run_qwen3)["pairs"]["learner_vs_prefill"]
    base, mis = gap["engine"]["mean_abs_dlogp"], gap["mismatched"]["mean_abs_dlogp"]
    assert mis > 10 * base, gap  # measured: about 50x
    assert_per_token_nvfp4_closes_gap(runs["nvfp4-per-token"])
    assert gap["strict-per-token"]["max_abs_dlogp"] == 0.0
    assert _max_gap(runs["nvfp4-strict-per-token"], "learner_vs_decode") == 0.0
    m = json.loads((runs["nvfp4-mismatched"] / "manifest.json").read_text())
    assert m["engines"]["learner"]["recipe"]["linear"] == "nvfp4-dynamic-tensor"
    assert m["engines"]["sampler"]["recipe"]["linear"] == "nvfp4-static"
    kernels = m["engines"]["learner"]["recipe"]["nvfp4_kernels"]  # which GEMM ran, per linear
    assert kernels and all(set(k["paths_used"]) == {"reference"} for k in kernels.values())  # CPU: the reference
    assert m["engines"]["learner"]["recipe"]["nvfp4_shared_inputs"] > 0  # q/k/v and gate/up: one quantization each
    sk = m["engines"]["sampler"]["recipe"]["nvfp4_kernels"]  # the sampler's linears too, by vLLM module name
    assert sk and all(set(k["paths_used"]) == {"reference"} for k in sk.values()), sk
    assert any(name.endswith("self_attn.qkv_proj") for name in sk) and any(name.endswith("mlp.down_proj") for name in sk)


def test_bisect_names_first_quantized_linear_and_its_reason(runs: Runs) -> None:
    """bisect on the mismatched NVFP4 run: the first divergent op is the first quantized linear,
    and the reason says how the two NVFP4 linears differ (scaling of activations and weights)."""
    run = runs["nvfp4-mismatched"]
    cli("bisect", str(run), "--no-replay", check=True)
    fd = json.loads((run / "bisect.json").read_text())["first_divergent"]
    assert fd["bitwise"]["op"] == "0.attn.q"  # norms, rope, attention are shared; q is the first NVFP4 linear
    r = fd["reason"]
    assert r["schemes"] == {"learner": "nvfp4-dynamic-tensor", "sampler": "nvfp4-static"}
    assert "activation scaling" in r["reason"] and r["activation_codes_differ_frac"] > 0
    assert r["rel_error_from_activation_scaling"] > 0


PLUGIN_RESTORE = r"""
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from importlib.metadata import entry_points
from mismatch_probe.probes.vllm import plugin as vp
assert any(e.value == "mismatch_probe.probes.vllm.plugin:register" for e in entry_points(group="vllm.general_plugins"))
targets = vp._targets()
before = {(c, a): c.__dict__.get(a) for c, a, _ in targets}
vp.register()  # no recipe requested: installs nothing
assert vp.installed() == []
# an engine worker process: the recipe comes through the environment variable and vLLM's own
# plugin loader (entry point group vllm.general_plugins), not through a call of ours
os.environ[vp.ENV] = "strict"
from vllm.plugins import load_general_plugins
load_general_plugins()
assert vp.active() is not None and vp.active().name == "strict" and len(vp.installed()) == len(targets)
vp.deactivate()
assert vp.installed() == [] and all(c.__dict__.get(a) is before[(c, a)] for c, a, _ in targets)
vp.activate("strict")
assert len(vp.installed()) == len(targets) and os.environ[vp.ENV] == "strict"
assert all(c.__dict__.get(a) is not before[(c, a)] for c, a, _ in targets)
vp.deactivate()
assert all(c.__dict__.get(a) is before[(c, a)] for c, a, _ in targets) and vp.ENV not in os.environ
print("ok", len(targets))
"""


def test_plugin_off_restores_vllm_methods_exactly() -> None:
    """Activation through the entry point with the recipe variable set (a fresh process), then
    deactivate puts vLLM's methods back exactly."""
    proc = subprocess.run([sys.executable, "-c", PLUGIN_RESTORE], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
