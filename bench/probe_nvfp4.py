# ruff: noqa: B023
"""One-call GPU probe of the tensor-core NVFP4 kernels: variants side by side, bitwise properties.

    python bench/probe_nvfp4.py --out DIR [--only checks,quantize,gemm,moe,decode,nseg]

``nseg``: the K-segment rule's candidates (``tuning.SegmentRule`` target / max_segments; ``--nseg-targets``)
side by side at N = K = 8192 and at layer shapes, with the bitwise row checks of every path
(BENCHMARKS.md); ``--nseg-variants`` adds native decode variants per rule, ``--nseg-prefill-cfgs``
prefill config overrides at NSEG > 1.

Configs are tried by retuning the prepared weight (``TCWeight.tuned`` with a ``GemmTuning`` whose parts
are built from the config dicts below: ``DecodeTuning.from_config``, ``PrefillTuning.from_config``).

Prints a table last; writes ``probe.json``. Timings: triton.testing.do_bench median (ms).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

# the timing, recording and section helpers are the one-call bench's (same folder on sys.path)
from bench_kernels import (  # noqa: E402, F401
    GRAPH,
    NOTES,
    ROWS,
    decode_inputs,
    eq,
    note,
    print_notes,
    rec,
    retuned,
    rows_table,
    section,
    sweep_paths,
    take_rows,
)


def with_decode(tw, cfg: dict):  # noqa: ANN001, ANN201
    """``tw`` under its tuning with the decode config keys ``cfg`` (as DECODE configs are written here)."""
    from mismatch_probe.kernels.nvfp4.tuning import DecodeTuning

    return retuned(tw, decode=DecodeTuning.from_config(cfg))


def with_prefill(tw, cfg: dict):  # noqa: ANN001, ANN201
    """``tw`` under its tuning with the prefill config keys ``cfg``."""
    from mismatch_probe.kernels.nvfp4.tuning import PrefillTuning

    return retuned(tw, prefill=PrefillTuning.from_config(cfg))


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
            pwc = with_decode(pw, cfg)
            try:
                y = T.tc_matmul(a, pwc, path="decode", a_op=aop_m)
                same = eq(y, full[:m]) if "NSEG" not in cfg else None
            except Exception as e:
                note(f"decode M={m} {name} failed: {type(e).__name__}: {str(e)[:1500]}")
                continue
            rec(f"M={m} decode {name}", lambda: T.tc_matmul(a, pwc, path="decode", a_op=aop_m), m=m, cublas_ms=cub,
                rows_eq_prefill=same)
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
        pwp = with_prefill(pw, cfg)
        try:
            y = T.tc_matmul(aq, pwp, path="prefill", a_op=aop)
            same = eq(y, full)
        except Exception as e:
            note(f"prefill {name} failed: {type(e).__name__}: {str(e)[:1500]}")
            continue
        rec(f"M=8192 prefill {name}", lambda: T.tc_matmul(aq, pwp, path="prefill", a_op=aop), cublas_ms=cub, rows_eq=same)
    rec("M=8192 tc_linear auto incl. quantize", lambda: T.tc_linear(X, pw), cublas_ms=cub)
    # batch invariance at several M, row offsets, both paths
    bad = []
    for m in (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4096):
        for off in (0, 37):
            if off + m > 8192:
                continue
            sub = take_rows(aq, off, m)
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
            p2c = with_decode(p2, c)
            ok = eq(T.tc_matmul(a16, p2c, path="decode", a_op=op16), f2[:16])
            rec(f"N={n2} K={k2} M=16 decode {nm} (nseg={p2.nseg})", lambda: T.tc_matmul(a16, p2c, path="decode", a_op=op16),
                rows_eq_prefill=ok)
        rec(f"N={n2} K={k2} M=16 decode + quantize, tc_linear", lambda: T.tc_linear(xb, p2))


@section
def moe() -> None:
    from mismatch_probe.kernels import gather_rows, moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

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
                pgc = with_decode(pg, c)
                y = T.tc_grouped(a, offsets, pgc, path=p, a_op=aop)
                off = offsets.tolist()
                bad = []
                for ex in (0, 5, 77, 127):
                    r0, r1 = off[ex], off[ex + 1]
                    if r1 > r0:
                        sub = type(a)(a.codes[r0:r1], a.scales[r0:r1], a.amax[r0:r1], True)
                        if not eq(T.tc_matmul(sub, pgc.expert(ex), path=p), y[r0:r1]):
                            bad.append(ex)
                rec(f"{tag} grouped {p} {c}", lambda: T.tc_grouped(a, offsets, pgc, path=p, a_op=aop), grouped_mm_ms=gm,
                    grouped_eq_per_expert=not bad)
            y1 = T.tc_grouped(a, offsets, pg, path="decode", a_op=aop)
            y2 = T.tc_grouped(a, offsets, pg, path="prefill", a_op=aop)
            note(f"{tag}: grouped decode == grouped prefill: {eq(y1, y2)}")


@section
def decode() -> None:
    """Decode-path variants (bytes in flight per SM: chunks per step x stages; warps), rows vs prefill."""
    from mismatch_probe.kernels import gather_rows, moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    d = decode_inputs(8192, 8192, 64)
    w, tw, X, aq, aop = d.w, d.tw, d.x, d.aq, d.aop
    full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
    variants = [("w4 cpi1 s4", {"CPI": 1}), ("w4 cpi2 s4 (default)", {}), ("w4 cpi1 s8", {"CPI": 1, "num_stages": 8}),
                ("w4 cpi2 s6", {"num_stages": 6}), ("w4 cpi4 s4", {"CPI": 4}), ("w4 cpi4 s3", {"CPI": 4, "num_stages": 3}),
                ("w8 cpi4 s4", {"CPI": 4, "num_warps": 8}), ("w8 cpi2 s6", {"num_warps": 8, "num_stages": 6})]
    for m in (1, 16):
        x = X[:m]
        a = take_rows(aq, 0, m)
        op = aop[:m]
        cub = rec(f"M={m} cuBLAS bf16", lambda: x @ w.t())
        for name, cfg in variants:
            twc = with_decode(tw, cfg)
            try:
                ok = eq(T.tc_matmul(a, twc, path="decode", a_op=op), full[:m])
            except Exception as e:
                note(f"M={m} {name} failed: {type(e).__name__}: {str(e)[:600]}")
                continue
            rec(f"M={m} decode BN64 {name}", lambda: T.tc_matmul(a, twc, path="decode", a_op=op), cublas_ms=cub,
                rows_eq_prefill=ok)
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
            pgc = with_decode(pg, cfg)
            ok = eq(T.tc_grouped(a, offsets, pgc, path="decode", a_op=aop2), y0)
            rec(f"MoE {name} T=64 grouped decode {vname}", lambda: T.tc_grouped(a, offsets, pgc, path="decode", a_op=aop2),
                rows_eq_prefill=ok)


# (SegmentRule.target, .max_segments) candidates of tc_linear.nseg_for, and the layer shapes (N, K) timed beside
# N = K = 8192: Qwen3-8B q/o, gate/up, down; Qwen3-0.6B gate/up, q
NSEG_CANDIDATES = ((128, 8), (256, 8), (512, 8), (1024, 8))
NSEG_SHAPES = ((4096, 4096), (12288, 4096), (4096, 12288), (3072, 1024), (2048, 1024))
NSEG_NK, NSEG_ROWS, NSEG_ROWS2, DEV = 8192, 8192, 4096, "cuda"  # (smaller on the CPU, for a dry run of the logic)
OUT_DIR = {"path": "."}
# --nseg-targets / --nseg-variants (native decode variants timed beside the default, per rule) /
# --nseg-prefill-cfgs (prefill config overrides timed at NSEG > 1)
NSEG_OPTS: dict = {"candidates": NSEG_CANDIDATES, "variants": (), "prefill_cfgs": ()}


@section
def nseg() -> None:
    """Per candidate K-segment rule: N = K = 8192 native decode M = 1, 16, 64, Triton decode M = 16,
    prefill M = 8192, the linear at M = 16; rows identical for every M
    of the issue's list, offsets 0 and 37, every path; tolerance vs the per-block reference; then
    the layer shapes: decode M = 16 and prefill M = 4096 vs cuBLAS, decode rows == prefill rows.
    The native decode gets its token operand in the layout it takes (converted outside the timing)."""
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.checks import TC_MS, tc_within_bound
    from mismatch_probe.kernels.nvfp4 import native
    from mismatch_probe.kernels.nvfp4 import tc_linear as T
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

    n = k = NSEG_NK
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    wq = nvfp4_quantize(w)
    X = torch.randn(NSEG_ROWS, k, device=DEV, dtype=torch.bfloat16)
    aq = nvfp4_quantize(X, per_token=True)
    aop = T.act_operand(aq)
    cub = {m: rec(f"N=K={n} M={m} cuBLAS bf16", lambda: X[:m] @ w.t(), m=m) for m in (1, 16, 64, NSEG_ROWS)}
    shapes = []
    for i, (n2, k2) in enumerate(NSEG_SHAPES):  # odd ones: per-row weight amax (the aligned recipes' weights)
        w2 = torch.randn(n2, k2, device=DEV, dtype=torch.bfloat16)
        x2 = torch.randn(NSEG_ROWS2, k2, device=DEV, dtype=torch.bfloat16)
        a2 = nvfp4_quantize(x2, per_token=True)
        shapes.append((n2, k2, nvfp4_quantize(w2, per_token=i % 2 == 1), a2, T.act_operand(a2),
                       rec(f"N={n2} K={k2} M=16 cuBLAS bf16", lambda: x2[:16] @ w2.t()),
                       rec(f"N={n2} K={k2} M=4096 cuBLAS bf16", lambda: x2 @ w2.t())))
    summary: list[dict] = []
    NSEG_SUMMARY.update(cublas={str(m): v for m, v in cub.items()}, candidates=summary,
                        shapes_cublas={f"N={n2} K={k2}": [c16, c4096] for n2, k2, *_, c16, c4096 in shapes})
    for target, cap in NSEG_OPTS["candidates"]:
        rule = DEFAULT.with_(segments={"target": target, "max_segments": cap})
        tw = T.prepare(wq, rule)
        tag = f"[target {target} max {cap}] N=K={n} nseg={tw.nseg}"
        full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
        bad = [] if eq(T.tc_matmul(aq, tw, path="prefill", a_op=aop), full) else ["repeat prefill"]
        row = {"target": target, "max": cap, "nseg": tw.nseg}
        row["prefill_8192"] = rec(f"{tag} M={NSEG_ROWS} prefill", lambda: T.tc_matmul(aq, tw, path="prefill", a_op=aop),
                                  cublas_ms=cub[NSEG_ROWS], nseg=tw.nseg)
        for cfg in NSEG_OPTS["prefill_cfgs"] if tw.nseg > 1 else ():
            twp = with_prefill(tw, cfg)
            ok = eq(T.tc_matmul(aq, twp, path="prefill", a_op=aop), full)
            row[f"prefill_8192 {cfg}"] = rec(f"{tag} M={NSEG_ROWS} prefill {cfg}",
                                             lambda: T.tc_matmul(aq, twp, path="prefill", a_op=aop),
                                             cublas_ms=cub[NSEG_ROWS], rows_eq=ok, nseg=tw.nseg)
            if not ok:
                bad.append((NSEG_ROWS, 0, f"prefill {cfg}"))
        for m in (1, 16, 64):
            a = take_rows(aq, 0, m)
            op = aop[:m]
            for v in (None, *NSEG_OPTS["variants"]):  # None: the default variant
                twv = tw if v is None else retuned(tw, native={"variant": v})
                opd = T.decode_operand(op, twv, m)
                ok = eq(T.tc_matmul(a, twv, path="decode", a_op=opd), full[:m])
                name = "native decode" if v is None else f"native decode v{v}"
                row[f"{name} M={m}"] = rec(f"{tag} M={m} {name}", lambda: T.tc_matmul(a, twv, path="decode", a_op=opd),
                                           cublas_ms=cub[m], rows_eq_prefill=ok, nseg=tw.nseg)
                if not ok:
                    bad.append((m, 0, name))
            if m == 16:
                twt = retuned(tw, decode={"native": False})
                ok = eq(T.tc_matmul(a, twt, path="decode", a_op=op), full[:m])
                row["triton decode M=16"] = rec(f"{tag} M=16 Triton decode", lambda: T.tc_matmul(a, twt, path="decode", a_op=op),
                                                cublas_ms=cub[m], rows_eq_prefill=ok, nseg=tw.nseg)
                x16 = X[:16]
                row["linear M=16"] = rec(f"{tag} M=16 linear incl. quantize", lambda: T.tc_linear(x16, tw),
                                         cublas_ms=cub[m], nseg=tw.nseg)
        n_cmp, differ = sweep_paths(aq, X, tw, full, TC_MS)
        bad += differ
        sub = take_rows(aq, 0, 64)
        row["rows"] = f"{n_cmp} comparisons: {'ALL ROWS IDENTICAL' if not bad else f'DIFFER: {bad}'}"
        try:
            row["tolerance"] = tc_within_bound(full[:64], sub, wq)
        except AssertionError as e:
            row["tolerance"] = f"FAILED: {e}"
        note(f"{tag}: {row['rows']}; vs per-block reference (64 rows): {row['tolerance']}; "
             f"record M=16: {T.kernel_record(16, tw)}")
        for n2, k2, wq2, a2, aop2, cub16, cub4096 in shapes:
            tp = T.prepare(wq2, rule)
            t2 = f"[target {target} max {cap}] N={n2} K={k2} nseg={tp.nseg}"
            f2 = T.tc_matmul(a2, tp, path="prefill", a_op=aop2)
            bad2 = []
            for m in (1, 16, 33, 64):
                sub = type(a2)(a2.codes[:m], a2.scales[:m], a2.amax[:m], True)
                if not eq(T.tc_matmul(sub, tp, path="decode"), f2[:m]):
                    bad2.append(m)
            a16 = type(a2)(a2.codes[:16], a2.scales[:16], a2.amax[:16], True)
            op16 = T.decode_operand(aop2[:16], tp, 16)
            row[f"N={n2} K={k2}"] = {
                "nseg": tp.nseg, "decode_eq_prefill": not bad2, "per_row_weight": tp.per_row,
                "decode_16": rec(f"{t2} M=16 native decode", lambda: T.tc_matmul(a16, tp, path="decode", a_op=op16),
                                 cublas_ms=cub16, rows_eq_prefill=not bad2, nseg=tp.nseg),
                "prefill_4096": rec(f"{t2} M={NSEG_ROWS2} prefill", lambda: T.tc_matmul(a2, tp, path="prefill", a_op=aop2),
                                    cublas_ms=cub4096, nseg=tp.nseg)}
            for cfg in NSEG_OPTS["prefill_cfgs"] if tp.nseg > 1 else ():  # e.g. {"TWO_LAUNCH": true} at NSEG 2
                tpp = with_prefill(tp, cfg)
                ok = eq(T.tc_matmul(a2, tpp, path="prefill", a_op=aop2), f2)
                row[f"N={n2} K={k2}"][f"prefill_4096 {cfg}"] = rec(
                    f"{t2} M={NSEG_ROWS2} prefill {cfg}", lambda: T.tc_matmul(a2, tpp, path="prefill", a_op=aop2),
                    cublas_ms=cub4096, rows_eq=ok, nseg=tp.nseg)
            if tp.nseg == 2:  # variant 15's other choice for the two K segments (in the CTA or across CTAs)
                inside = not native.fused_segments(16, tp, 2)
                tpk = retuned(tp, native={"ks2": inside})
                ok = eq(T.tc_matmul(a16, tpk, path="decode", a_op=op16), f2[:16])
                lab = "inside the CTA (KS2)" if inside else "across CTAs + reduce"
                row[f"N={n2} K={k2}"][f"decode_16 segments {lab}"] = rec(
                    f"{t2} M=16 native decode, K segments {lab}",
                    lambda: T.tc_matmul(a16, tpk, path="decode", a_op=op16), cublas_ms=cub16, rows_eq_prefill=ok, nseg=tp.nseg)
            if bad2:
                note(f"{t2}: decode rows differ from prefill at M {bad2}")
        summary.append(row)
        with open(os.path.join(OUT_DIR["path"], "nseg.json"), "w") as f:  # after each candidate (a cut-off run keeps them)
            json.dump({"rows": ROWS, "notes": NOTES, "nseg": NSEG_SUMMARY}, f, indent=1)


NSEG_SUMMARY: dict = {}


def nseg_table() -> None:
    """The candidates side by side (printed last): us, and prefill as a multiple of cuBLAS bf16's time."""
    us = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    x = lambda v, c: "-" if v is None or not c else f"{v / c:.2f}x"  # noqa: E731
    cub, sc = NSEG_SUMMARY["cublas"], NSEG_SUMMARY["shapes_cublas"]
    big = str(NSEG_ROWS)
    print(f"\nN=K={NSEG_NK} cuBLAS bf16: M=1 {us(cub['1'])}, M=16 {us(cub['16'])}, M=64 {us(cub['64'])}, "
          f"M={big} {us(cub[big])} us; layer shapes M=16 / M={NSEG_ROWS2}: "
          + "; ".join(f"{key} {us(v[0])} / {us(v[1])}" for key, v in sc.items()))
    print("| target (max) | nseg | native dec M=1 | M=16 | M=64 | Triton M=16 | linear M=16 "
          "| prefill M=8192 | rows, tolerance |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in NSEG_SUMMARY["candidates"]:
        for v in (None, *NSEG_OPTS["variants"]):
            name = "native decode" if v is None else f"native decode v{v}"
            d = {m: r.get(f"{name} M={m}") for m in (1, 16, 64)}
            print(f"| {r['target']} ({r['max']}){'' if v is None else f' v{v}'} | {r['nseg']} | {us(d[1])} | {us(d[16])} | "
                  f"{us(d[64])} | {us(r.get('triton decode M=16'))} | "
                  f"{us(r.get('linear M=16'))} | {us(r['prefill_8192'])} ({x(r['prefill_8192'], cub[big])}) | "
                  f"{r['rows'][:60]}; {r['tolerance'][:40]} |")
    print("| target | " + " | ".join(sc) + " |  (nseg, native decode M=16 us, prefill M=4096 x cuBLAS)")
    print("|---|" + "---|" * len(sc))
    for r in NSEG_SUMMARY["candidates"]:
        cells = []
        for key, (c16, c4096) in sc.items():
            v = r.get(key)
            cells.append("-" if v is None else f"{v['nseg']}, {us(v['decode_16'])} ({x(c16, v['decode_16'])} faster), "
                         f"{x(v['prefill_4096'], c4096)}{'' if v['decode_eq_prefill'] else ' ROWS DIFFER'}")
        print(f"| {r['target']} | " + " | ".join(cells) + " |")


def table() -> None:
    rows_table(("bits_ok", "rows_eq_prefill", "rows_eq", "grouped_eq_per_expert"))
    print_notes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="checks,quantize,gemm,moe")
    ap.add_argument("--nseg-targets", default=",".join(str(t) for t, _ in NSEG_CANDIDATES),
                    help="SegmentRule.target candidates of the nseg section (max_segments 8)")
    ap.add_argument("--nseg-variants", default="", help="native decode variants timed beside the default (nseg)")
    ap.add_argument("--nseg-prefill-cfgs", default="[]", help="JSON list of prefill config overrides timed at NSEG > 1")
    args = ap.parse_args()
    NSEG_OPTS.update(candidates=tuple((int(t), 8) for t in args.nseg_targets.split(",") if t),
                     variants=tuple(int(v) for v in args.nseg_variants.split(",") if v),
                     prefill_cfgs=tuple(json.loads(args.nseg_prefill_cfgs)))
    OUT_DIR["path"] = args.out
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__, flush=True)
    for part in args.only.split(","):
        {"checks": checks, "quantize": quantize, "gemm": gemm, "moe": moe, "decode": decode, "nseg": nseg}[part]()
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump({"rows": ROWS, "notes": NOTES, "nseg": NSEG_SUMMARY}, f, indent=1)
    table()
    if NSEG_SUMMARY:
        nseg_table()


if __name__ == "__main__":
    main()
