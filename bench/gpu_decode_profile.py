"""Where a vLLM decode step goes: the device kernels of generation on an 8B-shaped model, per recipe.

    python bench/gpu_decode_profile.py --out DIR [--recipes engine,nvfp4-per-token] [--seqs 16] [--eager]

Run on the GPU machine after the CUDA vLLM bundle is installed (``. /tmp/site/mp-env.sh``). Each recipe
in its own process (vLLM in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so ``torch.profiler`` sees
the engine's kernels, those replayed from CUDA graphs included): a Qwen3-8B-shaped model with vLLM's
dummy weights, ``--seqs`` sequences x 64 generated tokens after an untimed warm-up, CUDA graphs on as
the speed bench runs them (``--eager``: off). Prints, per recipe, the wall time per generated step and
the device time per step by kernel (top 25, grouped by name), the host's self time per step by event
(top 15: ATen ops, CUDA runtime calls), the prefill alone (a 1-token generate), then a side-by-side table last.
A diagnostic (the profiler's overhead is in the wall time); the figures of record are gpu_stack's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
cfg = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from mismatch_probe.probes import engine_args as ea
if cfg["recipe"] != "engine":
    from mismatch_probe.probes.vllm import plugin
    plugin.activate(cfg["recipe"])
kw = dict(model=cfg["model"], dtype="bfloat16", seed=0, max_model_len=1024, gpu_memory_utilization=0.85,
          enforce_eager=cfg["eager"], enable_prefix_caching=False, load_format="dummy")
if ea.strict_attention_on_cuda(cfg["recipe"]):
    kw["attention_backend"] = "FLASH_ATTN"
comp = ea.recipe_graphs(kw, cfg["recipe"], on_cpu=False, moe=False)
if comp is not None:
    kw["compilation_config"] = comp
llm = LLM(**kw)
steps = 64
sp = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0, logprobs=0)
prompts = [TokensPrompt(prompt_token_ids=[1] + [8 + (i * 7 + j) % 400 for j in range(32)]) for i in range(cfg["seqs"])]
llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize(); t = time.time()
llm.generate(prompts, sp, use_tqdm=False)
torch.cuda.synchronize(); plain = (time.time() - t) / steps
one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, logprobs=0)
llm.generate(prompts, one, use_tqdm=False)
torch.cuda.synchronize(); t = time.time()
llm.generate(prompts, one, use_tqdm=False)  # the prefill and one sampled token: the step time without it
torch.cuda.synchronize(); prefill = time.time() - t
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    torch.cuda.synchronize(); t = time.time()
    llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize(); wall = (time.time() - t) / steps
by = {}
for ev in prof.key_averages():
    dt = getattr(ev, "device_time_total", None)
    if dt is None:
        dt = getattr(ev, "cuda_time_total", 0)
    if dt and ev.key and not ev.key.startswith(("cudaGraphLaunch", "ProfilerStep")) and ev.device_type.name == "CUDA":
        by[ev.key] = (dt / steps, ev.count / steps)
tot = sum(v[0] for v in by.values())
host = {}  # host-side events (ATen ops, CUDA runtime calls): self CPU time per step
for ev in prof.key_averages():
    if ev.device_type.name == "CPU" and ev.key and ev.self_cpu_time_total:
        host[ev.key] = (ev.self_cpu_time_total / steps, ev.count / steps)
print("PROFILE", json.dumps({"wall_ms_per_step": plain * 1e3, "profiled_wall_ms_per_step": wall * 1e3,
                             "prefill_and_one_token_ms": prefill * 1e3,
                             "decode_wall_ms_per_step": (plain * steps - prefill) / (steps - 1) * 1e3,
                             "device_ms_per_step": tot / 1e3,
                             "host_self_us": sorted(([k, v[0], v[1]] for k, v in host.items()), key=lambda r: -r[1])[:30],
                             "kernels": sorted(([k, v[0], v[1]] for k, v in by.items()), key=lambda r: -r[1])[:40]}))
'''


def build(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_stack import Q8B, save_tokenizer
    from transformers import Qwen3Config

    model = out / "q8b"
    model.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        Qwen3Config(**Q8B, torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"]).save_pretrained(model)
        save_tokenizer(model, Q8B["vocab_size"])
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipes", default="engine,nvfp4-per-token")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = build(args.out)
    res = {}
    for recipe in args.recipes.split(","):
        cfg = {"model": str(model), "recipe": recipe, "seqs": args.seqs, "eager": args.eager}
        try:
            p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True,
                               timeout=args.timeout, cwd=tempfile.gettempdir())
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PROFILE ")), None)
            res[recipe] = json.loads(line[8:]) if line else {"error": (p.stderr or "")[-1500:]}
        except subprocess.TimeoutExpired:
            res[recipe] = {"error": "timeout"}
        (args.out / "decode_profile.json").write_text(json.dumps(res, indent=1))
        r = res[recipe]
        print(f"\n## {recipe}, {args.seqs} seqs, {'eager' if args.eager else 'cuda graphs'}", flush=True)
        if "error" in r:
            print(r["error"])
            continue
        print(f"wall {r['wall_ms_per_step']:.2f} ms/step (profiled {r['profiled_wall_ms_per_step']:.2f}), "
              f"device {r['device_ms_per_step']:.2f} ms/step; prefill + 1 token {r['prefill_and_one_token_ms']:.1f} ms, "
              f"decode alone {r['decode_wall_ms_per_step']:.2f} ms/step")
        print("| host self us/step | calls/step | host event |\n|---:|---:|---|")
        for name, us, cnt in r["host_self_us"][:15]:
            print(f"| {us:.1f} | {cnt:.1f} | {name[:110]} |")
        print("| us/step | launches/step | kernel |\n|---:|---:|---|")
        for name, us, cnt in r["kernels"][:25]:
            print(f"| {us:.1f} | {cnt:.1f} | {name[:110]} |")
    print("\n| recipe | wall ms/step | decode alone ms/step | prefill + 1 token ms | device ms/step |\n|---|---:|---:|---:|---:|")
    for recipe, r in res.items():
        if "error" not in r:
            print(f"| {recipe} | {r['wall_ms_per_step']:.2f} | {r['decode_wall_ms_per_step']:.2f} | "
                  f"{r['prefill_and_one_token_ms']:.1f} | {r['device_ms_per_step']:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
