"""Issue 28, point 1: the NVFP4 decode GEMM at the Qwen3-8B layer shapes, shape by shape (H200).

Where the 8B decode step's linears go, per shape and per M (tokens in the step): the native decode GEMM
(the default variant and the others, which give the same bits: checked with ``torch.equal``), the
activation quantize alone, the whole linear as the recipe calls it, and cuBLAS bf16; and the fused shapes
(q/k/v as one [6144, 4096] weight, gate/up as one [24576, 4096]) to price one launch per fused linear.
Every figure: the call captured in a CUDA graph and replayed (CUDA events, median of 5), weights resident.
A diagnostic for choosing what to change, not an acceptance figure. ``--layers``: only the fused layers as
the recipe calls them (``NVFP4Linear`` with the shards of q/k/v, gate/up, and o, down; its input quantize
included): the shards as one launch (the default on sm_90) against one launch per shard and against their
K-segment reduces one launch each (`tc_linear.SHARD_REDUCE` off), bits compared.

    python bench/gpu_decode_shapes.py --out DIR [--ms 16,64] [--variants 15,14,12,7] [--layers]
    python bench/gpu_decode_shapes.py --out DIR --device cpu --tiny     # the script itself, on a CPU

Writes ``DIR/gpu_decode_shapes.json``; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_nvfp4_check as G  # noqa: E402  (graph_us)

# name -> (N, K) of the Qwen3-8B decoder layer's linears, as vLLM runs them (shards of qkv and gate_up)
SHAPES = {"q": (4096, 4096), "k/v": (1024, 4096), "o": (4096, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
          "qkv fused": (6144, 4096), "gate_up fused": (24576, 4096)}
PER_LAYER = {"q": 1, "k/v": 2, "o": 1, "gate/up": 2, "down": 1}  # launches of each shard shape per layer
TINY = {"q": (128, 64), "k/v": (64, 64), "down": (64, 128)}


def one(m: int, n: int, k: int, variants: list[int], dev: str, gen: torch.Generator) -> dict[str, Any]:
    from mismatch_probe.kernels.nvfp4 import native
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.tc_linear import tc_matmul

    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    lin = NVFP4Linear("nvfp4-per-token")
    tw = lin.prepared(w)[0]
    qa, op = lin.quantize_input(x, None, tw)
    ref = tc_matmul(qa, tw, a_op=op)
    res: dict[str, Any] = {"M": m, "N": n, "K": k, "nseg": tw.nseg}
    if dev != "cuda":
        return {**res, "note": "no CUDA: one interpreter call, no timing"}
    res["variant"] = native.decode_variant(m, tw) if native.available() else "triton"
    res["fused_segments"] = bool(native.available() and native.fused_segments(m, tw, tw.nseg))
    res["bf16_us"] = round(G.graph_us(lambda: torch.nn.functional.linear(x, w)), 2)
    res["gemm_us"] = round(G.graph_us(lambda: tc_matmul(qa, tw, a_op=op)), 2)
    res["quantize_us"] = round(G.graph_us(lambda: lin.quantize_input(x, None, tw)), 2)
    res["linear_us"] = round(G.graph_us(lambda: lin(x, w)), 2)
    nbytes = n * k * (0.5 + 0.125)  # codes + fp16 scales (the native layout variant 15 streams)
    res["gemm_TBps"] = round(nbytes / (res["gemm_us"] * 1e-6) / 1e12, 2)
    res["bf16_TBps"] = round(n * k * 2 / (res["bf16_us"] * 1e-6) / 1e12, 2)
    by_v: dict[str, Any] = {}
    for v in variants:
        for ks2 in ((None, True, False) if v in native.CORE else (None,)):
            t = tw.tuned(tw.tuning.with_(native={"variant": v, "ks2": ks2}))
            key = f"v{v}" + ("" if ks2 is None else f" ks2={int(ks2)}")
            try:
                op_v = lin.quantize_input(x, None, t)[1]  # the token operand in this variant's layout
                y = tc_matmul(qa, t, a_op=op_v)
                by_v[key] = {"us": round(G.graph_us(lambda t=t, o=op_v: tc_matmul(qa, t, a_op=o)), 2),
                             "equal": bool(torch.equal(y, ref))}
            except Exception as e:  # a variant this shape or M does not take
                by_v[key] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
    res["variants"] = by_v
    return res


# the Qwen3-8B layer's linears as vLLM runs them: (N of each shard, K)
LAYERS = {"qkv": ([4096, 1024, 1024], 4096), "o": ([4096], 4096), "gate_up": ([12288, 12288], 4096),
          "down": ([4096], 12288)}


def layer_row(m: int, name: str, parts: list[int], k: int, gen: torch.Generator) -> dict[str, Any]:
    """One fused linear as the recipe calls it (input quantize + GEMMs): the default (shards in one launch, their
    K-segment reduces in one launch) against each A/B arm (reduces one launch each; shards one launch each)."""
    from mismatch_probe.kernels.nvfp4 import native, tc_linear
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear

    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(sum(parts), k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    lin = NVFP4Linear("nvfp4-per-token", partitions=parts if len(parts) > 1 else None)
    tws = lin.prepared(w)
    grouped = bool(native.available() and native.shards_ok(m, tws))
    y1 = lin(x, w)
    res: dict[str, Any] = {"layer": name, "M": m, "N": parts, "K": k, "nseg": [t.nseg for t in tws], "one_launch": grouped,
                           "bf16_us": round(G.graph_us(lambda: torch.nn.functional.linear(x, w)), 2),
                           "linear_us": round(G.graph_us(lambda: lin(x, w)), 2)}
    for key, mod, switch in (("reduce_each", tc_linear, "SHARD_REDUCE"), ("per_shard", native, "GROUP_SHARDS")):
        setattr(mod, switch, False)  # the A/B arm: that switch off (its default on), the same bits expected
        try:
            res[f"{key}_equal"] = bool(torch.equal(lin(x, w), y1))
            res[f"{key}_us"] = round(G.graph_us(lambda: lin(x, w)), 2)
        finally:
            setattr(mod, switch, True)
    return res


def layer_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| M | layer | N (shards) x K | nseg | bf16 us | recipe linear us | one launch | reduces one each us | "
             "per shard us | same bits |", "|---|---|---|---|---:|---:|---|---:|---:|---|"]
    tot: dict[int, list[float]] = {}
    for r in rows:
        if "linear_us" not in r:
            lines.append(f"| {r.get('M')} | {r['layer']} | error: {r.get('error', '')[-80:]} |")
            continue
        lines.append(f"| {r['M']} | {r['layer']} | {r['N']} x {r['K']} | {r['nseg']} | {r['bf16_us']} | {r['linear_us']} | "
                     f"{r['one_launch']} | {r['reduce_each_us']} | {r['per_shard_us']} | "
                     f"{r['per_shard_equal'] and r['reduce_each_equal']} |")
        t = tot.setdefault(r["M"], [0.0, 0.0, 0.0])
        t[0] += r["bf16_us"]
        t[1] += r["linear_us"]
        t[2] += r["per_shard_us"]
    for m, (b, lv, ps) in tot.items():
        lines.append(f"\nM={m}: per layer bf16 {b:.1f} us, nvfp4 recipe {lv:.1f} us ({b / lv:.2f}x), one launch per shard "
                     f"{ps:.1f} us ({b / ps:.2f}x)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--ms", default="16,64")
    ap.add_argument("--variants", default="15,14,12,7")
    ap.add_argument("--layers", action="store_true", help="only the fused layers as the recipe calls them")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=a.device).manual_seed(0)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv, "rows": []}
    if a.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    if a.layers:
        for m in [int(v) for v in a.ms.split(",")]:
            for name, (parts, k) in LAYERS.items():
                try:
                    r = layer_row(m, name, parts, k, gen)
                except Exception:
                    r = {"layer": name, "M": m, "error": traceback.format_exc()[-400:]}
                res["rows"].append(r)
                print("ROW", json.dumps(r, default=str), flush=True)
                (a.out / "gpu_decode_layers.json").write_text(json.dumps(res, indent=1, default=str))
        print(layer_table(res["rows"]), flush=True)
        return
    shapes = TINY if a.tiny else SHAPES
    for m in [int(v) for v in a.ms.split(",")]:
        for name, (n, k) in shapes.items():
            try:
                r = {"shape": name, **one(m, n, k, [int(v) for v in a.variants.split(",")], a.device, gen)}
            except Exception:
                r = {"shape": name, "M": m, "N": n, "K": k, "error": traceback.format_exc()[-400:]}
            res["rows"].append(r)
            print("ROW", json.dumps(r, default=str), flush=True)
            (a.out / "gpu_decode_shapes.json").write_text(json.dumps(res, indent=1, default=str))
    print(table(res["rows"]), flush=True)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| M | shape | N x K | nseg | bf16 us | gemm us (TB/s) | quantize us | linear us | variants us (equal) |",
             "|---|---|---|---|---|---|---|---|---|"]
    per_layer: dict[int, dict[str, float]] = {}
    for r in rows:
        if "gemm_us" not in r:
            why = r.get("error", r.get("note", ""))[:80]
            lines.append(f"| {r.get('M')} | {r['shape']} | {r.get('N')} x {r.get('K')} | | {why} |")
            continue
        vs = ", ".join(f"{key} {v['us']}{'' if v.get('equal') else ' UNEQUAL'}" if "us" in v else f"{key} err"
                       for key, v in r["variants"].items())
        lines.append(f"| {r['M']} | {r['shape']} | {r['N']} x {r['K']} | {r['nseg']} | {r['bf16_us']} | "
                     f"{r['gemm_us']} ({r['gemm_TBps']}) | {r['quantize_us']} | {r['linear_us']} | {vs} |")
        pl = per_layer.setdefault(r["M"], {})
        if r["shape"] in PER_LAYER:
            c = PER_LAYER[r["shape"]]
            pl["bf16"] = pl.get("bf16", 0.0) + c * r["bf16_us"]
            pl["gemm"] = pl.get("gemm", 0.0) + c * r["gemm_us"]
        pl[r["shape"]] = r["gemm_us"]
    for m, pl in per_layer.items():
        if "gemm" in pl:
            fused = sum(pl.get(s, 0.0) for s in ("qkv fused", "o", "gate_up fused", "down"))
            lines.append(f"\nM={m}: per layer, shards as separate launches: nvfp4 GEMMs {pl['gemm']:.1f} us vs cuBLAS "
                         f"bf16 {pl['bf16']:.1f} us (shards, bf16 runs them fused in vLLM); fused shapes (one launch per "
                         f"fused linear, bits not the recipe's): {fused:.1f} us; x 36 layers: {pl['gemm'] * 36 / 1e3:.2f} "
                         f"vs {fused * 36 / 1e3:.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
