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
* ``speed8b`` / ``q8b`` (issue 28): vLLM generation on an 8B-shaped model (dummy weights), bf16 vs
  nvfp4-per-token, CUDA graphs on both, 16 and 64 x 256 tokens; ``compare --recipe nvfp4-per-token``
  in CUDA graphs on an 8B-shaped checkpoint (16 x 256 tokens: the logprobs vs the learner's).
* ``speed``: vLLM generation throughput on the 0.6B shape, 64 x 256 tokens (``ignore_eos``): the
  engine with CUDA graphs, the engine eager, strict eager, strict with CUDA graphs; and the HF
  learner forward (4 x 1,024 tokens), engine vs strict.

Each ``compare`` is timed from the call to its exit (the run on disk). Prints one table last, and
writes ``DIR/gpu_stack.json``.
"""

from __future__ import annotations

import argparse
import gc
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
Q8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
           num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, vocab_size=151936,
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

    cfg = Qwen3Config(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out, shape["vocab_size"])
    # give the weights' memory back to the driver: this process outlives the steps' `compare` processes, and
    # PyTorch's cache would keep the model's bytes reserved on the GPU under them (the 8B shape: 16 GiB, the
    # "Process ... has 16.00 GiB" of round 19's q8b OOM; the main holder was the sampler's engine, never
    # released under vLLM 0.26: probes/vllm/runner.py `_shut_down`, BENCHMARKS.md issue 28 round 22)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def save_tokenizer(out: Path, vocab: int) -> None:
    """The embedded tiny models' word-level tokenizer, widened to ``vocab`` ids, into ``out``."""
    from mismatch_probe.probes import tiny_models as tm

    old = tm.VOCAB_SIZE
    tm.VOCAB_SIZE = vocab
    try:
        tm._tokenizer("word").save_pretrained(out)
    finally:
        tm.VOCAB_SIZE = old


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
        # a row gather in both engines: bitwise in every run, the engine's included (an embed that
        # differs means the capture read a tensor the engine overwrote in place: OpRecorder.copy_on_record)
        out["embed_bitwise"] = bool((df[df.op == "embed"].bitwise_equal_frac == 1.0).all())
    except Exception as e:  # noqa: BLE001
        out["ops"] = f"no op errors: {type(e).__name__}"
    try:
        m = json.loads((run / "manifest.json").read_text())
        sm = m["engines"]["sampler"]
        out["sampler"] = {k: sm.get(k) for k in ("device", "enforce_eager", "attention_backend", "compilation_config")}
        ov = sm.get("recipe", {}).get("plugin_overrides") or []
        out["flash_attn_override"] = any("FlashAttentionImpl.forward" in o for o in ov)
        kern = sm.get("recipe", {}).get("kernels") or sm.get("nvfp4") or None
        if kern:
            out["sampler_kernels"] = str(kern)[:200]
        # which linears took their input's quantization from the op that produced it, per projection (summed
        # over layers; Python calls: graph replays are not counted)
        up: dict[str, int] = {}
        for lname, rec in (sm.get("recipe", {}).get("nvfp4_kernels") or {}).items():
            if isinstance(rec, dict) and "input_quantized_upstream" in rec:
                proj = str(lname).rsplit(".", 1)[-1]
                up[proj] = up.get(proj, 0) + int(rec["input_quantized_upstream"])
        if up:
            out["input_quantized_upstream"] = up
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
import hashlib, json, struct, sys, time
import torch
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from mismatch_probe.probes import engine_args as ea
if "switch" in cfg:  # an A/B arm (same bits): the engine in this process, where the module's switch is
    import importlib, os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    mod, attr, on = cfg["switch"]
    setattr(importlib.import_module(mod), attr, bool(on))
if cfg["recipe"] != "engine":
    from mismatch_probe.probes.vllm import plugin
    plugin.activate(cfg["recipe"])
kw = dict(model=cfg["model"], dtype="bfloat16", seed=0, max_model_len=1024, gpu_memory_utilization=cfg["mem"],
          enforce_eager=cfg["eager"], enable_prefix_caching=False, load_format=cfg["load"])
if ea.strict_attention_on_cuda(cfg["recipe"]):
    kw["attention_backend"] = "FLASH_ATTN"
comp = ea.recipe_graphs(kw, cfg["recipe"], on_cpu=False, moe=False)  # what the tool sets for a recipe in graphs
if comp is not None:
    kw["compilation_config"] = comp
t = time.time()
llm = LLM(**kw)
start = time.time() - t
sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0, logprobs=0)
llm.generate([TokensPrompt(prompt_token_ids=[1, 9, 10, 11])] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
res = {"start_s": start, "by_batch": {}}
for n in cfg["batches"]:
    prompts = [TokensPrompt(prompt_token_ids=[1] + [8 + (i * 7 + j) % 400 for j in range(32)]) for i in range(n)]
    # untimed: the same batch for 8 tokens first, so the timed call is the steady state of that shape (its
    # first prefill builds one-time state: the NVFP4 prefill operands, Triton specializations, graphs)
    torch.cuda.synchronize(); t = time.time()
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=0), use_tqdm=False)
    torch.cuda.synchronize(); warm = time.time() - t
    torch.cuda.synchronize(); t = time.time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize(); dt = time.time() - t
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    h = hashlib.sha1()
    for o in outs:
        c = o.outputs[0]
        h.update(struct.pack(f"{len(c.token_ids)}i", *c.token_ids))
        h.update(struct.pack(f"{len(c.token_ids)}d", *[c.logprobs[k][c.token_ids[k]].logprob for k in range(len(c.token_ids))]))
    res["by_batch"][str(n)] = {"tok_s": round(ntok / dt), "tokens": ntok, "seconds": round(dt, 2), "lp_sha1": h.hexdigest()[:12],
                               "warmup_8tok_s": round(warm, 2)}
