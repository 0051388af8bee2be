"""The synthetic capture behind ``data/ops_golden_v2.parquet``: deterministic tensors of several
dtypes recorded through :class:`OpRecorder` (two micro-batches with right padding, digest / stats /
full rows by rule and token range, the ``full_rows`` window, a logits top-k). The golden was
written by the recorder of commit f5f4120 (per-row ``ops.parquet``, schema v2), before the packed
layout; ``tests/probes/test_capture_packed.py`` checks today's tables against it, row for row.

    python tests/probes/capture_golden.py OUT.parquet   # rewrite the golden (only on purpose)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN = Path(__file__).parent / "data" / "ops_golden_v2.parquet"
COLS = ["op", "layer", "seq_id", "pos", "dtype", "shape", "numel", "sum", "sum_sq", "abs_max", "n_nan", "n_inf",
        "digest", "values", "topk_ids", "topk_values"]


def plan() -> Any:
    from mismatch_probe.probes.capture import CapturePlan, CaptureRule

    rules = [CaptureRule("logits", "stats"), CaptureRule("*.mlp.*", "digest"), CaptureRule("*.attn.q", "full", (2, 5)),
             CaptureRule("embed", "off", (0, 1))]
    return CapturePlan("stats", rules, full_rows=7, topk=3)


def record(rec: Any) -> None:
    """Two micro-batches (3 x 6 tokens, 2 x 9 tokens), right padding, ops of five dtypes."""
    import torch

    batches = [([4, 1, 7], [6, 3, 5], 6), ([0, 2], [9, 8], 9)]
    rec.begin([4, 1, 7, 0, 2], [6, 3, 5, 9, 8])
    g = torch.Generator().manual_seed(1234)
    for b, (ids, lens, width) in enumerate(batches):
        seq = np.full((len(ids), width), -1, np.int64)
        for i, (s, n) in enumerate(zip(ids, lens, strict=True)):
            seq[i, :n] = s
        seq = seq.reshape(-1)
        pos = np.tile(np.arange(width), len(ids))
        shape = (len(ids), width)

        def t(*cols: int, dtype: Any = torch.bfloat16, scale: float = 3.0, shape: tuple = shape) -> Any:
            x = torch.randn(*shape, *cols, generator=g) * scale
            return x.to(dtype)

        emb = t(16)
        if b == 1:
            emb[0, 1, 3] = float("nan")
            emb[1, 0, 2] = float("inf")
        rec.record_rows("embed", emb, seq, pos)
        for layer in range(2):
            rec.record_rows(f"{layer}.attn.q", t(4, 8), seq, pos)
            rec.record_rows(f"{layer}.attn.core", t(32, dtype=torch.float16), seq, pos)
            rec.record_rows(f"{layer}.mlp.gate", t(24), seq, pos)
            rec.record_rows(f"{layer}.moe.topk_ids", (t(2, dtype=torch.float32) * 10).to(torch.int64), seq, pos)
            rec.record_rows(f"{layer}.moe.topk_weights", t(2, dtype=torch.float32), seq, pos)
            rec.record_rows(f"{layer}.out", t(16, dtype=torch.float32), seq, pos)
        rec.record_rows("final_norm", t(16), seq, pos)
        rec.record_rows("logits", t(40, scale=5.0), seq, pos)


def sorted_rows(table: Any) -> Any:
    """``table`` (an ops table) in (op, seq_id, pos) order, the golden's columns."""
    return table.select(COLS).sort_by([("op", "ascending"), ("seq_id", "ascending"), ("pos", "ascending")])


def main(out: Path) -> None:
    import pyarrow.parquet as pq

    from mismatch_probe.probes.recorder import OpRecorder

    rec = OpRecorder(plan(), sink=None)
    record(rec)
    pq.write_table(sorted_rows(rec.table()), out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))


OP_ERRORS_GOLDEN = Path(__file__).parent / "data" / "op_errors_golden_v2.parquet"


def perturbed(table: Any) -> Any:
    """The golden ops table as another engine's capture would differ from it: digests of some rows
    of three ops changed, one byte of some kept values changed (so their errors are not zero), the
    rows in another order; ``dtype`` of one op changed (never bitwise equal)."""
    import pandas as pd

    df = table.to_pandas()
    flip = df.op.isin(["0.mlp.gate", "1.attn.q", "logits"]) & (df.pos % 3 == 1)
    df.loc[flip, "digest"] = df.loc[flip, "digest"].map(lambda d: d[::-1])

    def bump(v: Any) -> Any:
        if v is None:
            return None
        b = bytearray(v)
        b[1] ^= 1  # the high byte of a bf16/fp16 element, a low byte of wider ones
        return bytes(b)

    full = df["values"].notna() & flip
    df.loc[full, "values"] = df.loc[full, "values"].map(bump)
    df.loc[df.op == "0.moe.topk_weights", "dtype"] = "float16"
    return pd.concat([df.iloc[1::2], df.iloc[::2]], ignore_index=True)


def write_op_errors_golden(out: Path) -> None:
    """The op errors of the golden vs :func:`perturbed` by the per-row (pandas) comparison."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mismatch_probe.analysis.op_errors import op_errors

    want = pq.read_table(GOLDEN)
    errs = op_errors(want.to_pandas(), perturbed(want), num_layers=2)
    pq.write_table(pa.Table.from_pandas(errs, preserve_index=False), out)
