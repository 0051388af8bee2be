"""Strict recipe on the learner side: batch invariance across micro-batch sizes, and the cost of
strict vs engine kernels for one forward pass (prefill and decode shapes).

    python bench/bench_strict.py [--device cpu|cuda] [--models tiny,0.6b,8b] [--json OUT.json] [--reps N] [--kernels]

Models: ``tiny`` (the embedded tiny-qwen3), ``0.6b`` (Qwen3-0.6B-shaped: 28 layers, hidden 1024,
16 x 128 heads, 8 KV heads, intermediate 3072, vocab 151,936) and ``8b`` (Qwen3-8B-shaped: 36
layers, hidden 4096, 32 x 128 heads, 8 KV heads, intermediate 12,288, vocab 151,936), random bf16
weights built in memory on the device.

Invariance: 8 sequences of different lengths scored with micro-batch sizes 1, 2, 3, 4, 8 (right
padding, as HfLearner does); a sequence counts as invariant when its token logprobs are bitwise
equal (``torch.equal``) for every micro-batch size. Cost: median wall time of one teacher-forced
forward (prefill, B x T tokens) and of one decode step (B sequences, 1 new token each over a KV
cache of T), engine kernels (sdpa, cuBLAS / oneDNN) vs the patched strict ops (CUDA: the Triton
kernels of ``kernels/strict/triton_ops.py``). ``--kernels`` (CUDA) adds per-kernel checks: rows alone
vs inside batches of M = 1..4096 bitwise, attention prefill rows == decode rows bitwise, error vs
an fp32 torch reference. Prints tables last.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from datetime import UTC, datetime
from typing import Any

import torch

from mismatch_probe.probes.hf.patch import patch, token_logprobs_fn

MBS = (1, 2, 3, 4, 8)
SHAPES = {
    "tiny": None,
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
LENGTHS = {"tiny": (5, 9, 17, 23, 31, 12, 40, 7), "0.6b": (37, 1024, 511, 900, 64, 700, 3, 257),
           "8b": (37, 512, 300, 450, 64, 200, 3, 129)}
PREFILL = {"tiny": (8, 128), "0.6b": (4, 1024), "8b": (4, 1024)}
DECODE = {"tiny": (8, 128), "0.6b": (64, 1024), "8b": (64, 1024)}


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


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


def invariance(model: Any, vocab: int, lengths: tuple[int, ...], recipe: str | None, dev: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(8, vocab, (n,), generator=g).tolist() for n in lengths]
    ref = _score(model, seqs, 1, recipe, dev)
    ok = [True] * len(seqs)
    worst = 0.0
    for mbs in MBS[1:]:
        got = _score(model, seqs, mbs, recipe, dev)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            if not torch.equal(a, b):
                ok[i] = False
                worst = max(worst, float((a - b).abs().max()))
    return {"invariant_seqs": sum(ok), "n_seqs": len(seqs), "max_abs_dlogp_across_mbs": worst}


def _timed(fn: Any, reps: int, dev: str) -> float:
    times = []
    for i in range(reps + 2):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        if i >= 2:  # warm-up (Triton compile, allocator)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prefill_ms(model: Any, vocab: int, b: int, t: int, reps: int, dev: str) -> float:
    ids = torch.randint(8, vocab, (b, t), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.inference_mode():
        return _timed(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids)), reps, dev)


def decode_ms(model: Any, vocab: int, b: int, t: int, reps: int, dev: str) -> float:
    """One decode step: ``b`` sequences, one new token each, over a KV cache of ``t`` tokens."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(8, vocab, (b, t), generator=g).to(dev)
    nxt = torch.randint(8, vocab, (b, 1), generator=g).to(dev)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        mask = torch.ones(b, t + 1, dtype=torch.long, device=dev)
        pos = torch.full((b, 1), t, device=dev)

        def step() -> None:
            model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(t)

        return _timed(step, reps, dev)


