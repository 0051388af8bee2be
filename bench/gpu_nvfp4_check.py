"""Issue #28 acceptance points 2-4 on one GPU in one run (<= 240 s): NVFP4 linear vs cuBLAS, weight sync vs
a device-to-device copy, HF learner forward bf16 vs nvfp4-per-token.

Run from outside the checkout (the package installed), e.g. on the H200 after ``. /tmp/site/mp-env.sh``::

    python bench/gpu_nvfp4_check.py --out /tmp/nvfp4_check        # GPU
    python bench/gpu_nvfp4_check.py --device cpu --tiny --out DIR  # dry run of the Python (tiny shapes)

Sections (each case catches its own exceptions: a failure is a row with its error; past ``--budget``
seconds the remaining cases are rows saying skipped). Run in the order b, a, c (b is the cheapest and
needs no native build):

* b ``sync``: every linear of the Qwen3-8B shape (36 layers: qkv [6144, 4096] shards [4096, 1024, 1024],
  o [4096, 4096], gate_up [24576, 4096] shards [12288, 12288], down [4096, 12288]), random bf16:
  ``sync_model`` vs one ``dst.copy_(src)`` per weight (median of 3 after a warm-up), the ratio
  (acceptance: <= 2), and bitwise equality with the reference path (``prepare(nvfp4_quantize_ref)``
  + the native layout) on two layers, both 1x16-block schemes.
* a ``linear``: ``NVFP4Linear("nvfp4-per-token")(x, w)`` (activation quantize + GEMM), the GEMM alone on
  pre-quantized activations, cuBLAS bf16 ``F.linear`` and FP8 per-tensor ``torch._scaled_mm`` (GEMM only),
  each captured in a CUDA graph and replayed (CUDA events, median of 5), weights resident; N = K = 8192 at
  M = 1, 16, 64, 8192 (acceptance: M = 16 >= 2.5x bf16, M = 8192 <= 1.3x slower) and the Qwen3-8B
  shapes at M = 16 and 2048; rows of M = 16 equal to the same rows at M = 8192 (torch.equal).
* c ``learner``: HF Qwen3 forward, random weights, 0.6B shape (4 x 1,024 tokens) and 8B shape
  (2 x 1,024): bf16 vs the nvfp4-per-token recipe (``probes.hf.patch.patch``), median of 5 after a
  warm-up, ``use_cache=False`` as the product's learner forward (``padded_forward``), the first nvfp4
  forward (it prepares the weights) timed apart (acceptance: <= 1.3x bf16),
  and batch invariance: sequence 0's logits alone equal its rows in the batch. ``--graphs``: both forwards
  also captured in a CUDA graph and replayed (the device-bound cost, a diagnostic; bitwise against eager).

Writes ``--out/gpu_nvfp4_check.json`` and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

T0 = time.time()
ROWS: list[dict[str, Any]] = []
ARGS: argparse.Namespace


def left() -> float:
    return ARGS.budget - (time.time() - T0)


def row(section: str, case: str, **kw: Any) -> dict[str, Any]:
    r = {"section": section, "case": case, "t_s": round(time.time() - T0, 1), **kw}
    ROWS.append(r)
    print("ROW", json.dumps(r, default=str), flush=True)
    return r


def guarded(section: str, case: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one case: its row, or a row with its error, or skipped past the budget."""
    if left() < need_s:
        row(section, case, status="skipped", note=f"budget ({left():.0f} s left, needs ~{need_s:.0f})")
        return
    try:
        row(section, case, status="ok", **fn())
    except Exception as e:  # one failing case is a row, never a crash
        row(section, case, status="error", error=f"{type(e).__name__}: {str(e)[:300]}",
            where=traceback.format_exc(limit=-2)[-600:])
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cuda() -> bool:
    return ARGS.device == "cuda"


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def wall(fn: Callable[[], Any], reps: int = 3, warm: int = 1) -> float:
    """Median seconds of ``fn`` (synchronized before and after), after ``warm`` calls."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def graph_us(fn: Callable[[], Any], target_ms: float = 20.0, repeats: int = 5) -> float:
    """Median microseconds per call of ``fn`` captured in a CUDA graph and replayed (CUDA events)."""
    replay, _ = graphed(fn)
    replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    replay()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t, 1e-6)
    reps = int(max(3, min(500, target_ms / 1e3 / est)))
    per = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(per)


def graphed(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """``fn`` (static inputs) captured in one CUDA graph after 3 warm-up calls on a side stream: (replay,
    the graph's output, overwritten by each replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g.replay, out


# ------------------------------------------------------------------------------------------------
# b: weight sync


def q8b_linears(layers: int, hidden: int, inter: int, heads: int, kv: int, hd: int) -> tuple[dict[str, tuple[int, int]],
                                                                                          dict[str, list[int]]]:
    shapes, parts = {}, {}
    for i in range(layers):
        shapes[f"{i}.qkv"] = ((heads + 2 * kv) * hd, hidden)
        parts[f"{i}.qkv"] = [heads * hd, kv * hd, kv * hd]
        shapes[f"{i}.o"] = (hidden, heads * hd)
        shapes[f"{i}.gate_up"] = (2 * inter, hidden)
        parts[f"{i}.gate_up"] = [inter, inter]
        shapes[f"{i}.down"] = (hidden, inter)
    return shapes, parts


def section_sync() -> None:
    from mismatch_probe.kernels.nvfp4 import native as NA
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.sync import sync_model
    from mismatch_probe.kernels.nvfp4.tc_linear import prepare

    dims = (2, 64, 96, 4, 2, 16) if ARGS.tiny else (36, 4096, 12288, 32, 8, 128)
    shapes, parts = q8b_linears(*dims)
    state: dict[str, Any] = {}

    def make() -> dict[str, Any]:
        g = torch.Generator(device=ARGS.device).manual_seed(0)
        ws = {nm: (torch.randn(s, generator=g, device=ARGS.device) * 0.02).to(torch.bfloat16) for nm, s in shapes.items()}
        state["ws"] = ws
        nbytes = sum(w.numel() * 2 for w in ws.values())
        return {"weights": len(ws), "params_M": round(nbytes / 2e6, 1), "bf16_GB": round(nbytes / 1e9, 2)}

    guarded("b sync", "make random weights", 20, make)
    if "ws" not in state:
        return
    ws = state["ws"]

    def timing() -> dict[str, Any]:
        dst = {nm: torch.empty_like(w) for nm, w in ws.items()}

        def copy() -> None:
            for nm, w in ws.items():
                dst[nm].copy_(w)

        def run() -> None:
            state["out"] = None  # free the previous result first
            state["out"] = sync_model(ws, "nvfp4-per-token", parts)

        t_copy = wall(copy)
        dst.clear()
        t_sync = wall(run)
        nbytes = sum(w.numel() * 2 for w in ws.values())
        return {"sync_ms": round(t_sync * 1e3, 2), "copy_ms": round(t_copy * 1e3, 2), "ratio": round(t_sync / t_copy, 2),
                "copy_GBps": round(2 * nbytes / t_copy / 1e9), "sync_read_GBps": round(nbytes / t_sync / 1e9),
                "target": "ratio <= 2", "pass": t_sync / t_copy <= 2.0 if cuda() else None}

    guarded("b sync", "sync_model vs D2D copy (all linears)", 60 if cuda() else 5, timing)

    names = list(ws)
    wlist = [ws[nm] for nm in names]
    plist = [parts.get(nm) for nm in names]

    def enqueue() -> dict[str, Any]:
        # diagnostic: host time to queue every launch (sync_model without its final flag read) vs the total
        from mismatch_probe.kernels.nvfp4 import sync as SY

        state["out"] = None
        sync()
        t = time.perf_counter()
        SY._sync_async(wlist, plist, "nvfp4-per-token", SY.DEFAULT)
        t_host = time.perf_counter() - t
        sync()
        t_all = time.perf_counter() - t
        return {"host_enqueue_ms": round(t_host * 1e3, 2), "total_ms": round(t_all * 1e3, 2),
                "note": "host-bound if enqueue ~ total"}

    def big_weight() -> dict[str, Any]:
        # diagnostic: the kernels' throughput on one large weight (GPU-bound: host time negligible)
        from mismatch_probe.kernels.nvfp4.sync import sync_weight

        n, k = (256, 256) if ARGS.tiny else (65536, 8192)
        w = (torch.randn(n, k, device=ARGS.device) * 0.02).to(torch.bfloat16)
        dst = torch.empty_like(w)
        t_copy = wall(lambda: dst.copy_(w))
        t_sync = wall(lambda: sync_weight(w, "nvfp4-per-token"))
        return {"shape": [n, k], "sync_ms": round(t_sync * 1e3, 3), "copy_ms": round(t_copy * 1e3, 3),
                "ratio": round(t_sync / t_copy, 2), "sync_read_GBps": round(w.numel() * 2 / t_sync / 1e9)}

    def parts_timing() -> dict[str, Any]:
        # diagnostic: the model's amax pass alone and amax + fused kernel (no flag read), synchronized, median
        from mismatch_probe.kernels.nvfp4 import sync as SY

        state["out"] = None
        nbytes = sum(w.numel() * 2 for w in wlist)
        ab = torch.zeros(len(wlist), SY._COLS, dtype=torch.float32, device=ARGS.device)
        sizes = [SY.shard_sizes(w.shape[0], p) for w, p in zip(wlist, plist)]
        old, SY.BACKEND = SY.BACKEND, "triton"
        try:
            t_amax = wall(lambda: SY._amax_pass(wlist, sizes, ab.zero_()))
            t_all = wall(lambda: SY._sync_async(wlist, plist, "nvfp4-per-token", SY.DEFAULT))
        finally:
            SY.BACKEND = old
        rec: dict[str, Any] = {
            "triton": {"amax_ms": round(t_amax * 1e3, 2), "amax_read_GBps": round(nbytes / t_amax / 1e9),
                       "amax_and_kernel_ms": round(t_all * 1e3, 2), "kernel_ms": round((t_all - t_amax) * 1e3, 2)}}
        mod = None
        if cuda():  # the extension where it builds, whatever SY.BACKEND says
            old, SY.BACKEND = SY.BACKEND, "auto"
            try:
                mod = SY._native_module(torch.device(ARGS.device))
            finally:
                SY.BACKEND = old
        if mod is not None:  # the native kernels alone (one launch each, the table already on the device)
            ws_ = [w.detach() for w in wlist]
            shards, nb = SY._layout(ws_, sizes, SY.DEFAULT)
            base = SY._base(ws_)
            tab, na, nq = SY._native_table(ws_, shards, base, False, mod)
            (t_dev,) = SY._to(torch.device(ARGS.device), tab)
            buf = torch.empty(nb, dtype=torch.uint8, device=ARGS.device)
            t_na = wall(lambda: mod.sync_weights(base, t_dev, ab.zero_(), buf, na, 0))
            t_nq = wall(lambda: mod.sync_weights(base, t_dev, ab, buf, 0, nq))
            out_b = sum(sum(sh.plan[4]) for sh in shards)
            rec["native"] = {"amax_ms": round(t_na * 1e3, 2), "amax_read_GBps": round(nbytes / t_na / 1e9),
                             "kernel_ms": round(t_nq * 1e3, 2), "kernel_GBps": round((nbytes + out_b) / t_nq / 1e9),
                             "programs": [na, nq]}
            del buf
        return rec

    def tune() -> dict[str, Any]:
        # the launch configurations (no bit changes): amax pass (rows per program, K block, warps) and the
        # fused kernel's warps, each timed on the whole model (synchronized, median of 3); the best become
        # SY.AMAX_CFG / SY.SYNC_WARPS for the rest of this section
        from mismatch_probe.kernels.nvfp4 import sync as SY

        if not cuda():
            return {"note": "cpu: no tuning"}
        state["out"] = None
        backend, SY.BACKEND = SY.BACKEND, "triton"  # these configurations are the Triton kernels'
        try:
            return tune_triton(SY)
        finally:
            SY.BACKEND = backend

    def tune_triton(SY: Any) -> dict[str, Any]:
        ab = torch.zeros(len(wlist), SY._COLS, dtype=torch.float32, device=ARGS.device)
        sizes = [SY.shard_sizes(w.shape[0], p) for w, p in zip(wlist, plist)]
        base = (SY.AMAX_CFG, SY.SYNC_WARPS)
        amax_t = {}
        for cfg in [(r, bk, w) for r in (8, 16, 32, 64) for bk in (128, 256, 512) for w in (4, 8)]:
            SY.AMAX_CFG = cfg
            try:
                amax_t[cfg] = wall(lambda: SY._amax_pass(wlist, sizes, ab.zero_()))
            except Exception as e:  # a configuration the compiler refuses: skipped
                amax_t[cfg] = float("inf")
                print("amax cfg", cfg, type(e).__name__, flush=True)
        best_amax = min(amax_t, key=amax_t.get)
        SY.AMAX_CFG = best_amax
        sync_t = {}
        for warps in (4, 8, 16):
            SY.SYNC_WARPS = warps
            try:
                sync_t[warps] = wall(lambda: SY._sync_async(wlist, plist, "nvfp4-per-token", SY.DEFAULT))
            except Exception as e:
                sync_t[warps] = float("inf")
                print("sync warps", warps, type(e).__name__, flush=True)
        SY.SYNC_WARPS = min(sync_t, key=sync_t.get)
        return {"amax_default": list(base[0]), "amax_default_ms": round(amax_t.get(base[0], float("nan")) * 1e3, 2),
                "amax_best": list(best_amax), "amax_best_ms": round(amax_t[best_amax] * 1e3, 2),
                "amax_and_kernel_ms_by_warps": {w: round(t * 1e3, 2) for w, t in sync_t.items()},
                "sync_warps_best": SY.SYNC_WARPS, "note": "whole model; the rest of section b runs with the best"}

    def equal(scheme: str, layer: int, backend: str | None = None) -> dict[str, Any]:
        # backend None: the path sync_model takes by default (SY.BACKEND); "triton" / "native": those kernels forced
        from mismatch_probe.kernels.nvfp4 import sync as SY

        bad, n, t_ref, t_syn = [], 0, 0.0, 0.0
        reuse = backend is None and scheme == "nvfp4-per-token" and bool(state.get("out"))
        got_all = state["out"] if reuse else None
        if not reuse:
            names = [k for k in shapes if k.startswith(f"{layer}.")]
            old, SY.BACKEND = SY.BACKEND, backend or SY.BACKEND
            try:
                sync()
                t = time.perf_counter()
                got_all = SY.sync_model({nm: ws[nm] for nm in names}, scheme, {nm: parts[nm] for nm in names if nm in parts})
                sync()
                t_syn = time.perf_counter() - t
            finally:
                SY.BACKEND = old
        for nm in [k for k in shapes if k.startswith(f"{layer}.")]:
            w, p = ws[nm], parts.get(nm)
            got = got_all[nm]
            t = time.perf_counter()
            ref = [prepare(q) for q in NVFP4Linear(scheme, p).weight(w)]
            for r in ref:
                NA.decode_ok(r)
            sync()
            t_ref += time.perf_counter() - t
            for si, (g_, r) in enumerate(zip(got, ref)):
                for f in ("codes", "scales", "amax", "dec", "dsc"):
                    n += 1
                    if not torch.equal(getattr(g_, f), getattr(r, f)):
                        bad.append(f"{nm}[{si}].{f}")
                n += 1
                if (g_.native, g_.bkc, g_.nseg) != (r.native, r.bkc, r.nseg) or (
                        r.native and not all(torch.equal(a, b) for a, b in zip(g_.native_w, r.native_w))):
                    bad.append(f"{nm}[{si}].native")
        return {"fields": n, "unequal": bad[:8], "pass": not bad, "ref_layer_s": round(t_ref, 2),
                "sync_layer_s": None if reuse else round(t_syn, 4), "backend": backend or default_backend()}

    def default_backend() -> str:
        from mismatch_probe.kernels.nvfp4 import sync as SY

        return "native" if SY._native_module(torch.device(ARGS.device)) is not None else "triton"

    def backends() -> dict[str, Any]:
        # the native and the Triton kernels each on the whole model: sync_model (call to return, median of 3)
        # and the host enqueue alone (_sync_async without the final flag read), against the D2D copy
        from mismatch_probe.kernels.nvfp4 import sync as SY

        dst = {nm: torch.empty_like(w) for nm, w in ws.items()}
        t_copy = wall(lambda: [dst[nm].copy_(w) for nm, w in ws.items()])
        dst.clear()
        rec: dict[str, Any] = {"copy_ms": round(t_copy * 1e3, 2), "default": default_backend()}
        old = SY.BACKEND
        try:
            for be in ("native", "triton"):
                SY.BACKEND = be
                state["out"] = None
                try:
                    t = wall(lambda: state.__setitem__("out", SY.sync_model(ws, "nvfp4-per-token", parts)))
                except RuntimeError as e:  # the native kernels absent here
                    rec[be] = {"error": str(e)[:200]}
                    continue
                state["out"] = None
                hosts = []
                for _ in range(3):
                    sync()
                    t0 = time.perf_counter()
                    SY._sync_async(wlist, plist, "nvfp4-per-token", SY.DEFAULT)
                    hosts.append(time.perf_counter() - t0)
                    sync()
                rec[be] = {"sync_ms": round(t * 1e3, 2), "ratio": round(t / t_copy, 2),
                           "host_enqueue_ms": round(statistics.median(hosts) * 1e3, 2)}
        finally:
            SY.BACKEND = old
        nat = rec.get("native", {})
        rec["pass"] = (nat.get("ratio", 99) <= 2.0) if cuda() else None
        return rec

    if ARGS.tune:
        guarded("b sync", "launch configurations (amax pass, fused kernel)", 90 if cuda() else 5, tune)
        guarded("b sync", "sync_model vs D2D copy (all linears), tuned", 60 if cuda() else 5, timing)
    last = dims[0] - 1
    guarded("b sync", "bitwise vs reference, layer 0 (per-token)", 15, lambda: equal("nvfp4-per-token", 0))
    guarded("b sync", f"bitwise vs reference, layer {last} (per-token)", 15, lambda: equal("nvfp4-per-token", last))
    guarded("b sync", "bitwise vs reference, layer 1 (static)", 15, lambda: equal("nvfp4-static", 1))
    guarded("b sync", "bitwise vs reference, layer 0 (per-token), Triton kernels forced", 15,
            lambda: equal("nvfp4-per-token", 0, "triton"))
    guarded("b sync", "bitwise vs reference, layer 1 (static), Triton kernels forced", 15,
            lambda: equal("nvfp4-static", 1, "triton"))
    for sch, lay in (("nvfp4-per-token", 0), ("nvfp4-per-token", last), ("nvfp4-static", 1)):
        guarded("b sync", f"bitwise vs reference, layer {lay} ({sch.split('-', 1)[1]}), native kernels forced", 15,
                lambda sch=sch, lay=lay: equal(sch, lay, "native"))
    guarded("b sync", "native vs Triton kernels, whole model (sync_model, host enqueue)", 60 if cuda() else 5, backends)
    guarded("b sync", "diagnostic: host enqueue time of all launches", 20 if cuda() else 5, enqueue)
    guarded("b sync", "diagnostic: one large weight (kernel throughput)", 20 if cuda() else 5, big_weight)
    guarded("b sync", "diagnostic: amax pass and fused kernel, whole model", 20 if cuda() else 5, parts_timing)
    state.clear()


# ------------------------------------------------------------------------------------------------
# a: linear


def section_linear() -> None:
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.tc_linear import OP_DTYPE, tc_matmul

    big = (64, 64) if ARGS.tiny else (8192, 8192)
    m_big = 256 if ARGS.tiny else 8192
    cases: list[tuple[int, int, int, str]] = [(m, *big, "") for m in (1, 16, 64, m_big)]
    if ARGS.tiny:
        q8 = {"qkv": (96, 64), "down": (64, 96)}
    else:
        q8 = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    for m in (48,) if ARGS.tiny else (16, 2048):
        cases += [(m, n, k, f" ({nm})") for nm, (n, k) in q8.items()]
    g = torch.Generator(device=ARGS.device).manual_seed(1)

    def one(m: int, n: int, k: int) -> dict[str, Any]:
        x = torch.randn(m, k, generator=g, device=ARGS.device).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g, device=ARGS.device) * 0.02).to(torch.bfloat16)
        lin = NVFP4Linear("nvfp4-per-token")
        y = lin(x, w)
        res: dict[str, Any] = {"paths": dict(lin.paths_used), "out": list(y.shape)}
        tw = lin.prepared(w)[0]
        qa, op = lin.quantize_input(x, None, tw)
        tc_matmul(qa, tw, a_op=op)  # (on the CPU: the interpreter, once)
        if not cuda():
            torch.nn.functional.linear(x, w)
            return {**res, "note": "timing skipped (no CUDA): linear on the reference path, GEMM in the interpreter, once"}
        fp8 = {}
        try:
            xf, wf = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            one_ = torch.ones((), dtype=torch.float32, device=x.device)
            torch._scaled_mm(xf, wf.t(), scale_a=one_, scale_b=one_, out_dtype=torch.bfloat16)
            fp8["fn"] = lambda: torch._scaled_mm(xf, wf.t(), scale_a=one_, scale_b=one_, out_dtype=torch.bfloat16)
        except Exception as e:
            res["fp8_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        us_bf16 = graph_us(lambda: torch.nn.functional.linear(x, w))
        us_lin = graph_us(lambda: lin(x, w))
        us_gemm = graph_us(lambda: tc_matmul(qa, tw, a_op=op))
        res.update(bf16_us=round(us_bf16, 1), nvfp4_linear_us=round(us_lin, 1), nvfp4_gemm_only_us=round(us_gemm, 1),
                   speedup_vs_bf16=round(us_bf16 / us_lin, 2), paths=dict(lin.paths_used), op_dtype=str(OP_DTYPE))
        if "fn" in fp8:
            us8 = graph_us(fp8["fn"])
            res.update(fp8_gemm_us=round(us8, 1))
        if m <= 64:  # the GEMM as a programmatic dependent launch after the quantizer (native.PDL) vs a plain launch
            from mismatch_probe.kernels.nvfp4 import native

            y_pdl = lin(x, w)
            native.PDL = False
            try:
                y_plain = lin(x, w)
                us_plain = graph_us(lambda: lin(x, w))
            finally:
                native.PDL = True
            res.update(nvfp4_linear_nopdl_us=round(us_plain, 1),
                       pdl_same_bits=bool(torch.equal(y_pdl.view(torch.int16), y_plain.view(torch.int16))))
        if m > 64:  # prefill: the weights decoded in registers (PrefillTuning.decode_weights), no fp16 operand kept
            twd = tw.tuned(tw.tuning.with_(prefill={"decode_weights": True}))
            same = torch.equal(tc_matmul(qa, twd, a_op=op).view(torch.int16), tc_matmul(qa, tw, a_op=op).view(torch.int16))
            res.update(gemm_wdec_us=round(graph_us(lambda: tc_matmul(qa, twd, a_op=op)), 1), wdec_equal=same)
        if (m, n, k) == (16, *big):
            res["target"] = "speedup >= 2.5"
            res["pass"] = us_bf16 / us_lin >= 2.5
        if (m, n, k) == (m_big, *big):
            res["target"] = "nvfp4 <= 1.3x bf16 time"
            res["pass"] = us_lin / us_bf16 <= 1.3
        return res

    for m, n, k, nm in cases:
        label = f"M={m} N={n} K={k}{nm}"
        guarded("a linear", label, 10 if m < 4096 else 20, lambda m=m, n=n, k=k: one(m, n, k))

    def rows_check() -> dict[str, Any]:
        n, k = big
        x = torch.randn(m_big, k, generator=g, device=ARGS.device).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g, device=ARGS.device) * 0.02).to(torch.bfloat16)
        lin = NVFP4Linear("nvfp4-per-token")
        y_big = lin(x, w)
        out = {}
        for m in (1, 16, 64):
            out[f"M={m}"] = bool(torch.equal(lin(x[:m].clone(), w), y_big[:m]))
        return {**out, "pass": all(out.values()), "paths": dict(lin.paths_used)}

    guarded("a linear", f"rows M=1/16/64 == rows of M={m_big} (N=K={big[0]}, torch.equal)", 10, rows_check)


