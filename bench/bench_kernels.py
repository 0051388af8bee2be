# ruff: noqa: B023
"""NVFP4 kernel benchmarks on the H200, in one call: the bitwise checks, the issue's table, an HF forward.

    python bench/bench_kernels.py [--out DIR] [--skip-checks] [--only checks,quantize,linear,sweep,moe,e2e]

1. ``checks``: every named check of ``mismatch_probe.kernels.checks`` on the GPU (bitwise ones and
   the GEMM tolerance ones, each labelled).
2. ``quantize``: bf16 8192x8192 per-token 1x16 vs a device copy (bandwidth share).
3. ``linear``: N = K = 8192, M = 1, 16, 64, 8192: cuBLAS bf16, FP8 ``torch._scaled_mm`` (per-tensor
   scales), the tensor-core NVFP4 GEMM (auto path, A pre-quantized), decode-path variants, the
   linear with its per-token quantize; each variant's rows compared with the prefill path's; at
   M <= 64 also cuBLAS and the auto path with the weights rotating over 3 copies (the NVFP4 weight,
   40 MiB, fits the L2 when one repeats).
   The default decode path on CUDA is the native (CUDA C++) kernel when it builds; the Triton
   decode variants run on the weight retuned with ``DecodeTuning(native=False)``.
4. ``sweep``: rows identical for M in {1..3, 7..9, ..., 1000, 4096, 8192} at two row offsets, decode
   (native and Triton) and prefill paths, repeated runs (N = K = 8192).
5. ``moe``: Qwen3-30B-A3B experts (128, top-8, hidden 2048, intermediate 768), 16384 and 64 tokens:
   ``torch._grouped_mm`` bf16 vs the grouped NVFP4 GEMM; grouped == per-expert calls.
6. ``e2e``: HF forward of a Qwen3-0.6B-shaped model (random weights, built in memory): bf16 vs
   ``nvfp4-per-token`` linears only on 4 x 1024 tokens and on 1 x 16 (decode-shaped: the native
   decode GEMM), the whole ``nvfp4-per-token`` recipe on 1 x 256.

Tuning (``--nseg-long-k``, ``--two-launch``, ``--native-variant``) is one ``GemmTuning`` value
(``mismatch_probe.kernels.nvfp4.tuning``) passed to every weight this script prepares, to the named
checks and to the e2e forward's NVFP4 linears; per-variant rows retune a weight with
``TCWeight.tuned``.

Kernel timings: ``triton.testing.do_bench_cudagraph`` medians (launch overhead excluded, as under
CUDA graphs in a serving engine); a few rows also without graphs. The HF forward: wall time of
``model(ids)`` with a synchronize, median of 5 after 2 warm-ups. Prints a table last; writes
``results.json`` under ``--out``. Timings are never test assertions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

import torch
import triton

ROWS: list[dict[str, Any]] = []
NOTES: list[str] = []
GRAPH = {"on": True}
SEL: dict[str, Any] = {"variants": None, "triton_all": True, "tuning": None}  # --variants / --triton-decode / tuning


def tuning():  # noqa: ANN201
    """The GemmTuning of this run (the recipes' default unless the flags change it)."""
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

    return SEL["tuning"] or DEFAULT


def retuned(tw, **parts):  # noqa: ANN001, ANN003, ANN201
    """``tw`` (its prepared tensors shared) under this run's tuning with ``parts`` replaced (dicts of
    fields, as ``GemmTuning.with_``); the native layout is made once on ``tw`` first."""
    from mismatch_probe.kernels.nvfp4 import native

    if native.available() and not tw.grouped:
        native.decode_ok(tw)
    return tw.tuned(tw.tuning.with_(**parts))


def variants() -> list[int]:
    """The native decode variants to run per-variant rows, checks and sweeps for (--variants)."""
    from mismatch_probe.kernels.nvfp4 import native

    if not native.available():
        return []
    return [v for v in native.VARIANTS if SEL["variants"] is None or v in SEL["variants"]]


def bench(fn, rep: int = 100) -> float:  # noqa: ANN001
    if GRAPH["on"]:
        with torch.cuda.stream(torch.cuda.Stream()):
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def rec(name: str, fn, **meta) -> float | None:  # noqa: ANN001
    try:
        ms = bench(fn)
    except Exception as e:
        ROWS.append({"name": name, "ms": None, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(f"[bench] {name}: FAILED {type(e).__name__}: {str(e)[:1000]}", flush=True)
        return None
    ROWS.append({"name": name, "ms": ms, "graph": GRAPH["on"], **meta})
    print(f"[bench] {name}: {ms * 1e3:.1f} us", flush=True)
    return ms


def note(s: str) -> None:
    NOTES.append(s)
    print(f"[note] {s}", flush=True)


def eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def decode_inputs(n: int, k: int, rows: int, *, per_row: bool = False, quant=None, gen=None, tun=None):  # noqa: ANN001, ANN201
    """The GEMM benchmarks' shared set-up: a bf16 weight [n, k] (randn) quantized (per-row amax if
    ``per_row``) and prepared for tc_linear (under ``tun``, default :func:`tuning`), bf16 activations
    [rows, k] quantized per token and their fp16 GEMM operand. ``quant``: the quantizer (default
    ``nvfp4_quantize``); ``gen``: a generator."""
    from types import SimpleNamespace

    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    q = quant or nvfp4_quantize
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    wq = q(w, per_token=per_row)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    aq = q(x, per_token=True)
    return SimpleNamespace(w=w, wq=wq, tw=T.prepare(wq, tun or tuning()), x=x, aq=aq, aop=T.act_operand(aq))


def take_rows(a, off: int, m: int):  # noqa: ANN001, ANN201
    """Rows [off, off + m) of a per-token NVFP4Tensor."""
    return type(a)(a.codes[off:off + m], a.scales[off:off + m], a.amax[off:off + m], a.per_token)


def quant_setup(m: int = 8192, k: int = 8192) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """The quantizer benches' input x (bf16 randn [m, k]) and a buffer y like it, after timing the
    device copy y <- x (the bandwidth baseline); the bytes a per-token quantize of x moves; and the
    rec() keywords that relate a quantizer row to that copy."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    cb = 2 * x.numel() * 2
    copy = rec(f"copy bf16 {m}x{k} (read + write)", lambda: y.copy_(x), bytes=cb)
    qb = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + m * 4
    return x, y, qb, {"copy_ms": copy, "copy_bytes": cb}


def sweep_cases(aq, ms):  # noqa: ANN001, ANN201
    """(m, off, rows [off, off + m) of ``aq``) for every M in ``ms`` at row offsets 0 and 37, where they fit."""
    for m in ms:
        for off in (0, 37):
            if off + m <= aq.shape[0]:
                yield m, off, take_rows(aq, off, m)


def sweep_paths(aq, x: torch.Tensor, tw, full: torch.Tensor, ms) -> tuple[int, list]:  # noqa: ANN001
    """Rows of every path the dispatcher can take vs the same rows of ``full`` (prefill over all of
    ``aq``): prefill for every case of :func:`sweep_cases`, and for M <= 64 also the native decode,
    the Triton decode and the whole linear (``tc_linear`` on the bf16 rows of ``x``). Returns the
    number of comparisons and the (m, off, path) that differ."""
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    n_cmp, bad = 0, []
    tw_triton = retuned(tw, decode={"native": False})
    for m, off, sub in sweep_cases(aq, ms):
        want = full[off:off + m]
        for p in ("decode", "decode-triton", "prefill", "tc_linear") if m <= 64 else ("prefill",):
            n_cmp += 1
            twp = tw_triton if p == "decode-triton" else tw
            got = T.tc_linear(x[off:off + m], twp) if p == "tc_linear" else T.tc_matmul(sub, twp, path=p.split("-")[0])
            if not eq(got, want):
                bad.append((m, off, p))
    return n_cmp, bad


def section(fn):  # noqa: ANN001, ANN201
    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t0 = time.time()
        try:
            fn(*a, **k)
        except Exception:
            note(f"SECTION {fn.__name__} CRASHED: {traceback.format_exc()[-1500:]}")
        print(f"[bench] section {fn.__name__}: {time.time() - t0:.0f}s", flush=True)

    return run


@section
def checks() -> None:
    from mismatch_probe.kernels.checks import kind_label, run_checks

    res = run_checks(device="cuda", tuning=tuning())
    for r in res:
        print(f"[check] {r.status:4s} {r.seconds:6.2f}s {r.name} [{kind_label(r.exact, r.bound)}]: {r.detail[:200]}")
    ran = [r for r in res if r.status != "skip"]
    bad = [f"{r.name}: {r.detail[:300]}" for r in ran if r.status != "pass"]
    ex = [r for r in ran if r.exact]
    note(f"named checks on the H200: {sum(r.status == 'pass' for r in ran)}/{len(ran)} pass "
         f"({sum(r.status == 'pass' for r in ex)}/{len(ex)} bitwise, "
         f"{sum(r.status == 'pass' for r in ran if not r.exact)}/{len(ran) - len(ex)} tolerance); failures: {bad}")
    from mismatch_probe.kernels.nvfp4 import native

    for v in variants():  # every native decode variant (K/128/NSEG = 2 there)
        res = run_checks(["tc_gemm_decode_vs_reference", "tc_grouped_vs_reference"], device="cuda",
                         tuning=tuning().with_(native={"variant": v}))
        note(f"named checks with native decode variant {v} {native.VARIANTS[v]}: "
             f"{[(r.name, r.status, r.detail[:120]) for r in res]}")


@section
def quantize() -> None:
    from mismatch_probe.kernels import nvfp4_quantize, select_backend
    from mismatch_probe.kernels.nvfp4 import quant_fast as qf
    from mismatch_probe.kernels.nvfp4 import triton_quant as tq

    x, _, qb, kw = quant_setup()
    k = x.shape[1]
    rec("quantize per-token 1x16 (default kernel)", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, **kw)
    qf.QF_CFG["NATIVE"] = 0
    rec("quantize per-token 1x16, Triton kernel", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, **kw)
    qf.QF_CFG.pop("NATIVE")
    note(f"quantize backend: {select_backend('quantize')}")
    a1 = torch.tensor([float(x.float().abs().max())], device="cuda")
    rec("quantize per-tensor 1x16, amax given (static)", lambda: nvfp4_quantize(x, amax=a1), bytes=qb, **kw)
    rec("quantize per-token + fp16 GEMM operand (tc_linear's A)", lambda: qf.quantize_rows(x, None, True, emit_op=torch.float16),
        bytes=qb + x.numel() * 2, **kw)
    for m in (1, 16, 64):  # decode-sized: the operand chunk-major for the native decode GEMM (tc_linear's A there)
        xm = x[:m]
        for cm in (0, 1, 2):
            rec(f"quantize per-token M={m} + fp16 operand, {('row-major', 'chunk-major', 'core-matrix')[cm]}",
                lambda: qf.quantize_rows(xm, None, True, emit_op=torch.float16, op_layout=cm))
    wt = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    rec("fused RMSNorm + per-token quantize (writes y too)", lambda: qf.rmsnorm_quantize_rows(x, wt, 1e-6),
        bytes=qb + x.numel() * 2, **kw)
    tq.QUANT_IMPL = "v1"
    rec("quantize per-token, previous kernel (v1)", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, **kw)
    tq.QUANT_IMPL = "fast"


def rotation(w: torch.Tensor, tw, n: int = 3):  # noqa: ANN001, ANN201
    """``n`` bf16 weights like ``w`` (``w`` first) and their prepared NVFP4 weights (``tw`` first): the
    weight sets of the rotating rows."""
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    ws = [w] + [torch.randn_like(w) for _ in range(n - 1)]
    return ws, [tw] + [T.prepare(nvfp4_quantize(v), tw.tuning) for v in ws[1:]]


def rotating(f, n: int = 3):  # noqa: ANN001, ANN201
    """A callable that runs ``f(i)`` for i = 0, 1, .., n - 1, 0, ... on successive calls (so each launch
    captured in do_bench_cudagraph's graph uses the next weight set)."""
    it = itertools.count()
    return lambda: f(next(it) % n)


@section
def linear() -> None:
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    d = decode_inputs(8192, 8192, 8192)
    w, tw, X, aq, aop = d.w, d.tw, d.x, d.aq, d.aop
    full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
    rw, rtw = rotation(w, tw)  # the weight sets of the decode rows with rotating weights
    w8 = w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    for m in (1, 16, 64, 8192):
        x, a, op = X[:m], take_rows(aq, 0, m), aop[:m]
        tag = f"N=K=8192 M={m}"
        cub = rec(f"{tag} cuBLAS bf16", lambda: x @ w.t(), m=m)
        x8 = x.to(torch.float8_e4m3fn)
        rec(f"{tag} FP8 _scaled_mm", lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            m=m, cublas_ms=cub)
        p = T.choose(m, tw)
        opd = T.decode_operand(op, tw, m)  # the operand as the quantizer writes it for this path (tc_linear)
        lay = {4: "chunk-major", 5: "core-matrix"}.get(opd.dim(), "row-major")
        rec(f"{tag} NVFP4 GEMM auto ({p}), A quantized ({lay} operand)", lambda: T.tc_matmul(a, tw, a_op=opd), m=m,
            cublas_ms=cub, rows_eq_prefill=eq(T.tc_matmul(a, tw, a_op=opd), full[:m]))
        rec(f"{tag} NVFP4 linear incl. per-token quantize", lambda: T.tc_linear(x, tw), m=m, cublas_ms=cub)
        if m <= 64:  # weights rotating over 3 copies: every launch reads its weight from HBM (the NVFP4
            # weight, 40 MiB, fits the 60 MB L2 when the same one repeats; the bf16 one, 128 MiB, does not)
            cub_r = rec(f"{tag} cuBLAS bf16, weights rotating x3", rotating(lambda i: x @ rw[i].t()), m=m, rot=3)
            rec(f"{tag} NVFP4 GEMM auto ({p}), weights rotating x3", rotating(lambda i: T.tc_matmul(a, rtw[i], a_op=opd)),
                m=m, cublas_ms=cub_r, rot=3)
        if m <= 64:
            bm = 16 if m <= 16 else 64
            tcfgs = (("decode Triton (default config)", {}),
                     ("decode swap (weights on MMA M)", {"SWAP": True, "BN": 64, "BM": bm}),
                     ("decode ns BN32", {"BN": 32, "BM": bm}),
                     ("decode ns BN64 s3", {"BN": 64, "BM": bm, "num_stages": 3}),
                     ("decode ns BN64 cpi2", {"BN": 64, "BM": bm, "CPI": 2}), ("decode no-asm", {"USE_ASM": False}))
            from mismatch_probe.kernels.nvfp4.tuning import DecodeTuning

            for name, cfg in tcfgs if SEL["triton_all"] else tcfgs[:1]:
                twc = retuned(tw, decode=DecodeTuning.from_config({**cfg, "NATIVE": False}))
                try:
                    ok = eq(T.tc_matmul(a, twc, path="decode", a_op=op), full[:m])
                except Exception as e:
                    note(f"{tag} {name} failed: {type(e).__name__}: {str(e)[:800]}")
                    continue
                rec(f"{tag} NVFP4 {name}", lambda: T.tc_matmul(a, twc, path="decode", a_op=op), m=m, cublas_ms=cub,
                    rows_eq_prefill=ok)
            from mismatch_probe.kernels.nvfp4 import native

            for v in variants():
                if v == 3 and m > 16:
                    continue  # the same instance as variant 0 there
                twv = retuned(tw, native={"variant": v})
                r_ = native.decode_variant(m, twv)
                opv = T.decode_operand(op, twv, m)
                try:
                    ok = eq(T.tc_matmul(a, twv, path="decode", a_op=opv), full[:m])
                except Exception as e:
                    note(f"{tag} native variant {v} failed: {type(e).__name__}: {str(e)[:800]}")
                    continue
                lab = ", ".join(str(r_[key]) for key in ("pipeline", "scales", "decode") if key in r_)
                rec(f"{tag} NVFP4 decode native v{v} ({lab}, {r_['STAGES']} stages x {r_['CPS']} chunks)",
                    lambda: T.tc_matmul(a, twv, path="decode", a_op=opv), m=m, cublas_ms=cub, rows_eq_prefill=ok)
            rec(f"{tag} NVFP4 prefill path", lambda: T.tc_matmul(a, tw, path="prefill", a_op=op), m=m, cublas_ms=cub)
        GRAPH["on"] = False
        rec(f"{tag} cuBLAS bf16, no CUDA graph", lambda: x @ w.t(), m=m)
        rec(f"{tag} NVFP4 linear incl. quantize, no CUDA graph", lambda: T.tc_linear(x, tw), m=m, cublas_ms=cub)
        GRAPH["on"] = True
    note(f"N=K=8192 records: M=16 {T.kernel_record(16, tw)}; M=8192 {T.kernel_record(8192, tw)}")
    note(f"N=K=8192: nseg={tw.nseg}, decode chunk {tw.bkc}; Triton decode config M=16: "
         f"{T.decode_config(16, tuning=tw.tuning.decode)}; "
         f"prefill: {T.prefill_config(tw.nseg, 8192 // tw.nseg, tw.tuning.prefill)}")


@section
def sweep() -> None:
    from mismatch_probe.kernels.nvfp4 import native

    dv = tuning().native.variant
    dv = native.default_variant() if dv is None else dv
    _sweep(f"default (native decode variant {dv})")
    _sweep(f"default (native decode variant {dv}), padded rows and K segments", 1000, 2048)
    for v in variants():
        if v not in (dv, 3):
            _sweep(f"native decode variant {v} {native.VARIANTS[v]}", tun=tuning().with_(native={"variant": v}))


def _sweep(label: str, n: int = 8192, k: int = 8192, tun=None) -> None:  # noqa: ANN001
    from mismatch_probe.kernels.checks import TC_MS, tc_within_bound
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    d = decode_inputs(n, k, 8192 + 64, tun=tun)
    wq, tw, X, aq = d.wq, d.tw, d.x, d.aq
    full = T.tc_matmul(aq, tw, path="prefill")
    bad = [] if eq(T.tc_matmul(aq, tw, path="prefill"), full) else ["repeat"]
    n_cmp, differ = sweep_paths(aq, X, tw, full, TC_MS)
    bad += differ
    tol = tc_within_bound(full[:64], take_rows(aq, 0, 64), wq)
    note(f"sweep [{label}] N={n} K={k} (nseg {tw.nseg}), M in {TC_MS} at offsets 0 and 37: {n_cmp} comparisons, "
         f"{'ALL ROWS IDENTICAL' if not bad else f'DIFFER: {bad}'}; repeat identical; vs per-block reference: {tol}")


@section
def moe() -> None:
    from mismatch_probe.kernels import gather_rows, moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    e, top, hidden, inter = 128, 8, 2048, 768
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        wb = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        tw = T.prepare(quantize_expert_weights(wb), tuning())
        wt = wb.transpose(1, 2)
        for t in (16384, 64):
            ids = torch.topk(torch.rand(t, e, device="cuda"), top, dim=1).indices
            perm, offsets = moe_route(ids, e)
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            a = gather_rows(nvfp4_quantize(x, per_token=True), perm // top)
            aop = T.act_operand(a)
            xa = x[perm // top].contiguous()
            offs32 = offsets[1:].to(torch.int32)
            tag = f"MoE {name} E=128 top8 N={n} K={k} T={t}"
            gm = rec(f"{tag} torch._grouped_mm bf16", lambda: torch._grouped_mm(xa, wt, offs=offs32))
            y = T.tc_grouped(a, offsets, tw, a_op=aop)
            ol = offsets.tolist()
            bad = []
            for ex in range(0, e, 9):
                if ol[ex + 1] > ol[ex]:
                    sub = type(a)(a.codes[ol[ex]:ol[ex + 1]], a.scales[ol[ex]:ol[ex + 1]], a.amax[ol[ex]:ol[ex + 1]], True)
                    if not eq(T.tc_matmul(sub, tw.expert(ex)), y[ol[ex]:ol[ex + 1]]):
                        bad.append(ex)
            p = T.choose(max(1, t * top // e), tw)
            rec(f"{tag} NVFP4 grouped auto ({p})", lambda: T.tc_grouped(a, offsets, tw, a_op=aop), grouped_mm_ms=gm,
                grouped_eq_per_expert=not bad)
            other = "prefill" if p == "decode" else None
            if other:
                rec(f"{tag} NVFP4 grouped {other}", lambda: T.tc_grouped(a, offsets, tw, path=other, a_op=aop),
                    grouped_mm_ms=gm, rows_eq_auto=eq(T.tc_grouped(a, offsets, tw, path=other, a_op=aop), y))
                tws = retuned(tw, decode={"swap": True})
                rec(f"{tag} NVFP4 grouped decode swap", lambda: T.tc_grouped(a, offsets, tws, path="decode", a_op=aop),
                    grouped_mm_ms=gm, rows_eq_auto=eq(T.tc_grouped(a, offsets, tws, path="decode", a_op=aop), y))
            rec(f"{tag} NVFP4 grouped incl. per-token quantize + gather",
                lambda: T.tc_grouped(gather_rows(nvfp4_quantize(x, per_token=True), perm // top), offsets, tw),
                grouped_mm_ms=gm)


@section
def e2e() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mismatch_probe.probes.hf.patch import patch

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")

    def timed(label: str, inp: torch.Tensor, runs: int = 5, warm: int = 2) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            for _ in range(warm):
                model(inp)
            torch.cuda.synchronize()
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                out = model(inp).logits
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
        ms = sorted(ts)[len(ts) // 2] * 1e3
        b, t = inp.shape
        ROWS.append({"name": f"HF forward Qwen3-0.6B-shaped, {b} x {t} tokens: {label}", "ms": ms, "graph": False,
                     "e2e": True})
        print(f"[bench] e2e {label} {b}x{t}: {ms:.1f} ms", flush=True)
        return ms, out.float()

    small = ids[:1, :256]
    for inp, label, ops, runs in ((ids, "nvfp4-per-token, linears only", ["linear"], 5),
                                  (ids[:1, :16], "nvfp4-per-token, linears only, decode-shaped (M = 16)", ["linear"], 5),
                                  (small, "nvfp4-per-token, whole recipe (strict norm/act/rope/attention too)", None, 1)):
        base, lb = timed("bf16 (engine)", inp, runs=runs)
        with patch(model, "nvfp4-per-token", ops=ops) as h:
            for st in h.nvfp4.values():  # this run's tuning (weights are prepared at the first call)
                st.tuning = tuning()
            t, lo = timed(label, inp, runs=runs, warm=1 if ops is None else 2)
            ROWS[-1]["vs_bf16"] = base / t
            summ = h.describe().get("nvfp4_kernels") or {}
            paths = sorted({p for s in summ.values() for p in s["paths_used"]})
            kern = next(iter(summ.values()), {}).get("kernel") or {}
            note(f"e2e {label}: {len(summ)} NVFP4 linears, paths used {paths}; logits vs bf16 max |d| "
                 f"{float((lo - lb).abs().max()):.3g}; first linear's manifest record: backend {kern.get('backend')}, "
                 f"path {kern.get('path')}, config {kern.get('config')}")


EQ_KEYS = ("rows_eq_prefill", "rows_eq_auto", "grouped_eq_per_expert")


def rows_table(eq_keys: tuple[str, ...] = EQ_KEYS) -> None:
    """ROWS as a table: the median and what follows from it (bandwidth, share of the copy bandwidth,
    speed vs cuBLAS bf16 / _grouped_mm / the bf16 forward) and the bit-equality flags ``eq_keys``."""
    print("\n| workload | median | derived |")
    print("|---|---:|---|")
    for r in ROWS:
        if r.get("ms") is None:
            print(f"| {r['name']} | failed | {r.get('error', '')[:100]} |")
            continue
        ms = r["ms"]
        val = f"{ms:.1f} ms" if r.get("e2e") else f"{ms * 1e3:.1f} us"
        d = []
        if "bytes" in r:
            d.append(f"{r['bytes'] / ms / 1e6:.0f} GB/s")
            if r.get("copy_ms"):
                d.append(f"{(r['bytes'] / ms) / (r['copy_bytes'] / r['copy_ms']) * 100:.0f}% of copy bandwidth")
        for key, lab in (("cublas_ms", "cuBLAS bf16"), ("grouped_mm_ms", "_grouped_mm")):
            if r.get(key):
                d.append(f"{r[key] / ms:.2f}x speed of {lab}")
        if r.get("vs_bf16"):
            d.append(f"{r['vs_bf16']:.2f}x speed of bf16")
        d += [f"{key}={r[key]}" for key in eq_keys if r.get(key) is not None]
        if not r.get("graph", True) and not r.get("e2e"):
            d.append("no CUDA graph")
        print(f"| {r['name']} | {val} | {', '.join(d)} |")


def print_notes() -> None:
    print("\nnotes:")
    for s in NOTES:
        print(" -", s[:900])


def table() -> None:
    rows_table()
    print_notes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--only", default="checks,quantize,linear,sweep,moe,e2e")
    ap.add_argument("--native-variant", type=int, default=None, help="the native decode variant to use by default")
    ap.add_argument("--variants", default=None, help="native decode variants for the per-variant rows (default: all)")
    ap.add_argument("--nseg-long-k", type=int, default=None,
                    help="SegmentRule.long_k: split a K of at least this in two where the tiles fill the GPU (changes bits)")
    ap.add_argument("--two-launch", nargs="?", const="on", choices=("on", "off"), default=None,
                    help="PrefillTuning.two_launch: two-segment prefill as two launches (on: the default since 21:11)")
    ap.add_argument("--triton-decode", choices=("all", "default"), default="all",
                    help="Triton decode configs timed in 'linear' (default: only the default config)")
    args = ap.parse_args()
    SEL["variants"] = None if args.variants is None else {int(v) for v in args.variants.split(",")}
    SEL["triton_all"] = args.triton_decode == "all"
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

    parts: dict[str, dict[str, Any]] = {}
    if args.nseg_long_k is not None:
        parts["segments"] = {"long_k": args.nseg_long_k or None}
    if args.two_launch is not None:
        parts["prefill"] = {"two_launch": args.two_launch == "on"}
    if args.native_variant is not None:
        parts["native"] = {"variant": args.native_variant}
    SEL["tuning"] = DEFAULT.with_(**parts)
    if not torch.cuda.is_available():
        print("error: the benchmarks need a CUDA GPU (none found)", file=sys.stderr)
        return 2
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "command": " ".join(sys.argv)}
    try:
        from mismatch_probe.kernels.nvfp4 import native

        nv = SEL["tuning"].native.variant
        info["native_default_variant"] = native.default_variant() if nv is None else nv
        info["nseg_long_k"] = SEL["tuning"].segments.long_k
        info["prefill_two_launch"] = SEL["tuning"].prefill.two_launch
    except ImportError:
        pass
    print(info, flush=True)
    parts = [p for p in args.only.split(",") if not (args.skip_checks and p == "checks")]
    fns = {"checks": checks, "quantize": quantize, "linear": linear, "sweep": sweep, "moe": moe, "e2e": e2e}
    for part in parts:
        fns[part]()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"info": info, "rows": ROWS, "notes": NOTES}, f, indent=1)
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
