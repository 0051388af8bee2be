"""Structure rules of issue 29, read from the source with ``ast`` (no import, no engine, < 1 s).

* Runners are constructed in exactly one function (``probes/factory.build_runner``); outside
  ``probes/`` nothing assigns a runner attribute or reads a runner's ``llm`` / ``model``.
* The commands are thin: no module in ``mismatch_probe/cli/`` imports pyarrow or builds a runner,
  and no command-line option is declared twice.

Each rule has a test that plants a violation and sees the checker report it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"mismatch_probe": "mismatch_probe", "mismatch_probe.probes": "probes", "mismatch_probe.kernels": "kernels",
         "mismatch_probe.reports": "reports"}
FACTORY = ("mismatch_probe.probes.factory", "build_runner")
RUNNER_BASE = "Runner"
# a runner held in a variable or attribute with one of these words in its name (``engines.sampler``,
# ``learner``, ``runner``): ``.model`` / ``.llm`` read on it reach into the engine
RUNNER_WORDS = ("runner", "learner", "sampler", "engine")


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for prefix, folder in ROOTS.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in f.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([prefix, *parts])] = f
    return mods


def _trees(mods: dict[str, Path]) -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text()) for m, p in mods.items()}


def _in_probes(module: str) -> bool:
    return module.startswith("mismatch_probe.probes.") or module == "mismatch_probe.probes"


def runner_classes(trees: dict[str, ast.Module]) -> set[str]:
    """Names of the classes that derive from ``Runner`` (directly or through another runner class)."""
    bases: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    found = {RUNNER_BASE}
    grew = True
    while grew:
        new = {c for c, bs in bases.items() if bs & found} - found
        found |= new
        grew = bool(new)
    return found


def runner_attributes(trees: dict[str, ast.Module], classes: set[str]) -> set[str]:
    """Every attribute a runner class sets on ``self`` (its configuration and state)."""
    attrs: set[str] = set()
    for tree in trees.values():
        for cls in ast.walk(tree):
            if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
                continue
            for node in ast.walk(cls):
                for t in _targets(node):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        attrs.add(t.attr)
    return attrs


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(enclosing function name or '<module>', node) for every node of ``tree``."""
    def visit(node: ast.AST, where: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            yield inner, child
            yield from visit(child, inner)

    yield from visit(tree, "<module>")


def runner_constructions(trees: dict[str, ast.Module], classes: set[str]) -> set[tuple[str, str]]:
    """(module, function) of every call of a runner class (``HfLearner(...)``, ``x.VllmSampler(...)``)."""
    out: set[tuple[str, str]] = set()
    for mod, tree in trees.items():
        for where, node in _functions(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func).rpartition(".")[2]
                if name in classes and name != RUNNER_BASE:
                    out.add((mod, where))
    return out


def runner_attribute_writes(trees: dict[str, ast.Module], attrs: set[str]) -> list[str]:
    """Outside probes/: ``x.attr = ...`` (x not ``self``) or ``setattr(x, "attr", ...)`` of a runner attribute."""
    bad: list[str] = []
    for mod, tree in trees.items():
        if _in_probes(mod):
            continue
        for node in ast.walk(tree):
            for t in _targets(node):
                own = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                if isinstance(t, ast.Attribute) and t.attr in attrs and not own:
                    bad.append(f"{mod}:{node.lineno}: {ast.unparse(t)} = ...")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in attrs):
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    return bad


def _names_a_runner(expr: ast.expr) -> bool:
    last = ast.unparse(expr).rpartition(".")[2].lower()
    return any(w in last for w in RUNNER_WORDS)


def engine_reads(trees: dict[str, ast.Module]) -> list[str]:
    """Outside probes/: ``.llm`` anywhere, ``.model`` of a runner, ``getattr(runner, "model" | "llm")``."""
    bad: list[str] = []
    for mod, tree in trees.items():
        if _in_probes(mod):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (node.attr == "llm" or (node.attr == "model" and _names_a_runner(node.value))):
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ("llm", "model")
                    and _names_a_runner(node.args[0])):
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    return bad


# -- the rules on the repository ------------------------------------------------------------------


def test_runners_are_constructed_in_exactly_one_function() -> None:
    trees = _trees(_modules())
    classes = runner_classes(trees)
    assert {"VllmSampler", "HfLearner", "FsdpLearner"} <= classes
    assert runner_constructions(trees, classes) == {FACTORY}


def test_outside_probes_no_runner_attribute_is_assigned() -> None:
    trees = _trees(_modules())
    attrs = runner_attributes(trees, runner_classes(trees))
    assert {"capture", "ops_dest", "topk", "seq_meta", "llm", "model"} <= attrs
    bad = runner_attribute_writes(trees, attrs)
    assert not bad, "runner attributes set from outside probes/ (pass them in the EngineSpec):\n" + "\n".join(bad)


def test_outside_probes_nothing_reads_a_runners_engine() -> None:
    bad = engine_reads(_trees(_modules()))
    assert not bad, "reads of a runner's engine outside probes/ (add a runner method):\n" + "\n".join(bad)


# -- the checkers see planted violations ---------------------------------------------------------


PLANTED = '''
from mismatch_probe.probes.hf.runner import HfLearner

def learn(prep, run):
    learner = HfLearner(prep.model.path, 64)
    learner.capture = None
    setattr(learner, "topk", 5)
    w = learner.model.lm_head.weight
    tok = engines.sampler.llm.get_tokenizer()
    return getattr(learner, "model", None), prep.model.path
'''


def test_the_checkers_see_planted_violations() -> None:
    trees = _trees(_modules())
    classes = runner_classes(trees)
    attrs = runner_attributes(trees, classes)
    planted = {"mismatch_probe.steps.planted": ast.parse(PLANTED)}
    assert runner_constructions(planted, classes) == {("mismatch_probe.steps.planted", "learn")}
    writes = runner_attribute_writes(planted, attrs)
    assert [w.split(": ", 1)[1] for w in writes] == ["learner.capture = ...", "setattr(learner, 'topk', 5)"]
    reads = sorted(r.split(": ", 1)[1] for r in engine_reads(planted))
    assert reads == ["engines.sampler.llm", "getattr(learner, 'model', None)", "learner.model"]  # not prep.model
    # the same code inside probes/ is the runners' own business
    assert runner_attribute_writes({"mismatch_probe.probes.x": planted["mismatch_probe.steps.planted"]}, attrs) == []
