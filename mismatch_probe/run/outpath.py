"""Where results may be written: the ``--out`` folder policy and the one output-file writer.

``--out`` (a run folder) is only ever a new folder, an empty one, or an existing *run* (its
``manifest.json`` says so) that ``--overwrite`` replaces **by rename**: the new run is staged
beside it, the old run is moved aside, the new one renamed into place, and only then the old one
removed. A folder that is not a run is never replaced, nor ``.``, ``..``, the current folder or
one above it, nor an empty name.

The final rename never replaces what appeared meanwhile: :func:`rename_noreplace` uses Linux's
``renameat2(RENAME_NOREPLACE)`` (atomic: fails with EEXIST when the target exists); where the
kernel or filesystem lacks it, ``os.rename`` of a folder, which POSIX lets replace only an *empty*
folder (a non-empty one gives ENOTEMPTY, a file ENOTDIR), so no content is ever lost.

Every single output file (``report --out``, ``gate --junit/--markdown``, ``diff --out``'s files)
goes through :func:`write_output`: ``-`` is stdout, a regular file (or a new path) is written
atomically, anything else (a folder, FIFO, device node, socket) is refused.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import sys
from pathlib import Path

from mismatch_probe.errors import UsageError

_NAME_MAX = 255
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def os_error(e: OSError, what: str) -> UsageError:
    """A one-line usage error for an OSError on ``what`` (no errno numbers, no traceback)."""
    reason = e.strerror or str(e)
    where = f" ({e.filename})" if e.filename is not None and str(e.filename) not in what else ""
    return UsageError(f"cannot write {what}{where}: {reason}")


def side_name(final: Path, tag: str) -> Path:
    """A hidden sibling of ``final`` (``.NAME.TAG-PID``) whose name fits NAME_MAX."""
    suffix = f".{tag}-{os.getpid()}"
    name = final.name
    room = _NAME_MAX - len(suffix.encode()) - 1
    while len(name.encode()) > room:
        name = name[:-1]
    return final.parent / f".{name}{suffix}"


def is_run(path: Path) -> bool:
    """True when ``path`` is a folder whose ``manifest.json`` is a mismatch-probe manifest."""
    m = Path(path) / "manifest.json"
    try:
        obj = json.loads(m.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and "schema_version" in obj and "status" in obj


def is_empty_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None
    except OSError:
        return False


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, or None when nothing is there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_out_dir(out: Path | str, *, overwrite: bool, flag: str = "--out") -> Path:
    """Apply the ``--out`` policy before any work starts; return the resolved absolute path."""
    raw = str(out)
    if not raw.strip():
        raise UsageError(f"{flag} is empty: name a new folder for the run")
    final = Path(os.path.realpath(raw))
    cwd = Path(os.path.realpath(os.getcwd()))
    if final == cwd or final in cwd.parents:
        raise UsageError(f"{flag} {raw} is the current folder or one above it: name a new folder for the run")
    if len(final.name.encode()) > _NAME_MAX:
        raise UsageError(f"{flag} {raw}: the folder name is longer than {_NAME_MAX} bytes")
    if os.path.lexists(final):
        if not final.is_dir():
            raise UsageError(f"{flag} {raw} exists and is not a folder")
        if is_empty_dir(final):
            return final
        if not is_run(final):
            raise UsageError(
                f"{flag} {raw} is a folder that is not a mismatch-probe run (no run manifest): --overwrite never "
                "replaces such a folder; choose a new one"
            )
        if not overwrite:
            raise UsageError(f"{flag} {raw} already exists; pass --overwrite to replace that run, or choose another folder")
        return final
    # a new folder: the nearest existing ancestor must be a writable folder
    anc = final.parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise UsageError(f"{flag} {raw}: {anc} is not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {raw}: cannot create a folder in {anc} (permission denied or read-only)")
    return final


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; OSError (EEXIST, ENOTEMPTY, ENOTDIR) when ``dst`` exists."""
    if sys.platform.startswith("linux"):
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
        except (AttributeError, OSError):
            fn = None
        if fn is not None:
            if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EINVAL):
                raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst) and not is_empty_dir(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)  # a folder replaces at most an empty folder (POSIX), never content


def check_output_file(path: Path, what: str) -> None:
    """Refuse an output target that is not a regular file or a new path (before any work)."""
    if str(path) == "-":
        return
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        anc = p.parent
        while not os.path.lexists(anc) and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir():
            raise UsageError(f"{what} {path}: {anc} is not a folder") from None
        return
    except OSError as e:
        raise os_error(e, f"{what} {path}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what} {path} is a folder, expected a file path")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{what} {path} is not a regular file (a pipe, device or socket): refusing to replace it; "
                         "use '-' for standard output")


def write_output(path: Path, data: bytes, what: str = "output") -> Path | None:
    """Write one output file: ``-`` is stdout; a regular file or new path is replaced atomically
    (through its symlink, if it is one); anything else is refused. Returns the path written."""
    from mismatch_probe.run.schema import atomic_write_bytes

    if str(path) == "-":
        sys.stdout.write(data.decode())
        sys.stdout.flush()
        return None
    check_output_file(path, what)
    target = Path(os.path.realpath(path))
    try:
        atomic_write_bytes(target, data)
    except OSError as e:
        raise os_error(e, f"{what} {path}") from None
    return target


def check_result_dir(out: Path, *, overwrite: bool, names: tuple[str, ...], flag: str = "--out") -> Path:
    """A folder for a command's few result files (``diff --out``): new, empty, or (with
    ``--overwrite``) one holding only those files from an earlier call. A run folder, a folder
    inside one that holds its files, or any other content is never written into."""
    raw = str(out)
    if not raw.strip():
        raise UsageError(f"{flag} is empty: name a new folder")
    p = Path(os.path.realpath(raw))
    if not os.path.lexists(p):
        check_out_dir(p, overwrite=False, flag=flag)  # a new folder: its parent must be writable
        return p
    if not p.is_dir():
        raise UsageError(f"{flag} {raw} exists and is not a folder")
    try:
        held = {c.name for c in p.iterdir()}
    except OSError as e:
        raise os_error(e, f"{flag} {raw}") from None
    if not held:
        return p
    if is_run(p) or not held <= set(names):
        raise UsageError(f"{flag} {raw} holds other files (a run's, or yours): never written into; choose a new folder")
    if not overwrite:
        raise UsageError(f"{flag} {raw} already holds {', '.join(sorted(held))}; pass --overwrite to replace them")
    return p
