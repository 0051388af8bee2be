"""Stage timings of the progress display (no engine): each step's wall seconds run to the end of its
block, not to its last advance (the work after it, e.g. rows reaching disk, is what a user waits for)."""

from __future__ import annotations

import io
import time

from rich.console import Console

from mismatch_probe.steps.progress import progress_bars, stage_seconds, step


def test_stage_seconds_count_to_the_end_of_each_step_in_order():
    with progress_bars(Console(file=io.StringIO())) as p:
        with step(p, "load"):
            time.sleep(0.05)
        with step(p, "score", total=2) as advance:
            advance()
            advance()  # the task is complete here; the work below still counts
            time.sleep(0.1)
        with step(p, "load"):  # a stage run twice is summed
            time.sleep(0.05)
        got = stage_seconds(p)
    assert list(got) == ["load", "score"]
    assert got["score"] >= 0.1 and got["load"] >= 0.1
