"""Helpers of the reliability tests (issue 30): the real CLI in a subprocess, from any folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mp(*args: str, cwd: Path | None = None, stdin: str | None = None, timeout: float = 600,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mismatch-probe ARGS`` in a fresh interpreter, run in ``cwd`` (default: the repository)."""
    pp = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "mismatch_probe", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO, input=stdin,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": pp, **(env or {})},
    )


def one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int = 2, engines: bool = False) -> str:
    """The run failed with ``code``, one error line on stderr holding every needle, no traceback
    (``engines``: after an engine started, whose loading bars may come before it)."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-1500:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    if engines:
        lines = [x for x in lines if x.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders), to prove nothing changed."""
    out: dict[str, bytes | None] = {}
    for p in sorted(Path(root).rglob("*")):
        out[str(p.relative_to(root))] = None if p.is_dir() else p.read_bytes()
    return out
