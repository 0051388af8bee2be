"""Every ``MISMATCH_PROBE_*`` environment variable, declared once, parsed and validated here.

This is the only module that reads ``os.environ`` for ``MISMATCH_PROBE_*`` (a test greps the
source for any other). Each variable has a kind: ``user`` (what a user sets), ``tuning`` (kernel
and capture knobs for benchmarks), ``internal`` (a channel between our own processes) and ``test``
(fault injection for the test suite). The values are read when asked for (not cached at import), so
a variable set later in the process (tests, benches) is seen; an empty value counts as unset. A bad
value is a :class:`~mismatch_probe.errors.UsageError` naming the variable and the allowed values.
``mismatch-probe engines`` shows the variables set here; run manifests record the user/tuning ones
that are set (``manifest["settings"]``); the README's table is :func:`markdown_table`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.errors import UsageError

KINDS = ("user", "tuning", "internal", "test")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # one of KINDS
    type: str  # "str" | "int" | "bool" (0/1) | "path"
    default: str | None  # as it would be written in the environment; None: unset (or computed, see doc)
    allowed: str  # the allowed values, in words (what the error message says)
    doc: str
    choices: tuple[str, ...] | None = None  # for "str"/"bool": the exact allowed strings
    pow2: tuple[int, int] | None = None  # for "int": a power of two in [lo, hi]


_ALL = (
    Setting("MISMATCH_PROBE_CACHE", "user", "path", "~/.cache/mismatch-probe", "a folder",
            "cache root: built tiny models (`<cache>/models`) and the native kernel build (`<cache>/native`)"),
    Setting("MISMATCH_PROBE_NATIVE", "user", "bool", "1", "0 or 1", "0: never build or use the CUDA C++ NVFP4 kernels",
            choices=("0", "1")),
    Setting("MISMATCH_PROBE_NATIVE_CACHE", "user", "path", None, "a folder",
            "build folder of the CUDA C++ NVFP4 kernels (default `<cache>/native`)"),
    Setting("MISMATCH_PROBE_NATIVE_VERBOSE", "user", "bool", "0", "0 or 1", "1: show the nvcc/ninja build output",
            choices=("0", "1")),
    Setting("MISMATCH_PROBE_CAPTURE_WRITER", "tuning", "str", "auto", "auto, process or thread",
            "who writes captured rows to disk: a separate process or a thread of the engine's process (auto: the "
            "process where CUDA runs the forward, the thread on a CPU-only machine, where a second process only "
            "competes for the same cores)", choices=("auto", "process", "thread")),
    Setting("MISMATCH_PROBE_CAPTURE_STREAM", "tuning", "str", "side", "side, side-equal or main",
            "CUDA stream of the capture kernels: a side stream (the engine's forwards on a high-priority stream; "
            "side-equal: on their own stream) or the engine's own", choices=("side", "side-equal", "main")),
    Setting("MISMATCH_PROBE_DIGEST_BLOCK", "tuning", "int", "256", "a power of two in 16..16384",
            "elements per step of the digest kernel (read at import)", pow2=(16, 16384)),
    Setting("MISMATCH_PROBE_DIGEST_WARPS", "tuning", "int", "1", "a power of two in 1..32",
            "warps per row of the digest kernel (read at import)", pow2=(1, 32)),
    Setting("MISMATCH_PROBE_TRITON_MODE", "tuning", "str", "auto", "auto or jit",
            "jit: compile the NVFP4 Triton kernels even without CUDA (AOT compile checks; read at import)",
            choices=("auto", "jit")),
    Setting("MISMATCH_PROBE_RECIPE", "internal", "str", None, "a recipe name",
            "the active vLLM plugin recipe, mirrored for vLLM's engine processes (probes/vllm/plugin.py)"),
    Setting("MISMATCH_PROBE_TEST_FSDP_FAULT", "test", "str", None, "rank:R:after_batches:K:kill|hang|raise",
            "FSDP rank fault injection for tests (probes/fsdp/worker.py)"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}


def raw(name: str) -> str | None:
    """The variable's value as set (None when unset or empty)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not declared in mismatch_probe/settings.py")
    return os.environ.get(name) or None


def get(name: str) -> Any:
    """The parsed value (str, int, bool or Path; None for an unset variable without a default)."""
    s = SETTINGS[name]
    value = raw(name)
    if value is None:
        if name == "MISMATCH_PROBE_NATIVE_CACHE":
            return get("MISMATCH_PROBE_CACHE") / "native"
        if s.default is None:
            return None
        value = s.default
    return _parse(s, value.strip())


def _parse(s: Setting, value: str) -> Any:
    bad = UsageError(f"{s.name}={value!r} is not valid: expected {s.allowed}")
    if s.choices is not None and value not in s.choices:
        raise bad
    if s.type == "bool":
        return value == "1"
    if s.type == "path":
        return Path(value).expanduser()
    if s.type == "int":
        try:
            n = int(value)
        except ValueError:
            raise bad from None
        if s.pow2 is not None and not (s.pow2[0] <= n <= s.pow2[1] and n & (n - 1) == 0):
            raise bad
        return n
    return value


def export(name: str, value: str | None) -> None:
    """Set (or with None, remove) a variable for this process and the processes it starts."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not declared in mismatch_probe/settings.py")
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def validate_all() -> None:
    """Raise the UsageError of the first variable set to a bad value."""
    for name in SETTINGS:
        get(name)


def non_default(kinds: tuple[str, ...] = KINDS) -> dict[str, str]:
    """The variables of ``kinds`` that are set to something other than their default (validated)."""
    out = {}
    for name, s in SETTINGS.items():
        value = raw(name)
        if s.kind in kinds and value is not None:
            get(name)
            if value.strip() != s.default:
                out[name] = value
    return out


def markdown_table(kinds: tuple[str, ...] = ("user", "tuning")) -> str:
    """The README's table of the variables of ``kinds`` (a test keeps the README in sync)."""
    rows = ["| variable | kind | default | allowed | what it does |", "|---|---|---|---|---|"]
    for s in _ALL:
        if s.kind in kinds:
            rows.append(f"| `{s.name}` | {s.kind} | {s.default or '-'} | {s.allowed} | {s.doc} |")
    return "\n".join(rows) + "\n"
