"""Entry point of ``mismatch-probe`` (console script and ``python -m mismatch_probe``): registers
the command modules on the app and runs it. User errors (:class:`ProbeError`) print one line and
exit with their typed code; parser errors exit 2 (see :func:`.app.parser_exit`).
"""

from __future__ import annotations

import sys

from mismatch_probe.cli.app import app, err_console, parser_exit
from mismatch_probe.errors import ProbeError


def _register() -> None:
    # Each module registers its commands on `app`; they import engines only when run.
    from mismatch_probe.cli import bisect, capture, compare, engines  # noqa: F401

    for optional in ("mismatch_probe.cli.report", "mismatch_probe.cli.kernels"):
        try:
            __import__(optional)
        except ModuleNotFoundError as e:
            if e.name != optional:
                raise


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        rv = app(args=argv, standalone_mode=False)
        if isinstance(rv, int) and rv != 0:
            sys.exit(rv)
    except ProbeError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        sys.exit(130)
    except Exception as e:  # the parser's own exceptions, from whatever click typer uses
        code = parser_exit(e)
        if code is None:
            raise
        sys.exit(code)


if __name__ == "__main__":  # ``python -m mismatch_probe.cli.main``
    main()
