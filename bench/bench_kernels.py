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


def _bench(fn, rep: int = 200) -> float:  # noqa: ANN001
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

    m = k = 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = _safe(rows, "copy bf16 8192x8192 (read+write)", lambda: y.copy_(x), bytes=2 * x.numel() * 2)
    qbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16 + m * 4
    from mismatch_probe.kernels import triton_nvfp4 as tq

    amax1 = torch.tensor([float(x.float().abs().max())], device="cuda")
    for impl in ("v2", "v1"):
        tq.QUANT_IMPL = impl
        _safe(rows, f"quantize per-token 1x16: Triton {impl}", lambda: nvfp4_quantize(x, per_token=True), bytes=qbytes,
              copy_ms=copy_ms)
        _safe(rows, f"quantize per-tensor 1x16, amax given: Triton {impl}", lambda: nvfp4_quantize(x, amax=amax1),
              bytes=qbytes, copy_ms=copy_ms)
    tq.QUANT_IMPL = "v2"
    _safe(rows, "quantize per-tensor 1x16 incl. torch amax pass: Triton v2", lambda: nvfp4_quantize(x), bytes=qbytes,
          copy_ms=copy_ms)
    _safe(rows, "quantize per-token 1x16: reference eager torch", lambda: nvfp4_quantize_ref(x, per_token=True),
          bytes=qbytes, copy_ms=copy_ms)
    if not quick:
        try:
            comp = torch.compile(lambda t: nvfp4_quantize_ref(t, per_token=True))
            comp(x)
            _safe(rows, "quantize per-token 1x16: reference torch.compile", lambda: comp(x), bytes=qbytes, copy_ms=copy_ms)
        except Exception as e:
            rows.append({"name": "quantize reference torch.compile", "ms": None, "error": str(e)[:200]})


def bench_linear(rows: list[dict[str, Any]], quick: bool) -> None:
    import torch

    from mismatch_probe.kernels import (
        aligned_linear,
        nvfp4_dequantize_ref,
        nvfp4_quantize,
        nvfp4_quantize_ref,
        w4a4_matmul,
    )
    from mismatch_probe.kernels.aligned_linear import choose_path

    n = k = 8192
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq = nvfp4_quantize(w)
    w_deq = nvfp4_dequantize_ref(wq, torch.bfloat16)
    for m in (1, 16, 64, 8192):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq = nvfp4_quantize(x, per_token=True)
        flops = 2 * m * n * k
        cub = _safe(rows, f"M={m}: cuBLAS bf16 x @ w.t()", lambda: x @ w.t(), m=m, flops=flops)
        _safe(rows, f"M={m}: W4A4 GEMM (auto path, A pre-quantized)", lambda: w4a4_matmul(xq, wq), m=m, flops=flops,
              cublas_ms=cub)
        for alt in ("fma", "fp4", "fp4w", "fp4w-swap", "bf16"):
            if alt != choose_path(m) and (m < 8192 or alt == "fp4w"):
                _safe(rows, f"M={m}: W4A4 GEMM ({alt} path)", lambda: w4a4_matmul(xq, wq, path=alt), m=m,
                      flops=flops, cublas_ms=cub)
        _safe(rows, f"M={m}: aligned_linear incl. per-token quantize", lambda: aligned_linear(x, wq), m=m, flops=flops,
              cublas_ms=cub)
        _safe(
            rows, f"M={m}: naive path (ref quantize->dequantize->bf16 matmul)",
            lambda: nvfp4_dequantize_ref(nvfp4_quantize_ref(x, per_token=True), torch.bfloat16) @ w_deq.t(),
            m=m, flops=flops, cublas_ms=cub,
        )


