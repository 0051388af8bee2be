"""Where the NVFP4 linear's prefill time goes (issue 28 point 2, M = 8192), and the prefill tile's
variants side by side: a bench diagnostic, one GPU, <= 5 minutes.

    python bench/prefill_split.py --out DIR [--m 8192] [--shapes 8192^2,qkv,o,gate_up,down] [--kernels]

Rows per shape (N, K) at M rows (each call captured in a CUDA graph and replayed, CUDA events, median of
5, weights resident): cuBLAS bf16 ``F.linear``; the linear as the recipe calls it
(``NVFP4Linear("nvfp4-per-token")(x, w)``: activation quantize + GEMM, default tuning); the activation
quantize alone (``quantize_input``); the GEMM alone on the quantized activations for each tile variant of
:data:`VARIANTS` (``PrefillTuning`` fields), with its bits against the default's (``torch.equal``); for a
weight of several K segments, one segment for reference (other bits). Then the registers and spills of
each compiled prefill kernel; ``--kernels``: a ``torch.profiler`` table of one linear call per shape.
Writes ``DIR/prefill_split.json``; prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from gpu_nvfp4_check import graph_us  # bench/ is on sys.path when this runs as a script


def kernels_of(fn: Any) -> list[tuple[str, float]]:
    """(kernel name, device us) of one call of ``fn`` (eager), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name[:90], round(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total, 1)))
    return out


# the prefill tile's variants timed beside the default (PrefillTuning fields; the same bits by the contract:
# checked per row)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "whole epilogue (before round 17)": {"split_epilogue": False},
    "4 stages": {"num_stages": 4},
}
SHAPES = {"8192^2": (8192, 8192), "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
ARGS: argparse.Namespace


def shape_rows(label: str, m: int, n: int, k: int) -> list[dict[str, Any]]:
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.tc_linear import kernel_record, tc_matmul
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    rows: list[dict[str, Any]] = []

    def row(name: str, us: float, **kw: Any) -> None:
        r = {"shape": label, "m": m, "n": n, "k": k, "case": name, "us": round(us, 1), **kw}
        rows.append(r)
        print("ROW", json.dumps(r), flush=True)

    row("cuBLAS bf16 F.linear", graph_us(lambda: torch.nn.functional.linear(x, w)))
    lin = NVFP4Linear("nvfp4-per-token")
    lin(x, w)
    tw = lin.prepared(w)[0]
    row("NVFP4 linear (quantize + GEMM), default tuning", graph_us(lambda: lin(x, w)), nseg=tw.nseg,
        record=kernel_record(m, tw, "prefill")["config"])
    qa, op = lin.quantize_input(x, None, tw)
    row("activation quantize alone (quantize_input)", graph_us(lambda: lin.quantize_input(x, None, tw)))
    base = tc_matmul(qa, tw, a_op=op)
    for name, pre in VARIANTS.items():
        twv = tw.tuned(tw.tuning.with_(prefill=pre))
        try:
            y = tc_matmul(qa, twv, a_op=op)
            same = bool(torch.equal(y.view(torch.int16), base.view(torch.int16)))
            row(f"GEMM: {name}", graph_us(lambda twv=twv: tc_matmul(qa, twv, a_op=op)), same_bits=same,
                config=kernel_record(m, twv, "prefill")["config"])
        except Exception as e:  # one variant failing leaves the others
            row(f"GEMM: {name}", float("nan"), error=f"{type(e).__name__}: {str(e)[:200]}")
    if tw.nseg > 1:
        lin1 = NVFP4Linear("nvfp4-per-token", tuning=DEFAULT.with_(segments={"long_k": None, "target": 1}))
        tw1 = lin1.prepared(w)[0]
        qa1, op1 = lin1.quantize_input(x, None, tw1)
        row(f"GEMM: one K segment (nseg {tw1.nseg}: other bits, reference)", graph_us(lambda: tc_matmul(qa1, tw1, a_op=op1)))
    if ARGS.kernels:
        print("\nkernels of one linear call (device us):")
        for kn, us in kernels_of(lambda: lin(x, w)):
            print(f"  {us:10.1f}  {kn}")
    return rows


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {sorted(SHAPES)}")
    ap.add_argument("--kernels", action="store_true", help="a torch.profiler table of one linear call per shape")
    ARGS = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_split.py: needs a CUDA GPU (it times CUDA graphs of the GPU kernels)")
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for label in ARGS.shapes.split(","):
        n, k = SHAPES[label]
        rows += shape_rows(label, ARGS.m, n, k)
    try:  # registers and spills of each compiled prefill kernel (Triton's per-device cache)
        from mismatch_probe.kernels.nvfp4 import gemm_tc

        for dev_cache in getattr(gemm_tc.prefill_kernel, "device_caches", {}).values():
            for key, kern in dev_cache[0].items():
                kern._init_handles()
                print(f"prefill_kernel: regs {kern.n_regs} spills {kern.n_spills} key ...{str(key)[-220:]}")
    except Exception as e:  # a diagnostic only
        print(f"(kernel cache not read: {type(e).__name__}: {e})")
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "m": ARGS.m,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (out / "prefill_split.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(f"\n{env}\n\n| shape | case | us | x cuBLAS bf16 | same bits |\n|---|---|---:|---:|---|")
    bf16 = 1.0
    for r in rows:
        if r["case"].startswith("cuBLAS"):
            bf16 = r["us"]
        same = r.get("same_bits", "")
        print(f"| {r['shape']} ({r['n']}, {r['k']}) | {r['case']} | {r['us']} | {r['us'] / bf16:.2f} | {same} |")


if __name__ == "__main__":
    main()
