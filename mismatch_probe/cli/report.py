"""``mismatch-probe report`` and ``mismatch-probe gate``: no torch or vLLM on these code paths."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mismatch_probe.cli.app import app, console

out_console = Console(width=None if sys.stdout.isatty() else 150)


@app.command("report")
def report(
    run: Path = typer.Argument(..., help="Run directory written by `mismatch-probe compare`."),
    out: Path | None = typer.Option(None, "--out", "-o", help="HTML file to write \\[default: RUN/report.html]."),
    gate_config: Path | None = typer.Option(
        None, "--gate-config", help="Gate TOML: show its checks and use its verdict in the report."
    ),
    convention: str | None = typer.Option(
        None, "--convention", help="verl | slime | nemo_rl: show all of that framework's metrics under its names."
    ),
) -> None:
    """Write a self-contained HTML report of a run (no network, no external assets)."""
    from mismatch_probe.reports import build_report

    t0 = time.perf_counter()
    path, absent = build_report(run, out, gate_config=gate_config, convention=convention)
    size = path.stat().st_size
    for section, why in absent.items():
        console.print(f"[yellow]absent:[/] {escape(section)}: {escape(why)}", highlight=False)
    console.print(f"wrote {escape(str(path))} ({size / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f} s", highlight=False)


@app.command("gate")
def gate(
    run: Path = typer.Argument(..., help="Run directory written by `mismatch-probe compare`."),
    config: Path | None = typer.Option(None, "--config", help="TOML file with thresholds (\\[gate] table)."),
    pair: str | None = typer.Option(None, "--pair", help="Pair the threshold flags apply to \\[default: learner_vs_decode]."),
    max_mean_abs_dlogp: float | None = typer.Option(None, "--max-mean-abs-dlogp", help="Bound on mean |dlogp|."),
    max_max_abs_dlogp: float | None = typer.Option(None, "--max-max-abs-dlogp", help="Bound on max |dlogp|."),
    max_k3: float | None = typer.Option(None, "--max-k3", help="Bound on the k3 KL estimator."),
    max_clip_frac: float | None = typer.Option(None, "--max-clip-frac", help="Bound on the PPO clip fraction."),
    max_kl: float | None = typer.Option(
        None, "--max-kl", help="Bound on full-vocabulary KL, both directions (skipped where not captured)."
    ),
    check: list[str] = typer.Option([], "--check", help="Generic check [PAIR.]METRIC<=VALUE (also < >= > ==); repeatable."),
    allow_first_divergent: bool | None = typer.Option(
        None,
        "--allow-first-divergent/--no-first-divergent",
        help="Allow an op where the engines first differ (needs op capture) \\[default: not checked].",
    ),
    first_divergent_kind: str | None = typer.Option(None, "--first-divergent-kind", help="bitwise (default) or tolerance."),
    strict: bool | None = typer.Option(
        None, "--strict/--no-strict", help="Fail checks whose metric this run did not record (default: skip)."
    ),
    markdown: Path | None = typer.Option(None, "--markdown", help="Write a Markdown summary (CI step summary)."),
    junit: Path | None = typer.Option(None, "--junit", help="Write JUnit XML (one testcase per check)."),
) -> None:
    """Check a run's gap against thresholds: exit 0 pass, 1 fail, 2 usage or input error."""
    from mismatch_probe.analysis import gate as g
    from mismatch_probe.run.outpath import check_output_file, write_output

    t0 = time.perf_counter()
    toml = g.load_toml(config) if config else None
    cfg = g.build_config(
        toml=toml,
        pair=pair,
        flag_max={
            "max_mean_abs_dlogp": max_mean_abs_dlogp,
            "max_max_abs_dlogp": max_max_abs_dlogp,
            "max_k3": max_k3,
            "max_clip_frac": max_clip_frac,
            "max_kl": max_kl,
        },
        checks=check,
        allow_first_divergent=allow_first_divergent,
        first_divergent_kind=first_divergent_kind,
        strict=strict,
    )
    for p, flag in ((markdown, "--markdown"), (junit, "--junit")):
        if p is not None:
            check_output_file(p, flag)
    results, manifest = g.run_gate(run, cfg)
    verdict = g.overall(results)

    style = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "skip": "[yellow]skip[/]"}
    table = Table(title=escape(f"mismatch-probe gate: {run}"))
    for col in ("check", "pair", "value", "threshold", "verdict", "detail"):
        table.add_column(col, overflow="fold")
    for r in results:
        table.add_row(escape(r.name), r.pair, escape(g.fmt_num(r.value)), r.threshold, style[r.verdict], escape(r.detail))
    out_console.print(table)
    if markdown is not None:
        write_output(markdown, g.to_markdown(results, run, manifest).encode(), "--markdown")
    if junit is not None:
        write_output(junit, g.to_junit(results, run, time.perf_counter() - t0), "--junit")
    n_fail = sum(r.verdict == "fail" for r in results)
    if verdict == "fail":
        out_console.print(f"[bold red]gate FAILED[/]: {n_fail} of {len(results)} checks failed")
        raise typer.Exit(1)
    out_console.print(f"[green]gate passed[/]: {len(results)} checks")
