"""``mismatch-probe clean PARENT``: list (and with ``--yes`` remove) the staging folders that failed
or interrupted runs left beside their ``--out`` (``.NAME.partial-PID``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from mismatch_probe.cli.app import app, console


@app.command("clean")
def clean(
    parent: Path = typer.Argument(Path("runs"), help="The folder holding run folders (the parent of --out)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove the stale ones (default: only list them)."),
) -> None:
    """List the staging folders of failed or interrupted runs in PARENT; --yes removes the stale ones."""
    from mismatch_probe.run.partials import find, orphan, remove

    staged = find(parent)
    if not staged:
        console.print(f"no staging folders of failed or interrupted runs in {escape(str(parent))}", highlight=False)
        return
    for s in staged:
        keep = s.alive or orphan(s)
        state = ("in use (process running)" if s.alive
                 else f"the replaced run, and nothing at {s.run_name}: move it back with mv" if orphan(s)
                 else f"stale, status {s.status}")
        action = "removed" if yes and not keep else ("kept" if yes else "")
        if yes and not keep:
            remove(s)
        console.print(f"{escape(str(s.path))}  (run {escape(s.run_name)}, {s.tag}, pid {s.pid}): {state}"
                      + (f" - {action}" if action else ""), highlight=False)
    if not yes and any(not (s.alive or orphan(s)) for s in staged):
        console.print(f"remove the stale ones with: mismatch-probe clean {escape(str(parent))} --yes", highlight=False)
