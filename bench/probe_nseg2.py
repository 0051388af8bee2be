# ruff: noqa: B023
"""One-call GPU probe: two K segments at N = K = 8192 with the chunk-major token operand.

    python bench/probe_nseg2.py --out DIR [--targets 128,256] [--variants 12,14] [--sweep]

The decode GEMM at M = 16 is bound by its consumers' one fp32 chain per output over K (512
dependent m16n8k16 steps at N = K = 8192, NSEG 1). ``tc_linear.nseg_for`` with a larger
``NSEG_TARGET`` splits K in two there (a bit change of that shape on every path, allowed by the
contract: chunks of K depending on (N, K) only, added in fixed order). This probe times, per rule:
the native decode (given variants) at M = 1, 16, 64, the Triton decode at M = 16 and the prefill at
M = 8192 against cuBLAS bf16, the Qwen3-8B layer shapes (decode M = 16, prefill M = 4096), and checks
decode rows == prefill rows; ``--sweep``: the issue's M sweep over every path at the last rule.
Prints a table last; writes ``nseg2.json``. Timings: CUDA-graph medians (bench_kernels.bench).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_kernels import NOTES, ROWS, eq, note, rec, sweep_paths, take_rows  # noqa: E402

SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288))  # Qwen3-8B q/o, gate/up, down


def run(targets: list[int], variants: list[int], sweep: bool, nk: int, rows: int, dev: str,
        shapes: tuple = SHAPES, prefill_cfgs: tuple = ()) -> list[dict]:
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.checks import TC_MS
    from mismatch_probe.kernels.nvfp4 import native
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    torch.manual_seed(0)
    w = torch.randn(nk, nk, device=dev, dtype=torch.bfloat16)
    wq = nvfp4_quantize(w)
    x = torch.randn(rows, nk, device=dev, dtype=torch.bfloat16)
    aq = nvfp4_quantize(x, per_token=True)
    aop = T.act_operand(aq)
    cub = {m: rec(f"N=K={nk} M={m} cuBLAS bf16", lambda: x[:m] @ w.t()) for m in (1, 16, 64, rows)}
    layer = []
    for n2, k2 in shapes:
        w2 = torch.randn(n2, k2, device=dev, dtype=torch.bfloat16)
        x2 = torch.randn(min(4096, rows), k2, device=dev, dtype=torch.bfloat16)
        layer.append((n2, k2, nvfp4_quantize(w2), nvfp4_quantize(x2, per_token=True), x2,
                      rec(f"N={n2} K={k2} M=16 cuBLAS bf16", lambda: x2[:16] @ w2.t()),
                      rec(f"N={n2} K={k2} M=4096 cuBLAS bf16", lambda: x2 @ w2.t())))
    out = []
    for target in targets:
        T.NSEG_TARGET = target
        tw = T.prepare(wq)
        tag = f"[target {target}] N=K={nk} nseg={tw.nseg}"
        full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
        row: dict = {"target": target, "nseg": tw.nseg, "cublas": cub}
        row["prefill"] = rec(f"{tag} M={rows} prefill", lambda: T.tc_matmul(aq, tw, path="prefill", a_op=aop))
        bad = []
        for cfg in prefill_cfgs if tw.nseg > 1 else ():
            T.PREFILL_CFG.update(cfg)
            if not eq(T.tc_matmul(aq, tw, path="prefill", a_op=aop), full):
                bad.append(("prefill", cfg))
            row[f"prefill {cfg}"] = rec(f"{tag} M={rows} prefill {cfg}", lambda: T.tc_matmul(aq, tw, path="prefill", a_op=aop))
            T.PREFILL_CFG.clear()
        for v in variants:
            native.NATIVE_CFG["variant"] = v
            for m in (1, 16, 64):
                a = take_rows(aq, 0, m)
                op = T.decode_operand(aop[:m], tw, m)
                if not eq(T.tc_matmul(a, tw, path="decode", a_op=op), full[:m]):
                    bad.append((v, m))
                row[f"v{v} M={m}"] = rec(f"{tag} M={m} native decode v{v}", lambda: T.tc_matmul(a, tw, path="decode", a_op=op))
            native.NATIVE_CFG.pop("variant")
        a16, op16 = take_rows(aq, 0, 16), aop[:16]
        T.DECODE_CFG["NATIVE"] = False
        if not eq(T.tc_matmul(a16, tw, path="decode", a_op=op16), full[:16]):
            bad.append(("triton", 16))
        row["triton M=16"] = rec(f"{tag} M=16 Triton decode", lambda: T.tc_matmul(a16, tw, path="decode", a_op=op16))
        T.DECODE_CFG.clear()
        row["rows"] = "decode == prefill" if not bad else f"DIFFER {bad}"
        note(f"{tag}: {row['rows']}; record M=16: {T.kernel_record(16, tw)}")
        for n2, k2, wq2, a2, _x2, c16, c4096 in layer:
            tp = T.prepare(wq2)
            op2 = T.act_operand(a2)
            f2 = T.tc_matmul(a2, tp, path="prefill", a_op=op2)
            s16 = take_rows(a2, 0, 16)
            d16 = T.decode_operand(op2[:16], tp, 16)
            ok = eq(T.tc_matmul(s16, tp, path="decode", a_op=d16), f2[:16])
            row[f"N={n2} K={k2}"] = {
                "nseg": tp.nseg, "decode_eq_prefill": ok, "cublas_16": c16, "cublas_4096": c4096,
                "decode_16": rec(f"[target {target}] N={n2} K={k2} nseg={tp.nseg} M=16 decode",
                                 lambda: T.tc_matmul(s16, tp, path="decode", a_op=d16)),
                "prefill_4096": rec(f"[target {target}] N={n2} K={k2} nseg={tp.nseg} M=4096 prefill",
                                    lambda: T.tc_matmul(a2, tp, path="prefill", a_op=op2))}
        out.append(row)
    if sweep:
        n_cmp, differ = sweep_paths(aq, x, tw, full, TC_MS)
        note(f"[target {targets[-1]}] sweep: {n_cmp} comparisons, {'ALL ROWS IDENTICAL' if not differ else differ}")
    return out


def table(out: list[dict], variants: list[int]) -> None:
    us = lambda ms: "-" if ms is None else f"{ms * 1e3:.1f}"  # noqa: E731
    x = lambda c, ms: "-" if ms is None or c is None else f"{c / ms:.2f}x"  # noqa: E731
    for r in out:
        c = r["cublas"]
        big = max(c)
        print(f"target {r['target']} nseg {r['nseg']}: {r['rows']}; prefill M={big} {us(r['prefill'])} us "
              f"({r['prefill'] / c[big]:.2f}x cuBLAS {us(c[big])})" if r["prefill"] and c[big] else f"target {r['target']}")
        print("| variant | M=1 | M=16 (vs cuBLAS) | M=64 |")
        for v in variants:
            d16 = r[f"v{v} M=16"]
            print(f"| v{v} | {us(r[f'v{v} M=1'])} | {us(d16)} ({x(c[16], d16)} faster) | {us(r[f'v{v} M=64'])} |")
        print(f"| Triton | - | {us(r['triton M=16'])} | - |   cuBLAS: {us(c[1])} / {us(c[16])} / {us(c[64])}")
        for key, v in r.items():
            if key.startswith("prefill {"):
                print(f"  {key}: {us(v)} us ({x(v, c[big])} of cuBLAS)")
            if key.startswith("N="):
                print(f"  {key} nseg {v['nseg']}: decode16 {us(v['decode_16'])} (cuBLAS {us(v['cublas_16'])}) "
                      f"prefill4096 {us(v['prefill_4096'])} ({x(v['prefill_4096'], v['cublas_4096'])} of cuBLAS "
                      f"{us(v['cublas_4096'])}) eq={v['decode_eq_prefill']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--targets", default="128,256")
    ap.add_argument("--variants", default="12,14")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--nk", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill-cfgs", default="[]", help="JSON list of prefill config overrides timed at NSEG > 1")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="layer shapes NxK")
    a = ap.parse_args()
    variants = [int(v) for v in a.variants.split(",") if v]
    shapes = tuple(tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s)
    out = run([int(t) for t in a.targets.split(",")], variants, a.sweep, a.nk, a.rows, a.device, shapes,
              tuple(json.loads(a.prefill_cfgs)))
    with open(os.path.join(a.out, "nseg2.json"), "w") as f:
        json.dump({"rows": ROWS, "notes": NOTES, "summary": out}, f, indent=1, default=str)
    table(out, variants)


if __name__ == "__main__":
    main()
