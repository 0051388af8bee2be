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
    p = None
    try:
        with _bars(console) as p:
            yield p
    finally:
        if p is not None:
            _SECONDS.pop(id(p), None)


@contextmanager
def _bars(console: Console) -> Iterator[Progress]:
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
    """One stage's task: yields ``advance(n=1)``; completes the task on exit and adds its wall time to
    :func:`stage_seconds` (what the user waited for, stage by stage)."""
    task = progress.add_task(description, total=total)
    t0 = time.perf_counter()
    yield lambda n=1: progress.advance(task, n)
    progress.update(task, completed=total if total is not None else 1, total=total or 1)
    done = _SECONDS.setdefault(id(progress), {})
    done[description] = round(done.get(description, 0.0) + time.perf_counter() - t0, 3)


_SECONDS: dict[int, dict[str, float]] = {}  # id(progress) -> stage -> seconds (dropped with the progress display)


def stage_seconds(progress: Progress) -> dict[str, float]:
    """Wall seconds of each completed stage of ``progress``, in the order they ran."""
    return dict(_SECONDS.get(id(progress), {}))