print("SPEED", json.dumps(res))
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


def vllm_memory(log: str) -> dict[str, float]:
    """What vLLM's log says of memory: the model's weights at load (the recipes' load-time copies
    included) and the KV cache left after its profile run (everything the recipes allocate in a forward,
    the NVFP4 layouts included, is gone from it)."""
    import re

    out = {}
    for key, pat in (("weights_gib", r"Model loading took ([0-9.]+) GiB"),
                     ("kv_cache_gib", r"Available KV cache memory: ([0-9.]+) GiB"),
                     ("kv_cache_tokens", r"GPU KV cache size: ([0-9,]+) tokens")):
        m = re.search(pat, log)
        if m:
            out[key] = float(m.group(1).replace(",", ""))
    return out


SPEED_LOG_DIR: Path | None = None  # where each speed run's whole output goes (main: --out)


def vllm_speed(name: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", SPEED, json.dumps(cfg)], capture_output=True, text=True, timeout=timeout,
                           cwd=tempfile.gettempdir())
        if SPEED_LOG_DIR is not None:  # the engine's own output: the root cause of a failed start is not in the tail
            slug = "".join(c if c.isalnum() else "_" for c in name)[:80]
            (SPEED_LOG_DIR / f"speed_{slug}.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SPEED ")), None)
        info = json.loads(line[6:]) if line else {"error": (p.stderr or "")[-600:]}
        info.update(vllm_memory(p.stdout + p.stderr))
    except subprocess.TimeoutExpired:
        info = {"error": "timeout"}
    return row(step="speed", name=name, seconds=round(time.time() - t, 1), **info)


def step_speed(model: Path, timeout: float, mem: float) -> None:
    """0.6B shape, 64 x 256 generated tokens (greedy): vLLM's default (torch.compile + CUDA graphs)
    vs strict eager vs strict in the tool's recipe graphs (and nvfp4-per-token in graphs); the logprob
    digests say whether graphs and eager computed the same bits."""
    base = {"model": str(model), "mem": mem, "load": "auto", "batches": [64]}
    for recipe, eager in (("engine", False), ("strict", True), ("strict", False), ("nvfp4-per-token", False)):
        vllm_speed(f"vLLM generate 64x256 {recipe} {'eager' if eager else 'cuda graphs'}",
                   base | {"recipe": recipe, "eager": eager}, timeout)
    try:
        p = subprocess.run([sys.executable, "-c", LEARNER, str(model)], capture_output=True, text=True, timeout=timeout,
                           cwd=tempfile.gettempdir())
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("LEARNER ")), None)
        info = json.loads(line[8:]) if line else {"error": (p.stderr or "")[-400:]}
    except subprocess.TimeoutExpired:
        info = {"error": "timeout"}
    if "engine" in info:
        info = {"engine_ms": round(info["engine"] * 1e3, 1), "strict_ms": round(info["strict"] * 1e3, 1),
                "strict_over_engine": round(info["strict"] / info["engine"], 2)}
    row(step="speed", name="HF learner forward 4x1024, median of 5", **info)


