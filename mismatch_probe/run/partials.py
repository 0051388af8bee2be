"""Staging folders that failed or interrupted runs leave beside ``--out`` (``.NAME.partial-PID``,
``.NAME.old-PID``): find them and remove the stale ones (``mismatch-probe clean``)."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import UsageError
from mismatch_probe.run.outpath import is_run

_STAGED = re.compile(r"^\.(?P<name>.+)\.(?P<tag>partial|old)-(?P<pid>\d+)$")


@dataclass(frozen=True)
class Staged:
    path: Path
    run_name: str  # the --out folder name it was staged for
    tag: str  # partial (a run being written, or a failed one) | old (a replaced run, moved aside)
    pid: int
    alive: bool  # its process still runs on this host: not stale

    @property
    def status(self) -> str:
        import json

        try:
            return str(json.loads((self.path / "manifest.json").read_text()).get("status", "?"))
        except (OSError, ValueError, AttributeError):
            return "?"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def find(parent: Path) -> list[Staged]:
    """The staging folders in ``parent`` (run folders only: each holds a run manifest)."""
    parent = Path(parent)
    if not parent.is_dir():
        raise UsageError(f"not a folder: {parent}")
    out = []
    for p in sorted(parent.iterdir()):
        m = _STAGED.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and is_run(p):
            pid = int(m["pid"])
            out.append(Staged(p, m["name"], m["tag"], pid, pid != os.getpid() and _alive(pid)))
    return out


def orphan(staged: Staged) -> bool:
    """A replaced run moved aside whose replacement never landed (nothing at ``--out``): the
    user's only copy, restored by hand (``mv``), never removed by ``clean``."""
    return staged.tag == "old" and not (staged.path.parent / staged.run_name).exists()


def remove(staged: Staged) -> None:
    """Remove one stale staging folder (never one whose process is alive, nor an orphaned old run)."""
    if staged.alive:
        raise UsageError(f"{staged.path} belongs to a running process ({staged.pid})")
    if orphan(staged):
        raise UsageError(f"{staged.path} is the only copy of the run {staged.run_name}: move it back, not removed")
    shutil.rmtree(staged.path)
