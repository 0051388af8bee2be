"""Progress display of the steps: one Rich progress per run, one task per stage.

Stages receive the ``Progress`` and wrap their work in :func:`step`; they never import the step
that calls them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


@contextmanager
def progress_bars(console: Console) -> Iterator[Progress]:
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as p:
        yield p


@contextmanager
def step(progress: Progress, description: str, total: float | None = 1) -> Iterator[Any]:
    """One stage's task: yields ``advance(n=1)``; completes the task on exit."""
    task = progress.add_task(description, total=total)
    yield lambda n=1: progress.advance(task, n)
    progress.update(task, completed=total if total is not None else 1, total=total or 1)
