"""``mismatch-probe capture``: one engine only, on the sequences of an earlier run, to compare
later with ``mismatch-probe diff`` (e.g. the FSDP learner against a run's single-process learner,
or a new vLLM build against an old capture)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from mismatch_probe.cli.app import app, console
from mismatch_probe.cli.options import command, option
from mismatch_probe.steps import options as opts
from mismatch_probe.steps.capture import CaptureConfig


@app.command("capture")
@command(CaptureConfig)
def capture(cfg: CaptureConfig) -> None:
    """Score a run's sequences with ONE engine, capturing logprobs and ops (to `diff` later)."""
    from mismatch_probe.steps.capture import run_capture

    path, n = run_capture(cfg, console)
    console.print(f"capture written to [bold]{escape(str(path))}[/] ({cfg.engine}, {n} sequences)")


@app.command("diff")
def diff(
    a: str = typer.Argument(..., help="Reference: a capture dir, or RUN:learner / RUN:sampler."),
    b: str = typer.Argument(..., help="The other side, same forms."),
    out: Path | None = option(opts.OUT, None),
    by_kind: bool = typer.Option(
        False, "--by-kind", help="Also print the per-op errors summarized per op kind (all layers of attn.o, ...)."
    ),
    overwrite: bool = option(opts.OVERWRITE, False),
) -> None:
    """Compare two captures of the same sequences: token logprob gap and per-op errors."""
    from mismatch_probe.steps.diff import check_out, run_diff, write_diff

    if out is not None:  # before any work: never into a run folder or a folder of other files
        out = check_out(out, overwrite)
    res = run_diff(a, b)
    summary = res.summary
    t = Table(title=escape(f"diff {a} vs {b}"))
    t.add_column("check")
    t.add_column("value", justify="right")
    t.add_row("tokens compared", str(res.n_tokens))
    t.add_row("logprobs bitwise equal", str(summary["bitwise_equal_logprobs"]))
    t.add_row("max |dlogp| (response)", f"{summary['gap']['max_abs_dlogp']:.3e}")
    if res.errs is not None:
        fd = summary["first_divergent"]["bitwise"]
        t.add_row("ops compared", str(len(res.errs)))
        t.add_row("first op not bitwise equal", fd["op"] if fd else "none (all equal)")
    console.print(t)
    if by_kind and res.kinds is not None:
        console.print(_kind_table(res.kinds, f"per op kind ({a} is the reference)"))
    if out is not None:
        write_diff(out, res)
        console.print(f"written {escape(str(out))}", highlight=False)


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
