# ruff: noqa: B023
"""NVFP4 kernel benchmarks (H200): quantize vs copy bandwidth, aligned W4A4 linear vs cuBLAS BF16,
MoE grouped GEMM vs torch._grouped_mm. Also runs the bitwise checks on the GPU first.

    python bench/bench_kernels.py [--out DIR] [--skip-checks] [--quick]

Prints a table last; writes ``results.json`` under ``--out``. Timings: triton.testing.do_bench
median (ms). Never used as a test assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

# Sizes and device; ``--dry-run`` shrinks them and runs each function once on CPU (interpreter)
# to catch script errors before a GPU run.
DEV = "cuda"
S: dict[str, Any] = {"quant": 8192, "nk": 8192, "ms": (1, 16, 64, 8192), "big_m": 8192,
                     "moe": (128, 8, 2048, 768), "tokens": (16384, 64)}
DRY = False


def _bench(fn, rep: int = 200) -> float:  # noqa: ANN001
    if DRY:
        fn()
        return 1.0
    import triton

    return float(triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median"))


def _safe(rows: list[dict[str, Any]], name: str, fn, **meta) -> float | None:  # noqa: ANN001
    try:
        ms = _bench(fn)
    except Exception as e:  # keep going: one failure should not lose the whole run
        rows.append({"name": name, "ms": None, "error": f"{type(e).__name__}: {str(e)[:200]}", **meta})
        print(f"[bench] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    rows.append({"name": name, "ms": ms, **meta})
    print(f"[bench] {name}: {ms * 1e3:.1f} us", flush=True)
    return ms


def bench_quantize(rows: list[dict[str, Any]], quick: bool) -> None:
    import torch

    from mismatch_probe.kernels import nvfp4_quantize, nvfp4_quantize_ref

    m = k = S["quant"]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    cbytes = 2 * x.numel() * 2
    copy_ms = _safe(rows, f"copy bf16 {m}x{k} (read+write)", lambda: y.copy_(x), bytes=cbytes)
    qbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + m * 4
    from mismatch_probe.kernels import triton_nvfp4 as tq

    amax1 = torch.tensor([float(x.float().abs().max())], device=DEV)
    for impl in ("v2", "v1"):
        tq.QUANT_IMPL = impl
        _safe(rows, f"quantize per-token 1x16: Triton {impl}", lambda: nvfp4_quantize(x, per_token=True), bytes=qbytes,
              copy_ms=copy_ms, copy_bytes=cbytes)
        _safe(rows, f"quantize per-tensor 1x16, amax given: Triton {impl}", lambda: nvfp4_quantize(x, amax=amax1),
              bytes=qbytes, copy_ms=copy_ms, copy_bytes=cbytes)
    tq.QUANT_IMPL = "v1"
    _safe(rows, "quantize per-tensor 1x16 incl. Triton amax pass", lambda: nvfp4_quantize(x), bytes=qbytes,
          copy_ms=copy_ms, copy_bytes=cbytes)
    _safe(rows, "quantize per-token 1x16: reference eager torch", lambda: nvfp4_quantize_ref(x, per_token=True),
          bytes=qbytes, copy_ms=copy_ms, copy_bytes=cbytes)
    if not quick and not DRY:
        try:
            comp = torch.compile(lambda t: nvfp4_quantize_ref(t, per_token=True))
            comp(x)
            _safe(rows, "quantize per-token 1x16: reference torch.compile", lambda: comp(x), bytes=qbytes,
                  copy_ms=copy_ms, copy_bytes=cbytes)
        except Exception as e:
            rows.append({"name": "quantize reference torch.compile", "ms": None, "error": str(e)[:200]})


def bench_linear(rows: list[dict[str, Any]], quick: bool) -> None:
    import torch

    from mismatch_probe.kernels import (
        aligned_linear,
        nvfp4_dequantize_ref,
        nvfp4_quantize,
        nvfp4_quantize_ref,
        w4a4_gemm_ref,
        w4a4_matmul,
    )
    from mismatch_probe.kernels.aligned_linear import choose_path
    from mismatch_probe.kernels.nvfp4_ref import NVFP4Tensor

    n = k = S["nk"]
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    wq = nvfp4_quantize(w)
    w_deq = nvfp4_dequantize_ref(wq, torch.bfloat16)
    for m in S["ms"]:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        xq = nvfp4_quantize(x, per_token=True)
        flops = 2 * m * n * k
        cub = _safe(rows, f"M={m}: cuBLAS bf16 x @ w.t()", lambda: x @ w.t(), m=m, flops=flops)
        r = min(m, 64)
        ref = w4a4_gemm_ref(NVFP4Tensor(xq.codes[:r], xq.scales[:r], xq.amax[:r], True), wq).view(torch.int16)

        def same(p: str) -> bool:
            try:
                return bool(torch.equal(w4a4_matmul(xq, wq, path=p)[:r].view(torch.int16), ref))
            except Exception:
                return False

        _safe(rows, f"M={m}: W4A4 GEMM (auto path = {choose_path(m)}, A pre-quantized)", lambda: w4a4_matmul(xq, wq),
              m=m, flops=flops, cublas_ms=cub, bits_equal_ref=same("auto"), max_abs_diff_ref=-1.0)
        for alt in ("fma", "fp4", "fp4w", "fp4w-swap", "bf16"):
            if alt != choose_path(m) and (m < S["big_m"] or alt == "fp4w"):
                _safe(rows, f"M={m}: W4A4 GEMM ({alt} path)", lambda: w4a4_matmul(xq, wq, path=alt), m=m,
                      flops=flops, cublas_ms=cub, bits_equal_ref=same(alt), max_abs_diff_ref=-1.0)
        _safe(rows, f"M={m}: aligned_linear incl. per-token quantize", lambda: aligned_linear(x, wq), m=m, flops=flops,
              cublas_ms=cub)
        _safe(
            rows, f"M={m}: naive path (ref quantize->dequantize->bf16 matmul)",
            lambda: nvfp4_dequantize_ref(nvfp4_quantize_ref(x, per_token=True), torch.bfloat16) @ w_deq.t(),
            m=m, flops=flops, cublas_ms=cub,
        )


def bench_sweep(rows: list[dict[str, Any]], quick: bool) -> None:
    """Config sweep of the W4A4 GEMM and the quantizer. Every GEMM config's output is compared
    bitwise with the pure-torch reference (first 64 rows at M=8192)."""
    import torch

    from mismatch_probe.kernels import nvfp4_quantize, w4a4_gemm_ref, w4a4_matmul
    from mismatch_probe.kernels import triton_nvfp4 as tq
    from mismatch_probe.kernels.nvfp4_ref import NVFP4Tensor

    n = k = S["nk"]
    x = torch.randn(S["big_m"], k, device=DEV, dtype=torch.bfloat16)
    qbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + x.shape[0] * 4
    for nw in (4, 8, 16):
        tq.QUANT_NUM_WARPS = nw
        _safe(rows, f"sweep quantize per-token v2 num_warps={nw}", lambda: nvfp4_quantize(x, per_token=True),
              bytes=qbytes)
    tq.QUANT_NUM_WARPS = None
    wq = nvfp4_quantize(torch.randn(n, k, device=DEV, dtype=torch.bfloat16))

    def cfg(p: str, bm: int, bn: int, nw: int, ns: int, ks: int = 8) -> tuple[str, dict[str, int]]:
        return p, {"BM": bm, "BN": bn, "num_warps": nw, "num_stages": ns, "KSTEP": ks}

    bm = S["big_m"]
    sweeps = {
        1: [cfg("fma", 1, bn, nw, 3) for bn in (16, 32, 64) for nw in (2, 4)],
        16: [cfg("fma", 16, bn, nw, 3) for bn in (16, 32, 64) for nw in (2, 4)]
        + [cfg("fp4w-swap", 16, bn, 4, 3, ks) for bn in (64, 128) for ks in (2, 8)]
        # diagnostics: mma.sync (BM or BN < 64) variants, wrong on the 2026-11-29 run
        + [cfg("fp4w", 16, 32, 4, 4), cfg("bf16", 16, 32, 4, 4), cfg("fp4w-swap", 16, 32, 4, 4)],
        bm: [cfg("bf16", *c) for c in ((128, 128, 8, 3, 8), (128, 128, 8, 3, 2), (128, 128, 8, 4, 1),
                                         (64, 128, 4, 3, 2), (128, 64, 4, 3, 2), (128, 256, 8, 3, 1))],
    }
    for m, cfgs in sweeps.items():
        xq = nvfp4_quantize(x[:m], per_token=True)
        r = min(m, 64)
        ref = w4a4_gemm_ref(NVFP4Tensor(xq.codes[:r], xq.scales[:r], xq.amax[:r], True), wq).view(torch.int16)
        for p, c in cfgs:
            name = f"sweep M={m} {p} BM={c['BM']} BN={c['BN']} w={c['num_warps']} s={c['num_stages']} k={c['KSTEP']}"
            try:
                got = w4a4_matmul(xq, wq, path=p, config=c)
                same = torch.equal(got[:r].view(torch.int16), ref)
                diff = float((got[:r].float() - ref.view(torch.bfloat16).float()).abs().max())
            except Exception as e:
                rows.append({"name": name, "ms": None, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                print(f"[bench] {name}: FAILED {e}", flush=True)
                continue
            _safe(rows, name, lambda: w4a4_matmul(xq, wq, path=p, config=c), flops=2 * m * n * k,
                  bits_equal_ref=same, max_abs_diff_ref=diff)


def bench_moe(rows: list[dict[str, Any]], quick: bool) -> None:
    import torch

    from mismatch_probe.kernels import grouped_w4a4, moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.grouped_gemm import gather_rows

    e, top, hidden, inter = S["moe"]
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        wb = torch.randn(e, n, k, device=DEV, dtype=torch.bfloat16) * 0.05
        wq = quantize_expert_weights(wb)
        wt = wb.transpose(1, 2)  # [E, K, N] view (column-major per expert) for torch._grouped_mm
        for t in S["tokens"]:
            ids = torch.topk(torch.rand(t, e, device=DEV), top, dim=1).indices
            perm, offsets = moe_route(ids, e)
            x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
            a = gather_rows(nvfp4_quantize(x, per_token=True), perm // top)
            xa = x[perm // top].contiguous()
            offs32 = offsets[1:].to(torch.int32)
            off = offsets.tolist()
            flops = 2 * t * top * n * k
            tag = f"MoE {name} E={e} top{top} N={n} K={k} T={t}"
            gm = None
            if hasattr(torch, "_grouped_mm"):
                gm = _safe(rows, f"{tag}: torch._grouped_mm bf16", lambda: torch._grouped_mm(xa, wt, offs=offs32),
                           flops=flops)

            def loop() -> None:
                for j in range(e):
                    if off[j + 1] > off[j]:
                        xa[off[j] : off[j + 1]] @ wb[j].t()

            _safe(rows, f"{tag}: per-expert bf16 loop", loop, flops=flops)
            _safe(rows, f"{tag}: grouped W4A4 (auto path)", lambda: grouped_w4a4(a, offsets, wq), flops=flops,
                  grouped_mm_ms=gm)
            for alt in (("fp4w", "fp4w-swap") if t <= 64 else ("fp4w",)):  # noqa: B007
                _safe(rows, f"{tag}: grouped W4A4 ({alt} path)", lambda: grouped_w4a4(a, offsets, wq, path=alt),
                      flops=flops, grouped_mm_ms=gm)


def run_gpu_checks() -> tuple[int, int, list[dict[str, Any]]]:
    from mismatch_probe.kernels import triton_nvfp4 as tq
    from mismatch_probe.kernels.checks import run_checks

    res = run_checks()
    default = tq.QUANT_IMPL
    other = "v2" if default == "v1" else "v1"
    tq.QUANT_IMPL = other  # the alternative quantize kernel passes the same checks
    names = [r.name for r in res if r.name.startswith(("quant_", "rmsnorm")) and "tile16" not in r.name]
    for r in run_checks(names):
        r.name = r.name + f" [quantize {other}]"
        res.append(r)
    tq.QUANT_IMPL = default
    out = [r.__dict__ for r in res]
    for r in res:
        print(f"[check] {r.status:4s} {r.seconds:7.2f}s {r.name}: {r.detail[:160]}", flush=True)
    ran = [r for r in res if r.status != "skip"]
    return sum(r.status == "pass" for r in ran), len(ran), out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="quantize,linear,moe,sweep")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU, each function once")
    args = ap.parse_args()
    import torch
    import triton

    global DEV, DRY
    if args.dry_run:
        DEV, DRY = "cpu", True
        S.update(quant=64, nk=64, ms=(1, 16, 40), big_m=40, moe=(4, 2, 32, 16), tokens=(9, 3))
    elif not torch.cuda.is_available():
        print("error: the benchmarks need a CUDA GPU (none found)", file=sys.stderr)
        return 2
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0) if not DRY else "cpu (dry run)",
        "cc": list(torch.cuda.get_device_capability(0)) if not DRY else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }
    print(info, flush=True)
    result: dict[str, Any] = {"info": info}
    if not args.skip_checks:
        t0 = time.time()
        passed, total, checks = run_gpu_checks()
        result["checks"] = {"passed": passed, "total": total, "seconds": time.time() - t0, "results": checks}
        print(f"[check] {passed}/{total} passed in {time.time() - t0:.0f}s", flush=True)
    rows: list[dict[str, Any]] = []
    for part in args.only.split(","):
        {"quantize": bench_quantize, "linear": bench_linear, "moe": bench_moe, "sweep": bench_sweep}[part](rows, args.quick)
        os.makedirs(args.out, exist_ok=True)
        result["bench"] = rows
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
    print_table(result)
    return 0


def print_table(result: dict[str, Any]) -> None:
    rows = result.get("bench", [])
    print("\n| benchmark | median us | derived |")
    print("|---|---:|---|")
    for r in rows:
        ms = r.get("ms")
        if ms is None:
            print(f"| {r['name']} | failed | {r.get('error', '')[:80]} |")
            continue
        d = []
        if "bytes" in r:
            d.append(f"{r['bytes'] / ms / 1e6:.0f} GB/s")
            if r.get("copy_ms") and r.get("copy_bytes"):
                d.append(f"{(r['bytes'] / ms) / (r['copy_bytes'] / r['copy_ms']) * 100:.0f}% of copy bandwidth")
        if "flops" in r:
            d.append(f"{r['flops'] / ms / 1e9:.1f} TFLOP/s")
        if "bits_equal_ref" in r:
            d.append("bits == ref" if r["bits_equal_ref"] else f"BITS DIFFER (max {r['max_abs_diff_ref']:.3g})")
        for key, lab in (("cublas_ms", "cuBLAS"), ("grouped_mm_ms", "_grouped_mm")):
            if r.get(key):
                d.append(f"{r[key] / ms:.2f}x vs {lab}")
        print(f"| {r['name']} | {ms * 1e3:.1f} | {', '.join(d)} |")
    c = result.get("checks")
    if c:
        print(f"\nbitwise checks on GPU: {c['passed']}/{c['total']} passed")
        for r in c["results"]:
            if r["status"] == "fail":
                print(f"  FAIL {r['name']}: {r['detail'][:200]}")


if __name__ == "__main__":
    sys.exit(main())
