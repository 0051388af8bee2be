"""The families this build supports: every module of this package that defines ``SPEC``.

Found by listing the package (no list to edit): a new family is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from mismatch_probe.errors import UsageError
from mismatch_probe.families.base import FamilySpec

_NOT_FAMILIES = {"base", "registry", "opnames"}


@cache
def families() -> dict[str, FamilySpec]:
    """``{model_type: spec}`` of every family module, sorted by model type."""
    import mismatch_probe.families as pkg

    found: dict[str, FamilySpec] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        spec = getattr(importlib.import_module(f"{pkg.__name__}.{info.name}"), "SPEC", None)
        if isinstance(spec, FamilySpec):
            found[spec.model_type] = spec
    return dict(sorted(found.items()))


def get(model_type: str) -> FamilySpec:
    """The spec of ``model_type``; a one-line usage error naming the supported ones otherwise."""
    spec = families().get(model_type)
    if spec is None:
        raise UsageError(f"model_type {model_type!r} is not supported (supported: {', '.join(families())})")
    return spec


def tiny_models() -> dict[str, FamilySpec]:
    """``{tiny model name: spec}``."""
    return {s.tiny: s for s in families().values() if s.tiny}