RECIPES_8B = ("engine", "nvfp4-per-token")  # --speed8b-recipes' default
# RECIPE@AB: the module switch the engine process sets (module, attribute) and the two arms' names (on, off)
_NV = "mismatch_probe.kernels.nvfp4"
AB = {"fuse-ab": (f"{_NV}.fused_input", "ENABLED", ("fused quant on", "fused quant off")),
      "shards-ab": (f"{_NV}.native", "GROUP_SHARDS", ("shards one launch", "shards one launch each")),
      "reduce-ab": (f"{_NV}.tc_linear", "SHARD_REDUCE", ("shards' reduces one launch", "shards' reduces one launch each")),
      "chunks-ab": (f"{_NV}.fused_input", "CHUNKED", ("producers in chunks of a row", "producers a program per row"))}


def step_speed8b(out: Path, timeout: float, mem: float, recipes: tuple[str, ...] = RECIPES_8B) -> None:
    """Issue 28: a Qwen3-8B-shaped model (vLLM's seeded dummy weights), 16 and 64 sequences x 256
    generated tokens, CUDA graphs on both: vLLM's default bf16 vs nvfp4-per-token (the tool's recipe graphs)."""
    model = out / "q8b"
    model.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        from transformers import Qwen3Config

        # the architecture named, as save_pretrained of a model writes it: without it vLLM 0.26 builds a
        # non-generative runner (LLM.generate refused) and downgrades the recipe's full decode graphs
        Qwen3Config(**Q8B, torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"]).save_pretrained(model)
        save_tokenizer(model, Q8B["vocab_size"])
    base = {"model": str(model), "mem": mem, "load": "dummy", "batches": [16, 64], "eager": False}
    for recipe in recipes:
        name, _, ab = recipe.partition("@")
        if ab:  # an A/B of one switch (same bits), the engine in this process: on, then off
            mod, attr, what = AB[ab]
            for on in (True, False):
                vllm_speed(f"vLLM generate 8B shape 16/64x256 {name} cuda graphs, in-process engine, {what[not on]}",
                           base | {"recipe": name, "switch": [mod, attr, on]}, timeout)
            continue
        vllm_speed(f"vLLM generate 8B shape 16/64x256 {recipe} cuda graphs", base | {"recipe": recipe}, timeout)


Q06B_RUNS = {
    "engine": [],
    "strict": ["--align", "strict"],
    "nvfp4-per-token": ["--recipe", "nvfp4-per-token"],
    "mismatched": ["--learner-recipe", "nvfp4-dynamic-tensor", "--sampler-recipe", "nvfp4-static", "--capture", "off"],
    # the recipes in CUDA graphs (the tool's full decode graphs, no torch.compile): capture must be off
    "strict-graphs": ["--align", "strict", "--capture", "off", "--sampler-arg", "enforce_eager=false"],
    "nvfp4-graphs": ["--recipe", "nvfp4-per-token", "--capture", "off", "--sampler-arg", "enforce_eager=false"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="tiny,q06b,bisect,speed", help="steps: tiny, q06b, bisect, speed, speed8b, q8b")
    ap.add_argument("--q06b", default="engine,strict,nvfp4-per-token,mismatched,strict-graphs,nvfp4-graphs",
                    help=f"which 0.6B compare runs: {', '.join(Q06B_RUNS)}")
    ap.add_argument("--tiny-models", default=",".join(TINY))
    ap.add_argument("--mem", type=float, default=0.5, help="vLLM gpu_memory_utilization (lower: two copies side by side)")
    ap.add_argument("--speed8b-recipes", default=",".join(RECIPES_8B), help="speed8b: which runs (engine, nvfp4-per-token; "
                    "RECIPE@fuse-ab: the recipe with the producers' fused quantization on, then off, engine in-process; "
                    "RECIPE@shards-ab: a fused layer's shards in one decode launch, then one each, in-process; "
                    "RECIPE@reduce-ab: the shards' K-segment reduces in one launch, then one each, in-process; "
                    "RECIPE@chunks-ab: the fused producers in chunks of a row, then a program per row, in-process)")
    ap.add_argument("--wait", type=float, default=0.0,
                    help="bisect: wait up to this many seconds for the 0.6B runs (written by another copy of this script)")
    ap.add_argument("--tag", default="gpu_stack", help="name of the JSON written into --out")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; later steps are skipped past it")
    ap.add_argument("--tiny", action="store_true", help="dry run on the CPU: tiny-qwen3 stands in for the 0.6B shape")
    args = ap.parse_args()
    global SPEED_LOG_DIR
    args.out = args.out.resolve()
    steps = set(args.only.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    SPEED_LOG_DIR = args.out
    runs = args.out / "runs"
    runs.mkdir(exist_ok=True)
    mem = [] if args.mem == 0.5 else ["--sampler-arg", f"gpu_memory_utilization={args.mem}"]

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
        for m in ["tiny-qwen3"] if args.tiny else args.tiny_models.split(","):
            if left() > 30:
                step_compare(f"{m}-strict", m, ["--align", "strict", "--n", "1", *mem], runs, min(240, left()))
    if args.tiny:
        model, gen = "tiny-qwen3", ["--n", "2", "--max-tokens", "16"]
    else:
        model = str(build_model(args.out / "q06b", Q06B)) if go("q06b") or go("speed") else ""
        gen = ["--n", "2", "--max-tokens", "256", "--prompts", str(prompts_file(args.out / "prompts.jsonl", 32, 151936))]
    if go("q06b"):
        for name in args.q06b.split(","):
            extra = Q06B_RUNS[name]
            if args.tiny and "enforce_eager=false" in extra:
                continue  # no CUDA graphs on the CPU (a one-line refusal, tested in tests/probes)
            if left() > 40:
                step_compare(f"q06b-{name}", model, gen + extra + mem, runs, min(300, left()))
    if go("bisect"):
        for name, extra, limit in (("q06b-engine", ["--ablation-seqs", "8"], 300), ("q06b-strict", ["--no-ablation"], 200)):
            t = time.time()
            while not (runs / name / "manifest.json").exists() and time.time() - t < args.wait and left() > 60:
                time.sleep(5)
            if (runs / name / "manifest.json").exists() and left() > 40:
                step_bisect(f"bisect {name}", runs / name, extra, min(limit, left()))
            else:
                row(step="bisect", name=f"bisect {name}", result=f"no run {name}")
    if go("speed") and not args.tiny:
        step_speed(Path(model), min(200, left()), args.mem)
    if go("speed8b") and not args.tiny:
        step_speed8b(args.out, min(300, left()), args.mem, tuple(r for r in args.speed8b_recipes.split(",") if r))
    if go("q8b") and not args.tiny:  # issue 28: the sampler's NVFP4 logprobs == the learner's on the 8B shape
        m8 = build_model(args.out / "q8b-ckpt", Q8B)
        step_compare("q8b-nvfp4-graphs", str(m8), ["--n", "1", "--max-tokens", "256", "--prompts",
                                                   str(prompts_file(args.out / "prompts16.jsonl", 16, 151936)),
                                                   *Q06B_RUNS["nvfp4-graphs"], *mem], runs, min(400, left()))
    (args.out / f"{args.tag}.json").write_text(json.dumps(ROWS, indent=1, default=str))
    print("\n| step | name | result |\n|---|---|---|")
    for r in ROWS:
        rest = {k: v for k, v in r.items() if k not in ("step", "name")}
        print(f"| {r['step']} | {r['name']} | {json.dumps(rest, default=str)} |")


if __name__ == "__main__":
    main()
