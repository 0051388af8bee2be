"""Progress display of the steps: one Rich progress per run, one task per stage.

Stages receive the ``Progress`` and wrap their work in :func:`step`; they never import the step
that calls them.
"""

from __future__ import annotations

import time
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
    """One stage's task: yields ``advance(n=1)``; completes the task on exit, its wall seconds (to the
    exit, not to the last advance: what comes after it, e.g. the rows reaching disk, counts) in the
    task's field ``seconds``."""
    task = progress.add_task(description, total=total)
    t0 = time.perf_counter()
    yield lambda n=1: progress.advance(task, n)
    progress.update(task, completed=total if total is not None else 1, total=total or 1,
                    seconds=time.perf_counter() - t0)


def stage_seconds(progress: Progress) -> dict[str, float]:
    """Wall seconds of each completed :func:`step` of ``progress``, in the order they ran (a stage run
    twice is summed)."""
    out: dict[str, float] = {}
    for t in progress.tasks:
        if "seconds" in t.fields:
            out[t.description] = round(out.get(t.description, 0.0) + t.fields["seconds"], 3)
    return out
