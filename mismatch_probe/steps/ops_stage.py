"""The op-capture and pre-flight parts of ``compare``: capture plans, tokenizer and weight parity,
``ops.parquet`` per side, and ``compare/op_errors.parquet``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa

from mismatch_probe.run import reader as layout
from mismatch_probe.run.schema import atomic_write_json, write_table

if TYPE_CHECKING:
    from mismatch_probe.run.rundir import RunWriter
    from mismatch_probe.steps.compare_types import Prepared


def describe_capture(plan: Any) -> dict[str, Any]:
    """The manifest's ``capture`` section: the plan and what it keeps, and why."""
    from mismatch_probe.probes.capture import KEPT_NOTE

    if plan is None:
        return {"plan": None, "kept": "nothing (capture off)"}
    return {"plan": plan.to_json(), "kept": KEPT_NOTE, "digest": "mp64 (see README, Per-op capture)"}


def tokenizer_mismatches(specs: list[Any], prompt_ids: list[list[int]], encode: Any) -> list[dict[str, Any]]:
    """Text prompts that the sampler's tokenizer (``encode``) turns into other ids than the learner's."""
    mismatched = []
    for i, (spec, ids) in enumerate(zip(specs, prompt_ids, strict=True)):
        if spec.text is None:
            continue
        theirs = list(encode(spec.text))
        if theirs != ids:
            mismatched.append({"prompt": i, "line": spec.line, "learner_ids": ids, "sampler_ids": theirs})
    return mismatched


def sampler_preflight(prep: Prepared, run: RunWriter, sampler: Any) -> None:
    """With the sampler loaded: its tokenization of the prompts, and the weights it holds."""
    mismatched = tokenizer_mismatches(prep.specs, prep.prompt_ids, sampler.encode)
    run.set_parity("tokenizer", {"ok": not mismatched, "mismatches": mismatched})
    atomic_write_json(run.path(layout.weights_file("sampler")), sampler.weight_digests())


def learner_preflight(prep: Prepared, run: RunWriter, learner: Any) -> None:
    """Compare the learner's weights with the digests the sampler stage recorded."""
    import json

    path = run.path(layout.weights_file("sampler"))
    if not path.exists():
        return
    res = learner.weight_parity(json.loads(path.read_text()), prep.sampler_model.path)
    run.set_parity("weights", {k: v for k, v in res.items() if k != "differences"} | {
        "n_differences": len(res["differences"])
    })
    atomic_write_json(run.path(layout.WEIGHT_PARITY), res)


def write_ops(run: RunWriter, side: str, runner: Any) -> None:
    if getattr(runner, "ops", None) is not None:
        write_table(run.path(layout.ops_file(side)), runner.ops, "ops")


def read_ops(run_dir: Path, side: str) -> pd.DataFrame | None:
    """``RUN/side/ops.parquet``, or the merged rank-partitioned dataset (see ``RunDir.ops``)."""
    from mismatch_probe.run.reader import RunDir

    return RunDir(run_dir).ops(side)


def compare_ops(run_dir: Path, num_layers: int) -> pd.DataFrame | None:
    """Write ``compare/op_errors.parquet`` when both sides captured ops (read column-wise, packed
    captures compared without unpacking them: analysis/op_errors.py ``op_errors_run``)."""
    from mismatch_probe.analysis.op_errors import op_errors_run

    errs = op_errors_run(run_dir, num_layers)
    if errs is None:
        return None
    write_table(Path(run_dir) / layout.OP_ERRORS, pa.Table.from_pandas(errs, preserve_index=False), "op_errors")
    return errs