def bench_sweep(rows: list[dict[str, Any]], quick: bool) -> None:
    """Tile-config sweep of the W4A4 GEMM; every config's output must equal the default's bits."""
    import torch

    from mismatch_probe.kernels import nvfp4_quantize, w4a4_matmul

    n = k = 8192
    wq = nvfp4_quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    sweeps = {
        1: [("fma", {"BM": 1, "BN": bn, "num_warps": nw, "num_stages": ns}) for bn in (16, 32, 64)
            for nw in (2, 4) for ns in (3, 4)],
        16: [("fma", {"BM": 16, "BN": bn, "num_warps": nw, "num_stages": 3}) for bn in (16, 32, 64) for nw in (2, 4, 8)]
        + [("fp4w-swap", {"BM": 16, "BN": bn, "num_warps": 4, "num_stages": ns, "KSTEP": ks})
           for bn in (64, 128) for ns in (3, 5) for ks in (4, 8)],
        8192: [("bf16", {"BM": bm, "BN": bn, "num_warps": nw, "num_stages": ns, "KSTEP": ks})
               for bm, bn, nw, ns, ks in ((128, 128, 8, 3, 8), (128, 128, 8, 4, 4), (128, 256, 8, 3, 2),
                                          (256, 128, 8, 3, 2), (128, 128, 4, 3, 8), (128, 256, 8, 2, 4))],
    }
    for m, cfgs in sweeps.items():
        xq = nvfp4_quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), per_token=True)
        base = w4a4_matmul(xq, wq)
        for p, cfg in cfgs:
            name = (f"sweep M={m} {p} BM={cfg['BM']} BN={cfg['BN']} w={cfg['num_warps']} s={cfg['num_stages']}"
                    f" k={cfg.get('KSTEP', '-')}")
            try:
                same = torch.equal(w4a4_matmul(xq, wq, path=p, config=cfg).view(torch.int16), base.view(torch.int16))
            except Exception as e:
                rows.append({"name": name, "ms": None, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                continue
            _safe(rows, name, lambda: w4a4_matmul(xq, wq, path=p, config=cfg), flops=2 * m * n * k,
                  bits_equal_default=same)


def bench_moe(rows: list[dict[str, Any]], quick: bool) -> None:
    import torch

    from mismatch_probe.kernels import grouped_w4a4, moe_route, nvfp4_quantize, quantize_expert_weights
    from mismatch_probe.kernels.grouped_gemm import gather_rows

    e, top, hidden, inter = 128, 8, 2048, 768
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        wb = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        wq = quantize_expert_weights(wb)
        wt = wb.transpose(1, 2)  # [E, K, N] view (column-major per expert) for torch._grouped_mm
        for t in (16384, 64):
            ids = torch.topk(torch.rand(t, e, device="cuda"), top, dim=1).indices
            perm, offsets = moe_route(ids, e)
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
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
            for alt in (("fp4w", "fp4w-swap") if t <= 64 else ("fp4w",)):
                _safe(rows, f"{tag}: grouped W4A4 ({alt} path)", lambda: grouped_w4a4(a, offsets, wq, path=alt),
                      flops=flops, grouped_mm_ms=gm)


def run_gpu_checks() -> tuple[int, int, list[dict[str, Any]]]:
    from mismatch_probe.kernels import triton_nvfp4 as tq
    from mismatch_probe.kernels.checks import run_checks

    res = run_checks()
    tq.QUANT_IMPL = "v1"  # the previous quantize kernel, kept for 16x16 tiles and as a fallback
    names = [r.name for r in res if r.name.startswith(("quant_", "rmsnorm")) and "tile16" not in r.name]
    for r in run_checks(names):
        r.name = r.name + " [quantize v1]"
        res.append(r)
    tq.QUANT_IMPL = "v2"
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
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        print("error: the benchmarks need a CUDA GPU (none found)", file=sys.stderr)
        return 2
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "cc": list(torch.cuda.get_device_capability(0)),
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
            if r.get("copy_ms"):
                d.append(f"{r['copy_ms'] / ms * 100:.0f}% of copy")
        if "flops" in r:
            d.append(f"{r['flops'] / ms / 1e9:.1f} TFLOP/s")
        if "bits_equal_default" in r:
            d.append("bits == default" if r["bits_equal_default"] else "BITS DIFFER")
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
