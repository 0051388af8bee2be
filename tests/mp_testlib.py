"""Helpers shared by the test modules (import as ``from mp_testlib import cli``; a module named
``conftest`` would clash with the sub-folders' own conftest files)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from mp_forked import REPO, start


def interpreted(script: str, timeout: float = 900, **env: str) -> str:
    """Run ``script`` in a fresh Python under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before
    Triton is imported, hence the subprocess; ``tests/`` on its path); fails the test with its stderr tail
    unless it exits 0. Its stdout."""
    import os
    import sys

    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, **env),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def cli(*args: str, timeout: float = 600, check: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``mismatch-probe ARGS`` as ``python -m mismatch_probe`` would (``mp_forked.start``): forked
    from the suite's pre-imported server, or, with ``env`` added to the environment, in a fresh interpreter."""
    proc = start(*args, env=env).wait(timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"mismatch-probe {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def plant(src: Path, dst: Path, scales: dict[str, float]) -> Path:
    """Copy an HF folder and scale the named parameters (a known, planted perturbation)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(str(f))
    for name, scale in scales.items():
        tensors[name] = (tensors[name].float() * scale).to(tensors[name].dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


# import root -> folder (pyproject's package-dir)
ROOTS = {"mismatch_probe": "mismatch_probe", "mismatch_probe.probes": "probes", "mismatch_probe.kernels": "kernels",
         "mismatch_probe.reports": "reports"}


def package_modules() -> dict[str, Path]:
    """Every module of the installed package by dotted name -> its source file in the checkout."""
    mods: dict[str, Path] = {}
    for prefix, folder in ROOTS.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in f.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([prefix, *parts])] = f
    return mods


def has_cuda() -> bool:
    """A CUDA GPU that torch can use (the gpu-marked tests skip without one: CI has none)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
