"""``mismatch-probe compare``: the learner-vs-sampler logprob gap on the same tokens."""

from __future__ import annotations

import math
from typing import Any

from rich.markup import escape
from rich.table import Table

from mismatch_probe.cli.app import app, console
from mismatch_probe.cli.options import command
from mismatch_probe.steps.compare_types import CompareConfig

SHOWN = (
    ("n_tokens", "response tokens"),
    ("mean_abs_dlogp", "mean |dlogp|"),
    ("max_abs_dlogp", "max |dlogp|"),
    ("p99_abs_dlogp", "p99 |dlogp|"),
    ("mean_abs_dprob", "mean |dprob|"),
    ("k3", "k3 (KL est.)"),
    ("chi2", "chi2"),
    ("clip_frac", "clip frac (eps 0.2)"),
    ("seq_max_abs_logratio", "max |seq log-ratio|"),
    ("pearson_prob", "pearson(prob)"),
)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, float) and v == int(v) and abs(v) >= 1:
        return str(int(v))
    return f"{v:.3e}" if v != 0 else "0"


def summary_table(summary: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    t.add_column("metric")
    pairs = summary["pairs"]
    for p in pairs:
        t.add_column(p.replace("_", " "), justify="right")
    for key, label in SHOWN:
        t.add_row(label, *[_fmt(pairs[p][key]) if pairs[p] else "-" for p in pairs])
    return t


@app.command("compare")
@command(CompareConfig)
def compare(cfg: CompareConfig) -> None:
    """Run sampler (vLLM) and learner (HF) on the same tokens; write RUN/ with token tables and gaps."""
    from mismatch_probe.steps.compare import run_compare

    path, summary = run_compare(cfg, console)
    console.print(summary_table(summary, f"logprob gap, {summary['n_sequences']} sequences ({cfg.model})"))
    console.print(f"run written to [bold]{escape(str(path))}[/]")
