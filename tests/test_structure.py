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

from mp_testlib import package_modules

FACTORY = ("mismatch_probe.probes.factory", "build_runner")
RUNNER_BASE = "Runner"
# a runner held in a variable or attribute with one of these words in its name (``engines.sampler``,
# ``learner``, ``runner``): ``.model`` / ``.llm`` read on it reach into the engine
RUNNER_WORDS = ("runner", "learner", "sampler", "engine")
# runner attributes no other object of the package has: set on anything outside probes/, they are a runner's
RUNNER_ONLY = {"ops_dest", "topk_support", "seq_meta", "dataset_dest", "ops_dataset_dest", "llm", "recipe_ops",
               "recipe_layers", "row_parallel_slices", "prefill_topk", "topk_out", "llm_kwargs", "model_kwargs"}


def _modules() -> dict[str, Path]:
    return package_modules()


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
    """Outside probes/: ``x.attr = ...`` or ``setattr(x, "attr", ...)`` of a runner attribute, where ``x``
    names a runner (``learner``, ``engines.sampler``, ...) or ``attr`` is a name only runners use
    (``ops_dest``, ``seq_meta``, ...: not ``dtype`` or ``device``, which other objects have too)."""
    only = attrs & RUNNER_ONLY

    def bad_target(obj: ast.expr, attr: str) -> bool:
        own = isinstance(obj, ast.Name) and obj.id == "self"
        return not own and attr in attrs and (_names_a_runner(obj) or attr in only)

    bad: list[str] = []
    for mod, tree in trees.items():
        if _in_probes(mod):
            continue
        for node in ast.walk(tree):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and bad_target(t.value, t.attr):
                    bad.append(f"{mod}:{node.lineno}: {ast.unparse(t)} = ...")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and bad_target(node.args[0], str(node.args[1].value))):
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
    r.ops_dest = None
    table.dtype = "x"
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
    assert sorted(w.split(": ", 1)[1] for w in writes) == ["learner.capture = ...", "r.ops_dest = ...",
                                                          "setattr(learner, 'topk', 5)"]  # not table.dtype
    reads = sorted(r.split(": ", 1)[1] for r in engine_reads(planted))
    assert reads == ["engines.sampler.llm", "getattr(learner, 'model', None)", "learner.model"]  # not prep.model
    # the same code inside probes/ is the runners' own business
    assert runner_attribute_writes({"mismatch_probe.probes.x": planted["mismatch_probe.steps.planted"]}, attrs) == []


# -- thin commands ---------------------------------------------------------------------------------

CLI = "mismatch_probe.cli."
# the same flag in another command where it means another thing: report's HTML file, the kernel
# bench's results folder; kernels check/bench's own --only and --json
OTHER_MEANING = {("--out", "mismatch_probe.cli.report"), ("--out", "mismatch_probe.cli.kernels"),
                 ("--only", "mismatch_probe.cli.kernels"), ("--json", "mismatch_probe.cli.kernels")}


def cli_violations(trees: dict[str, ast.Module], classes: set[str]) -> list[str]:
    """Modules of cli/ that import pyarrow or build a runner (the factory, a runner class)."""
    builders = classes | {"build_runner", "EngineSpec"}
    bad: list[str] = []
    for mod, tree in trees.items():
        if not mod.startswith(CLI):
            continue
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "pyarrow" or n.startswith("pyarrow.") for n in names):
                bad.append(f"{mod}:{node.lineno}: imports pyarrow")
            if any(n.rpartition(".")[2] in builders or n.endswith("probes.factory") for n in names):
                bad.append(f"{mod}:{node.lineno}: imports a runner builder")
            if isinstance(node, ast.Call) and ast.unparse(node.func).rpartition(".")[2] in builders:
                bad.append(f"{mod}:{node.lineno}: builds a runner")
    return bad


