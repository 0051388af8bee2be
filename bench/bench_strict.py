"""Strict recipe on the learner side: batch invariance across micro-batch sizes, and the cost of
strict vs engine kernels for one forward pass.

    python bench/bench_strict.py [--device cpu|cuda] [--json OUT.json] [--reps N] [--big]

Invariance: 8 sequences of different lengths scored with micro-batch sizes 1, 2, 3, 4, 8 (right
padding, as HfLearner does); a sequence counts as invariant when its logprobs are bitwise equal
for every micro-batch size. Cost: median wall time of one teacher-forced forward (B x T tokens),
the engine's own kernels (sdpa, cuBLAS / oneDNN) vs the patched strict ops (CPU: fp32 trees;
CUDA: fixed-config Triton GEMM and RMSNorm, torch tree attention). ``--big`` adds a 1024-hidden,
8-layer random Qwen3 (built in memory). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import torch

from mismatch_probe.probes.hf.patch import patch, token_logprobs_fn
from mismatch_probe.probes.tiny_models import resolve_tiny_model

LENGTHS = (5, 9, 17, 23, 31, 12, 40, 7)
MBS = (1, 2, 3, 4, 8)


def _score(model: Any, seqs: list[list[int]], mbs: int, recipe: str | None, dev: str) -> list[torch.Tensor]:
    f = token_logprobs_fn(recipe)
    out: list[torch.Tensor] = []
    for i in range(0, len(seqs), mbs):
        chunk = seqs[i : i + mbs]
        w = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), w, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(chunk):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        with torch.inference_mode():
            lp = f(model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits, ids.to(dev))
        out.extend(lp[j, : len(s) - 1].cpu() for j, s in enumerate(chunk))
    return out


def invariance(model: Any, vocab: int, recipe: str | None, dev: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(8, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    ref = _score(model, seqs, 8, recipe, dev)
    ok = [True] * len(seqs)
    worst = 0.0
    for mbs in MBS:
        got = _score(model, seqs, mbs, recipe, dev)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            if not torch.equal(a, b):
                ok[i] = False
                worst = max(worst, float((a - b).abs().max()))
    return {"invariant_seqs": sum(ok), "n_seqs": len(seqs), "max_abs_dlogp_across_mbs": worst}


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def forward_ms(model: Any, vocab: int, b: int, t: int, reps: int, dev: str) -> float:
    ids = torch.randint(8, vocab, (b, t), generator=torch.Generator().manual_seed(1)).to(dev)
    times = []
    with torch.inference_mode():
        for i in range(reps + 2):
            _sync(dev)
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            _sync(dev)
            if i >= 2:  # warm-up (Triton compile, allocator)
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _big(dev: str) -> tuple[Any, int]:
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return m.to(dev).eval(), 32000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()
    dev = args.device
    import transformers

    models: list[tuple[str, Any, int, tuple[int, int]]] = []
    tiny = transformers.AutoModelForCausalLM.from_pretrained(resolve_tiny_model("tiny-qwen3"), dtype=torch.bfloat16,
                                                             attn_implementation="sdpa").to(dev).eval()
    models.append(("tiny-qwen3", tiny, 512, (8, 128)))
    if args.big:
        big, v = _big(dev)
        models.append(("qwen3-1024h-8L (random)", big, v, (8, 256)))
    rows = []
    for name, model, vocab, (b, t) in models:
        row: dict[str, Any] = {"model": name, "tokens": f"{b}x{t}"}
        row["engine_invariance"] = invariance(model, vocab, None, dev) if name == "tiny-qwen3" else None
        row["engine_ms"] = forward_ms(model, vocab, b, t, args.reps, dev)
        with patch(model, "strict"):
            row["strict_invariance"] = invariance(model, vocab, "strict", dev) if name == "tiny-qwen3" else None
            row["strict_ms"] = forward_ms(model, vocab, b, t, args.reps, dev)
        row["slowdown"] = row["strict_ms"] / row["engine_ms"]
        rows.append(row)
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(json.dumps(meta))
    mbs = ",".join(map(str, MBS))
    print(f"| model | tokens | engine invariant (mbs {mbs}) | strict invariant | engine ms | strict ms | strict/engine |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["model"], r["tokens"], _fmt(r["engine_invariance"]), _fmt(r["strict_invariance"])]
        cells += [f"{r['engine_ms']:.1f}", f"{r['strict_ms']:.1f}", f"{r['slowdown']:.1f}x"]
        print("| " + " | ".join(cells) + " |")


def _fmt(d: dict[str, Any] | None) -> str:
    return f"{d['invariant_seqs']}/{d['n_seqs']} (max {d['max_abs_dlogp_across_mbs']:.2e})" if d else "-"


if __name__ == "__main__":
    main()
