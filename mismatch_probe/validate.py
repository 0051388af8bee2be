"""Option values checked before any engine starts: each bad value is a one-line :class:`UsageError`
that names the flag (NaN, infinities and out-of-range numbers included)."""

from __future__ import annotations

import math

from mismatch_probe.errors import UsageError

DTYPES = ("bfloat16", "float16", "float32")
_SHOWN = 12  # digits of an integer shown in a message (no 309-digit echoes)


def shown(v: object) -> str:
    """``v`` for a message, huge integers shortened (``1e+308`` rather than 309 digits)."""
    if isinstance(v, int) and not isinstance(v, bool) and len(str(abs(v))) > _SHOWN:
        return f"{float(v):.3g}" if abs(v) < 10**308 else f"an integer of {len(str(abs(v)))} digits"
    return repr(v) if isinstance(v, str) else str(v)


def at_least(v: int, flag: str, minimum: int) -> int:
    if v < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {shown(v)}")
    return v


def finite(v: float, flag: str, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None) -> float:
    """A finite number (not NaN or infinite), >= ``minimum``, > ``above``, <= ``maximum``."""
    if not math.isfinite(v):
        raise UsageError(f"{flag} must be a finite number, got {v}")
    if minimum is not None and v < minimum:
        raise UsageError(f"{flag} must be >= {minimum:g}, got {v:g}")
    if above is not None and v <= above:
        raise UsageError(f"{flag} must be > {above:g}, got {v:g}")
    if maximum is not None and v > maximum:
        raise UsageError(f"{flag} must be <= {maximum:g}, got {v:g}")
    return v


def fraction(v: float, flag: str) -> float:
    return finite(v, flag, minimum=0.0, maximum=1.0)


def dtype(v: str, flag: str = "--dtype") -> str:
    if v not in DTYPES:
        raise UsageError(f"{flag} must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {v!r}")
    return v


def recipe(name: str | None, flag: str = "--recipe") -> str:
    """A recipe name as both engines know it (``mismatch_probe.kernels.recipes``)."""
    from mismatch_probe.kernels.recipes import resolve

    try:
        return resolve("engine", name).name
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


INT_MAX = 2**31 - 1  # counts and sizes beyond this are mistakes (and overflow the engines' int32)


def compare_values(cfg: object) -> None:
    """The numeric options of ``compare`` (a ``CompareConfig``), before anything is loaded."""
    g = cfg.__dict__
    if "out" in g:  # the --out policy first: a refused folder costs no engine start
        from mismatch_probe.run.outpath import check_out_dir

        check_out_dir(g["out"], overwrite=bool(g.get("overwrite")))
    for flag, key, lo in (("--n", "n", 1), ("--max-tokens", "max_tokens", 1), ("--micro-batch-size", "micro_batch_size", 1),
                          ("--nproc", "nproc", 1), ("--capture-topk", "capture_topk", 0)):
        if key in g:
            at_least(g[key], flag, lo)
            at_most(g[key], flag, INT_MAX)
    for flag, key in (("--topk", "topk"), ("--capture-full-rows", "capture_full_rows")):
        if g.get(key) is not None:
            at_least(g[key], flag, 0)
            at_most(g[key], flag, INT_MAX)
    if "seed" in g:
        at_least(g["seed"], "--seed", 0)
        at_most(g["seed"], "--seed", 2**63 - 1 - 2**31)  # prompt i samples with seed + i (an int64 in the engines)
    if "temperature" in g:
        finite(g["temperature"], "--temperature", minimum=0.0)
    if "fsdp_timeout_s" in g:
        finite(g["fsdp_timeout_s"], "--fsdp-timeout", above=0.0)


def at_most(v: int, flag: str, maximum: int) -> int:
    if v > maximum:
        raise UsageError(f"{flag} must be <= {maximum}, got {shown(v)}")
    return v
