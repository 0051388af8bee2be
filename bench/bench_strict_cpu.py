"""Strict on the CPU at user scale: ``compare`` vs ``compare --align strict``, and ``bisect`` with
ablation on a planted perturbation, on a >=100M-parameter random-weight model built in-process.

    python bench/bench_strict_cpu.py [--workdir DIR] [--skip-bisect] [--json OUT.json]

Model: Qwen3 config, hidden 768, 12 layers, 12 heads x 64 (4 KV heads), intermediate 3072, the
embedded 512-word tokenizer: 105M parameters, seeded random weights (bf16). Runs (subprocesses,
as a user would run them, default prompts: 8 prompts x 2 samples = 16 sequences, 16 tokens):

1. ``compare`` (engine kernels) and ``compare --align strict``: wall time each, the strict run's
   max |dlogp| per pair and the number of captured ops not bitwise equal.
2. Planted perturbation: the sampler's checkpoint gets layer ``PLANT``'s ``post_attention_layernorm``
   weight scaled by 1.05; ``compare --sampler-model`` then ``bisect`` (replay + ablation): wall time,
   the top local-error op and the top ablation layer.
Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PLANT = 5


def build(out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    from mismatch_probe.probes.tiny_models import MAX_POSITIONS, VOCAB_SIZE, _tokenizer

    if (out / "config.json").exists():
        return out
    cfg = transformers.Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                   num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                                   max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   tie_word_embeddings=False, initializer_range=0.04, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(torch.bfloat16)
    with torch.no_grad():  # random norm weights, so every layer's norms matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    _tokenizer().save_pretrained(out)
    return out


def plant(src: Path, out: Path) -> Path:
    """A copy of ``src`` with layer PLANT's post-attention norm weight scaled by 1.05."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (out / "config.json").exists():
        return out
    shutil.copytree(src, out)
    f = out / "model.safetensors"
    sd = load_file(f)
    key = f"model.layers.{PLANT}.post_attention_layernorm.weight"
    sd[key] = (sd[key].float() * 1.05).to(sd[key].dtype)
    save_file(sd, f, metadata={"format": "pt"})
    return out


def _cli(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mismatch_probe", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mismatch-probe {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-bisect", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import pandas as pd
    import torch

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-strict-cpu-"))
    model = build(work / "qwen3-105m")
    n_params = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        model / "model.safetensors").values())
    res: dict[str, Any] = {"model": "qwen3 768h 12L (random)", "params": n_params}
    res["engine_s"] = _cli("compare", "--model", str(model), "--out", str(work / "engine"), "--overwrite")
    res["strict_s"] = _cli("compare", "--model", str(model), "--align", "strict", "--out", str(work / "strict"), "--overwrite")
    s = json.loads((work / "strict/compare/summary.json").read_text())
    res["strict_pairs_max"] = {k: v["max_abs_dlogp"] for k, v in s["pairs"].items()}
    errs = pd.read_parquet(work / "strict/compare/op_errors.parquet")
    res["strict_ops"], res["strict_ops_not_equal"] = len(errs), int((errs.bitwise_equal_frac != 1.0).sum())
    res["n_sequences"] = s["n_sequences"]
    if not args.skip_bisect:
        bad = plant(model, work / "qwen3-105m-planted")
        res["planted_compare_s"] = _cli("compare", "--model", str(model), "--sampler-model", str(bad),
                                        "--out", str(work / "planted"), "--overwrite")
        res["bisect_s"] = _cli("bisect", str(work / "planted"))
        b = json.loads((work / "planted/bisect.json").read_text())
        res["bisect_top_local"] = b["local_errors"][0]["op"] if b.get("local_errors") else None
        res["bisect_ablation"] = [r["group"] for r in b.get("ablation", [])][:3]
        res["bisect_dominant"] = (b["first_divergent"].get("dominant") or {}).get("op")
        res["bisect_first_bitwise"] = (b["first_divergent"].get("bitwise") or {}).get("op")
        core = [r for r in b.get("local_errors", []) if r["kind"] == "attn.core"]
        res["attn_core_local_error"] = {r["op"]: r["local_error"] for r in core}
        res["attn_core_reverse_local_error"] = {r["op"]: r["reverse_local_error"] for r in core}
        res["bisect_top3_local"] = [(r["op"], r["local_error"]) for r in b.get("local_errors", [])[:3]]
        res["ablation_passes"] = b.get("ablation_passes")
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "workdir": str(work)}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "result": res}, indent=1))
    print(json.dumps(meta))
    print(json.dumps(res, indent=1))
    print("| model | params | compare s | compare --align strict s | ratio | strict max |dlogp| (all pairs) | ops not equal |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {res['model']} | {n_params / 1e6:.0f}M | {res['engine_s']:.1f} | {res['strict_s']:.1f} | "
          f"{res['strict_s'] / res['engine_s']:.2f}x | {max(res['strict_pairs_max'].values()):.1e} | "
          f"{res['strict_ops_not_equal']}/{res['strict_ops']} |")
    if "bisect_s" in res:
        core = res["attn_core_local_error"]
        span = f"{min(core.values()):.2e}..{max(core.values()):.2e} over {len(core)} layers" if core else "not replayed"
        print(f"bisect (planted {PLANT}.post_attn_norm): {res['bisect_s']:.1f} s; top local error {res['bisect_top_local']}; "
              f"ablation {res['bisect_ablation']} ({res['ablation_passes']} passes); first not bitwise equal "
              f"{res['bisect_first_bitwise']}; dominant divergence {res['bisect_dominant']}; attn.core local error {span}")


if __name__ == "__main__":
    main()
