"""A command's options built from its step's config dataclass (flags and config from one declaration).

``@command(CompareConfig)`` turns ``def compare(cfg: CompareConfig) -> None`` into a Typer command
whose options are the config's fields that carry a :class:`~mismatch_probe.steps.options.Flag`
(their flags, help and defaults); the command receives the config, built from the parsed values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from mismatch_probe.steps.options import Flag, flag_of

C = TypeVar("C")


def option(flag: Flag, default: Any) -> Any:
    """A ``typer.Option`` of a shared flag (a command without a config dataclass)."""
    return typer.Option(default, *flag.flags, help=flag.help)


def parameters(config_cls: type) -> list[inspect.Parameter]:
    """One keyword parameter per flagged field of ``config_cls``, its default a ``typer.Option``."""
    hints = typing.get_type_hints(config_cls)
    out = []
    for f in dataclasses.fields(config_cls):
        flag = flag_of(f)
        if flag is None:
            continue
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = ...  # required
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option(flag, default),
                                     annotation=hints[f.name]))
    return out


def command(config_cls: type[C]) -> Callable[[Callable[[C], None]], Callable[..., None]]:
    """Decorator: ``fn(cfg)`` as a Typer command with ``config_cls``'s options (register it with
    ``app.command(NAME)`` after this decorator)."""

    def wrap(fn: Callable[[C], None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def run(**values: Any) -> None:
            fn(config_cls(**{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}))

        del run.__wrapped__  # Typer reads the signature below, not fn's
        run.__signature__ = inspect.Signature(parameters(config_cls))  # type: ignore[attr-defined]
        run.__annotations__ = {}
        return run

    return wrap