# ------------------------------------------------------------------------------------------------
# n: the norm with the quantization of its output fused in (kernels/nvfp4/norm_quant.py)


def section_norm() -> None:
    from mismatch_probe.kernels.nvfp4 import norm_quant as NQ
    from mismatch_probe.kernels.nvfp4 import quant_fast
    from mismatch_probe.kernels.nvfp4.ref import nvfp4_quantize_ref
    from mismatch_probe.kernels.nvfp4.tc_linear import OP_DTYPE
    from mismatch_probe.kernels.strict import triton_ops as T

    g = torch.Generator(device=ARGS.device).manual_seed(2)
    bf = torch.bfloat16 if cuda() else torch.float32

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.element_size() == 2:
            return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        return bool(torch.equal(a, b))

    def bits() -> dict[str, Any]:
        hs = (128, 256) if ARGS.tiny else (1024, 2048, 4096, 5120, 8192)
        ms = (1, 7, 16, 33) if ARGS.tiny else (1, 7, 16, 33, 64, 300, 2048)
        cases, fails = 0, []
        for h in hs:
            for m in ms:
                for res in (False, True):
                    for unit in (False, True):
                        for layout in ((0, 2) if m <= 64 else (0,)):
                            x = (torch.randn(m, h, generator=g, device=ARGS.device) * 2).to(bf)
                            x[0, :16] = 0
                            r = torch.randn(m, h, generator=g, device=ARGS.device).to(bf) if res else None
                            w = (torch.randn(h, generator=g, device=ARGS.device) * 0.1 + 1).to(bf)
                            off, first = (1.0, False) if unit else (0.0, True)
                            y, rout, (q, op) = NQ.norm_quantize(x, r, w, 1e-6, off, first, layout)
                            ey, er = T._norm(x, r, w, 1e-6, off, first)
                            codes, scales, amax, eop = quant_fast.quantize_rows(ey, None, True, emit_op=OP_DTYPE,
                                                                                op_layout=layout)
                            ref = nvfp4_quantize_ref(ey, per_token=True)
                            ok = {"y": same(y, ey), "residual": r is None or same(rout, er),
                                  "codes": same(q.codes, codes) and same(q.codes, ref.codes),
                                  "scales": same(q.scales, scales) and same(q.scales, ref.scales),
                                  "amax": same(q.amax, amax) and same(q.amax, ref.amax), "operand": same(op, eop)}
                            cases += 1
                            if not all(ok.values()):
                                fails.append(f"H={h} M={m} res={res} unit={unit} layout={layout}: "
                                             + ",".join(k for k, v in ok.items() if not v))
        return {"cases": cases, "failed": len(fails), "first_failures": fails[:6], "pass": not fails,
                "against": "strict norm (triton_ops._norm) then the linear's quantizer (quant_fast.quantize_rows, "
                           "the operand in the GEMM's layout) and the reference quantizer; torch.equal on the bits"}

    guarded("n norm+quantize", "bits: fused == strict norm then quantizer (bf16, layouts 0/2)", 20, bits)

    def pair(m: int, n: int, k: int) -> dict[str, Any]:
        from types import SimpleNamespace

        from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear

        x = torch.randn(m, k, generator=g, device=ARGS.device).to(bf)
        gw = (torch.randn(k, generator=g, device=ARGS.device) * 0.1 + 1).to(bf)
        w = (torch.randn(n, k, generator=g, device=ARGS.device) * 0.02).to(bf)
        lin, mod = NVFP4Linear("nvfp4-per-token"), SimpleNamespace()

        def norm() -> torch.Tensor:
            return T._norm(x, None, gw, 1e-6, 0.0, True)[0]

        def fused() -> torch.Tensor:
            return lin(NQ.rmsnorm(mod, x, None, gw, 1e-6)[0], w)

        def unfused() -> torch.Tensor:
            return lin(norm(), w)

        def base() -> torch.Tensor:
            return torch.nn.functional.linear(norm(), w)

        fused()
        yf, yu = fused(), unfused()
        res: dict[str, Any] = {"same_bits": same(yf, yu), "fused_calls": lin.fused_inputs,
                               "paths": dict(lin.paths_used)}
        if not cuda():
            return {**res, "note": "timing skipped (no CUDA)"}
        xn = norm()
        us = {"norm_bf16_linear": graph_us(base), "norm_nvfp4_linear": graph_us(unfused),
              "fused_norm_nvfp4_gemm": graph_us(fused), "norm": graph_us(norm),
              "fused_norm": graph_us(lambda: NQ.rmsnorm(mod, x, None, gw, 1e-6)),
              "bf16_linear": graph_us(lambda: torch.nn.functional.linear(xn, w)),
              "torch_rms_norm_bf16_linear": graph_us(lambda: torch.nn.functional.linear(
                  torch.nn.functional.rms_norm(x, (k,), gw, 1e-6), w))}
        res.update({f"{a}_us": round(b, 1) for a, b in us.items()})
        res["speedup_fused_pair_vs_bf16_pair"] = round(us["norm_bf16_linear"] / us["fused_norm_nvfp4_gemm"], 2)
        res["speedup_unfused_pair_vs_bf16_pair"] = round(us["norm_bf16_linear"] / us["norm_nvfp4_linear"], 2)
        return res

    big = (64, 64) if ARGS.tiny else (8192, 8192)
    cases = [(m, *big, "") for m in (16, 256 if ARGS.tiny else 8192)]
    if not ARGS.tiny:
        cases += [(16, 6144, 4096, " (8B qkv)"), (16, 24576, 4096, " (8B gate_up)"), (2048, 6144, 4096, " (8B qkv)")]
    for m, n, k, nm in cases:
        guarded("n norm+quantize", f"pair M={m} N={n} K={k}{nm}: norm then linear", 10 if m < 4096 else 20,
                lambda m=m, n=n, k=k: pair(m, n, k))


