"""The import contract: layers import only downward, ``kernels`` imports no engine wiring, no cycles.

Reads every module of the package with ``ast`` (no import, no engine needed, < 1 s). Every
``import`` counts, also the ones inside functions (a deferred import is still a dependency) and
the ones under ``if TYPE_CHECKING:`` (a type-only import is a dependency of the reader: a cycle
through one is still a cycle). ``from pkg import sub`` depends on ``pkg.sub``, not on
``pkg/__init__``. The layer order is declared in pyproject.toml (``[tool.mismatch_probe]
layers``, top first) and documented in the README ("Design").
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from mp_testlib import REPO, package_modules


def _layers() -> list[list[str]]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mismatch_probe"]
    return [[p.strip() for p in entry.split("|")] for entry in cfg["layers"]]


def _modules() -> dict[str, Path]:
    return package_modules()


def type_checking_imports(tree: ast.AST) -> int:
    """How many imports sit under ``if TYPE_CHECKING:`` (counted like every other import)."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            n += sum(isinstance(x, ast.Import | ast.ImportFrom) for sub in node.body for x in ast.walk(sub))
    return n


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
            targets = subs + ([mod] if len(subs) < len(node.names) else [])
        else:
            continue
        for t in targets:
            while t and t not in mods:  # ``import a.b.c`` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    mods = _modules() if mods is None else mods
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """Index of the layer holding ``module`` (the longest declared prefix wins)."""
    best, best_len = len(layers), -1
    for i, group in enumerate(layers):
        for prefix in group:
            full = "mismatch_probe" if prefix == "mismatch_probe" else f"mismatch_probe.{prefix}"
            if (module == full or module.startswith(full + ".")) and len(full) > best_len:
                best, best_len = i, len(full)
    return best


def test_every_module_has_a_declared_layer() -> None:
    layers = _layers()
    assert all(_layer_of(m, layers) < len(layers) for m in _modules())


def test_no_module_imports_a_layer_above_it() -> None:
    layers = _layers()
    bad = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts if _layer_of(t, layers) < _layer_of(m, layers)]
    assert not bad, "imports that point up the layers:\n" + "\n".join(sorted(bad))


def test_kernels_import_no_engine_wiring_steps_or_cli() -> None:
    banned = ("mismatch_probe.probes", "mismatch_probe.steps", "mismatch_probe.cli")
    bad = [f"{m} -> {t}" for m, ts in _graph().items() if m.startswith("mismatch_probe.kernels")
           for t in ts if t.startswith(banned)]
    assert not bad, "\n".join(bad)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = find_cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_type_checking_imports_are_counted() -> None:
    """The package has type-only imports, and each of them is an edge of the graph above."""
    mods = _modules()
    n = sum(type_checking_imports(ast.parse(p.read_text())) for p in mods.values())
    assert n > 0
    stages = _imports("mismatch_probe.steps.compare_stages", mods["mismatch_probe.steps.compare_stages"], mods)
    assert "mismatch_probe.steps.compare_types" in stages  # imported under TYPE_CHECKING only


def test_the_checker_fails_on_a_planted_cycle(tmp_path: Path) -> None:
    """A cycle closed by a ``TYPE_CHECKING`` import (the shape issue 29 found in steps/compare) is
    reported, through a relative import and a deferred one."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "orchestrator.py").write_text("def run():\n    from . import stages\n    return stages\n")
    (pkg / "stages.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from mismatch_probe.steps.orchestrator import Config\n"
    )
    (pkg / "types_.py").write_text("X = 1\n")
    mods = {f"mismatch_probe.steps.{f.stem}": f for f in pkg.glob("*.py") if f.stem != "__init__"}
    cycles = find_cycles(_graph(mods))
    assert cycles == [["mismatch_probe.steps.orchestrator", "mismatch_probe.steps.stages"]]
    (pkg / "stages.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .types_ import X\n")
    assert find_cycles(_graph(mods)) == []  # the types in their own module below both: no cycle


def test_the_checker_sees_a_planted_violation(tmp_path: Path) -> None:
    """The parser resolves relative and deferred imports (so the checks above can fail)."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from ..steps import compare\n    import mismatch_probe.cli.app\n")
    mods = {"mismatch_probe.kernels.nvfp4.mod": f, "mismatch_probe.kernels.steps.compare": f,
            "mismatch_probe.cli.app": f}
    got = _imports("mismatch_probe.kernels.nvfp4.mod", f, mods)
    assert got == {"mismatch_probe.kernels.steps.compare", "mismatch_probe.cli.app"}
