"""Forward-hook plumbing shared by the engine adapters: every hook returns None (a hook that
returns a value would replace the module's output), and all handles are removed on exit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def first(x: Any) -> Any:
    """The tensor of an output that may be a tuple (vLLM linears return ``(out, bias)``)."""
    return x[0] if isinstance(x, tuple | list) else x


class HookSet:
    """A set of forward (pre-)hooks that can be removed together."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def fwd(self, module: Any, fn: Callable[[Any], None]) -> None:
        """Call ``fn(output)`` after ``module`` runs."""

        def hook(_m: Any, _inp: Any, out: Any) -> None:
            fn(out)

        self._handles.append(module.register_forward_hook(hook))

    def pre(self, module: Any, fn: Callable[[tuple, dict], None]) -> None:
        """Call ``fn(args, kwargs)`` before ``module`` runs."""

        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            fn(args, kwargs)

        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles)
