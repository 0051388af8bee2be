"""HTML report of a run: ``build_report(run)`` writes one self-contained file (no torch, no vLLM)."""

from __future__ import annotations

from pathlib import Path


def build_report(
    run: Path, out: Path | None = None, *, gate_config: Path | None = None, convention: str | None = None
) -> tuple[Path, dict[str, str]]:
    """Render ``RUN/report.html`` (or ``out``); returns the path and the absent sections with reasons."""
    from mismatch_probe.analysis import gate as g
    from mismatch_probe.analysis.conventions import FRAMEWORKS
    from mismatch_probe.errors import UsageError
    from mismatch_probe.reports.load import load_run
    from mismatch_probe.reports.render import write_report

    if convention is not None and convention not in FRAMEWORKS:
        raise UsageError(f"--convention must be one of {', '.join(FRAMEWORKS)}, got {convention!r}")
    from mismatch_probe.run.outpath import check_output_file
    from mismatch_probe.run.reader import REPORT

    run = Path(run)
    out = Path(out) if out is not None else run / REPORT
    if out.is_dir():
        out = out / REPORT
    check_output_file(out, "report --out")  # before the work: a pipe or device is refused
    cfg = g.build_config(toml=g.load_toml(gate_config)) if gate_config is not None else None
    data = load_run(run)
    data.convention = convention
    results = g.evaluate(cfg, data.summary, run) if cfg is not None else None
    return write_report(data, out, results), dict(data.absent)
