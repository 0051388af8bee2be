"""``mismatch-probe capture``: one engine only, on the sequences of an earlier run, to compare
later with ``mismatch-probe diff`` (e.g. the FSDP learner against a run's single-process learner,
or a new vLLM build against an old capture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from mismatch_probe.cli.app import app, console
from mismatch_probe.errors import UsageError


@app.command("capture")
def capture(
    engine: str = typer.Option(..., "--engine", "-e", help="hf | fsdp | vllm"),
    source: Path = typer.Option(..., "--from", help="A run directory whose sequences (sequences.parquet) are scored."),
    out: Path = typer.Option(..., "--out", "-o", help="Capture directory to write."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model (default: the run's learner model)."),
    capture_mode: str = typer.Option("stats", "--capture", help="off | digest | stats | full"),
    capture_rule: list[str] = typer.Option([], "--capture-rule", help="GLOB=MODE[@START:END] (repeatable)."),
    capture_full_rows: int | None = typer.Option(
        None, "--capture-full-rows",
        help="Raw values for the first N tokens (bisect's rows) \\[default: 256 under --capture stats].",
    ),
    capture_topk: int = typer.Option(8, "--capture-topk", help="logits rows: keep the top-k values and ids."),
    full_logits: bool = typer.Option(False, "--full-logits", help="Keep vocabulary-wide logits rows where capture is full."),
    micro_batch_size: int = typer.Option(8, "--micro-batch-size"),
    nproc: int = typer.Option(2, "--nproc", help="--engine fsdp: ranks."),
    timeout: float = typer.Option(300.0, "--fsdp-timeout", help="--engine fsdp: seconds before a rank counts as hung."),
    recipe: str | None = typer.Option(None, "--recipe", help="Alignment recipe (hf, vllm)."),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    overwrite: bool = typer.Option(False, "--overwrite"),
    sampler_arg: list[str] = typer.Option(
        [], "--sampler-arg", help="--engine vllm: KEY=VALUE vLLM engine argument (repeatable)."
    ),
    learner_arg: list[str] = typer.Option(
        [], "--learner-arg", help="--engine hf|fsdp: KEY=VALUE from_pretrained attn_implementation / config attribute."
    ),
) -> None:
    """Score a run's sequences with ONE engine, capturing logprobs and ops (to `diff` later)."""
    from mismatch_probe.steps.capture import CaptureConfig, run_capture

    cfg = CaptureConfig(engine=engine, source=source, out=out, model=model, capture=capture_mode,
                        capture_rules=list(capture_rule), capture_full_rows=capture_full_rows, capture_topk=capture_topk,
                        full_logits=full_logits, micro_batch_size=micro_batch_size, nproc=nproc, fsdp_timeout_s=timeout,
                        recipe=recipe, dtype=dtype, overwrite=overwrite, sampler_args=list(sampler_arg),
                        learner_args=list(learner_arg))
    path, n = run_capture(cfg, console)
    console.print(f"capture written to [bold]{path}[/] ({engine}, {n} sequences)")


def _side_dir(arg: str) -> tuple[Path, str]:
    """``DIR`` (a capture: its only engine folder) or ``RUN:learner`` / ``RUN:sampler``."""
    path, _, side = arg.rpartition(":") if ":" in arg else (arg, "", "")
    p = Path(path)
    if side:
        return p, side
    sides = [c.name for c in p.iterdir() if c.is_dir() and (c / "tokens.parquet").exists()] if p.is_dir() else []
    if len(sides) != 1:
        raise UsageError(f"{arg}: name the side as DIR:SIDE (found {sides or 'none'})")
    return p, sides[0]