# ------------------------------------------------------------------------------------------------
# c: HF learner


Q06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936,
            max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
Q8B = {**Q06B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
       "tie_word_embeddings": False}
TINY = {**Q06B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def profile_forward(fn: Callable[[], Any], top: int = 8) -> dict[str, Any]:
    """One call of ``fn`` under torch.profiler (after the timed runs): its wall, the device time summed
    over its kernels, the kernel count, and the ``top`` kernels by device time (name, us, count); a
    diagnostic of where a forward goes (device-bound or host-bound), not a timing."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
    with profile(activities=acts) as prof:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        wall_s = time.perf_counter() - t
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA") and e.device_time_total:
            k = kernels.setdefault(e.name[:60], [0.0, 0])
            k[0] += e.device_time_total
            k[1] += 1
    dev = sum(v[0] for v in kernels.values())
    best = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_ms": round(wall_s * 1e3, 2), "device_ms": round(dev / 1e3, 2),
            "kernels": int(sum(v[1] for v in kernels.values())), "top": [f"{n}: {v[0]:.0f} us x{v[1]}" for n, v in best]}


def host_profile(fn: Callable[[], Any], name: str, top: int = 10) -> list[str]:
    """One call of ``fn`` under cProfile (after the timed runs): the whole table (by own time) into
    ``ARGS.out/<name>_cprofile.txt``, and the ``top`` functions by own time (us, calls); where a
    host-bound forward's Python goes (cProfile's own overhead inflates small functions)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    sync()
    pr.enable()
    fn()
    sync()
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf).sort_stats("tottime")
    st.print_stats(60)
    st.sort_stats("cumulative").print_stats(60)
    (ARGS.out / f"{name}_cprofile.txt").write_text(buf.getvalue())
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    return [f"{Path(f).name}:{ln}({fn_}): {v[2] * 1e6:.0f} us x{v[1]}" for (f, ln, fn_), v in rows]


