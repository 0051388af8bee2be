"""compare's op comparison alone (``analysis.op_errors.op_errors_run``, what its op-errors stage runs),
on two synthetic packed captures shaped like the H200 check of issue 27: 479 ops of a Qwen3-0.6B-like
model, 64 sequences x 288 tokens (8.8 M row pairs), compare's default plan (stats + the 256-row full
window + logits top-8), random bf16 rows (every row differs between the sides).

    python bench/bench_op_compare.py --out /tmp/opcmp [--cols 1536] [--threads 1,2] [--repeats 3]

``--cols``: values per row (1536 gives ~660 MB per side, about the H200 run's 685 MB). Writing the two
captures takes ~1 min per side at 1536 on 2 CPU cores (kept in --out and reused). Prints medians per
thread count; the tables must be equal (one digest of the op-errors table)."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

OPS = ["embed"] + [f"{layer}.{k}" for layer in range(28) for k in (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.rope_q", "attn.rope_k", "attn.core",
    "attn.o", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "attn.out", "mlp.out")] + ["final_norm", "logits"]


def make(root: Path, cols: int, n_seq: int = 64, length: int = 288, mb: int = 8) -> None:
    from mismatch_probe.probes.capture import build_plan
    from mismatch_probe.probes.recorder import OpRecorder

    for side, seed in (("learner", 0), ("sampler", 1)):
        if (root / side / "ops.parquet").exists():
            continue
        rec = OpRecorder(build_plan("stats", [], topk=8), sink=root / side / "ops.parquet")
        rec.begin(list(range(n_seq)), [length] * n_seq)
        g = torch.Generator().manual_seed(seed)
        for b0 in range(0, n_seq, mb):
            seq, pos = np.repeat(np.arange(b0, b0 + mb), length), np.tile(np.arange(length), mb)
            for op in OPS:
                rec.record(op, torch.randn(seq.size, 512 if op == "logits" else cols, generator=g).to(torch.bfloat16), seq, pos)
        rec.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    root = a.out / f"cols{a.cols}"
    t = time.perf_counter()
    make(root, a.cols)
    print(json.dumps({"made_s": round(time.perf_counter() - t, 1),
                      "mb_per_side": round((root / "learner/ops.parquet").stat().st_size / 1e6, 1)}), flush=True)
    import mismatch_probe.analysis.op_errors as oe

    oe.op_errors_run(root, 28)  # warm: numba's cached compile, the page cache
    for th in (int(x) for x in a.threads.split(",")):
        oe.OP_THREADS = th
        ts = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            e = oe.op_errors_run(root, 28)
            ts.append(time.perf_counter() - t)
        print(json.dumps({"threads": th, "median_s": round(statistics.median(ts), 2), "all_s": [round(x, 2) for x in ts],
                          "row_pairs": int(e.n_rows.sum()), "table_sha": hashlib.sha1(e.to_csv().encode()).hexdigest()[:12]}),
              flush=True)


if __name__ == "__main__":
    main()
