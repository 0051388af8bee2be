"""Issue 27, points 1 and 2, in one script: the whole cost of op capture, as a user waits for it.

1. HF learner ``score()`` with capture streamed to ``ops_dest`` (as ``compare`` runs it), the timer
   stopped when ``score()`` returns (every row on disk, the file renamed into place), modes off /
   digest / stats (and ``default``: compare's default plan, stats + 256 full rows + logits top-8)
   interleaved round by round, on the Qwen3-0.6B shape (4 x 1,024 tokens) and the Qwen3-8B shape
   (2 x 1,024 tokens), random weights built in memory; logprobs checked bitwise against capture
   off; the streamed table checked equal, row for row, to the recorder's in-memory per-row table.
   ``MODE@thread``: the same with the writer thread instead of the writer process; ``MODE@rNk``: chunks
   of N Ki rows, ``MODE@qNm``: queued tensors launched every N MiB, ``MODE@hN``: at most N side-stream batches in
   flight, ``MODE@lateflush``: the last micro-batch's rows handed to the writer at close(), ``MODE@cN``: N
   chunks wait for the writer before recording blocks, ``MODE@slot`` / ``MODE@noslot``: chunks copied by the
   device into the writer's shared memory or through pinned buffers, ``MODE@fixed``: digest chunks end at
   BUFFER_ROWS only (not where the forward's tail is left), ``MODE@norec``: the capture's wrappers run but record
   nothing (what the wrappers alone cost), ``MODE@gcoff``: the interpreter's garbage collector off during the
   ``score()``, ``MODE@lpfirst``: the engine's stream does not wait for the last chunk's digests before the
   logprobs, ``MODE@ownstream``: each recorder on a new side stream (before one per device), ``MODE@nologits``: the
   logits not recorded, ``MODE@tN``: stats chunks spread over all but
   the forward's last N% of rows (``t0``: cut at STATS_BUFFER_ROWS only), ``MODE@nokernel``: no digest kernel
   launched (rows garbage: the device time the kernels take from the forward, against the recording's host time),
   ``MODE@pin``: the engine's thread alone on one core (its SMT siblings idle), every other thread and the writer
   processes on the other CPUs (``off@pin`` is its baseline); ``MODE@shm``: the file written under ``/dev/shm``
   (memory) instead of the temp folder (a diagnostic: what the file system's writes cost the writer);
   ``MODE@fatrows``: row sets pickled whole for the writer process (seq / pos / modes per row, as before round 24),
   ``MODE@nocache``: the capture's wrappers made anew at each ``score()`` (as before round 24), ``MODE@trunc``: the
   writer truncates its temp file instead of creating it (ext4 then writes the data back at close; before round 24);
   variants combine with ``+``
   (``digest@noslot+r1536k``) (``--modes``; ``--cprofile``: one whole
   ``score()`` per listed mode profiled; ``--trace``: each score()'s stages, bench/capture_trace.py). ``close s``: how long
   ``score()`` waits after its last forward (the recorder's ``close()``).
2. ``mismatch-probe compare`` with the default capture vs ``--capture off`` (same prompts, seeds:
   same sequences, checked), Qwen3-0.6B-shaped checkpoint, 64 sequences x 256 generated tokens;
   wall time of each command (after one untimed short ``compare``: the machine's first engine start
   fills the compile and page caches), compare's output kept per run (its stage times), and the op
   comparison of the two engines' tables
   (``analysis.op_errors.op_errors_run``, what compare's op-errors stage runs) timed on its own.

    python bench/gpu_capture_check.py --out $OUT                    # the H200 run (CUDA, vLLM)
    python bench/gpu_capture_check.py --out $OUT --quick            # fewer rounds, no table checks
    python bench/gpu_capture_check.py --out /tmp/x --device cpu --tiny   # this script itself, on a CPU

Writes ``$OUT/gpu_capture_check.json`` (after each part) and prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_capture as B  # noqa: E402

# shape -> (sequences, tokens each, micro-batch size); --tiny: one small shape for a CPU check
SCORE_SHAPES = {"qwen3-0.6b": (4, 1024, 4), "qwen3-8b": (2, 1024, 2)}
TINY_SCORE = {"tiny-qwen3": (4, 64, 2)}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


_ALL_CPUS = set(os.sched_getaffinity(0))  # the CPUs this bench may use (MODE@pin restores them)


def _pin(on: bool) -> str:
    """MODE@pin (a diagnostic): the engine's thread alone on the first CPU it may use, that core's SMT siblings
    left to nothing else; every other thread of this process and of the idle writer processes on the other
    CPUs. ``on`` False: every one of them on all CPUs again. Returns what it did, for the log."""
    import threading

    from mismatch_probe.probes import recorder_writer as rw

    cpus = _ALL_CPUS
    me = min(cpus)
    try:
        sib_txt = Path(f"/sys/devices/system/cpu/cpu{me}/topology/thread_siblings_list").read_text().strip()
        sib = set()
        for part in sib_txt.split(","):
            lo, _, hi = part.partition("-")
            sib |= set(range(int(lo), int(hi or lo) + 1))
    except OSError:
        sib = {me}
    rest = cpus - sib if on else cpus
    main = {me} if on else cpus
    tids = [(int(t), rest) for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
    for c in list(rw._IDLE):
        try:
            tids += [(int(t), rest) for t in os.listdir(f"/proc/{c.proc.pid}/task")]
        except OSError:  # that process is gone
            pass
    for tid, want in tids:
        try:
            os.sched_setaffinity(tid, want)
        except OSError:
            pass
    os.sched_setaffinity(0, main)
    return f"engine thread on {sorted(main)}, {len(tids)} other threads on {len(rest)} CPUs (siblings {sorted(sib)})"


def _plans() -> dict[str, Any]:
    from mismatch_probe.probes.capture import CapturePlan, build_plan

    return {"off": None, "digest": CapturePlan("digest"), "stats": CapturePlan("stats"),
            "default": build_plan("stats", [], topk=8)}


_CLOSE: list[float] = []
STAGES: dict[str, Any] = {}  # shape -> mode -> stage medians (--trace)
LOGS: Path | None = None  # where compare's output goes (--out)


def score_part(shape: str, n_seqs: int, seq_len: int, mb: int, device: str, rounds: int, modes: list[str],
               check_tables: bool, tmp: Path, cprofile: tuple[str, ...] = (), trace: bool = False) -> list[dict[str, Any]]:
    """Point 1: score() with ops streamed to disk, per mode, rounds interleaved (round 0 warms up)."""
    from mismatch_probe.run.schema import read_table

    model = B.build_model(shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, model.config.vocab_size, seq_len).tolist() for _ in range(n_seqs)]
    ids = list(range(n_seqs))
    r = B.learner(model, device, mb)
    plans = _plans()
    times: dict[str, list[float]] = {m: [] for m in modes}
    lps: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    rows: dict[str, int] = {}
    from mismatch_probe.probes import recorder as recmod
    from mismatch_probe.probes.hf import runner as hfrun

    defaults = (recmod.BUFFER_ROWS, recmod._QUEUE_BYTES, recmod.STATS_BUFFER_ROWS, recmod._HELD_MAX,
                recmod._QUEUE_CHUNKS, recmod._D2H_TO_SLOT, recmod.CUDA_BUFFER_ROWS, recmod._STATS_TAIL)
    closes: dict[str, list[float]] = {m: [] for m in modes}
    orig_parts = recmod.OpRecorder._device_parts

    def _f64max(self: Any, u: int) -> dict[str, Any]:
        parts = orig_parts(self, u)
        parts.pop("amb", None)
        return parts

    orig_close = recmod.OpRecorder.close

    def timed_close(self: Any) -> None:  # how long score() waits after its last forward (rows to disk)
        t = time.perf_counter()
        try:
            orig_close(self)
        finally:
            _CLOSE.append(time.perf_counter() - t)

    recmod.OpRecorder.close = timed_close
    orig_rr = recmod.OpRecorder.record_rows
    from mismatch_probe.probes.hf.capture import model_sites
    from mismatch_probe.probes.ops_table import _Rows

    slim = (_Rows.__getstate__, _Rows.__setstate__)
    from mismatch_probe.run.schema import StreamWriter

    orig_temp = StreamWriter.temp_path

    def _temp_nonempty(path: Path) -> str:  # MODE@trunc: the writer truncates its temp file (before round 24)
        tmp_ = orig_temp(path)
        Path(tmp_).write_bytes(b"\0")  # ops_packed.fresh leaves a non-empty file: the writer's open truncates it
        return tmp_

    def _fat_get(self: Any) -> dict[str, Any]:  # MODE@fatrows: every field of a row set, as before round 24
        return {**self.__dict__, "full_dev": None}

    def _fat_set(self: Any, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _norec(self: Any, op: str, tensor: Any, seq_ids: Any, pos: Any) -> None:
        return None

    from mismatch_probe.probes import digest_triton as dtk

    def _nokernel(*_a: Any, **_k: Any) -> None:
        return None

    tr = None
    if trace:  # stage timestamps per score() (bench/capture_trace.py)
        from capture_trace import Trace

        tr = Trace().install()
    use_pin = any("pin" in m.partition("@")[2].split("+") for m in modes)
    orig_ld = dtk.launch_desc  # the trace's wrapper of it, where --trace: MODE@nokernel replaces it for its rounds
    for i in range(rounds + 1):
        for mode in modes:
            base_mode, _, variant = mode.partition("@")  # MODE@thread: the writer thread, not the writer process
            vs = variant.split("+")  # variants combine: MODE@q1024m+r1536k
            os.environ["MISMATCH_PROBE_CAPTURE_WRITER"] = "thread" if "thread" in vs else "process"
            # MODE@rNk: chunks of N*1024 rows; MODE@qNm: queued tensors launched every N MiB
            rk = [int(v[1:-1]) << 10 for v in vs if v[:1] == "r" and v.endswith("k")]
            recmod.BUFFER_ROWS = rk[0] if rk else defaults[0]
            recmod.STATS_BUFFER_ROWS = rk[0] if rk else defaults[2]
            qm = [int(v[1:-1]) << 20 for v in vs if v[:1] == "q" and v.endswith("m")]
            recmod._QUEUE_BYTES = qm[0] if qm else defaults[1]
            # MODE@lateflush: the last micro-batch's rows handed to the writer at close(), after the logprobs
            hfrun.EARLY_FLUSH = "lateflush" not in vs
            # MODE@lpfirst: the logprobs' kernels before the last chunk's digests (the engine does not wait for them)
            hfrun.CAPTURE_FIRST = "lpfirst" not in vs
            # MODE@hN: at most N side-stream batches in flight before the recording thread waits
            hn = [int(v[1:]) for v in vs if v[:1] == "h" and v[1:].isdigit()]
            recmod._HELD_MAX = hn[0] if hn else defaults[3]
            # MODE@cN: N chunks wait for the writer before recording blocks
            cn = [int(v[1:]) for v in vs if v[:1] == "c" and v[1:].isdigit()]
            recmod._QUEUE_CHUNKS = cn[0] if cn else defaults[4]
            # MODE@slot / MODE@noslot: chunks copied by the device straight into the writer's shared memory, or not
            recmod._D2H_TO_SLOT = True if "slot" in vs else False if "noslot" in vs else defaults[5]
            # MODE@fixed: digest chunks end at BUFFER_ROWS only (no chunk end adapted to the forward's tail)
            recmod.CUDA_BUFFER_ROWS = recmod.BUFFER_ROWS if "fixed" in vs else defaults[6]
            # MODE@tN: stats chunks spread over all but the forward's last N% of rows (t0: cut at STATS_BUFFER_ROWS)
            tn = [int(v[1:]) for v in vs if v[:1] == "t" and v[1:].isdigit()]
            recmod._STATS_TAIL = tn[0] / 100 if tn else defaults[7]
            # MODE@ownstream: a side stream of its own for each recorder (the behaviour before one per device)
            if "ownstream" in vs:
                recmod._SIDE_STREAMS.clear()
            # MODE@norec: the wrappers run, the recorder records nothing; MODE@gcoff: no garbage collection
            recmod.OpRecorder.record_rows = _norec if "norec" in vs else orig_rr
            # MODE@nokernel: everything but the digest kernels (their rows garbage): the device time they take
            # from the forward, against the host time of recording (a diagnostic)
            dtk.launch_desc = _nokernel if "nokernel" in vs else orig_ld
            # MODE@fatrows: row sets pickled whole for the writer process (seq / pos / modes per row: ~100 KB a
            # chunk message); MODE@nocache: the capture's wrappers made anew at each score() (before round 24)
            _Rows.__getstate__, _Rows.__setstate__ = (_fat_get, _fat_set) if "fatrows" in vs else slim
            StreamWriter.temp_path = staticmethod(_temp_nonempty if "trunc" in vs else orig_temp)
            if "nocache" in vs:
                model_sites(model).fwds.clear()
            gc_was = gc.isenabled()
            if "gcoff" in vs:
                gc.disable()
            _CLOSE.clear()
            r.capture = plans[base_mode]
            # MODE@f64max: every abs_max stored as float64 (the layout's bytes before bf16 ops' 2-byte abs_max)
            recmod.OpRecorder._device_parts = _f64max if "f64max" in vs else orig_parts
            if "nologits" in vs:  # MODE@nologits: the logits not recorded (their digests are the forward's last work)
                from mismatch_probe.probes.capture import CapturePlan, CaptureRule

                r.capture = CapturePlan(base_mode, [CaptureRule("logits", "off")])
            # MODE@pin: the engine's thread on a core of its own, the writer's and every other thread elsewhere
            if use_pin:
                pinned = _pin("pin" in vs)
                if i == 0 and "pin" in vs:
                    print(f"{mode}: {pinned}", flush=True)
            # MODE@shm: the file in memory (/dev/shm), not the temp folder's file system (a diagnostic)
            dest = (Path("/dev/shm") if "shm" in vs else tmp) / f"{shape}-{mode}.parquet"
            dest.unlink(missing_ok=True)
            r.ops_dest = dest if r.capture is not None else None
            _sync(device)
            if tr is not None:
                tr.begin()
            t0 = time.perf_counter()
            lp = r.score(seqs, ids)  # returns once the rows are on disk (OpRecorder.close())
            _sync(device)
            dt = time.perf_counter() - t0
            if gc_was:
                gc.enable()
            if tr is not None:
                tr.end(mode)
            if i:
                times[mode].append(dt)
                closes[mode].append(sum(_CLOSE))
            lps[mode] = lp
            if r.capture is not None:
                sizes[mode] = dest.stat().st_size
                rows[mode] = int((r.info.settings.get("capture") or {}).get("rows", 0))
                if "shm" in vs:  # memory: not kept past its round
                    dest.unlink(missing_ok=True)
    dtk.launch_desc = orig_ld
    if use_pin:
        _pin(False)
    if tr is not None:
        tr.uninstall()
        STAGES[shape] = tr.summary()
    recmod.OpRecorder.close = orig_close
    recmod.OpRecorder.record_rows = orig_rr
    _Rows.__getstate__, _Rows.__setstate__ = slim
    StreamWriter.temp_path = staticmethod(orig_temp)
    recmod.OpRecorder._device_parts = orig_parts
    (recmod.BUFFER_ROWS, recmod._QUEUE_BYTES, recmod.STATS_BUFFER_ROWS, recmod._HELD_MAX, recmod._QUEUE_CHUNKS,
     recmod._D2H_TO_SLOT, recmod.CUDA_BUFFER_ROWS, recmod._STATS_TAIL) = defaults
    for mode in cprofile:  # after the timed rounds (the profiler slows what it runs): one whole score() each
        import cProfile
        import pstats

        r.capture = plans[mode]
        dest = tmp / f"{shape}-{mode}-prof.parquet"
        r.ops_dest = dest if r.capture is not None else None
        _sync(device)
        pr = cProfile.Profile()
        pr.enable()
        r.score(seqs, ids)
        _sync(device)
        pr.disable()
        dest.unlink(missing_ok=True)
        if LOGS is not None:
            with open(LOGS / f"cprofile_{shape}_{mode}.txt", "w") as f:
                for key in ("tottime", "cumulative"):
                    pstats.Stats(pr, stream=f).sort_stats(key).print_stats(45)
                # where the recorder's launches and flushes spend their host time, one level down
                for fn in ("_launch", "flush", "launch_desc", "_hold_until_done", "stage", "_device_parts", "_submit"):
                    pstats.Stats(pr, stream=f).sort_stats("cumulative").print_callees(f"\\b{fn}\\b")
    out = []
    base = times.get("off")
    for mode in modes:
        equal = all(np.array_equal(a, b) for a, b in zip(lps[mode], lps[modes[0]], strict=True))
        row = {"part": "score", "shape": shape, "params_m": round(n_params / 1e6, 1), "device": device,
               "tokens": n_seqs * seq_len, "micro_batch": mb, "mode": mode, "seconds": statistics.median(times[mode]),
               "all_s": times[mode], "logprobs_bitwise_equal_off": bool(equal),
               "bytes": sizes.get(mode, 0), "rows": rows.get(mode, 0),
               "close_s": statistics.median(closes[mode]) if closes[mode] else 0.0}
        if base:
            row["x_off"] = row["seconds"] / statistics.median(base)
            row["x_off_per_round"] = statistics.median(t / o for t, o in zip(times[mode], base, strict=True))
        plan = plans[mode.partition("@")[0]]
        # streamed (packed) == in-memory per-row
        if check_tables and plan is not None and ("@" not in mode or "slot" in mode) and "norec" not in mode:
            r.capture, r.ops_dest = plan, None
            r.score(seqs, ids)
            mem = r.ops
            disk = read_table(tmp / f"{shape}-{mode}.parquet", "ops")
            key = [("op", "ascending"), ("seq_id", "ascending"), ("pos", "ascending")]
            row["table_equal_in_memory"] = bool(disk.sort_by(key).equals(mem.sort_by(key)) or _same(disk, mem, key))
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all_s"}), flush=True)
    del model, r
    return out


def _same(a: Any, b: Any, key: list) -> bool:
    """Equal column by column (NaN equal to NaN: the stats of digest-only rows)."""
    a, b = a.sort_by(key), b.sort_by(key)
    if a.num_rows != b.num_rows:
        return False
    import pyarrow as pa

    for c in b.column_names:
        x, y = a.column(c), b.column(c)
        if pa.types.is_floating(x.type):
            if not np.array_equal(x.to_numpy(), y.to_numpy(), equal_nan=True):
                return False
        elif not x.equals(y):
            return False
    return True


# ---- point 2: compare on vLLM -------------------------------------------------------------------
def _checkpoint(shape: str, root: Path) -> Path:
    """A checkpoint folder of ``shape`` (random weights) with a word-level tokenizer covering its
    vocabulary (every sampled id detokenizes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = root / f"model-{shape}"
    if (out / "config.json").exists():
        return out
    model = B.build_model(shape, "cpu")
    model.generation_config.do_sample = True
    model.save_pretrained(out)
    v = model.config.vocab_size
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(v - 4)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", model_max_length=8192).save_pretrained(out)
    del model
    return out


def compare_part(shape: str | None, n_prompts: int, n: int, prompt_len: int, max_tokens: int, reps: int,
                 tmp: Path) -> list[dict[str, Any]]:
    """Point 2: ``compare`` wall time, default capture vs ``--capture off``, alternating, ``reps`` each."""
    import pyarrow.parquet as pq

    from mismatch_probe.analysis.op_errors import op_errors_run

    model = ["--model", str(_checkpoint(shape, tmp))] if shape else []
    vocab = B.SHAPES[shape]["vocab_size"] if shape else 512
    rng = np.random.default_rng(1)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [1] + rng.integers(4, vocab, prompt_len - 1).tolist()}) + "\n"
                               for _ in range(n_prompts)))
    exe = [sys.executable, "-m", "mismatch_probe", "compare", *model, "--prompts", str(prompts), "--n", str(n),
           "--max-tokens", str(max_tokens), "--overwrite"]
    runs: dict[str, list[float]] = {"default": [], "off": []}
    # untimed warm-up (a short compare with capture): the first engine start of a machine fills the disk
    # caches (torch.compile, Triton, the checkpoint's pages) that every later start reuses
    warm = tmp / "prompts-warm.jsonl"
    warm.write_text("".join(prompts.read_text().splitlines(keepends=True)[:4]))
    p = subprocess.run([*exe[:exe.index("--prompts")], "--prompts", str(warm), "--n", "1", "--max-tokens", "8", "--overwrite",
                        "--out", str(tmp / "run-warm")], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"compare (warm-up) failed, exit {p.returncode}:\n{p.stderr[-4000:]}")
    for _ in range(reps):
        for mode in ("off", "default"):
            out = tmp / f"run-{mode}"
            t0 = time.perf_counter()
            p = subprocess.run(exe + ["--out", str(out)] + (["--capture", "off"] if mode == "off" else []),
                               capture_output=True, text=True)
            dt = time.perf_counter() - t0
            if p.returncode != 0:
                raise RuntimeError(f"compare ({mode}) failed, exit {p.returncode}:\n{p.stderr[-4000:]}")
            runs[mode].append(dt)
            if LOGS:  # the stages' elapsed times (compare's progress display)
                (LOGS / f"compare_{mode}_{len(runs[mode])}.log").write_text(p.stdout + p.stderr)
            print(json.dumps({"compare": mode, "seconds": round(dt, 2)}), flush=True)
    seq = {m: pq.read_table(tmp / f"run-{m}" / "sequences.parquet").sort_by("seq_id").column("token_ids").to_pylist()
           for m in ("off", "default")}
    n_layers = B.SHAPES[shape]["num_hidden_layers"] if shape else 4  # (exec_order only)
    cmp_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        errs = op_errors_run(tmp / "run-default", int(n_layers))
        cmp_s.append(time.perf_counter() - t0)
    ops_bytes = {s: (tmp / "run-default" / s / "ops.parquet").stat().st_size
                 for s in ("learner", "sampler") if (tmp / "run-default" / s / "ops.parquet").exists()}
    tokens = sum(len(s) for s in seq["default"])
    med = {m: statistics.median(v) for m, v in runs.items()}
    row = {"part": "compare", "shape": shape or "tiny-qwen3", "sequences": len(seq["default"]), "tokens": tokens,
           "generated_per_seq": max_tokens, "off_s": med["off"], "default_s": med["default"],
           "x_off": med["default"] / med["off"], "off_all": runs["off"], "default_all": runs["default"],
           "same_sequences": seq["off"] == seq["default"], "op_compare_s": statistics.median(cmp_s),
           "op_compare_all": cmp_s, "op_rows_compared": int(errs.n_rows.sum()) if errs is not None else 0,
           "ops_bytes": ops_bytes}
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    return [row]