@app.command("diff")
def diff(
    a: str = typer.Argument(..., help="Reference: a capture dir, or RUN:learner / RUN:sampler."),
    b: str = typer.Argument(..., help="The other side, same forms."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for op_errors.parquet and summary.json."),
    by_kind: bool = typer.Option(
        False, "--by-kind", help="Also print the per-op errors summarized per op kind (all layers of attn.o, ...)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the files of an earlier diff in --out."),
) -> None:
    """Compare two captures of the same sequences: token logprob gap and per-op errors."""
    import numpy as np
    import pyarrow as pa

    from mismatch_probe.run.outpath import check_result_dir, write_output
    from mismatch_probe.run.reader import DIFF_FILES, OP_ERRORS_NAME, SUMMARY_NAME, RunDir

    if out is not None:  # before any work: never into a run folder or a folder of other files
        out = check_result_dir(out, overwrite=overwrite, names=DIFF_FILES)

    from mismatch_probe.analysis.metrics import logprob_gap
    from mismatch_probe.analysis.op_errors import by_kind as kind_summary
    from mismatch_probe.analysis.op_errors import op_errors
    from mismatch_probe.run.schema import read_table, write_table
    from mismatch_probe.steps.bisect import first_divergent
    from mismatch_probe.steps.ops_stage import read_ops

    (pa_, sa), (pb, sb) = _side_dir(a), _side_dir(b)
    ta = read_table(pa_ / sa / "tokens.parquet", "tokens").to_pandas()
    tb = read_table(pb / sb / "tokens.parquet", "tokens").to_pandas()
    ta, tb = ta[ta.source != "decode"], tb[tb.source != "decode"]
    m = ta.merge(tb, on=["seq_id", "pos"], suffixes=("_a", "_b"))
    if m.empty or not (m.token_id_a == m.token_id_b).all():
        raise UsageError("the two captures did not score the same tokens (capture both --from the same run)")
    resp = m[m.is_response_a]
    summary: dict[str, Any] = {"a": a, "b": b, "n_tokens": len(m), "gap": logprob_gap(
        resp.logprob_b.to_numpy(), resp.logprob_a.to_numpy(), seq_ids=resp.seq_id.to_numpy())}
    summary["bitwise_equal_logprobs"] = bool(np.array_equal(m.logprob_a.to_numpy(), m.logprob_b.to_numpy()))
    oa, ob = read_ops(pa_, sa), read_ops(pb, sb)
    errs = None
    if oa is not None and ob is not None:
        n_layers = RunDir(pa_).config_int("num_layers", 10_000)
        errs = op_errors(oa, ob, n_layers)
        summary["first_divergent"] = first_divergent(errs)
        kinds = kind_summary(errs)
        summary["by_kind"] = [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
                              for r in kinds.to_dict("records")]
    t = Table(title=f"diff {a} vs {b}")
    t.add_column("check")
    t.add_column("value", justify="right")
    t.add_row("tokens compared", str(len(m)))
    t.add_row("logprobs bitwise equal", str(summary["bitwise_equal_logprobs"]))
    t.add_row("max |dlogp| (response)", f"{summary['gap']['max_abs_dlogp']:.3e}")
    if errs is not None:
        fd = summary["first_divergent"]["bitwise"]
        t.add_row("ops compared", str(len(errs)))
        t.add_row("first op not bitwise equal", fd["op"] if fd else "none (all equal)")
    console.print(t)
    if by_kind and errs is not None:
        console.print(_kind_table(kinds, f"per op kind ({a} is the reference)"))
    if out is not None:
        import json

        write_output(out / SUMMARY_NAME, (json.dumps(summary, indent=2, default=str) + "\n").encode(), "diff --out")
        if errs is not None:
            write_table(out / OP_ERRORS_NAME, pa.Table.from_pandas(errs, preserve_index=False), "op_errors")
        console.print(f"written {out}")


def _kind_table(kinds: Any, title: str) -> Table:
    """``analysis.op_errors.by_kind``'s rows as a Rich table (rel L2: the kind's first layer, median, max)."""
    t = Table(title=title)
    t.add_column("op kind", no_wrap=True)
    for col in ("ops", "rows", "bitwise equal", "rel L2 first", "rel L2 median", "rel L2 max", "max |diff|"):
        t.add_column(col, justify="right")

    def e(v: float) -> str:
        return "-" if v != v else ("0" if v == 0 else f"{v:.2e}")

    for r in kinds.itertuples():
        t.add_row(r.kind, str(r.n_ops), str(r.n_rows), f"{r.bitwise_equal_frac:.3f}", e(r.rel_l2_first),
                  e(r.rel_l2_median), e(r.rel_l2_max), e(r.max_abs_diff))
    return t
