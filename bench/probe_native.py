# ruff: noqa: B023
"""One-call GPU probe of the native (CUDA C++) NVFP4 backend: build, bitwise checks, timings.

    python bench/probe_native.py --out DIR [--only build,checks,quant,decode]

1. ``build``: compile ``kernels/nvfp4/csrc/`` (``nvfp4_native.cu`` and the headers it includes; timed).
2. ``checks``: the named checks of ``kernels/checks.py`` with the native backend on (the bf16
   quantizer checks and the tensor-core GEMM checks run it), then at 8192^2: native quantizer ==
   reference (random, tie-heavy, NaN/Inf rows; codes, scales, amax; fp16 operand == Triton's), and
   native decode rows == prefill rows == Triton decode rows for M in the issue's list <= 64 at
   offsets 0 and 37; per-row weight amax; N = 1000, K = 1024 (padding, K segments).
3. ``quant`` / ``decode``: CUDA-graph medians side by side (copy, Triton, native; cuBLAS bf16,
   FP8 ``_scaled_mm``, Triton decode, native decode variants).

Prints a table last; writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from bench_kernels import (  # noqa: E402
    NOTES,
    ROWS,
    decode_inputs,
    eq,
    note,
    quant_setup,
    rec,
    retuned,
    section,
    table,
    take_rows,
)

MS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64)


@section
def build() -> None:
    from mismatch_probe.kernels.nvfp4 import native

    t0 = time.time()
    ok = native.available()
    note(f"native build: available={ok} in {time.time() - t0:.1f}s; status {native.status()}")


@section
def checks() -> None:
    from mismatch_probe.kernels.checks import CHECKS, run_checks

    names = [c.name for c in CHECKS if c.name.startswith(("quant_", "tc_", "dequant"))]
    res = run_checks(names)
    bad = [f"{r.name}: {r.detail[:300]}" for r in res if r.status == "fail"]
    note(f"named checks with native on: {sum(r.status == 'pass' for r in res)}/{len(res)} pass; fails: {bad}")
    q_checks()
    d_checks()


def q_checks() -> None:
    from mismatch_probe.kernels import nvfp4_quantize_ref
    from mismatch_probe.kernels.nvfp4 import native
    from mismatch_probe.kernels.nvfp4 import quant_fast as qf

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    x[1] *= 0  # zero row
    x[2, 5] = float("nan")
    x[3, 100] = float("inf")
    x[4] = x[4] * 1e-30
    x[5] = (torch.randint(-12, 13, (8192,), device="cuda", generator=g) * 0.25).to(torch.bfloat16)  # ties
    x[6, :16] = -0.0
    x[7] = x[7] * torch.exp(torch.randn(8192, device="cuda", generator=g) * 3).to(torch.bfloat16)
    r = nvfp4_quantize_ref(x, per_token=True)
    c, s, a, op = native.quantize_rows(x, None, True, emit_op=torch.float16)
    ok = torch.equal(c, r.codes) and torch.equal(s, r.scales) and torch.equal(a.view(torch.int32), r.amax.view(torch.int32))
    qf.QF_CFG["NATIVE"] = 0
    c2, s2, a2, op2 = qf.quantize_rows(x, None, True, emit_op=torch.float16)
    qf.QF_CFG.pop("NATIVE")
    fin = ~torch.isnan(op2)
    ok_op = torch.equal(op.view(torch.int16)[fin], op2.view(torch.int16)[fin]) and torch.equal(torch.isnan(op), ~fin)
    amax1 = r.amax.max().reshape(1)
    r1 = nvfp4_quantize_ref(x, amax=amax1)
    c3, s3, _, _ = native.quantize_rows(x, amax1, False)
    ok_t = torch.equal(c3, r1.codes) and torch.equal(s3, r1.scales)
    mism = int((c != r.codes).sum()) + int((s != r.scales).sum())
    note(f"native quantizer 8192^2 (zero/NaN/Inf/tiny/ties/-0/heavy rows): per-token == ref {ok} (mismatched bytes {mism}); "
         f"fp16 operand == Triton's {ok_op}; per-tensor given amax == ref {ok_t}")


def d_checks() -> None:
    from mismatch_probe.kernels import nvfp4_quantize_ref
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    def one(n: int, k: int, per_row: bool, label: str, ms=MS) -> None:  # noqa: ANN001
        g = torch.Generator(device="cuda").manual_seed(n + k)
        d = decode_inputs(n, k, 160, per_row=per_row, quant=nvfp4_quantize_ref, gen=g)
        tw, aq, aop = d.tw, d.aq, d.aop
        full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
        tw_triton = retuned(tw, decode={"native": False})
        bad, nat = [], 0
        for m in ms:
            for off in (0, 37):
                sub = take_rows(aq, off, m)
                nat += int(T.use_native(tw, aop, tw.nseg))
                y = T.tc_matmul(sub, tw, path="decode")
                yt = T.tc_matmul(sub, tw_triton, path="decode")
                if not eq(y, full[off:off + m]):
                    bad.append((m, off, "native"))
                if not eq(yt, full[off:off + m]):
                    bad.append((m, off, "triton"))
        y2 = T.tc_matmul(take_rows(aq, 0, 16), tw, path="decode")
        rep = eq(y2, T.tc_matmul(take_rows(aq, 0, 16), tw, path="decode"))
        note(f"native decode {label} N={n} K={k} nseg={tw.nseg}: {len(ms) * 2} (M, offset) pairs, native used {nat}; "
             f"{'ALL ROWS IDENTICAL to prefill (native and Triton decode)' if not bad else f'DIFFER {bad[:12]}'}; "
             f"repeat identical {rep}; record {T.kernel_record(16, tw)}")

    one(8192, 8192, False, "per-tensor weight amax")
    one(4096, 8192, True, "per-row weight amax", (1, 16, 33, 64))
    one(1000, 1024, False, "padded rows, K segments", (1, 7, 16, 17, 64))


@section
def quant() -> None:
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import quant_fast as qf

    x, y, qb, kw = quant_setup()
    rec("quantize per-token 1x16, native", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, **kw)
    a1 = torch.tensor([float(x.float().abs().max())], device="cuda")
    rec("quantize per-tensor 1x16, amax given, native", lambda: nvfp4_quantize(x, amax=a1), bytes=qb, **kw)
    rec("quantize per-token + fp16 operand, native", lambda: qf.quantize_rows(x, None, True, emit_op=torch.float16),
        bytes=qb + x.numel() * 2, **kw)
    qf.QF_CFG["NATIVE"] = 0
    rec("quantize per-token 1x16, Triton", lambda: nvfp4_quantize(x, per_token=True), bytes=qb, **kw)
    qf.QF_CFG.pop("NATIVE")
    rec("copy bf16 8192x8192 again", lambda: y.copy_(x), bytes=kw["copy_bytes"])


@section
def decode() -> None:
    from mismatch_probe.kernels.nvfp4 import native
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    d = decode_inputs(8192, 8192, 64)
    w, tw, X, aq, aop = d.w, d.tw, d.x, d.aq, d.aop
    w8 = w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    for m in (1, 8, 16, 32, 64):
        x, a, op = X[:m], take_rows(aq, 0, m), aop[:m]
        tag = f"N=K=8192 M={m}"
        ref = T.tc_matmul(a, tw, path="prefill", a_op=op)
        cub = rec(f"{tag} cuBLAS bf16", lambda: x @ w.t(), m=m)
        x8 = x.to(torch.float8_e4m3fn)
        rec(f"{tag} FP8 _scaled_mm", lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            m=m, cublas_ms=cub)
        twt = retuned(tw, decode={"native": False})
        rec(f"{tag} Triton decode", lambda: T.tc_matmul(a, twt, path="decode", a_op=op), m=m, cublas_ms=cub,
            rows_eq_prefill=eq(T.tc_matmul(a, twt, path="decode", a_op=op), ref))
        for v in native.VARIANTS:
            twv = retuned(tw, native={"variant": v})
            lab = f" v{v}: {native.VARIANTS[v]}"
            rec(f"{tag} native decode" + lab, lambda: T.tc_matmul(a, twv, path="decode", a_op=op),
                m=m, cublas_ms=cub, rows_eq_prefill=eq(T.tc_matmul(a, twv, path="decode", a_op=op), ref))
        rec(f"{tag} native linear incl. per-token quantize", lambda: T.tc_linear(x, tw), m=m, cublas_ms=cub,
            rows_eq_prefill=eq(T.tc_linear(x, tw), ref))
    wb = 8192 * 8192 // 2 + 8192 * 8192 // 16
    note(f"weight bytes streamed (codes + scales) {wb / 1e6:.1f} MB; record M=16: {T.kernel_record(16, tw)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="build,checks,quant,decode")
    args = ap.parse_args()
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    print(info, flush=True)
    fns = {"build": build, "checks": checks, "quant": quant, "decode": decode}
    for part in args.only.split(","):
        fns[part]()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "native.json"), "w") as f:
            json.dump({"info": info, "rows": ROWS, "notes": NOTES}, f, indent=1)
    table()


if __name__ == "__main__":
    main()
