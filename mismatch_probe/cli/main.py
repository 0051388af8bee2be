"""Entry point of ``mismatch-probe`` (console script and ``python -m mismatch_probe``): registers
the command modules on the app and runs it. User errors (:class:`ProbeError`) print one line and
exit with their typed code; parser errors exit 2 (see :func:`.app.parser_exit`).
"""

from __future__ import annotations

import errno
import logging
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
    except OSError as e:
        if e.errno not in _USER_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename is not None else ""
        print_error(f"{where}{e.strerror or e}")
        sys.exit(2)
    except Exception as e:  # the parser's own exceptions, from whatever click typer uses
        code = parser_exit(e)
        if code is None:
            raise
        sys.exit(code)


if __name__ == "__main__":  # ``python -m mismatch_probe.cli.main``
    main()
