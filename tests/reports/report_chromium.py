"""Drive Debian's headless Chromium (no Playwright): DOM dump, console messages, screenshot."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)
_CONSOLE = re.compile(r":CONSOLE[:(]|Uncaught|Refused to|Content Security Policy|net::ERR_")


@dataclass
class PageLoad:
    dom: str
    console: list[str]  # console messages and page errors Chromium logged


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    # CI installs it (`bash install.sh --dev` fails when it cannot), so a missing browser fails the
    # browser tests instead of skipping them.
    assert CHROMIUM, "chromium not installed: `bash install.sh --dev` installs Debian's chromium (as root)"
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def load(page: Path, timeout: float = 90) -> PageLoad:
    """Load ``page`` and return its DOM after scripts ran, and every console line logged."""
    p = _run(["--dump-dom", Path(page).resolve().as_uri()], timeout)
    console = [line for line in p.stderr.splitlines() if _CONSOLE.search(line)]
    if p.returncode != 0 or "<html" not in p.stdout:
        raise RuntimeError(f"chromium failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return PageLoad(p.stdout, console)


def screenshot(page: Path, out: Path, size: str = "1280,2400", timeout: float = 90) -> Path:
    p = _run(
        [f"--screenshot={out}", f"--window-size={size}", "--hide-scrollbars", Path(page).resolve().as_uri()],
        timeout,
    )
    if p.returncode != 0 or not Path(out).exists():
        raise RuntimeError(f"chromium screenshot failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return Path(out)
