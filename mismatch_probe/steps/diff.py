"""``diff``: two captures of the same sequences (``capture`` folders or a run's sides) compared:
token logprob gap and per-op errors, optionally written to a result folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.errors import UsageError
from mismatch_probe.run import reader as layout


@dataclass
class DiffResult:
    summary: dict[str, Any]  # what summary.json holds
    n_tokens: int
    errs: Any = None  # the op_errors table (pandas), where both sides captured ops
    kinds: Any = None  # analysis.op_errors.by_kind of ``errs``


def side_dir(arg: str) -> tuple[Path, str]:
    """``DIR`` (a capture: its only engine folder) or ``RUN:learner`` / ``RUN:sampler``."""
    path, _, side = arg.rpartition(":") if ":" in arg else (arg, "", "")
    p = Path(path)
    if side:
        return p, side
    sides = [c.name for c in p.iterdir() if c.is_dir() and (p / layout.tokens_file(c.name)).exists()] if p.is_dir() else []
    if len(sides) != 1:
        raise UsageError(f"{arg}: name the side as DIR:SIDE (found {sides or 'none'})")
    return p, sides[0]


def check_out(out: Path, overwrite: bool) -> Path:
    """The result folder ``out``, checked before any work: never a run folder or a folder of other files."""
    from mismatch_probe.run.outpath import check_result_dir
    from mismatch_probe.run.reader import DIFF_FILES

    return check_result_dir(out, overwrite=overwrite, names=DIFF_FILES)


def run_diff(a: str, b: str) -> DiffResult:
    """Join the two sides' token tables (decode rows left out) and their ops; ``a`` is the reference."""
    import numpy as np

    from mismatch_probe.analysis.metrics import logprob_gap
    from mismatch_probe.analysis.op_errors import by_kind as kind_summary
    from mismatch_probe.analysis.op_errors import first_divergent, op_errors
    from mismatch_probe.run.reader import RunDir
    from mismatch_probe.run.schema import read_table
    from mismatch_probe.steps.ops_stage import read_ops

    (pa_, sa), (pb, sb) = side_dir(a), side_dir(b)
    ta = read_table(pa_ / layout.tokens_file(sa), "tokens").to_pandas()
    tb = read_table(pb / layout.tokens_file(sb), "tokens").to_pandas()
    ta, tb = ta[ta.source != "decode"], tb[tb.source != "decode"]
    m = ta.merge(tb, on=["seq_id", "pos"], suffixes=("_a", "_b"))
    if m.empty or not (m.token_id_a == m.token_id_b).all():
        raise UsageError("the two captures did not score the same tokens (capture both --from the same run)")
    resp = m[m.is_response_a]
    summary: dict[str, Any] = {"a": a, "b": b, "n_tokens": len(m), "gap": logprob_gap(
        resp.logprob_b.to_numpy(), resp.logprob_a.to_numpy(), seq_ids=resp.seq_id.to_numpy())}
    summary["bitwise_equal_logprobs"] = bool(np.array_equal(m.logprob_a.to_numpy(), m.logprob_b.to_numpy()))
    res = DiffResult(summary=summary, n_tokens=len(m))
    oa, ob = read_ops(pa_, sa), read_ops(pb, sb)
    if oa is not None and ob is not None:
        n_layers = RunDir(pa_).config_int("num_layers", 10_000)
        res.errs = op_errors(oa, ob, n_layers)
        summary["first_divergent"] = first_divergent(res.errs)
        res.kinds = kind_summary(res.errs)
        summary["by_kind"] = [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
                              for r in res.kinds.to_dict("records")]
    return res


def write_diff(out: Path, res: DiffResult) -> None:
    """``out/summary.json`` and, where ops were compared, ``out/op_errors.parquet``."""
    import pyarrow as pa

    from mismatch_probe.run.outpath import write_output
    from mismatch_probe.run.reader import OP_ERRORS_NAME, SUMMARY_NAME
    from mismatch_probe.run.schema import write_table

    write_output(out / SUMMARY_NAME, (json.dumps(res.summary, indent=2, default=str) + "\n").encode(), "diff --out")
    if res.errs is not None:
        write_table(out / OP_ERRORS_NAME, pa.Table.from_pandas(res.errs, preserve_index=False), "op_errors")
