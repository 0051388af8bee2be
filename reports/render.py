"""Assemble the self-contained HTML page from the run data and the section fragments."""

from __future__ import annotations

import datetime as dt
from importlib import resources
from pathlib import Path
from string import Template

from mismatch_probe import __version__
from mismatch_probe.analysis.gate import CheckResult
from mismatch_probe.reports import frameworks, sections
from mismatch_probe.reports.html import esc
from mismatch_probe.reports.load import RunData

# (anchor id, title, builder); the order of the page
SECTIONS = (
    ("drift", "Where drift starts", sections.drift),
    ("scatter", "Learner vs sampler logprobs", sections.scatter),
    ("histogram", "Histogram of |dlogp|", sections.histogram),
    ("decomposition", "Decomposition: learner vs sampler-prefill vs sampler-decode", sections.decomposition),
    ("full-distribution", "Full distribution (top-K)", frameworks.full_distribution),
    ("frameworks", "RL frameworks' view", frameworks.convention_view),
    ("training-run", "Training-run gap", frameworks.training_run),
    ("worst", "Worst tokens", sections.worst_tokens),
    ("ops", "Op table", sections.op_table),
    ("bisect", "Bisect ranking", sections.bisect),
    ("manifest", "Run manifest", sections.manifest),
)


def _asset(name: str) -> str:
    return resources.files("mismatch_probe.reports").joinpath(name).read_text(encoding="utf-8")


def render_html(data: RunData, gate: list[CheckResult] | None = None) -> str:
    cfg = data.manifest.get("config") or {}
    model = cfg.get("model") or cfg.get("model_dir") or "?"
    verdict_key, head = sections.headline(data, gate)
    title = f"mismatch-probe report: {model}"
    built = [(sid, t, build(data)) for sid, t, build in SECTIONS]
    built = [(sid, t, html) for sid, t, html in built if html]  # a section with nothing to say is left out
    nav = "".join(f'<a href="#{sid}">{esc(t.split(":")[0])}</a>' for sid, t, _ in built)
    parts = [
        f"<header><h1>{esc(title)}</h1><div class='meta'>run <code>{esc(data.root)}</code> &middot; "
        f"learner {esc(cfg.get('learner', '?'))} vs sampler {esc(cfg.get('sampler', '?'))} &middot; "
        f"status {esc(data.manifest.get('status', '?'))} &middot; generated "
        f"{esc(dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC'))} by mismatch-probe {esc(__version__)}"
        f"</div></header>",
        f'<nav><a href="#summary">Summary</a>{nav}</nav>',
        "<main>",
        f'<section id="summary"><h2>Summary</h2>{head}{sections.weight_parity(data)}{sections.absent_box(data)}</section>',
    ]
    for sid, t, html in built:
        parts.append(f'<section id="{sid}"><h2>{esc(t)}</h2>{html}</section>')
    parts.append("</main>")
    return Template(_asset("template.html")).substitute(
        title=esc(title),
        version=esc(__version__),
        verdict=esc(verdict_key),
        style=_asset("report.css"),
        body="\n".join(parts),
        script=_asset("report.js"),
    )


def write_report(data: RunData, out: Path, gate: list[CheckResult] | None = None) -> Path:
    from mismatch_probe.run.outpath import write_output

    write_output(out, render_html(data, gate).encode("utf-8"), "report --out")
    return out
