"""The op writer process alone, host side: chunks shaped like the H200 0.6B capture run (4 x 1,024
tokens, 479 op calls: digest mode in 2 chunks of <= 1 Mi rows, stats mode in 15 chunks of 128 Ki
rows) handed to :class:`~mismatch_probe.probes.recorder_writer.WriterProcess` as fast as it takes
them, timed until ``close()`` returns (every row in ``ops.parquet``, renamed into place).

No engine and no GPU: this is the part of the capture cost that runs on the host after the device
copies (the feeder thread's hand-over, the writer process's Arrow build, the Parquet write, the close),
so its figures are the floor of what a capture of the same rows waits for on that host.

    python bench/bench_writer_pipe.py --repeats 5 [--dest /tmp] [--out results.json]

Columns: ``total`` = first submit until close() returns; ``tail`` = last submit until close()
returns (what a forward that ends with a full last chunk waits for after its last op).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _jobs(mode: str, tokens: int, ops: int, rows_per_chunk: int) -> list[tuple]:
    """The chunk jobs a recorder of ``mode`` hands its writer for ``ops`` op calls of ``tokens``
    tokens (real segments from a CPU recorder; arena contents random)."""
    import torch

    from mismatch_probe.probes.capture import CapturePlan
    from mismatch_probe.probes.recorder import OpRecorder

    seq = np.repeat(np.arange(4), tokens // 4)
    pos = np.tile(np.arange(tokens // 4), 4)
    rec = OpRecorder(CapturePlan(mode), buffer_rows=rows_per_chunk)
    jobs: list[tuple] = []
    rec._submit = jobs.append  # type: ignore[method-assign]
    t = torch.zeros(tokens, 1)
    for i in range(ops):
        rec.record_rows(f"{i // 17}.op{i % 17}", t, seq, pos)
    rec.flush()
    rng = np.random.default_rng(0)
    out = []
    for _ev, segs, dig, st, _vals, _tv, _ti in jobs:
        dig = rng.integers(-(1 << 62), 1 << 62, dig.shape[0], dtype=np.int64)
        if mode == "digest":
            st = None
        else:
            # as the device splits them (recorder_writer.STATS_PARTS): sums, abs_max, counts, abs_max's bf16 bits
            am = np.abs(rng.standard_normal(dig.shape[0])).astype(np.float32)
            am_b = (am.view(np.uint32) >> 16).astype(np.int16)
            st = (rng.standard_normal((dig.shape[0], 2)), (am_b.astype(np.uint32) << 16).view(np.float32).astype(np.float64),
                  np.zeros((dig.shape[0], 2), np.int32), am_b)
        out.append((None, segs, dig, st, None, None, None))
    return out


def run(mode: str, dest: Path, repeats: int) -> dict[str, Any]:
    from mismatch_probe.probes.recorder import _META
    from mismatch_probe.probes.recorder_writer import STATS_PARTS, WriterProcess
    from mismatch_probe.run.schema import StreamWriter

    jobs = _jobs(mode, 4096, 479, 1 << 20 if mode == "digest" else 1 << 17)
    totals, tails = [], []
    for r in range(repeats + 1):  # the first round starts the process (not counted)
        sink = dest / f"ops_{mode}_{r}.parquet"
        w = WriterProcess(sink, StreamWriter.temp_path(sink), _META, 2)
        t0 = time.perf_counter()
        for ev, segs, dig, st, vals, tv, ti in jobs:
            sp = dict(zip(STATS_PARTS, st, strict=True)) if st is not None else {}
            t1 = time.perf_counter()
            w.submit((ev, segs, {"dig": dig, **sp, "vals": vals, "tv": tv, "ti": ti}))
        w.close()
        t2 = time.perf_counter()
        if r:
            totals.append(t2 - t0)
            tails.append(t2 - t1)
        size = sink.stat().st_size
        sink.unlink()
    return {"mode": mode, "chunks": len(jobs), "rows": int(sum(j[2].shape[0] for j in jobs)), "mb": size / 1e6,
            "total_ms": statistics.median(totals) * 1e3, "tail_ms": statistics.median(tails) * 1e3,
            "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dest", default=None, help="directory for the Parquet files (default: a temp dir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dest = Path(a.dest or tempfile.mkdtemp(prefix="mp-writer-"))
    dest.mkdir(parents=True, exist_ok=True)
    rows = [run(m, dest, a.repeats) for m in ("digest", "stats")]
    if a.out:
        Path(a.out).write_text(json.dumps({"host": platform.node(), "rows": rows}, indent=1))
    print(f"\nwriter pipeline, host only ({platform.processor() or platform.machine()}), dest {dest}")
    print(f"{'mode':8} {'chunks':>6} {'rows':>9} {'MB':>7} {'total ms':>9} {'tail ms':>8}")
    for r in rows:
        print(f"{r['mode']:8} {r['chunks']:6d} {r['rows']:9d} {r['mb']:7.2f} {r['total_ms']:9.1f} {r['tail_ms']:8.1f}")


if __name__ == "__main__":
    main()