def option_declarations(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """flag -> the places declaring it: ``typer.Option`` / ``typer.Argument`` calls and ``Flag((...), help)``."""
    out: dict[str, list[str]] = {}
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("typer.Option", "typer.Argument"):
                consts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            elif name.rpartition(".")[2] == "Flag" and node.args and isinstance(node.args[0], ast.Tuple):
                consts = [e.value for e in node.args[0].elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            else:
                continue
            for c in consts:
                for flag in c.split("/"):  # --replay/--no-replay
                    if flag.startswith("--"):
                        out.setdefault(flag, []).append(mod)
    return out


def declared_twice(decls: dict[str, list[str]]) -> list[str]:
    bad = []
    for flag, mods in sorted(decls.items()):
        mine = [m for m in mods if (flag, m) not in OTHER_MEANING]
        if len(mine) > 1:
            bad.append(f"{flag}: {', '.join(mine)}")
    return bad


def test_cli_imports_no_pyarrow_and_builds_no_runner() -> None:
    trees = _trees(_modules())
    bad = cli_violations(trees, runner_classes(trees))
    assert not bad, "cli/ must parse and call a step:\n" + "\n".join(bad)


def test_no_option_is_declared_twice() -> None:
    decls = option_declarations(_trees(_modules()))
    assert {"--capture", "--out", "--engine", "--n"} <= set(decls)
    bad = declared_twice(decls)
    assert not bad, "options declared in more than one place (declare a Flag in steps/options.py):\n" + "\n".join(bad)


def test_compare_and_capture_share_their_options() -> None:
    """The options both commands have are one declaration each (the same Flag object), and the
    commands' options are exactly their config's flagged fields."""
    import dataclasses

    from mismatch_probe.cli.options import parameters
    from mismatch_probe.steps.capture import CaptureConfig
    from mismatch_probe.steps.compare_types import CompareConfig
    from mismatch_probe.steps.options import flag_of

    def flags(cls: type) -> dict[str, object]:
        return {f.name: flag_of(f) for f in dataclasses.fields(cls)}

    cmp, cap = flags(CompareConfig), flags(CaptureConfig)
    shared = {k for k in cmp if k in cap}
    assert len(shared) == 15 and all(cmp[k] is cap[k] for k in shared)
    assert [p.name for p in parameters(CompareConfig)] == [f.name for f in dataclasses.fields(CompareConfig)]


def test_a_command_builds_its_config_from_the_flags(tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from mismatch_probe.cli.options import command
    from mismatch_probe.steps.capture import CaptureConfig

    got: list[CaptureConfig] = []
    app = typer.Typer()

    @app.command("capture")
    @command(CaptureConfig)
    def capture(cfg: CaptureConfig) -> None:
        got.append(cfg)

    @app.command("other")
    def other() -> None: ...

    res = CliRunner().invoke(app, ["capture", "-e", "hf", "--from", str(tmp_path), "--out", "o", "--capture-rule", "a=full",
                                   "--capture-rule", "b=stats", "--fsdp-timeout", "9", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert got == [CaptureConfig(engine="hf", source=tmp_path, out=Path("o"), capture_rules=["a=full", "b=stats"],
                                 fsdp_timeout_s=9.0, overwrite=True)]
    res = CliRunner().invoke(app, ["capture", "--from", "x", "--out", "o"])
    assert res.exit_code == 2 and "--engine" in res.output  # required: a field without a default


PLANTED_CLI = '''
import pyarrow as pa
import typer
from mismatch_probe.probes.factory import build_runner

def cmd(out=typer.Option(None, "--out"), cap=typer.Option("stats", "--capture")):
    return build_runner(None)
'''


def test_the_cli_checkers_see_planted_violations() -> None:
    trees = _trees(_modules())
    planted = {"mismatch_probe.cli.planted": ast.parse(PLANTED_CLI)}
    bad = [b.split(": ", 1)[1] for b in cli_violations(planted, runner_classes(trees))]
    assert bad == ["imports pyarrow", "imports a runner builder", "builds a runner"]
    decls = option_declarations({**trees, **planted})
    assert declared_twice(decls) == ["--capture: mismatch_probe.steps.options, mismatch_probe.cli.planted",
                                     "--out: mismatch_probe.steps.options, mismatch_probe.cli.planted"]


def test_the_factory_configures_runners_through_their_constructors(tmp_path: Path) -> None:
    """build_runner sets everything an engine needs before it loads (nothing is set afterwards), and
    vLLM's context follows one rule: longest sequence + 1, at least 64, at most the model's."""
    from mismatch_probe.probes.factory import EngineSpec, build_runner, max_model_len
    from mismatch_probe.probes.models import ModelInfo

    mi = ModelInfo(path=tmp_path, name="t", model_type="qwen3", vocab_size=512, max_positions=128, num_layers=2, is_moe=False)
    assert [max_model_len(mi, n) for n in (5, 63, 64, 100, 127, 500)] == [64, 64, 65, 101, 128, 128]
    plan = object()
    v = build_runner(EngineSpec("vllm", mi, 80, seed=3, engine_kwargs={"max_num_seqs": 4}, recipe="strict",
                                recipe_ops=frozenset(), capture=plan, ops_dest=tmp_path / "ops.parquet", topk=5,
                                engine_auto={"x": {"value": 1, "reason": "test"}}))
    assert (v.max_model_len, v.seed, v.llm_kwargs, v.recipe, v.recipe_ops, v.topk) == (81, 3, {"max_num_seqs": 4}, "strict",
                                                                                       frozenset(), 5)
    assert v.capture is plan and v.ops_dest == tmp_path / "ops.parquet" and v.info.auto["x"]["reason"] == "test"
    h = build_runner(EngineSpec("hf", mi, 80, engine_kwargs={"attn_implementation": "eager", "rope_theta": 1.0}, topk=3,
                                topk_support={1: {"prefill": [[1, 2, 3]]}}, row_parallel_slices=2, micro_batch_size=4))
    assert (h.attn_implementation, h.model_kwargs, h.topk, h.row_parallel_slices, h.micro_batch_size) == (
        "eager", {"rope_theta": 1.0}, 3, 2, 4)
    f = build_runner(EngineSpec("fsdp", mi, 80, capture=plan, ops_dest=tmp_path / "o", tokens_dest=tmp_path / "t",
                                seq_meta=((0, 0, 3), (1, 0, 4)), nproc=3, timeout_s=9.0))
    assert (f.seq_meta, f.dataset_dest, f.ops_dataset_dest, f.nproc, f.timeout_s, f.capture) == (
        [(0, 0, 3), (1, 0, 4)], tmp_path / "t", tmp_path / "o", 3, 9.0, plan)
    assert f.ops_dest is None  # the FSDP ranks write a dataset; nothing streams in this process
