"""``mismatch-probe bisect RUN``: first divergent op, local error per op, ablation."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from mismatch_probe.cli import app, console


def _f(v: object) -> str:
    return "-" if v is None else (f"{v:.3e}" if isinstance(v, float) else str(v))


@app.command("bisect")
def bisect(
    run: Path = typer.Argument(..., help="A run directory written by compare (with op capture)."),
    replay: bool = typer.Option(True, "--replay/--no-replay", help="Local error by input substitution (loads both engines)."),
    max_rows: int = typer.Option(256, "--max-rows", help="Tokens per op used for input substitution."),
    top: int = typer.Option(10, "--top", help="Rows of the local-error table to print."),
) -> None:
    """Find the first op where the engines differ and rank ops by the error they introduce."""
    from rich.progress import Progress

    from mismatch_probe.bisect import first_divergent, load_op_errors, local_errors
    from mismatch_probe.ops_stage import read_ops
    from mismatch_probe.rundir import load_manifest
    from mismatch_probe.schema import atomic_write_json

    manifest = load_manifest(run)
    errs = load_op_errors(run)
    result: dict = {"schema_version": 1, "run": str(run), "first_divergent": first_divergent(errs)}
    if replay:
        learner, sampler = read_ops(run, "learner"), read_ops(run, "sampler")
        with Progress(console=console, transient=True) as p:
            task = p.add_task("input substitution (both engines)", total=len(errs))
            rows, skipped = local_errors(run, manifest, learner, sampler, max_rows, lambda: p.advance(task))
        result["local_errors"] = rows
        result["not_replayed"] = skipped
    result["ablation"] = []
    result["ablation_note"] = "ablation needs the alignment recipes (compare --align/--recipe); not run"
    atomic_write_json(run / "bisect.json", result)

    fd = result["first_divergent"]
    t = Table(title=f"bisect: {run}")
    t.add_column("finding")
    t.add_column("op")
    t.add_column("detail")
    b, tol = fd["bitwise"], fd["tolerance"]
    b_detail = f"equal rows {b['bitwise_equal_frac']:.1%}" if b else "all ops equal"
    tol_detail = f"rel L2 {_f(tol['rel_l2'])} ({tol['dtype']})" if tol else "-"
    t.add_row("first not bitwise equal", b["op"] if b else "none", b_detail)
    t.add_row("first over tolerance", tol["op"] if tol else "none", tol_detail)
    console.print(t)
    if replay and result["local_errors"]:
        lt = Table(title="local error by input substitution (sampler op on learner input vs learner output)")
        for c in ("rank", "op", "local", "reverse", "inherited", "total", "bitwise"):
            lt.add_column(c, justify="right" if c != "op" else "left")
        for i, r in enumerate(result["local_errors"][:top], 1):
            lt.add_row(str(i), r["op"], _f(r["local_error"]), _f(r["reverse_local_error"]), _f(r["inherited_error"]),
                       _f(r["total_error"]), f"{r['local_bitwise_frac']:.0%}")
        console.print(lt)
    console.print(f"written {run / 'bisect.json'}")
