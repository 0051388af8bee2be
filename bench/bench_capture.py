"""Capture cost: forward time with capture off / digest / stats / full-window, bytes written per
token, peak host memory; plus the mp64 digest of CUDA (Triton) against the numpy reference.

Models are built in memory from a config with random weights (no download): Qwen3-0.6B-shaped
(28 layers, hidden 1024, vocab 151,936) and Qwen3-8B-shaped (36 layers, hidden 4096), and for the
CPU a ~129M-parameter Llama-shaped model (12 layers, hidden 768, vocab 32,000). Scoring goes
through the real ``HfLearner`` (micro-batched, right padding, fp32 log-softmax) and the real
recorder streaming ``ops.parquet`` to disk.

Timings per mode (median of ``--repeats``):
  forward  = score() until the last op is recorded (device work included: CUDA synchronize);
             chunks still being written by the writer thread are not waited for, but the
             recording thread blocks when the writer is ``queue_chunks`` chunks behind
  total    = score() including close(): every row written and the file renamed into place

    python bench/bench_capture.py --device cuda --shapes qwen3-0.6b,qwen3-8b --out results.json
    python bench/bench_capture.py --device cpu --shapes llama-129m --seq-len 512 --seqs-per-mb 4 --mbs 2
    python bench/bench_capture.py --cli-check   # `capture --engine hf` off vs stats, 16 sequences, CPU
    python bench/bench_capture.py --rss         # peak RSS vs number of tokens (64 x 2,048 tokens)
    python bench/bench_capture.py --writer-check --repeats 3   # the writer alone: per-row vs packed, op comparison
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False),
    "llama-129m": dict(family="llama", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000,
                       tie_word_embeddings=False),
    "tiny-qwen3": dict(family="qwen3", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=1024,
                       tie_word_embeddings=True),
}


def build_model(shape: str, device: str) -> Any:
    import torch
    import transformers

    spec = dict(SHAPES[shape])
    fam = spec.pop("family")
    cls = transformers.Qwen3Config if fam == "qwen3" else transformers.LlamaConfig
    cfg = cls(**spec, max_position_embeddings=8192, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def learner(model: Any, device: str, mb: int) -> Any:
    from mismatch_probe.probes.hf.runner import HfLearner

    r = HfLearner(Path("."), model.config.vocab_size, micro_batch_size=mb, device=device)
    r.model = model
    r._apply_recipe()  # the engine recipe: the model's own ops, fp32 log-softmax
    r._loaded = True
    return r


def plans(full_rows: int) -> dict[str, Any]:
    from mismatch_probe.probes.capture import CapturePlan, build_plan

    # full-window = compare's default (stats everywhere, raw values for full_rows tokens, logits top-k);
    # full-all = the old default (--capture full before issue #11: every row's values, logits included)
    return {"off": None, "digest": CapturePlan("digest"), "stats": CapturePlan("stats"),
            "full-window": build_plan("stats", [], full_rows=full_rows, topk=8), "full-all": CapturePlan("full")}


def _peak_rss_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_modes(shape: str, device: str, seq_len: int, per_mb: int, mbs: int, repeats: int, full_rows: int,
               buffer_rows: int, tmp: Path, modes: list[str], cprofile_mode: str = "",
               cprofile_out: Path | None = None) -> list[dict[str, Any]]:
    from mismatch_probe.probes import recorder as recmod

    model = build_model(shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.config.vocab_size, seq_len).tolist() for _ in range(per_mb * mbs)]
    ids = list(range(len(seqs)))
    r = learner(model, device, per_mb)
    tokens = per_mb * mbs * seq_len
    closes: list[float] = []
    orig_close = recmod.OpRecorder.close

    def timed_close(self: Any) -> None:
        # the kernels of the tensors still queued are part of the forward (launched and waited for here;
        # before 2026-12-01 18:00 the last launch ran inside close(), outside `forward`)
        if not self._closed:
            self._launch()
            if self._stream:
                self._stream.synchronize()
        t = time.perf_counter()
        orig_close(self)
        closes.append(time.perf_counter() - t)

    recmod.BUFFER_ROWS = buffer_rows
    recmod.OpRecorder.close = timed_close
    from mismatch_probe.probes import digest_triton

    orig_launch, orig_record, orig_rows = digest_triton.launch_desc, recmod.OpRecorder.record, recmod.OpRecorder.record_rows
    orig_qbytes, orig_batch_launch = recmod._QUEUE_BYTES, recmod.OpRecorder.launch

    def setup(mode: str, lr: Any = r) -> Any:
        # variants of a mode (MODE@VARIANT), to attribute the cost:
        #   thread   the writer thread instead of the writer process
        #   main     the digest kernels on the engine's stream instead of a side stream
        #   nolaunch no digest kernel launched (host work, copies and writing only; rows hold garbage)
        #   hooks    the hooks run but record nothing (hook dispatch only)
        #   qNg      the queue launches at N GiB instead of the default (4 GiB; 1 GiB before 18:00 2026-12-01)
        #   keep     no launch at each new micro-batch (only when the queue is full, and at close)
        #   eqprio   the engine's forwards on the caller's stream (MISMATCH_PROBE_CAPTURE_STREAM=side-equal),
        #            not on the high-priority stream of the default `side`
        base_mode, _, variant = mode.partition("@")
        recmod._QUEUE_BYTES = int(variant[1:-1]) << 30 if variant[:1] == "q" and variant[1:-1].isdigit() else orig_qbytes
        recmod.OpRecorder.launch = (lambda self: None) if variant == "keep" else orig_batch_launch
        os.environ["MISMATCH_PROBE_CAPTURE_WRITER"] = "thread" if variant == "thread" else "process"
        os.environ["MISMATCH_PROBE_CAPTURE_STREAM"] = {"main": "main", "eqprio": "side-equal"}.get(variant, "side")
        digest_triton.launch_desc = (lambda *a, **k: None) if variant == "nolaunch" else orig_launch
        recmod.OpRecorder.record = (lambda *a, **k: None) if variant == "hooks" else orig_record
        recmod.OpRecorder.record_rows = (lambda *a, **k: None) if variant == "hooks" else orig_rows
        plan = plans(full_rows)[base_mode]
        lr.capture = plan
        lr.ops_dest = tmp / f"{shape}-{mode}.parquet" if plan is not None else None
        return plan

    out = []
    ref_lp = None
    fwds: dict[str, list[float]] = {m: [] for m in modes}
    tots: dict[str, list[float]] = {m: [] for m in modes}
    lps: dict[str, Any] = {}
    infos: dict[str, dict[str, Any]] = {}
    peaks: dict[str, float] = {}
    try:
        # modes interleaved (round i runs every mode once): the host's speed drifts within a process
        for i in range(repeats + 1):  # the first round warms up (Triton compile, allocator)
            for mode in modes:
                setup(mode)
                closes.clear()
                _sync(device)
                _peak_rss_reset()
                t0 = time.perf_counter()
                lps[mode] = r.score(seqs, ids)
                _sync(device)
                t1 = time.perf_counter()
                if i:
                    tots[mode].append(t1 - t0)
                    fwds[mode].append(t1 - t0 - (closes[0] if closes else 0.0))
                infos[mode] = dict(r.info.settings.get("capture") or {})
                peaks[mode] = max(peaks.get(mode, 0.0), _peak_rss_mb())
        if cprofile_mode:  # after the timed rounds: the profiler slows the forwards it runs
            import cProfile
            import pstats

            # the forwards only: the profile stops where close() starts (writing every row, the
            # writer's threads waiting on pipes), which would otherwise fill the tables
            setup(cprofile_mode)
            pr = cProfile.Profile()

            def profiled_close(self: Any) -> None:
                pr.disable()
                orig_close(self)

            recmod.OpRecorder.close = profiled_close
            try:
                pr.enable()
                r.score(seqs, ids)
                pr.disable()
            finally:
                recmod.OpRecorder.close = timed_close
            with open(cprofile_out, "w") as f:
                for key in ("tottime", "cumulative"):
                    pstats.Stats(pr, stream=f).sort_stats(key).print_stats(60)
        for mode in modes:
            plan = setup(mode)
            dest, lp, fwd, tot = r.ops_dest, lps[mode], fwds[mode], tots[mode]
            if ref_lp is None:
                ref_lp = lp
            row = {"shape": shape, "params_m": round(n_params / 1e6, 1), "device": device, "mode": mode,
                   "tokens": tokens, "micro_batch_tokens": per_mb * seq_len, "forward_s": statistics.median(fwd),
                   "total_s": statistics.median(tot), "forward_all": fwd, "total_all": tot,
                   "peak_rss_mb": round(peaks[mode], 1),
                   "logprobs_equal_off": all(np.array_equal(a, b) for a, b in zip(lp, ref_lp, strict=True))}
            if plan is not None:
                size = dest.stat().st_size
                row.update(bytes=size, bytes_per_token=size / tokens, rows=infos[mode]["rows"],
                           writer_peak_rss_mb=infos[mode].get("writer_peak_rss_mb"))
                if not mode.endswith(("@nolaunch", "@hooks")):  # those rows are garbage / absent
                    row["digest_check"] = _check_full_rows(dest)
                    row["table_sha"] = _table_sha(dest)  # same hash across variants: the same rows, bit for bit
            out.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    finally:
        recmod.OpRecorder.close = orig_close
        digest_triton.launch_desc, recmod.OpRecorder.record, recmod.OpRecorder.record_rows = orig_launch, orig_record, orig_rows
        recmod._QUEUE_BYTES, recmod.OpRecorder.launch = orig_qbytes, orig_batch_launch
        os.environ.pop("MISMATCH_PROBE_CAPTURE_WRITER", None)
        os.environ.pop("MISMATCH_PROBE_CAPTURE_STREAM", None)
    del model, r
    return out


def _table_sha(path: Path) -> str:
    """sha256 of the digest and stats columns in (op, seq_id, pos) order (values excluded)."""
    import hashlib

    from mismatch_probe.run.schema import read_table

    cols = ["op", "seq_id", "pos", "digest", "sum", "sum_sq", "abs_max", "n_nan", "n_inf"]
    t = read_table(path, "ops").select(cols).sort_by([("op", "ascending"), ("seq_id", "ascending"), ("pos", "ascending")])
    h = hashlib.sha256()
    for c in cols[3:]:
        h.update(t.column(c).to_numpy(zero_copy_only=False).astype(str if c == "digest" else float).tobytes())
    return h.hexdigest()[:12]


def _check_full_rows(path: Path) -> dict[str, Any]:
    """Digests recorded on the device vs the numpy reference on the kept raw values."""
    from mismatch_probe.probes.digest import digest_bytes_ref, hex_digests
    from mismatch_probe.run.schema import read_table

    t = read_table(path, "ops").select(["op", "dtype", "digest", "values"]).to_pandas()
    t = t[t["values"].notna()]
    if t.empty:
        return {"rows": 0}
    t = t.groupby("op").head(8)
    size = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "bool": 1}
    ok = 0
    for (dt, n), g in t.groupby([t.dtype, t["values"].map(len)]):
        raw = np.frombuffer(b"".join(g["values"]), np.uint8).reshape(len(g), n)
        ok += int((np.array(hex_digests(digest_bytes_ref(raw, size[dt]))) == g.digest.to_numpy()).sum())
    return {"rows": len(t), "equal": ok}


def digest_triton_cfg() -> tuple[int, int]:
    from mismatch_probe.probes import digest_triton

    return digest_triton.BLOCK, digest_triton.WARPS


def kernel_bench(shape: str, tokens: int = 4096) -> list[dict[str, Any]]:
    """The digest+stats kernel alone on one forward's captured tensors of ``shape`` (bf16 rows of
    the widths a forward captures, one tensor per op), per (BLOCK, WARPS), and the digest-only
    kernel at the default (BLOCK, WARPS): elements per second."""
    import torch

    from mismatch_probe.probes import digest_triton

    c = SHAPES[shape]
    h, q, kv, i, v = (c["hidden_size"], c["num_attention_heads"] * c["head_dim"],
                      c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"], c["vocab_size"])
    widths = [h, q, kv, kv, q, kv, q, kv, q, h, h, h, i, i, i, h, h] * c["num_hidden_layers"] + [h, h, v]
    pool = {w: torch.randn(tokens, w, device="cuda").to(torch.bfloat16) for w in set(widths)}
    ts = [pool[w] for w in widths]
    n_el = sum(t.numel() for t in ts)
    dig = torch.empty(len(ts) * tokens, dtype=torch.int64, device="cuda")
    st = digest_triton.split_arena(len(ts) * tokens, "cuda")
    out = []
    saved = digest_triton.BLOCK, digest_triton.WARPS
    # (BLOCK, WARPS, stats, tensors per launch): 64 as the queue launched before 2026-12-01 18:00, 256 about
    # what a 4 GiB queue launches on the 0.6B shape
    for block, warps, stats, group in ((256, 1, True, 64), (256, 1, False, 64), (256, 1, True, 256),
                                       (256, 1, False, 256), (512, 2, True, 64)):
        digest_triton.BLOCK, digest_triton.WARPS = block, warps

        def run(stats: bool = stats, group: int = group) -> None:
            for a in range(0, len(ts), group):
                digest_triton.launch([(t, (a + j) * tokens, 0) for j, t in enumerate(ts[a : a + group])], dig, st,
                                     stats)

        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        t = statistics.median(times)
        out.append({"shape": shape, "block": block, "warps": warps, "stats": stats, "tensors_per_launch": group,
                    "elements": n_el, "seconds": t,
                    "g_elements_per_s": n_el / t / 1e9, "gb_per_s": 2 * n_el / t / 1e9})
        print(json.dumps(out[-1]), flush=True)
    digest_triton.BLOCK, digest_triton.WARPS = saved
    return out


def profile_forward(shape: str, modes: list[str], device: str, seq_len: int, per_mb: int, tmp: Path,
                    out_dir: Path) -> dict[str, Any]:
    """torch.profiler over one score() (one micro-batch) per capture mode, side by side: ``off``,
    ``digest@hooks`` (hooks that record nothing), ``digest``...; a table per mode in ``out_dir``
    and a summary (wall, host and device totals, kernel launches) per mode."""
    from torch.profiler import ProfilerActivity, profile

    from mismatch_probe.probes import recorder as recmod

    model = build_model(shape, device)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.config.vocab_size, seq_len).tolist() for _ in range(per_mb)]
    r = learner(model, device, per_mb)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    orig_record = recmod.OpRecorder.record
    out: dict[str, Any] = {}
    try:
        for mode in modes:
            base_mode, _, variant = mode.partition("@")
            recmod.OpRecorder.record = (lambda *a, **k: None) if variant == "hooks" else orig_record
            r.capture = plans(256)[base_mode]
            r.ops_dest = tmp / "prof.parquet" if r.capture is not None else None
            r.score(seqs, list(range(per_mb)))  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                r.score(seqs, list(range(per_mb)))
                _sync(device)
            wall = time.perf_counter() - t0
            ka = prof.key_averages()
            launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
            out[mode] = {"wall_s_profiled": wall, "self_cpu_ms": sum(e.self_cpu_time_total for e in ka) / 1e3,
                         "self_device_ms": sum(getattr(e, "self_device_time_total", 0) for e in ka) / 1e3,
                         "kernel_launches": launches}
            name = mode.replace("@", "_at_")
            (out_dir / f"profile_{shape}_{name}.txt").write_text(
                ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n"
                + (ka.table(sort_by="self_device_time_total", row_limit=20) if device == "cuda" else ""))
            print(json.dumps({"profile": mode, **out[mode]}), flush=True)
    finally:
        recmod.OpRecorder.record = orig_record
    del model, r
    return out


def _save(path: Path, res: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


def cli_check(seq_len: int, n_seqs: int, repeats: int) -> list[dict[str, Any]]:
    """`mismatch-probe capture --engine hf --capture off|stats` on n_seqs sequences of a 129M model."""
    import pyarrow as pa
    import torch

    from mismatch_probe.run.rundir import RunWriter
    from mismatch_probe.run.schema import write_table

    tmp = Path(tempfile.mkdtemp(prefix="bench-capture-cli-"))
    model = build_model("llama-129m", "cpu")
    model.save_pretrained(tmp / "model")
    from mismatch_probe.probes.models import resolve_model

    tiny = resolve_model("tiny-llama").path  # a local tokenizer (ids < its vocab, well inside 32,000)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp / "model" / f).write_bytes((tiny / f).read_bytes())
    n_params = sum(p.numel() for p in model.parameters())
    del model
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32000, seq_len).tolist() for _ in range(n_seqs)]
    with RunWriter(tmp / "run") as run:
        run.manifest["config"] = {"model_dir": str(tmp / "model")}
        write_table(run.path("sequences.parquet"), pa.table({"seq_id": list(range(n_seqs)), "prompt_id": list(range(n_seqs)),
                                                             "n_prompt": [seq_len // 2] * n_seqs, "token_ids": seqs}),
                    "sequences")
        run.finish()
    out = []
    exe = [sys.executable, "-m", "mismatch_probe"]
    for mode in ["off", "stats"] * repeats:
        dest = tmp / f"cap-{mode}"
        load = os.getloadavg()[0]
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(exe + ["capture", "--engine", "hf", "--from", str(tmp / "run"), "--out", str(dest), "--capture", mode,
                              "--overwrite"], check=True, capture_output=True)
        dt = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
        ops = dest / "hf" / "ops.parquet"
        out.append({"mode": mode, "seconds": dt, "cpu_seconds": cpu, "load_1min_before": load,
                    "ops_bytes": ops.stat().st_size if ops.exists() else 0})
        print(json.dumps(out[-1]), flush=True)
    med = {m: statistics.median(r["seconds"] for r in out if r["mode"] == m) for m in ("off", "stats")}
    cmed = {m: statistics.median(r["cpu_seconds"] for r in out if r["mode"] == m) for m in ("off", "stats")}
    print(json.dumps({"cli_median_s": med, "ratio": med["stats"] / med["off"], "cli_median_cpu_s": cmed,
                      "cpu_ratio": cmed["stats"] / cmed["off"], "params_m": n_params / 1e6,
                      "threads": torch.get_num_threads()}))
    return out


def rss_check(n_seqs: list[int], seq_len: int) -> list[dict[str, Any]]:
    """Peak RSS of a stats + full-window capture, tiny model on CPU, growing token counts: each count
    runs in a fresh process so the peaks do not mix."""
    res = []
    for n in n_seqs:
        code = (f"import sys; sys.argv=['x']; from bench.bench_capture import _rss_child; _rss_child({n}, {seq_len})")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
        res.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps(res[-1]), flush=True)
    return res


def _rss_child(n_seqs: int, seq_len: int) -> None:
    import torch

    model = build_model("tiny-qwen3", "cpu")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1024, seq_len).tolist() for _ in range(n_seqs)]
    r = learner(model, "cpu", 4)
    r.capture = plans(256)["full-window"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-rss-"))
    r.ops_dest = tmp / "ops.parquet"
    base = _peak_rss_mb()
    _peak_rss_reset()
    t0 = time.perf_counter()
    r.score(seqs, list(range(n_seqs)))
    print(json.dumps({"seqs": n_seqs, "tokens": n_seqs * seq_len, "rows": r.info.settings["capture"]["rows"],
                      "ops_mb": round(r.ops_dest.stat().st_size / 1e6, 1), "seconds": round(time.perf_counter() - t0, 1),
                      "rss_before_mb": round(base, 1), "peak_rss_during_mb": round(_peak_rss_mb(), 1),
                      "writer_process_peak_rss_mb": r.info.settings["capture"].get("writer_peak_rss_mb"),
                      "buffer_rows": r.info.settings["capture"]["buffer_rows"], "threads": torch.get_num_threads()}))


def writer_check(repeats: int) -> list[dict[str, Any]]:
    """The writer alone on the rows of one Qwen3-0.6B-shaped score() (4 x 1,024 tokens, 478 ops of
    1,024 bf16 columns, chunks of 2^20 rows, random digests and stats): the per-row table of schema
    v2 (``_build_table`` + ``StreamWriter``) vs the packed layout (``_build_packed`` +
    ``PackedWriter``), interleaved; then ``op_errors_run`` on two packed captures of those rows (what
    compare's op-errors stage runs) and ``read_table`` unpacking one."""
    from mismatch_probe.analysis.op_errors import op_errors_run
    from mismatch_probe.probes.ops_table import DIGEST, STATS, _build_packed, _build_table, _ops_schema, _Rows, packed_writer
    from mismatch_probe.run.schema import StreamWriter, read_table

    b, t, layers = 4, 1024, 28
    n = b * t
    seq, pos = np.repeat(np.arange(b), t), np.tile(np.arange(t), b)
    kinds = ["input_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.rope_q", "attn.rope_k",
             "attn.core", "attn.o", "resid_mid", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "out"]
    ops = ["embed"] + [f"{i}.{k}" for i in range(layers) for k in kinds] + ["final_norm"]
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-writer-"))
    out = []
    for mode, code in (("digest", DIGEST), ("stats", STATS)):
        rows = _Rows(np.arange(n), seq, pos, np.full(n, code, np.int8), np.zeros(0, np.int64), stats=code >= STATS)
        per = (1 << 20) // n
        chunks = [[(op, "bfloat16", [1024], 1024, 2, rows, j * n, True) for j, op in enumerate(ops[a : a + per])]
                  for a in range(0, len(ops), per)]
        total = len(ops) * n
        dig = rng.integers(0, 2**63, total, dtype=np.int64)
        st = rng.standard_normal((total, 5)) if code >= STATS else None
        if st is not None:
            st[:, 3:] = 0.0

        def write(kind: str, path: Path, chunks: list = chunks, dig: Any = dig, st: Any = st) -> float:
            t0 = time.perf_counter()
            w = packed_writer(path) if kind == "packed" else StreamWriter(path, "ops", _ops_schema())
            base = 0
            for segs in chunks:
                m = len(segs) * n
                s = None if st is None else st[base : base + m]
                build = _build_packed if kind == "packed" else _build_table
                w.write(build(segs, dig[base : base + m].view(np.uint64), s, None, None, None))
                base += m
            w.close()
            return time.perf_counter() - t0

        secs: dict[str, list[float]] = {"per-row": [], "packed": []}
        for _ in range(repeats):
            for kind in secs:
                secs[kind].append(write(kind, tmp / mode / ("learner" if kind == "packed" else "rows") / "ops.parquet"))
        (tmp / mode / "sampler").mkdir(exist_ok=True)
        (tmp / mode / "sampler" / "ops.parquet").write_bytes((tmp / mode / "learner" / "ops.parquet").read_bytes())
        cmp_s, unpack_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            errs = op_errors_run(tmp / mode, layers)
            cmp_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            read_table(tmp / mode / "learner" / "ops.parquet", "ops")
            unpack_s.append(time.perf_counter() - t0)
        row = {"mode": mode, "rows": total, "tokens": n, "per_row_s": statistics.median(secs["per-row"]),
               "packed_s": statistics.median(secs["packed"]), "per_row_all": secs["per-row"], "packed_all": secs["packed"],
               "per_row_mb": (tmp / mode / "rows" / "ops.parquet").stat().st_size / 1e6,
               "packed_mb": (tmp / mode / "learner" / "ops.parquet").stat().st_size / 1e6,
               "op_errors_run_s": statistics.median(cmp_s), "op_rows_compared": int(errs.n_rows.sum()),
               "read_unpack_s": statistics.median(unpack_s), "load_1min": os.getloadavg()[0]}
        out.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'mode':7} {'rows':>9} {'per-row s':>9} {'packed s':>8} {'speed-up':>8} {'per-row MB':>10} {'packed MB':>9} "
          f"{'compare s':>9} {'unpack s':>8}")
    for r in out:
        print(f"{r['mode']:7} {r['rows']:9d} {r['per_row_s']:9.3f} {r['packed_s']:8.3f} {r['per_row_s'] / r['packed_s']:8.1f} "
              f"{r['per_row_mb']:10.1f} {r['packed_mb']:9.1f} {r['op_errors_run_s']:9.3f} {r['read_unpack_s']:8.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--modes", default="off,digest,stats,full-window")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seqs-per-mb", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shape-repeats", default="", help="per-shape repeats, e.g. qwen3-8b=3 (else --repeats)")
    ap.add_argument("--full-rows", type=int, default=256)
    ap.add_argument("--buffer-rows", type=int, default=1 << 22)
    ap.add_argument("--cli-check", action="store_true")
    ap.add_argument("--cli-seq-len", type=int, default=512)
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--writer-check", action="store_true", help="the writer alone: per-row vs packed ops.parquet, "
                    "and the op comparison, on the rows of a 0.6B-shaped score() (CPU)")
    ap.add_argument("--kernel-bench", action="store_true", help="CUDA: the digest kernel alone per (BLOCK, WARPS)")
    ap.add_argument("--profile", action="store_true", help="CUDA: torch.profiler of one forward per --profile-modes")
    ap.add_argument("--profile-modes", default="off,digest@hooks,digest", help="modes profiled side by side")
    ap.add_argument("--cprofile", default="", help="cProfile one score() of this mode (first shape) after the "
                    "timed rounds, until close(); tables by tottime and cumulative time next to --out")
    ap.add_argument("--kernel-auto", action="store_true", help="CUDA: forwards use the fastest (BLOCK, WARPS) found")
    ap.add_argument("--variant-shapes", default="qwen3-0.6b", help="shapes that also run the MODE@VARIANT modes")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "argv": sys.argv,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.cli_check:
        res["cli"] = cli_check(a.cli_seq_len, 16, a.repeats)
    elif a.rss:
        res["rss"] = rss_check([16, 64], 2048)
    elif a.writer_check:
        res["writer"] = writer_check(a.repeats)
    else:
        import torch

        tmp = Path(tempfile.mkdtemp(prefix="bench-capture-"))
        if a.device == "cuda":
            res["gpu"] = torch.cuda.get_device_name()
            if a.kernel_bench:
                res["kernel"] = [k for shape in a.shapes.split(",") for k in kernel_bench(shape)]
                if a.kernel_auto:  # the forwards below run with the fastest (BLOCK, WARPS) over all shapes
                    from mismatch_probe.probes import digest_triton

                    tot: dict[tuple[int, int], float] = {}
                    for k in res["kernel"]:
                        if not k["stats"] or k["tensors_per_launch"] != 64:
                            continue
                        tot[(k["block"], k["warps"])] = tot.get((k["block"], k["warps"]), 0.0) + k["seconds"]
                    digest_triton.BLOCK, digest_triton.WARPS = min(tot, key=tot.get)
            res["kernel_config"] = {"block": digest_triton_cfg()[0], "warps": digest_triton_cfg()[1]}
            print(json.dumps(res["kernel_config"]), flush=True)
            if a.profile:
                res["profile"] = profile_forward(a.shapes.split(",")[0], a.profile_modes.split(","), "cuda", a.seq_len,
                                                 a.seqs_per_mb, tmp, a.out.parent if a.out else tmp)
        res["runs"] = []
        for shape in a.shapes.split(","):
            # MODE@VARIANT (see time_modes) only on --variant-shapes
            modes = [m for m in a.modes.split(",") if "@" not in m or shape in a.variant_shapes.split(",")]
            cprof = a.cprofile if shape == a.shapes.split(",")[0] else ""
            reps = int(dict(x.split("=") for x in a.shape_repeats.split(",") if x).get(shape, a.repeats))
            res["runs"] += time_modes(shape, a.device, a.seq_len, a.seqs_per_mb, a.mbs, reps, a.full_rows,
                                      a.buffer_rows, tmp, modes, cprof,
                                      (a.out.parent if a.out else tmp) / f"cprofile_{shape}_{cprof.replace('@', '_at_')}.txt")
            for f in tmp.glob("*.parquet"):
                f.unlink()
            if a.out:  # after each shape: a later failure keeps what ran
                _save(a.out, res)
        for k in res.get("kernel", []):
            print(f"kernel {k['shape']:12} block {k['block']:5d} warps {k['warps']} {'stats' if k['stats'] else 'digest'} "
                  f"{k['g_elements_per_s']:7.1f} G el/s "
                  f"{k['gb_per_s']:7.1f} GB/s")
        print(f"\n{'shape':12} {'mode':16} {'forward s':>10} {'x off':>6} {'x/round':>7} {'total s':>8} {'x off':>6} "
              f"{'B/token':>9} {'rows':>10} {'peak RSS MB':>11} {'lp==off':>7} {'table sha':>12}")
        base: dict[str, dict[str, Any]] = {}
        for r in res["runs"]:
            if r["mode"] == "off":
                base[r["shape"]] = r
            b = base.get(r["shape"], r)
            # the median of the per-round ratios (round i ran every mode once, one after another)
            r["x_off_per_round"] = statistics.median(f / o for f, o in zip(r["forward_all"], b["forward_all"], strict=True))
            print(f"{r['shape']:12} {r['mode']:16} {r['forward_s']:10.4f} {r['forward_s'] / b['forward_s']:6.2f} "
                  f"{r['x_off_per_round']:7.2f} "
                  f"{r['total_s']:8.3f} {r['total_s'] / b['total_s']:6.2f} {r.get('bytes_per_token', 0):9.0f} "
                  f"{r.get('rows', 0):10d} {r['peak_rss_mb']:11.0f} {str(r['logprobs_equal_off']):>7} "
                  f"{r.get('table_sha', ''):>12}")
    if a.out:
        _save(a.out, res)


if __name__ == "__main__":
    main()