def learner(shape: dict[str, Any], batch: int, tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mismatch_probe.probes.hf.patch import patch

    cfg = Qwen3Config(**shape)
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(ARGS.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    res: dict[str, Any] = {"build_s": round(time.perf_counter() - t, 1), "tokens": f"{batch} x {tokens}"}
    ids = torch.randint(8, min(400, shape["vocab_size"]), (batch, tokens), device=ARGS.device)
    reps = 5 if cuda() else 1
    h = None

    def fwd(x: Any = ids) -> Any:  # the call padded_forward makes (no KV cache); its logits
        return model(x, use_cache=False).logits

    try:
        with torch.inference_mode():
            res["bf16_s"] = round(wall(fwd, reps=reps), 4)
            if ARGS.profile:
                res["bf16_profile"] = profile_forward(fwd)
                res["bf16_host_top"] = host_profile(fwd, f"bf16_{shape['num_hidden_layers']}l", 5)
            lb = fwd()
            res["bf16_batch_invariant"] = bool(torch.equal(fwd(ids[:1])[0], lb[0]))
            del lb
            h = patch(model, "nvfp4-per-token")
            sync()
            t = time.perf_counter()
            fwd()
            sync()
            res["nvfp4_first_s"] = round(time.perf_counter() - t, 3)
            res["nvfp4_s"] = round(wall(fwd, reps=reps), 4)
            if ARGS.profile:
                res["nvfp4_profile"] = profile_forward(fwd)
                res["nvfp4_host_top"] = host_profile(fwd, f"nvfp4_{shape['num_hidden_layers']}l")
            res["ratio"] = round(res["nvfp4_s"] / res["bf16_s"], 3)
            lb = fwd()
            res["nvfp4_batch_invariant"] = bool(torch.equal(fwd(ids[:1])[0], lb[0]))
            # side by side: every linear quantizing its own input (before SharedInput) vs q/k/v and gate/up sharing
            for st in h.nvfp4.values():
                st.shared = None
            res["nvfp4_unshared_s"] = round(wall(fwd, reps=reps), 4)
            res["shared_bitwise_unshared"] = bool(torch.equal(fwd(), lb))
            for st in h.nvfp4.values():
                st.shared = h.shared
            # the producers' fused quantization (fused_input) off: the strict norm then each linear's quantizer
            from mismatch_probe.kernels.nvfp4 import fused_input

            res["linears_fed_by_fused_norm"] = sum(st.fused_inputs for st in h.nvfp4.values())
            fused_input.ENABLED = False
            try:
                res["nvfp4_unfused_norm_s"] = round(wall(fwd, reps=reps), 4)
                res["fused_norm_bitwise_unfused"] = bool(torch.equal(fwd(), lb))
            finally:
                fused_input.ENABLED = True
            if ARGS.graphs and cuda():
                res.update(graph_forwards(model, ids, lb, h))
                if "nvfp4_graph_s" in res:
                    res["graph_nvfp4_vs_eager_bf16"] = round(res["nvfp4_graph_s"] / res["bf16_s"], 3)
            res["target"] = "ratio <= 1.3, batch invariant"
            res["pass"] = res["ratio"] <= 1.3 and res["nvfp4_batch_invariant"] if cuda() else None
    finally:
        if h is not None:
            h.undo()
    return res


def graph_first_diff(model: Any, ids: Any) -> str:
    """Where the learner's graph of ``model(ids)`` (``GraphedForward``, as ``cuda_graphs=true`` makes it) first
    leaves the eager bits: every leaf module's output is cloned by a forward hook in each forward the class runs
    (its eager call, two warm-ups, the capture; the capture's clones are kernels of the graph, which the
    class's check replays), and the eager call's clones are compared with the capture's in call order. Returns
    the first module that differs (with the largest |difference|), or that none does."""
    from mismatch_probe.probes.hf.graphs import GraphedForward

    outs: list[tuple[str, Any]] = []

    def hook(name: str) -> Callable[..., None]:
        def f(_m: Any, _i: Any, o: Any) -> None:
            o = o[0] if isinstance(o, tuple | list) else o
            if isinstance(o, torch.Tensor):
                outs.append((name, o.detach().clone()))
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if not list(m.children())]
    try:
        model(ids, use_cache=False)  # how many outputs one forward records
        n = len(outs)
        outs.clear()
        gf = GraphedForward(model)
        gf(ids, torch.ones_like(ids), False)
        sync()
        if len(outs) != 4 * n:
            return f"{len(outs)} module outputs recorded, not 4 x {n} (capture: {gf.stats.eager_shapes or 'kept'})"
        for (name, a), (_, b) in zip(outs[:n], outs[-n:], strict=True):
            if a.shape != b.shape or not torch.equal(a, b):
                d = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("nan")
                return f"{name} ({type(model.get_submodule(name)).__name__}): max |d| {d:.3g}"
        return f"none of {n} module outputs differs"
    except Exception as e:  # a diagnosis: never the bench's failure
        return f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        for hd in handles:
            hd.remove()
        outs.clear()


def graph_forwards(model: Any, ids: Any, nvfp4_logits: Any, h: Any) -> dict[str, Any]:
    """Both forwards (nvfp4-per-token, then bf16) as the learner runs them with ``--learner-arg cuda_graphs=true``
    (probes/hf/graphs.py: the first call eager, then captured and kept only if its replay is the eager bits):
    the time per call once the graph replays (static shape, weights resident), the replay's logits against the
    eager forward's (torch.equal), and the learner's graph stats (a shape it refused runs eagerly: its reason)."""
    from mismatch_probe.probes.hf.graphs import GraphedForward

    res: dict[str, Any] = {}
    mask = torch.ones_like(ids)
    for name in ("nvfp4", "bf16"):
        if name == "bf16":
            h.undo()
        try:
            eager = nvfp4_logits if name == "nvfp4" else model(ids, use_cache=False).logits
            gf = GraphedForward(model)
            gf(ids, mask, False)  # eager, then the capture and its check
            res[f"{name}_graph_equal_eager"] = bool(torch.equal(gf(ids, mask, False), eager))
            res[f"{name}_graph_s"] = round(wall(lambda gf=gf: gf(ids, mask, False), reps=5), 4)
            res[f"{name}_graph_stats"] = gf.stats.to_json()
            if not res[f"{name}_graph_equal_eager"] or gf.stats.eager_shapes:
                res[f"{name}_graph_first_diff"] = graph_first_diff(model, ids)
            del eager, gf
        except Exception as e:
            res[f"{name}_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if "nvfp4_graph_s" in res and "bf16_graph_s" in res:
        res["graph_ratio"] = round(res["nvfp4_graph_s"] / res["bf16_graph_s"], 3)
    return res


def section_learner() -> None:
    if ARGS.tiny:
        guarded("c learner", "tiny Qwen3 (2 x 32 tokens)", 5, lambda: learner(TINY, 2, 32))
        return
    guarded("c learner", "Qwen3-0.6B shape, 4 x 1024 tokens", 30, lambda: learner(Q06B, 4, 1024))
    guarded("c learner", "Qwen3-8B shape, 2 x 1024 tokens", 60, lambda: learner(Q8B, 2, 1024))


# ------------------------------------------------------------------------------------------------


def env() -> dict[str, Any]:
    import triton

    out: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__, "device": ARGS.device,
                           "tiny": ARGS.tiny}
    if cuda():
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    try:
        from mismatch_probe.kernels.nvfp4 import native

        out["native"] = native.status()
    except Exception as e:
        out["native"] = f"{type(e).__name__}: {e}"
    return out


def table() -> str:
    skip = {"section", "case", "status", "t_s", "where"}
    lines = ["| section | case | status | figures |", "|---|---|---|---|"]
    for r in ROWS:
        figs = ", ".join(f"{k}={v}" for k, v in r.items() if k not in skip)
        lines.append(f"| {r['section']} | {r['case']} | {r['status']} | {figs.replace('|', '/')} |")
    return "\n".join(lines)


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=230.0, help="seconds; later cases past it are skipped")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (dry run of the script's Python)")
    ap.add_argument("--only", default="nbac", help="sections to run, in this order (letters of n, a, b, c)")
    ap.add_argument("--tune", action="store_true", help="b: try the sync's launch configurations, keep the best")
    ap.add_argument("--profile", action="store_true", help="c: one forward of each recipe under torch.profiler "
                    "(wall vs device time, kernel count, top kernels), after the timed runs")
    ap.add_argument("--graphs", action="store_true", help="c: both forwards also captured in a CUDA graph and "
                    "replayed (the cost without the host's launches; bitwise against eager)")
    ARGS = ap.parse_args()
    if ARGS.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --tiny for a dry run")
    ARGS.out.mkdir(parents=True, exist_ok=True)
    info = env()
    print("ENV", json.dumps(info, default=str), flush=True)
    sections = {"a": section_linear, "b": section_sync, "c": section_learner, "n": section_norm}
    for s in ARGS.only:
        try:
            sections[s]()
        except Exception as e:  # belt and braces: the cases catch their own
            row(s, "section", status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
    info["elapsed_s"] = round(time.time() - T0, 1)
    (ARGS.out / "gpu_nvfp4_check.json").write_text(json.dumps({"env": info, "rows": ROWS}, indent=1, default=str))
    print(f"\nwrote {ARGS.out / 'gpu_nvfp4_check.json'} ({info['elapsed_s']} s)\n")
    print(table())


if __name__ == "__main__":
    main()
