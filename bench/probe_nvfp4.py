# ruff: noqa: B023
"""One-call GPU probe of the tensor-core NVFP4 kernels: variants side by side, bitwise properties.

    python bench/probe_nvfp4.py --out DIR

Prints a table last; writes ``probe.json``. Timings: triton.testing.do_bench median (ms).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

# the timing, recording and section helpers are the one-call bench's (same folder on sys.path)
from bench_kernels import GRAPH, NOTES, ROWS, eq, note, rec, section  # noqa: E402, F401


@section
def checks() -> None:
    from mismatch_probe.kernels.checks import run_checks

    names = [c for c in __import__("mismatch_probe.kernels.checks", fromlist=["CHECKS"]).CHECKS]
    names = [c.name for c in names if c.name.startswith(("quant_", "rmsnorm", "dequant"))]
    res = run_checks(names)
    bad = [f"{r.name}: {r.detail[:200]}" for r in res if r.status == "fail"]
    note(f"quantizer checks on GPU (fast kernel): {sum(r.status == 'pass' for r in res)}/{len(res)} pass; fails: {bad}")


@section
def quantize() -> None:
    from mismatch_probe.kernels import nvfp4_quantize, nvfp4_quantize_ref
    from mismatch_probe.kernels.nvfp4 import quant_fast as qf

    m = k = 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    cb = 2 * x.numel() * 2
    copy = rec("copy bf16 8192^2", lambda: y.copy_(x), bytes=cb)
    qb = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + m * 4
    ref = nvfp4_quantize_ref(x[:256], per_token=True)
    for cfg in ({}, {"num_warps": 4}, {"num_warps": 2}, {"ELEMS": 16384, "num_warps": 4},
                {"ELEMS": 16384, "num_warps": 8}):
        qf.QF_CFG.clear()
        qf.QF_CFG.update(cfg)
        q = nvfp4_quantize(x, per_token=True)
        ok = torch.equal(q.codes[:256], ref.codes) and torch.equal(q.scales[:256], ref.scales)
        rec(f"quantize per-token fast {cfg}", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, copy_ms=copy,
            copy_bytes=cb, bits_ok=ok)
    qf.QF_CFG.clear()
    rec("quantize per-token fast + fp16 operand", lambda: qf.quantize_rows(x, None, True, emit_op=torch.float16),
        bytes=qb + x.numel() * 2, copy_ms=copy, copy_bytes=cb)
    wt = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    rec("fused rmsnorm+quantize fast", lambda: qf.rmsnorm_quantize_rows(x, wt, 1e-6),
        bytes=qb + x.numel() * 2, copy_ms=copy, copy_bytes=cb)
    from mismatch_probe.kernels.nvfp4 import triton_quant as tq

    tq.QUANT_IMPL = "v1"
    rec("quantize per-token old v1", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, copy_ms=copy, copy_bytes=cb)
    tq.QUANT_IMPL = "fast"


def ref_rows(a, wq, rows):  # noqa: ANN001, ANN201
    from mismatch_probe.kernels.nvfp4 import ref as R

    sub = R.NVFP4Tensor(a.codes[:rows], a.scales[:rows], a.amax[:rows], True)
    acc = R.w4a4_accumulate_ref(R.block_dequant_operand(sub), R.block_dequant_operand(wq))
    return (acc * R.gemm_alpha(sub.row_amax()[:, None], wq.row_amax()[None, :])).to(torch.bfloat16)


def tol(got: torch.Tensor, ref: torch.Tensor) -> str:
    e = (got.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
    d = (got.float() - ref.float()).abs()
    ulp = (ref.float().abs() * 2.0**-7).clamp_min(1e-30)
    return f"{e * 100:.2f}% bits equal ref, max {float((d / ulp).max()):.2f} bf16-ulp"


@section
def gemm() -> None:
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    n = k = 8192
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq = nvfp4_quantize(w)
    pw = T.prepare(wq)
    note(f"N=K=8192: nseg={pw.nseg} bkc={pw.bkc}")
    X = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
    aq = nvfp4_quantize(X, per_token=True)
    aop = T.act_operand(aq)
    full = T.tc_matmul(aq, pw, path="prefill", a_op=aop)
    note(f"prefill M=8192 vs per-block ref (64 rows): {tol(full[:64], ref_rows(aq, wq, 64))}")
    w8 = w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    for m in (1, 16, 64):
        x = X[:m]
        a = nvfp4_quantize(x, per_token=True)
        aop_m = T.act_operand(a)
        cub = rec(f"M={m} cuBLAS bf16", lambda: x @ w.t(), m=m)
        x8 = x.to(torch.float8_e4m3fn)
        rec(f"M={m} FP8 _scaled_mm", lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16), m=m)
        bm = 16 if m <= 16 else 64
        variants = [("swap default", {}), ("swap s3", {"num_stages": 3}), ("swap nseg4", {"NSEG": 4}),
                    ("swap nseg8", {"NSEG": 8}),
                    ("ns BM{bm} BN32 s4", {"SWAP": False, "BM": bm, "BN": 32}),
                    ("ns BM{bm} BN32 s6", {"SWAP": False, "BM": bm, "BN": 32, "num_stages": 6}),
                    ("ns BM{bm} BN64 s4", {"SWAP": False, "BM": bm, "BN": 64}),
                    ("ns BM{bm} BN32 cpi2 s4", {"SWAP": False, "BM": bm, "BN": 32, "CPI": 2}),
                    ("ns BM{bm} BN16 cpi2 s4", {"SWAP": False, "BM": bm, "BN": 16, "CPI": 2}),
                    ("ns BM{bm} BN32 noasm", {"SWAP": False, "BM": bm, "BN": 32, "USE_ASM": False})]
        if m == 16:
            variants += [("ns BM64 BN32 s4 (wgmma)", {"SWAP": False, "BM": 64, "BN": 32}),
                         ("ns BM64 BN64 s4 (wgmma)", {"SWAP": False, "BM": 64, "BN": 64})]
        variants = [(nm.format(bm=bm), c) for nm, c in variants]
        for name, cfg in variants:
            T.DECODE_CFG.clear()
            T.DECODE_CFG.update(cfg)
            try:
                y = T.tc_matmul(a, pw, path="decode", a_op=aop_m)
                same = eq(y, full[:m]) if "NSEG" not in cfg else None
            except Exception as e:
                note(f"decode M={m} {name} failed: {type(e).__name__}: {str(e)[:1500]}")
                continue
            rec(f"M={m} decode {name}", lambda: T.tc_matmul(a, pw, path="decode", a_op=aop_m), m=m, cublas_ms=cub,
                rows_eq_prefill=same)
        T.DECODE_CFG.clear()
        rec(f"M={m} tc_linear auto incl. quantize", lambda: T.tc_linear(x, pw), m=m, cublas_ms=cub)
        GRAPH["on"] = False
        rec(f"M={m} tc_linear auto incl. quantize, no CUDA graph", lambda: T.tc_linear(x, pw), m=m, cublas_ms=cub)
        rec(f"M={m} cuBLAS bf16, no CUDA graph", lambda: x @ w.t(), m=m)
        GRAPH["on"] = True
        rec(f"M={m} prefill path", lambda: T.tc_matmul(a, pw, path="prefill", a_op=aop_m), m=m, cublas_ms=cub)
    # large M
    cub = rec("M=8192 cuBLAS bf16", lambda: X @ w.t())
    x8 = X.to(torch.float8_e4m3fn)
    rec("M=8192 FP8 _scaled_mm", lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    for name, cfg in (("default 128x256x64 w8 s3 G16", {}), ("128x256x64 w8 s4 G16", {"num_stages": 4}),
                      ("128x256x64 w8 s3 G32", {"GROUP_M": 32}),
                      ("128x128x64 w8 s4 G16 (nseg>1 config)", {"BN": 128, "num_stages": 4})):
        T.PREFILL_CFG.clear()
        T.PREFILL_CFG.update(cfg)
        try:
            y = T.tc_matmul(aq, pw, path="prefill", a_op=aop)
            same = eq(y, full)
        except Exception as e:
            note(f"prefill {name} failed: {type(e).__name__}: {str(e)[:1500]}")
            continue
        rec(f"M=8192 prefill {name}", lambda: T.tc_matmul(aq, pw, path="prefill", a_op=aop), cublas_ms=cub, rows_eq=same)
    T.PREFILL_CFG.clear()
    rec("M=8192 tc_linear auto incl. quantize", lambda: T.tc_linear(X, pw), cublas_ms=cub)
    # batch invariance at several M, row offsets, both paths
    bad = []
    for m in (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4096):
        for off in (0, 37):
            if off + m > 8192:
                continue
            sub = type(aq)(aq.codes[off:off + m], aq.scales[off:off + m], aq.amax[off:off + m], True)
            for p in (("decode", "prefill") if m <= 64 else ("prefill",)):
                if not eq(T.tc_matmul(sub, pw, path=p), full[off:off + m]):
                    bad.append((m, off, p))
    note(f"batch invariance N=K=8192 (rows vs M=8192 prefill): {'ALL EQUAL' if not bad else bad}")
    # smaller N (nseg > 1): decode vs prefill
    for n2, k2 in ((1024, 1024), (3072, 1024), (1024, 3072)):
        w2 = nvfp4_quantize(torch.randn(n2, k2, device="cuda", dtype=torch.bfloat16))
        p2 = T.prepare(w2)
        x2 = torch.randn(300, k2, device="cuda", dtype=torch.bfloat16)
        a2 = nvfp4_quantize(x2, per_token=True)
        f2 = T.tc_matmul(a2, p2, path="prefill")
        bad2 = [m for m in (1, 5, 16, 33, 64) if not eq(T.tc_matmul(type(a2)(a2.codes[:m], a2.scales[:m], a2.amax[:m], True),
                                                                      p2, path="decode"), f2[:m])]
        note(f"N={n2} K={k2} nseg={p2.nseg}: decode vs prefill {'equal' if not bad2 else bad2}; "
             f"ref: {tol(f2[:64], ref_rows(a2, w2, 64))}")
        xb = x2[:16].contiguous()
        wb2 = torch.randn(n2, k2, device="cuda", dtype=torch.bfloat16)
        a16 = type(a2)(a2.codes[:16], a2.scales[:16], a2.amax[:16], True)
        op16 = T.act_operand(a16)
        rec(f"N={n2} K={k2} M=16 cuBLAS", lambda: xb @ wb2.t())
        for nm, c in (("swap", {}), ("ns BN32", {"SWAP": False, "BN": 32, "BM": 16}),
                      ("ns BN16 cpi2", {"SWAP": False, "BN": 16, "BM": 16, "CPI": 2})):
            T.DECODE_CFG.clear()
            T.DECODE_CFG.update(c)
            ok = eq(T.tc_matmul(a16, p2, path="decode", a_op=op16), f2[:16])
            rec(f"N={n2} K={k2} M=16 decode {nm} (nseg={p2.nseg})", lambda: T.tc_matmul(a16, p2, path="decode", a_op=op16),
                rows_eq_prefill=ok)
        T.DECODE_CFG.clear()
        rec(f"N={n2} K={k2} M=16 decode + quantize, tc_linear", lambda: T.tc_linear(xb, p2))


@section
def moe() -> None:
    from mismatch_probe.kernels import moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.nvfp4 import tc_linear as T
    from mismatch_probe.kernels.nvfp4.grouped import gather_rows

    e, top, hidden, inter = 128, 8, 2048, 768
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        wb = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        wq = quantize_expert_weights(wb)
        pg = T.prepare(wq)
        wt = wb.transpose(1, 2)
        for t in (16384, 64):
            ids = torch.topk(torch.rand(t, e, device="cuda"), top, dim=1).indices
            perm, offsets = moe_route(ids, e)
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            a = gather_rows(nvfp4_quantize(x, per_token=True), perm // top)
            aop = T.act_operand(a)
            xa = x[perm // top].contiguous()
            offs32 = offsets[1:].to(torch.int32)
            tag = f"MoE {name} N={n} K={k} T={t}"
            gm = rec(f"{tag} torch._grouped_mm bf16", lambda: torch._grouped_mm(xa, wt, offs=offs32))
            for p, c in ((("decode", {}), ("decode", {"SWAP": False, "BN": 32}), ("prefill", {})) if t <= 64 else
                         (("prefill", {}),)):
                T.DECODE_CFG.clear()
                T.DECODE_CFG.update(c)
                y = T.tc_grouped(a, offsets, pg, path=p, a_op=aop)
                off = offsets.tolist()
                bad = []
                for ex in (0, 5, 77, 127):
                    r0, r1 = off[ex], off[ex + 1]
                    if r1 > r0:
                        sub = type(a)(a.codes[r0:r1], a.scales[r0:r1], a.amax[r0:r1], True)
                        if not eq(T.tc_matmul(sub, pg.expert(ex), path=p), y[r0:r1]):
                            bad.append(ex)
                rec(f"{tag} grouped {p} {c}", lambda: T.tc_grouped(a, offsets, pg, path=p, a_op=aop), grouped_mm_ms=gm,
                    grouped_eq_per_expert=not bad)
            T.DECODE_CFG.clear()
            y1 = T.tc_grouped(a, offsets, pg, path="decode", a_op=aop)
            y2 = T.tc_grouped(a, offsets, pg, path="prefill", a_op=aop)
            note(f"{tag}: grouped decode == grouped prefill: {eq(y1, y2)}")


@section
def decode() -> None:
    """Decode-path variants (bytes in flight per SM: chunks per step x stages; warps), rows vs prefill."""
    from mismatch_probe.kernels import moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.nvfp4 import tc_linear as T
    from mismatch_probe.kernels.nvfp4.grouped import gather_rows

    n = k = 8192
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    tw = T.prepare(nvfp4_quantize(w))
    X = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    aq = nvfp4_quantize(X, per_token=True)
    aop = T.act_operand(aq)
    full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
    variants = [("w4 cpi1 s4", {"CPI": 1}), ("w4 cpi2 s4 (default)", {}), ("w4 cpi1 s8", {"CPI": 1, "num_stages": 8}),
                ("w4 cpi2 s6", {"num_stages": 6}), ("w4 cpi4 s4", {"CPI": 4}), ("w4 cpi4 s3", {"CPI": 4, "num_stages": 3}),
                ("w8 cpi4 s4", {"CPI": 4, "num_warps": 8}), ("w8 cpi2 s6", {"num_warps": 8, "num_stages": 6})]
    for m in (1, 16):
        x = X[:m]
        a = type(aq)(aq.codes[:m], aq.scales[:m], aq.amax[:m], True)
        op = aop[:m]
        cub = rec(f"M={m} cuBLAS bf16", lambda: x @ w.t())
        for name, cfg in variants:
            T.DECODE_CFG.clear()
            T.DECODE_CFG.update(cfg)
            try:
                ok = eq(T.tc_matmul(a, tw, path="decode", a_op=op), full[:m])
            except Exception as e:
                note(f"M={m} {name} failed: {type(e).__name__}: {str(e)[:600]}")
                continue
            rec(f"M={m} decode BN64 {name}", lambda: T.tc_matmul(a, tw, path="decode", a_op=op), cublas_ms=cub,
                rows_eq_prefill=ok)
        T.DECODE_CFG.clear()
    e, top = 128, 8
    for name, nn, kk in (("gate_up", 1536, 2048), ("down", 2048, 768)):
        wq = quantize_expert_weights(torch.randn(e, nn, kk, device="cuda", dtype=torch.bfloat16) * 0.05)
        pg = T.prepare(wq)
        ids = torch.topk(torch.rand(64, e, device="cuda"), top, dim=1).indices
        perm, offsets = moe_route(ids, e)
        a = gather_rows(nvfp4_quantize(torch.randn(64, kk, device="cuda", dtype=torch.bfloat16), per_token=True), perm // top)
        aop2 = T.act_operand(a)
        y0 = T.tc_grouped(a, offsets, pg, path="prefill", a_op=aop2)
        for vname, cfg in (("cpi1 s4 (default)", {}), ("cpi2 s4", {"CPI": 2}), ("cpi2 s6", {"CPI": 2, "num_stages": 6}),
                           ("cpi4 s4", {"CPI": 4})):
            T.DECODE_CFG.clear()
            T.DECODE_CFG.update(cfg)
            ok = eq(T.tc_grouped(a, offsets, pg, path="decode", a_op=aop2), y0)
            rec(f"MoE {name} T=64 grouped decode {vname}", lambda: T.tc_grouped(a, offsets, pg, path="decode", a_op=aop2),
                rows_eq_prefill=ok)
        T.DECODE_CFG.clear()


def table() -> None:
    print("\n| probe | median us | derived |")
    print("|---|---:|---|")
    for r in ROWS:
        if r.get("ms") is None:
            print(f"| {r['name']} | failed | {r.get('error', '')[:100]} |")
            continue
        ms = r["ms"]
        d = []
        if "bytes" in r:
            d.append(f"{r['bytes'] / ms / 1e6:.0f} GB/s")
            if r.get("copy_ms"):
                d.append(f"{(r['bytes'] / ms) / (r['copy_bytes'] / r['copy_ms']) * 100:.0f}% of copy")
        for key, lab in (("cublas_ms", "cuBLAS"), ("grouped_mm_ms", "_grouped_mm")):
            if r.get(key):
                d.append(f"{r[key] / ms:.2f}x vs {lab}")
        for key in ("bits_ok", "rows_eq_prefill", "rows_eq", "grouped_eq_per_expert"):
            if key in r and r[key] is not None:
                d.append(f"{key}={r[key]}")
        print(f"| {r['name']} | {ms * 1e3:.1f} | {', '.join(d)} |")
    print("\nnotes:")
    for s in NOTES:
        print(" -", s[:600])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="checks,quantize,gemm,moe")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__, flush=True)
    for part in args.only.split(","):
        {"checks": checks, "quantize": quantize, "gemm": gemm, "moe": moe, "decode": decode}[part]()
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump({"rows": ROWS, "notes": NOTES}, f, indent=1)
    table()


if __name__ == "__main__":
    main()
