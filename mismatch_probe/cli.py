"""The ``mismatch-probe`` command line (Typer + Rich).

Engines are imported lazily inside commands: start-up stays fast, and one broken backend never
breaks the CLI. User errors (:class:`ProbeError`) print one line and exit with code 2.
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


def _register() -> None:
    # Each module registers its commands on `app`; they import engines only when run.
    from mismatch_probe import cmd_bisect, cmd_capture, cmd_compare, cmd_engines  # noqa: F401

    for optional in ("mismatch_probe.cmd_report", "mismatch_probe.kernels.cli"):
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
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(2 if isinstance(e, click.UsageError) else e.exit_code)
        raise


if __name__ == "__main__":  # ``python -m mismatch_probe.cli``: run the imported module's app, not a copy
    from mismatch_probe.cli import main as _main

    _main()