def build(name: str, dev: str) -> tuple[Any, int]:
    import transformers

    if SHAPES[name] is None:
        from mismatch_probe.probes.tiny_models import resolve_tiny_model

        m = transformers.AutoModelForCausalLM.from_pretrained(resolve_tiny_model("tiny-qwen3"), dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
        return m.to(dev).eval(), 512
    cfg = transformers.Qwen3Config(vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6, **SHAPES[name])
    torch.manual_seed(0)
    with torch.device(dev):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return m.eval(), 151936


def kernel_checks(dev: str) -> list[dict[str, Any]]:
    """CUDA: each strict kernel's rows alone vs inside batches (bitwise) and its error vs fp32 torch."""
    from mismatch_probe.kernels.strict import ops as so

    g = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

    for n, k in ((1024, 1024), (3072, 1024), (151936, 1024), (4096, 12288)):
        w = torch.randn(n, k, device=dev, generator=g).bfloat16() * 0.03
        x = torch.randn(4096, k, device=dev, generator=g).bfloat16()
        full = so.linear(x, w)
        inv = all(torch.equal(so.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 7, 64, 129, 1000))
        inv = inv and torch.equal(so.linear(x[100:101], w), full[100:101])
        rows.append({"kernel": f"linear {n}x{k}", "rows_invariant": inv, "rel_err_vs_fp32": rel(full, x.float() @ w.float().T)})
    b, t, hq, hkv, d = 3, 700, 16, 8, 128
    q = torch.randn(b, t, hq, d, device=dev, generator=g).bfloat16()
    kk = torch.randn(b, t, hkv, d, device=dev, generator=g).bfloat16()
    vv = torch.randn(b, t, hkv, d, device=dev, generator=g).bfloat16()
    pos = torch.arange(t, device=dev).expand(b, t)
    pre = so.attention_batch(q, kk, vv, pos, d**-0.5)
    alone = so.attention_batch(q[1:2, :300], kk[1:2, :300], vv[1:2, :300], pos[1:2, :300], d**-0.5)
    dec_ok = all(torch.equal(so.attention_batch(q[:, j : j + 1], kk[:, : j + 1], vv[:, : j + 1], pos[:, j : j + 1], d**-0.5),
                             pre[:, j : j + 1]) for j in (0, 63, 64, 299, 699))
    rk, rv = (z.transpose(1, 2).float().repeat_interleave(hq // hkv, 1) for z in (kk, vv))
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2).float(), rk, rv, is_causal=True)
    rows.append({"kernel": "attention 16x128 (GQA 2)", "rows_invariant": torch.equal(alone, pre[1:2, :300]) and dec_ok,
                 "prefill_eq_decode": dec_ok, "rel_err_vs_fp32": rel(pre, ref.transpose(1, 2))})
    x = torch.randn(4096, 1024, device=dev, generator=g).bfloat16()
    r = torch.randn(4096, 1024, device=dev, generator=g).bfloat16()
    wn = torch.rand(1024, device=dev, generator=g).bfloat16() + 0.5
    y, rr = so.add_rmsnorm(x, r, wn, 1e-6)
    y1, _ = so.add_rmsnorm(x[5:6], r[5:6], wn, 1e-6)
    xr = (x.float() + r.float()).bfloat16().float()
    ref = (wn.float() * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float())
    rows.append({"kernel": "add_rmsnorm 1024", "rows_invariant": torch.equal(y1, y[5:6]), "rel_err_vs_fp32": rel(y, ref)})
    gt = torch.randn(4096, 3072, device=dev, generator=g).bfloat16()
    up = torch.randn(4096, 3072, device=dev, generator=g).bfloat16()
    a = so.act_and_mul(gt, up)
    rows.append({"kernel": "silu_and_mul", "rows_invariant": torch.equal(so.act_and_mul(gt[7:9], up[7:9]), a[7:9]),
                 "rel_err_vs_fp32": rel(a, torch.nn.functional.silu(gt.float()) * up.float())})
    lg = torch.randn(64, 151936, device=dev, generator=g).bfloat16() * 3
    lp = so.log_softmax_fp32(lg)
    rows.append({"kernel": "log_softmax 151936", "rows_invariant": torch.equal(so.log_softmax_fp32(lg[3:4]), lp[3:4]),
                 "rel_err_vs_fp32": rel(lp, torch.log_softmax(lg.float(), -1))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="tiny")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args()
    dev = args.device
    krows: list[dict[str, Any]] = []
    if args.kernels and dev == "cuda":
        try:
            krows = kernel_checks(dev)
        except Exception:  # noqa: BLE001 - report and go on to the models
            traceback.print_exc()
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(_model_row(name, dev, args))
        except Exception:  # noqa: BLE001 - one model's failure must not lose the others' figures
            traceback.print_exc()
        if dev == "cuda":
            torch.cuda.empty_cache()
    _report(dev, args, rows, krows)


def _model_row(name: str, dev: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, vocab = build(name, dev)
    b, t = PREFILL[name]
    row: dict[str, Any] = {"model": name, "prefill": f"{b}x{t}"}
    row["engine_invariance"] = invariance(model, vocab, LENGTHS[name], None, dev)
    row["engine_ms"] = prefill_ms(model, vocab, b, t, args.reps, dev)
    db, dt = DECODE[name]
    row["decode"] = f"{db}x1 over {dt}"
    row["engine_decode_ms"] = None if args.no_decode else decode_ms(model, vocab, db, dt, args.reps, dev)
    with patch(model, "strict"):
        row["strict_invariance"] = invariance(model, vocab, LENGTHS[name], "strict", dev)
        row["strict_ms"] = prefill_ms(model, vocab, b, t, args.reps, dev)
        row["strict_decode_ms"] = None if args.no_decode else decode_ms(model, vocab, db, dt, args.reps, dev)
    row["slowdown"] = row["strict_ms"] / row["engine_ms"]
    row["wall_s"] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    return row


def _report(dev: str, args: argparse.Namespace, rows: list[dict[str, Any]], krows: list[dict[str, Any]]) -> None:
    import transformers

    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "kernels": krows}, fh, indent=1)
    print(json.dumps(meta))
    if krows:
        print("| kernel | rows alone == in batch (bitwise) | rel err vs fp32 torch |")
        print("|---|---|---|")
        for k in krows:
            print(f"| {k['kernel']} | {k['rows_invariant']} | {k['rel_err_vs_fp32']:.2e} |")
    mbs = ",".join(map(str, MBS))
    print(f"| model | prefill | engine invariant (mbs {mbs}) | strict invariant | engine ms | strict ms | strict/engine "
          "| decode | engine ms | strict ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["model"], r["prefill"], _fmt(r["engine_invariance"]), _fmt(r["strict_invariance"])]
        cells += [f"{r['engine_ms']:.1f}", f"{r['strict_ms']:.1f}", f"{r['slowdown']:.2f}x", r["decode"]]
        cells += [_ms(r["engine_decode_ms"]), _ms(r["strict_decode_ms"])]
        print("| " + " | ".join(cells) + " |")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _fmt(d: dict[str, Any] | None) -> str:
    return f"{d['invariant_seqs']}/{d['n_seqs']} (max {d['max_abs_dlogp_across_mbs']:.2e})" if d else "-"


if __name__ == "__main__":
    main()