def _table(res: dict[str, Any]) -> str:
    lines = [f"\n{'shape':12} {'mode':14} {'tokens':>7} {'seconds':>9} {'x off':>6} {'x/round':>7} {'MB':>8} "
             f"{'B/token':>8} {'rows':>10} {'lp==off':>7} {'table==mem':>10} {'close s':>8}"]
    for r in res.get("score", []):
        lines.append(f"{r['shape']:12} {r['mode']:14} {r['tokens']:7d} {r['seconds']:9.4f} {r.get('x_off', 1.0):6.2f} "
                     f"{r.get('x_off_per_round', 1.0):7.2f} {r['bytes'] / 1e6:8.2f} {r['bytes'] / r['tokens']:8.0f} "
                     f"{r['rows']:10d} {str(r['logprobs_bitwise_equal_off']):>7} {str(r.get('table_equal_in_memory', '-')):>10} "
                     f"{r.get('close_s', 0.0):8.4f}")
    for r in res.get("compare", []):
        lines.append(f"\ncompare {r['shape']}: {r['sequences']} sequences, {r['tokens']} tokens: --capture off "
                     f"{r['off_s']:.1f} s, default capture {r['default_s']:.1f} s ({r['x_off']:.2f}x); "
                     f"same sequences: {r['same_sequences']}; op comparison {r['op_compare_s']:.2f} s "
                     f"({r['op_rows_compared']} row pairs); ops.parquet bytes {r['ops_bytes']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a check of this script on a CPU)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, one compare, no table checks, off/digest/stats")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--compare-reps", type=int, default=0, help="compare runs per mode (default 2, --quick 1)")
    ap.add_argument("--modes", default="", help="score modes (default off,digest,stats[,default,...]); "
                    "variants MODE@rNk (chunks of N Ki rows, any plan), MODE@qNm (launch every N MiB), MODE@thread")
    ap.add_argument("--skip-score", action="store_true")
    ap.add_argument("--shapes", default="", help="score shapes (default: all of SCORE_SHAPES)")
    ap.add_argument("--cprofile", default="", help="modes (e.g. off,stats) of which one whole score() each is "
                    "cProfiled after the timed rounds: $OUT/cprofile_SHAPE_MODE.txt")
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--trace", action="store_true", help="stage timestamps per score() (bench/capture_trace.py): "
                    "a second table, medians per mode")
    a = ap.parse_args()
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    global LOGS
    LOGS = a.out
    # outside any checkout: the op writer subprocess and the compare commands (python -m ...) import the
    # installed package, not the checkout's mismatch_probe/ folder (which lacks probes/ and kernels/)
    os.chdir(tempfile.gettempdir())
    rounds = 3 if a.quick else a.rounds
    modes = ["off", "digest", "stats"] + ([] if a.quick else ["default", "digest@thread", "stats@thread"])
    if a.modes:
        modes = a.modes.split(",")
    res: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "argv": sys.argv,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": a.device}
    import torch

    if a.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
        # (the Triton digest/stats kernel against the numpy reference: tests/gpu/test_digest_kernel_gpu.py)
    res["versions"] = {"torch": torch.__version__, "pyarrow": __import__("pyarrow").__version__}
    dump = a.out / "gpu_capture_check.json"
    tmp = Path(tempfile.mkdtemp(prefix="gpu-capture-check-"))
    os.environ.setdefault("MISMATCH_PROBE_CAPTURE_WRITER", "process")
    try:
        if not a.skip_score:
            res["score"] = []
            shapes = TINY_SCORE if a.tiny else SCORE_SHAPES
            for shape, (n_seqs, seq_len, mb) in shapes.items():
                if a.shapes and shape not in a.shapes.split(","):
                    continue
                res["score"] += score_part(shape, n_seqs, seq_len, mb, a.device, rounds, modes, not a.quick, tmp,
                                           tuple(m for m in a.cprofile.split(",") if m), a.trace)
                if STAGES:
                    res["stages"] = STAGES
                dump.write_text(json.dumps(res, indent=1))
                for f in tmp.glob("*.parquet"):
                    f.unlink()
        if not a.skip_compare:
            if a.tiny:  # the embedded tiny Qwen3 (vocabulary 512), 8 sequences x 16 tokens
                res["compare"] = compare_part(None, 4, 2, 8, 16, 1, tmp)
            else:  # 32 prompts x 2 samples = 64 sequences, 256 generated tokens each
                res["compare"] = compare_part("qwen3-0.6b", 32, 2, 32, 256, a.compare_reps or (1 if a.quick else 2), tmp)
            dump.write_text(json.dumps(res, indent=1))
    finally:
        dump.write_text(json.dumps(res, indent=1))
        if STAGES:
            from capture_trace import table

            for shape, summ in STAGES.items():
                print(f"\n{shape}: " + table(summ), flush=True)
        print(_table(res), flush=True)


if __name__ == "__main__":
    main()
