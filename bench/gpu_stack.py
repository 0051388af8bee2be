"""The GPU stack as a user runs it: CUDA vLLM + the HF learner on one GPU, every step through the CLI.

    python bench/gpu_stack.py --out DIR [--only tiny,q06b,bisect,speed] [--budget SECONDS] [--tiny]

Run on the GPU machine after the CUDA vLLM bundle is installed (``. /tmp/site/mp-env.sh``; see
docs/gpu.md). Steps, in order (``--only`` picks some; each is skipped once ``--budget`` seconds have
passed, so the table always comes out). The kernel-level check (the strict attention kernel over
vLLM's paged cache vs the learner's call, bitwise) is a gpu-marked test: ``bash bench/gpu_tests.sh``
(``tests/gpu/test_gpu_stack.py``).

* ``tiny``: ``compare --align strict`` on tiny-qwen3, tiny-llama, tiny-qwen3-moe, tiny-gemma3.
* ``q06b``: a Qwen3-0.6B-shaped random model (28 layers, hidden 1024, vocab 151,936, a word-level
  tokenizer over the whole vocabulary), 32 prompts x ``--n 2`` x 256 generated tokens (64 sequences):
  ``compare`` with the engine recipe, ``--align strict``, ``--recipe nvfp4-per-token``, and
  ``--learner-recipe nvfp4-dynamic-tensor --sampler-recipe nvfp4-static``.
* ``bisect``: ``bisect`` (with ablation) on the 0.6B engine run, ``bisect --no-ablation`` on the strict run.
* ``speed``: vLLM generation throughput on the 0.6B shape, 64 x 256 tokens (``ignore_eos``): the
  engine with CUDA graphs, the engine eager, strict eager, strict with CUDA graphs; and the HF
  learner forward (4 x 1,024 tokens), engine vs strict.

Each ``compare`` is timed from the call to its exit (the run on disk). Prints one table last, and
writes ``DIR/gpu_stack.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

Q06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936,
            max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
TINY = ("tiny-qwen3", "tiny-llama", "tiny-qwen3-moe", "tiny-gemma3")
ROWS: list[dict[str, Any]] = []
T0 = time.time()


def row(**kw: Any) -> dict[str, Any]:
    ROWS.append(kw)
    print("ROW", json.dumps(kw, default=str), flush=True)
    return kw


def build_model(out: Path, shape: dict[str, Any]) -> Path:
    """A Qwen3 model of ``shape`` with seeded random bf16 weights and a word tokenizer over its vocabulary."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mismatch_probe.probes import tiny_models as tm

    cfg = Qwen3Config(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    old = tm.VOCAB_SIZE
    tm.VOCAB_SIZE = shape["vocab_size"]
    try:
        tm._tokenizer("word").save_pretrained(out)
    finally:
        tm.VOCAB_SIZE = old
    return out


def prompts_file(out: Path, n: int, vocab: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = [json.dumps({"prompt_token_ids": [1] + [rng.randrange(8, min(vocab, 500)) for _ in range(rng.randrange(8, 64))]})
             for _ in range(n)]
    out.write_text("\n".join(lines) + "\n")
    return out


def cli(name: str, args: list[str], timeout: float) -> tuple[int, float, str]:
    t = time.time()
    try:
        # cwd outside any checkout: the writer subprocess (python -m ...) must import the installed package
        p = subprocess.run(["mismatch-probe", *args], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "COLUMNS": "200"}, cwd=tempfile.gettempdir())
        rc, err = p.returncode, (p.stderr or "")[-2500:]
    except subprocess.TimeoutExpired:
        rc, err = 124, "timeout"
    dt = time.time() - t
    if rc != 0:
        print(f"--- {name} rc={rc}\n{err}", flush=True)
    return rc, dt, err


def summarize_run(run: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        s = json.loads((run / "compare/summary.json").read_text())
        for pair in ("learner_vs_decode", "learner_vs_prefill", "prefill_vs_decode"):
            p = s["pairs"].get(pair)
            if p:
                out[pair] = f"{p['mean_abs_dlogp']:.2e}/{p['max_abs_dlogp']:.2e}"
        out["n_seq"] = s.get("n_sequences")
    except Exception as e:  # noqa: BLE001 - a missing piece is a finding, shown in the table
        out["summary"] = f"unreadable: {e}"
    try:
        import pandas as pd

        df = pd.read_parquet(run / "compare/op_errors.parquet")
        out["ops"] = len(df)
        out["ops_not_bitwise"] = int((df.bitwise_equal_frac != 1.0).sum())
        bad = df[df.bitwise_equal_frac != 1.0]
        if len(bad):
            out["first_bad_ops"] = list(bad.op)[:4]
    except Exception as e:  # noqa: BLE001
        out["ops"] = f"no op errors: {type(e).__name__}"
    try:
        m = json.loads((run / "manifest.json").read_text())
        sm = m["engines"]["sampler"]
        out["sampler"] = {k: sm.get(k) for k in ("device", "enforce_eager", "attention_backend")}
        ov = sm.get("recipe", {}).get("plugin_overrides") or []
        out["flash_attn_override"] = any("FlashAttentionImpl.forward" in o for o in ov)
        kern = sm.get("recipe", {}).get("kernels") or sm.get("nvfp4") or None
        if kern:
            out["sampler_kernels"] = str(kern)[:200]
    except Exception as e:  # noqa: BLE001
        out["manifest"] = f"unreadable: {e}"
    return out


def step_compare(name: str, model: str, extra: list[str], runs: Path, timeout: float) -> Path:
    run = runs / name
    rc, dt, err = cli(name, ["compare", "--model", model, "--out", str(run), "--overwrite", *extra], timeout)
    info = summarize_run(run) if rc == 0 else {"error": err.strip().splitlines()[-1:] if err else ""}
    row(step="compare", name=name, rc=rc, seconds=round(dt, 1), **info)
    return run


def step_bisect(name: str, run: Path, extra: list[str], timeout: float) -> None:
    rc, dt, err = cli(name, ["bisect", str(run), *extra], timeout)
    info: dict[str, Any] = {}
    if rc == 0:
        b = json.loads((run / "bisect.json").read_text())
        fd = b["first_divergent"]["bitwise"]
        info["first_not_bitwise"] = fd["op"] if fd else None
        le = b.get("local_errors") or []
        att = [r for r in le if r["op"].endswith("attn.core")]
        info["replayed_ops"] = len(le)
        info["attn_core_local_error"] = [f"{r['op']}:{r['local_error']:.2e}" for r in att[:3]]
        info["top_local"] = [f"{r['op']}:{r['local_error']:.2e}" for r in le[:3]]
        info["ablation_top"] = [f"{r['group']}:{r['share']:.0%}" for r in (b.get("ablation") or [])[:3]]
        info["replay_failures"] = list((b.get("replay_failures") or {}).items())[:2]
    else:
        info["error"] = err.strip().splitlines()[-1:] if err else ""
    row(step="bisect", name=name, rc=rc, seconds=round(dt, 1), **info)


SPEED = r'''
import json, sys, time
import torch
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if cfg["recipe"] != "engine":
    from mismatch_probe.probes.vllm import plugin
    plugin.activate(cfg["recipe"])
kw = dict(model=cfg["model"], dtype="bfloat16", seed=0, max_model_len=1024, gpu_memory_utilization=0.5,
          enforce_eager=cfg["eager"], enable_prefix_caching=False)
if cfg["recipe"] != "engine":
    kw["attention_backend"] = "FLASH_ATTN"
llm = LLM(**kw)
prompts = [TokensPrompt(prompt_token_ids=[1] + [8 + (i * 7 + j) % 400 for j in range(32)]) for i in range(64)]
sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=1.0, seed=0, logprobs=0)
llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)
torch.cuda.synchronize(); t = time.time()
outs = llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize(); dt = time.time() - t
n = sum(len(o.outputs[0].token_ids) for o in outs)
lp = [o.outputs[0].logprobs[k][o.outputs[0].token_ids[k]].logprob for o in outs[:2] for k in range(4)]
print("SPEED", json.dumps({"tok_s": n / dt, "tokens": n, "seconds": dt, "lp": lp}))
'''

LEARNER = r'''
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
from mismatch_probe.probes.hf.patch import patch
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).cuda().eval()
ids = torch.randint(8, 400, (4, 1024), device="cuda")
res = {}
for label in ("engine", "strict"):
    h = patch(model, label) if label != "engine" else None
    with torch.inference_mode():
        model(ids)
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            t = time.time(); model(ids); torch.cuda.synchronize(); ts.append(time.time() - t)
    if h is not None:
        h.undo()
    res[label] = sorted(ts)[2]
print("LEARNER", json.dumps(res))
'''


def step_speed(model: Path, timeout: float) -> None:
    for recipe, eager in (("engine", False), ("engine", True), ("strict", True), ("strict", False)):
        cfg = json.dumps({"model": str(model), "recipe": recipe, "eager": eager})
        t = time.time()
        try:
            p = subprocess.run([sys.executable, "-c", SPEED, cfg], capture_output=True, text=True, timeout=timeout)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SPEED ")), None)
            info = json.loads(line[6:]) if line else {"error": (p.stderr or "")[-400:]}
        except subprocess.TimeoutExpired:
            info = {"error": "timeout"}
        row(step="speed", name=f"vLLM generate 64x256 {recipe} {'eager' if eager else 'cuda graphs'}",
            seconds=round(time.time() - t, 1), **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in info.items()})
    try:
        p = subprocess.run([sys.executable, "-c", LEARNER, str(model)], capture_output=True, text=True, timeout=timeout)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("LEARNER ")), None)
        info = json.loads(line[8:]) if line else {"error": (p.stderr or "")[-400:]}
    except subprocess.TimeoutExpired:
        info = {"error": "timeout"}
    if "engine" in info:
        info = {"engine_ms": round(info["engine"] * 1e3, 1), "strict_ms": round(info["strict"] * 1e3, 1),
                "strict_over_engine": round(info["strict"] / info["engine"], 2)}
    row(step="speed", name="HF learner forward 4x1024, median of 5", **info)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="tiny,q06b,bisect,speed")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later steps are skipped past it")
    ap.add_argument("--tiny", action="store_true", help="dry run on the CPU: tiny-qwen3 stands in for the 0.6B shape")
    args = ap.parse_args()
    args.out = args.out.resolve()
    steps = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.out / "runs"
    runs.mkdir(exist_ok=True)

    def left() -> float:
        return args.budget - (time.time() - T0)

    def go(step: str) -> bool:
        if step not in steps:
            return False
        if left() < 20:
            row(step=step, name="skipped: budget spent")
            return False
        return True

    if go("tiny"):
        for m in TINY[:1] if args.tiny else TINY:
            if left() > 30:
                step_compare(f"{m}-strict", m, ["--align", "strict", "--n", "1"], runs, min(240, left()))
    if args.tiny:
        model, gen = "tiny-qwen3", ["--n", "2", "--max-tokens", "16"]
    else:
        model = str(build_model(args.out / "q06b", Q06B)) if go("q06b") or go("speed") or go("bisect") else ""
        gen = ["--n", "2", "--max-tokens", "256", "--prompts", str(prompts_file(args.out / "prompts.jsonl", 32, 151936))]
    if go("q06b"):
        for name, extra in (("q06b-engine", []), ("q06b-strict", ["--align", "strict"]),
                            ("q06b-nvfp4-per-token", ["--recipe", "nvfp4-per-token"]),
                            ("q06b-nvfp4-mismatched", ["--learner-recipe", "nvfp4-dynamic-tensor", "--sampler-recipe",
                                                       "nvfp4-static", "--capture", "off"])):
            if left() > 40:
                step_compare(name, model, gen + extra, runs, min(300, left()))
    if go("bisect"):
        if (runs / "q06b-engine/manifest.json").exists() and left() > 40:
            step_bisect("bisect q06b-engine", runs / "q06b-engine", ["--ablation-seqs", "8"], min(300, left()))
        if (runs / "q06b-strict/manifest.json").exists() and left() > 40:
            step_bisect("bisect q06b-strict", runs / "q06b-strict", ["--no-ablation"], min(200, left()))
    if go("speed") and not args.tiny:
        step_speed(Path(model), min(200, left()))
    (args.out / "gpu_stack.json").write_text(json.dumps(ROWS, indent=1, default=str))
    print("\n| step | name | result |\n|---|---|---|")
    for r in ROWS:
        rest = {k: v for k, v in r.items() if k not in ("step", "name")}
        print(f"| {r['step']} | {r['name']} | {json.dumps(rest, default=str)} |")


if __name__ == "__main__":
    main()
