# ruff: noqa: B023
"""One-call GPU probe of the prefill GEMM at small layer shapes (issue 13's side finding).

    python bench/probe_prefill.py --out DIR [--only prefill,sweep,e2e,decode] [--dry]

``--nseg-min-k 1024``: everything under a candidate K-segment rule (see ``_min_k_rule``).
``--dry``: a smoke run of the script on the CPU (Triton interpreter, shapes / 16, a tiny model,
one call per timing): checks the script, times nothing.

* ``prefill``: the prefill path of ``tc_linear`` at the Qwen3-0.6B layer shapes (K segments of the
  default rule) and at N = K = 8192, M in {1024, 4096, 8192}, cuBLAS bf16 beside it: the new
  mainloop (one K loop across the segments, ``FLAT``), the old one (a loop per segment), the same
  weights with one K segment (what another ``nseg_for`` rule would give; other bits), and tile
  configs of the new loop at M = 4096.
* ``decode``: decode GEMM M = 16 at those shapes with the rule's segments vs 1 and 2 (Triton, and
  the native kernel when it built: started in a background thread at the start).
* ``sweep``: rows identical for M in ``checks.TC_MS`` at offsets 0 and 37: prefill new == prefill
  old == decode (native and Triton) == the whole linear (quantize + GEMM), at three layer shapes.
* ``wide`` (not in the default list): M = 4096 (8192 at N = K = 8192), a 16-warp 128 x 256 tile and
  2 / 1 K segments.
* ``e2e_gpu`` (not in the default list): the 4 x 1024 forward's eager time, GPU kernel time and
  CUDA-graph replay time, bf16 vs nvfp4-per-token.
* ``e2e``: HF forward of a Qwen3-0.6B-shaped model (random weights, 4 x 1024 tokens): bf16 vs
  ``nvfp4-per-token`` linears with the new and the old prefill loop (logits compared bitwise) and
  with one K segment everywhere; 1 x 16 tokens (decode path) with the rule's segments and with 1.

Configs are tried on a weight retuned with ``TCWeight.tuned`` (``PrefillTuning.from_config`` of the
config dicts below; ``DecodeTuning(native=...)``); the e2e forwards give their NVFP4 linears the
``GemmTuning`` to run.

Writes ``probe_prefill.json``; prints a table last. Timings: ``bench_kernels.bench`` medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import threading
import time
from typing import Any

import torch
import triton
from bench_kernels import NOTES, ROWS, eq, note, print_notes, rec, rows_table, section, sweep_cases, take_rows  # noqa: E402  (same folder on sys.path)

SHAPES = {"q": (2048, 1024), "k/v": (1024, 1024), "o": (1024, 2048), "gate/up": (3072, 1024), "down": (1024, 3072)}
PER_LAYER = {"q": 1, "k/v": 2, "o": 1, "gate/up": 2, "down": 1}  # linears of each shape per Qwen3 layer
MS = (1024, 4096, 8192)
TILES = {"s3": {"num_stages": 3}, "s5": {"num_stages": 5}, "BM64 w4": {"BM": 64, "num_warps": 4},
         "BK128 s3": {"BK": 128, "num_stages": 3}}  # (BN 256 with two fp32 tiles: 255 regs + stack, not tried)
BUILD: dict[str, object] = {}
RUN = {"dev": "cuda", "ms": MS, "tc_ms": None, "dim": 1}


def _build_native() -> None:
    from mismatch_probe.kernels.nvfp4 import native

    t0 = time.time()
    BUILD["ok"] = native.available()
    BUILD["s"] = round(time.time() - t0, 1)
    BUILD["status"] = native.status()


def _sync() -> None:
    if RUN["dev"] == "cuda":
        torch.cuda.synchronize()


def _cfg(wt, cfg: dict):  # noqa: ANN001, ANN202
    """``wt`` (same tensors, same nseg) with the prefill config keys ``cfg`` (as PrefillTuning.from_config)."""
    from mismatch_probe.kernels.nvfp4.tuning import PrefillTuning

    return wt.tuned(wt.tuning.with_(prefill=PrefillTuning.from_config(cfg)))


def _native(wt, native: bool):  # noqa: ANN001, ANN202
    """``wt`` with the native decode kernel allowed or not (same bits)."""
    return wt.tuned(wt.tuning.with_(decode={"native": native}))


def _weights(n: int, k: int, per_row: bool, native: bool = True):  # noqa: ANN202
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

    w = torch.randn(n, k, device=RUN["dev"], dtype=torch.bfloat16)
    wq = nvfp4_quantize(w, per_token=per_row)
    return w, wq, T.prepare(wq, DEFAULT.with_(decode={"native": native}))


@section
def prefill() -> None:
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    for name, (n, k) in [*SHAPES.items(), ("8192^2", (8192, 8192))]:
        n, k = n // RUN["dim"], k // RUN["dim"]
        # native off: the build runs in the background; nothing here uses decode
        w, _, tw = _weights(n, k, name == "gate/up", native=False)
        tw1 = dataclasses.replace(tw, nseg=1)
        X = torch.randn(RUN["ms"][-1], k, device=RUN["dev"], dtype=torch.bfloat16)
        aq = nvfp4_quantize(X, per_token=True)
        aop = T.act_operand(aq)
        full = T.tc_matmul(aq, tw, path="prefill", a_op=aop)
        for m in RUN["ms"]:
            x, a, op = X[:m], take_rows(aq, 0, m), aop[:m]
            tag = f"{name} N={n} K={k} NSEG={tw.nseg} M={m}"
            cub = rec(f"{tag} cuBLAS bf16", lambda: x @ w.t(), shape=name, m=m, kind="cublas")
            variants = [("new (one K loop)", {}, tw)]
            if tw.nseg > 1:
                variants += [("old (loop per segment)", {"FLAT": False}, tw), ("NSEG=1 weights", {}, tw1)]
                if m == RUN["ms"][1]:
                    variants += [(f"new {lab}", cfg, tw) for lab, cfg in TILES.items()]
            for lab, cfg, wt in variants:
                wc = _cfg(wt, cfg)
                try:
                    got = T.tc_matmul(a, wc, path="prefill", a_op=op)
                except Exception as e:  # a tile config that does not fit
                    note(f"{tag} {lab} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                same = eq(got, full[:m]) if wt is tw else None
                rec(f"{tag} prefill {lab}", lambda: T.tc_matmul(a, wc, path="prefill", a_op=op), shape=name, m=m,
                    kind=lab, cublas_ms=cub, rows_eq_new=same)
        note(f"{name}: nseg {tw.nseg}, prefill config {T.prefill_config(tw.nseg, k // tw.nseg, tw.tuning.prefill)}")


@section
def decode() -> None:
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    note(f"native build: {BUILD}")
    for name, (n, k) in SHAPES.items():
        n, k = n // RUN["dim"], k // RUN["dim"]
        w, _, tw = _weights(n, k, False)
        x = torch.randn(16, k, device=RUN["dev"], dtype=torch.bfloat16)
        a = nvfp4_quantize(x, per_token=True)
        op = T.act_operand(a)
        cub = rec(f"{name} N={n} K={k} M=16 cuBLAS bf16", lambda: x @ w.t(), shape=name, m=16, kind="cublas")
        for s in sorted({tw.nseg, 1, 2}):
            wt = dataclasses.replace(tw, nseg=s)
            ref = T.tc_matmul(a, wt, path="prefill", a_op=op)
            for lab, native in (("Triton", False), ("native", True)):
                if native and not BUILD.get("ok"):
                    continue
                wn = _native(wt, native)
                rec(f"{name} N={n} K={k} M=16 decode {lab} NSEG={s}{' (rule)' if s == tw.nseg else ''}",
                    lambda: T.tc_matmul(a, wn, path="decode", a_op=op), shape=name, m=16, kind=f"decode {lab}",
                    nseg=s, cublas_ms=cub, rows_eq_prefill=eq(T.tc_matmul(a, wn, path="decode", a_op=op), ref))


@section
def sweep() -> None:
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.checks import TC_MS, tc_within_bound
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    for name, per_row in (("k/v", False), ("gate/up", True), ("down", False)):
        n, k = (d // RUN["dim"] for d in SHAPES[name])
        _, wq, tw = _weights(n, k, per_row)
        X = torch.randn(max(RUN["tc_ms"] or TC_MS) + 64, k, device=RUN["dev"], dtype=torch.bfloat16)
        aq = nvfp4_quantize(X, per_token=True)
        full = T.tc_matmul(aq, tw, path="prefill")
        bad = [] if eq(T.tc_matmul(aq, tw, path="prefill"), full) else ["repeat"]
        if not eq(T.tc_matmul(aq, _cfg(tw, {"FLAT": False}), path="prefill"), full):
            bad.append("old loop, full M")
        n_cmp = 2
        for m, off, sub in sweep_cases(aq, RUN["tc_ms"] or TC_MS):
            want = full[off:off + m]
            paths = [("prefill", {}, None), ("prefill-old", {"FLAT": False}, None)]
            if m <= 64:
                paths += [("decode-triton", {}, False)] + ([("decode-native", {}, True)] if BUILD.get("ok") else [])
            for p, cfg, native in paths:
                wp = _cfg(tw, cfg) if native is None else _native(_cfg(tw, cfg), native)
                n_cmp += 1
                if not eq(T.tc_matmul(sub, wp, path=p.split("-")[0]), want):
                    bad.append((m, off, p))
            n_cmp += 1
            if not eq(T.tc_linear(X[off:off + m], tw), want):
                bad.append((m, off, "tc_linear"))
        tol = tc_within_bound(full[:64], take_rows(aq, 0, 64), wq)
        note(f"sweep {name} N={n} K={k} NSEG={tw.nseg} ({'per-row' if per_row else 'per-tensor'} weight amax), "
             f"M in TC_MS at offsets 0 and 37, paths prefill new/old, decode Triton"
             f"{'/native' if BUILD.get('ok') else ' (native not built)'}, tc_linear: {n_cmp} comparisons, "
             f"{'ALL ROWS IDENTICAL' if not bad else f'DIFFER: {bad[:20]}'}; first 64 rows vs per-block reference: {tol}")


def _median_ms(fn, warm: int = 2, n: int = 5) -> tuple[float, Any]:  # noqa: ANN001
    """Median wall time (ms) of ``n`` synchronized calls of ``fn`` after ``warm`` calls, and the last result."""
    for _ in range(warm):
        fn()
    _sync()
    ts, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3, out


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    """Qwen3-0.6B-shaped model, random weights, bf16, and 4 x 1024 token ids."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = RUN["dim"]
    cfg = Qwen3Config(hidden_size=1024 // d, intermediate_size=3072 // d, num_hidden_layers=28 if d == 1 else 2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128 // d,
                      vocab_size=151936 if d == 1 else 256, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(RUN["dev"]):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, torch.randint(0, cfg.vocab_size, (4, 1024 // d), device=RUN["dev"])


@section
def e2e() -> None:
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT, PrefillTuning
    from mismatch_probe.probes.hf.patch import patch

    model, ids = _model()

    def timed(label: str, inp: torch.Tensor, base: float | None = None) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            ms, out = _median_ms(lambda: model(inp).logits)
        b, t = inp.shape
        ROWS.append({"name": f"HF forward Qwen3-0.6B-shaped {b} x {t}: {label}", "ms": ms, "graph": False, "e2e": True,
                     "vs_bf16": None if base is None else base / ms})
        print(f"[bench] e2e {b}x{t} {label}: {ms:.1f} ms", flush=True)
        return ms, out

    for inp in (ids, ids[:1, :16]):
        base, lb = timed("bf16", inp)
        outs = {}
        runs = [("nvfp4-per-token linears, new prefill loop", {}, 8), ("nvfp4-per-token linears, old prefill loop",
                {"FLAT": False}, 8), ("nvfp4-per-token linears, NSEG=1 everywhere", {}, 1)]
        for label, pcfg, nmax in runs if inp.shape[1] > 64 else (runs[0], runs[2]):
            tun = DEFAULT.with_(segments={"max_segments": nmax}, prefill=PrefillTuning.from_config(pcfg))
            with patch(model, "nvfp4-per-token", ops=["linear"]) as h:
                for st in h.nvfp4.values():  # weights are prepared at the first call
                    st.tuning = tun
                _, outs[label] = timed(label, inp, base)
                summ = h.describe().get("nvfp4_kernels") or {}
                paths = sorted({p for s in summ.values() for p in s["paths_used"]})
                note(f"e2e {tuple(inp.shape)} {label}: {len(summ)} NVFP4 linears, paths {paths}, logits vs bf16 "
                     f"max |d| {float((outs[label].float() - lb.float()).abs().max()):.3g}")
        if len(outs) == 3:
            a, b = outs[runs[0][0]], outs[runs[1][0]]
            note(f"e2e {tuple(inp.shape)}: logits new loop == old loop bitwise: {bool(torch.equal(a, b))}")


@section
def wide() -> None:
    """M = 4096 at the layer shapes (M = 8192 at N = K = 8192): the default loop, 16 warps with a
    128 x 256 tile (two fp32 tiles of 64 registers per thread), and the weights with 2 and 1 K
    segments (other bits)."""
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    for name, (n, k) in [*SHAPES.items(), ("8192^2", (8192, 8192))]:
        n, k = n // RUN["dim"], k // RUN["dim"]
        m = RUN["ms"][2 if name == "8192^2" else 1]
        w, _, tw = _weights(n, k, False)
        x = torch.randn(m, k, device=RUN["dev"], dtype=torch.bfloat16)
        a = nvfp4_quantize(x, per_token=True)
        op = T.act_operand(a)
        ref = T.tc_matmul(a, tw, path="prefill", a_op=op)
        tag = f"{name} N={n} K={k} NSEG={tw.nseg} M={m}"
        cub = rec(f"{tag} cuBLAS bf16", lambda: x @ w.t(), shape=name, m=m, kind="cublas")
        w16 = {"BN": 256, "num_warps": 16, "num_stages": 3}
        tw2 = dataclasses.replace(tw, nseg=2)
        variants = [("new (one K loop)", {}, tw), ("new BN256 w16", w16, tw), ("NSEG=2 weights", {}, tw2)]
        tw1 = dataclasses.replace(tw, nseg=1)
        variants += ([("NSEG=1 weights", {}, tw1), ("NSEG=1 weights BN128 s4", {"BN": 128, "num_stages": 4}, tw1)]
                     if tw.nseg > 1 else [("NSEG=2 BN256 w16", w16, tw2)])
        for lab, cfg, wt in variants:
            wc = _cfg(wt, cfg)
            try:
                same = eq(T.tc_matmul(a, wc, path="prefill", a_op=op), ref) if wt is tw else None
            except Exception as e:
                note(f"{tag} {lab} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            rec(f"{tag} prefill {lab}", lambda: T.tc_matmul(a, wc, path="prefill", a_op=op), shape=name, m=m,
                kind=lab, cublas_ms=cub, rows_eq_new=same)


@section
def e2e_gpu() -> None:
    """4 x 1024 forward, bf16 vs nvfp4-per-token linears (rule's segments; 1 segment): eager wall
    time, the sum of GPU kernel times of one forward (torch.profiler), and CUDA-graph replays."""
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT
    from mismatch_probe.probes.hf.patch import patch

    model, ids = _model()

    def measure(label: str) -> None:
        with torch.no_grad():
            row = {"name": f"forward 4 x 1024 {label}", "ms": _median_ms(lambda: model(ids))[0], "e2e": True,
                   "graph": False}
            try:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    model(ids)
                    _sync()
                ev = [e for e in prof.key_averages() if e.device_time_total > 0]
                row["kernel_ms"] = sum(e.self_device_time_total for e in ev) / 1e3
                top = sorted(ev, key=lambda e: -e.self_device_time_total)[:6]
                note(f"{label}: GPU kernel time {row['kernel_ms']:.1f} ms; top: "
                     + "; ".join(f"{e.key[:40]} {e.self_device_time_total / 1e3:.2f} ms x{e.count}" for e in top))
            except Exception as e:
                note(f"{label}: profiler failed: {type(e).__name__}: {str(e)[:200]}")
            try:
                g = torch.cuda.CUDAGraph()
                st = torch.cuda.Stream()
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    model(ids)
                torch.cuda.current_stream().wait_stream(st)
                with torch.cuda.graph(g):
                    model(ids)
                row["graph_ms"] = _median_ms(g.replay, warm=1)[0]
                del g
            except Exception as e:
                note(f"{label}: CUDA graph failed: {type(e).__name__}: {str(e)[:200]}")
        ROWS.append(row)
        print(f"[bench] e2e_gpu {row}", flush=True)

    measure("bf16")
    for label, nmax in (("nvfp4-per-token linears", 8), ("nvfp4-per-token linears, NSEG=1 everywhere", 1)):
        with patch(model, "nvfp4-per-token", ops=["linear"]) as h:
            for st in h.nvfp4.values():
                st.tuning = DEFAULT.with_(segments={"max_segments": nmax})
            measure(label)
    base = ROWS[-3]
    for r in ROWS[-3:]:
        note(f"e2e_gpu {r['name']}: eager {r['ms']:.1f} ms ({base['ms'] / r['ms']:.2f}x bf16 speed); kernels "
             f"{r.get('kernel_ms', float('nan')):.1f} ms; graph replay {r.get('graph_ms', float('nan')):.1f} ms "
             f"({base.get('graph_ms', float('nan')) / r.get('graph_ms', float('nan')):.2f}x)")


def table() -> None:
    rows_table(("rows_eq_new", "rows_eq_prefill"))
    # the GEMM time of one 0.6B layer's linears at M = 4096 (7 linears), per loop vs cuBLAS
    tot: dict[str, float] = {}
    for r in ROWS:
        if r.get("m") == 4096 and r.get("shape") in PER_LAYER and r.get("ms"):
            tot[r["kind"]] = tot.get(r["kind"], 0.0) + PER_LAYER[r["shape"]] * r["ms"]
    if "cublas" in tot:
        print("\none 0.6B layer's 7 linears at M = 4096 (sum of GEMM medians): "
              + ", ".join(f"{kind} {v * 1e3:.0f} us ({v / tot['cublas']:.2f}x)" for kind, v in tot.items()))
    print_notes()


def _dry() -> None:
    import bench_kernels

    from mismatch_probe.kernels.nvfp4 import linear as NL

    RUN.update(dev="cpu", ms=(32, 64, 96), tc_ms=(1, 2, 17, 65, 129), dim=16)  # 8192^2 -> 512^2
    bench_kernels.bench = lambda fn, rep=100: (fn(), 1e-3)[1]
    NL.use_kernels = lambda t: True


def _min_k_rule(min_k: int) -> None:
    """Replace ``tc_linear.nseg_for`` (the single source of every path's segments) by the default
    rule capped at K / NSEG >= min_k: a candidate rule, measured without editing the library."""
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    rule = T.nseg_for

    def capped(n: int, k: int, grouped: bool = False, rule_: object = T.DEFAULT.segments) -> int:
        s = rule(n, k, grouped, rule_)
        while s > 1 and k // s < min_k:
            s //= 2
        return s

    T.nseg_for = capped
    note(f"candidate rule: NSEG capped at K / NSEG >= {min_k}: "
         + ", ".join(f"{name} {capped(*nk)}" for name, nk in SHAPES.items()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="prefill,sweep,e2e,decode")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--nseg-min-k", type=int, default=0,
                    help="run everything under a candidate K-segment rule: the default rule's NSEG halved "
                         "until each segment has at least this many K (every path, as nseg_for would)")
    args = ap.parse_args()
    if args.nseg_min_k:
        _min_k_rule(args.nseg_min_k)
    if args.dry:
        _dry()
    elif not torch.cuda.is_available():
        print("error: the probe needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "gpu": torch.cuda.get_device_name(0) if RUN["dev"] == "cuda" else "none (--dry)",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "command": " ".join(sys.argv)}
    print(info, flush=True)
    parts = args.only.split(",")
    builder = None
    if "decode" in parts or "sweep" in parts:
        builder = threading.Thread(target=_build_native, daemon=True)
        builder.start()
    fns = {"prefill": prefill, "decode": decode, "sweep": sweep, "e2e": e2e, "wide": wide, "e2e_gpu": e2e_gpu}
    os.makedirs(args.out, exist_ok=True)
    for part in parts:
        if part in ("decode", "sweep") and builder is not None:
            builder.join()
        fns[part]()
        with open(os.path.join(args.out, "probe_prefill.json"), "w") as f:
            json.dump({"info": info, "build": BUILD, "rows": ROWS,
                       "notes": NOTES}, f, indent=1, default=str)
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
