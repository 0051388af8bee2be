"""Names cited in docstrings resolve: every ``:mod:`` / ``:func:`` / ``:class:`` / ... reference and
every dotted ``module.name`` a docstring of the package cites exists.

Reads every module of the four import roots with ``ast`` (no import, no engine needed): a module's
names are its top-level definitions, assignments and imports (and, for a lazy package, the keys of
its ``_EXPORTS``); a class's names are its body's definitions and assignments. A reference
``a.b.c`` resolves when ``a`` is a name of the citing module (or of one of its classes), a module
found relative to the citing module's package or one of its parents, a module of that short name
anywhere in the package, a top-level definition of any module (Sphinx's global search, roles only),
or external (an installed top-level module: ``torch.equal`` is not checked further); then each next
part must be a submodule, a module-level name, or a class member (imports and the package's base
classes are followed). Checked: the Sphinx roles always; dotted names in plain text or ````literals````
when their first part is a module of the package (so ``x.shape`` or ``e.g.`` are left alone), except
file names (``capture.py``), the citing function's own parameters (``params.n``), patterns with an
upper-case placeholder inside (``conventions.FRAMEWORK.NAME``), keys under the root
(``mismatch_probe.schema_version``: only ``mismatch_probe.<module>...`` is a name) and the packages
that share a name with one of ours (``vllm.LLM`` in prose is vLLM's).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass, field

from mp_testlib import package_modules

# how the docs spell the roots besides their import names (the folders of the checkout)
ALIASES = {"kernels": "mismatch_probe.kernels", "probes": "mismatch_probe.probes", "reports": "mismatch_probe.reports"}
ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|data|attr|obj|exc|const):`([^`]+)`")
DOTTED = re.compile(r"(?<![\w./\-~:])(\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/\-])")
# top-level packages that are also short names of our modules: in prose they mean the external one
SHARED_NAMES = {"vllm", "torch", "triton", "transformers"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "parquet", "html", "toml", "cu", "cuh", "txt", "csv", "pt", "pth", "npy",
                 "yaml", "yml", "sh", "js", "css", "xml", "whl", "so", "cfg", "ini", "log", "lock", "gz", "tar", "zip"}


@dataclass
class ClassInfo:
    members: set[str]
    bases: list[str]


@dataclass
class ModInfo:
    name: str
    is_pkg: bool
    names: set[str] = field(default_factory=set)
    values: set[str] = field(default_factory=set)  # the names bound by a module-level assignment
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target ("pkg.mod" or "pkg.mod.attr")
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    docstrings: list[tuple[int, str, frozenset[str]]] = field(default_factory=list)  # (line, text, parameters)


def _target(mod: ModInfo, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".") if mod.is_pkg else mod.name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def parse_module(name: str, source: str, is_pkg: bool) -> ModInfo:
    """The names, imports, classes and docstrings of one module's source."""
    tree = ast.parse(source)
    mod = ModInfo(name, is_pkg)
    for node in ast.walk(tree):  # imports anywhere (deferred imports name things too)
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                mod.imports.setdefault(local, a.name if a.asname else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = _target(mod, node)
            for a in node.names:
                if a.name != "*":
                    mod.imports.setdefault(a.asname or a.name, f"{base}.{a.name}")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            mod.names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            mod.names.add(node.name)
            mod.classes[node.name] = ClassInfo(_members(node), [ast.unparse(b) for b in node.bases])
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        mod.names.add(n.id)
                        mod.values.add(n.id)
            value = node.value
            if (isinstance(value, ast.Dict) and any(isinstance(t, ast.Name) and t.id in ("_EXPORTS", "__all__")
                                                    for t in targets)):
                mod.names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif isinstance(node, ast.If | ast.Try):  # names defined under a guard
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    mod.names.add(sub.name)
    mod.names.update(mod.imports)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                args: frozenset[str] = frozenset()
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    a = node.args
                    args = frozenset(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x)
                mod.docstrings.append((getattr(node, "lineno", 1), doc, args))
    return mod


def _members(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def index() -> dict[str, ModInfo]:
    """Every module of the four import roots, by dotted name."""
    return {name: parse_module(name, f.read_text(), f.name == "__init__.py") for name, f in package_modules().items()}


class Resolver:
    def __init__(self, mods: dict[str, ModInfo]) -> None:
        self.mods = mods
        self.by_short: dict[str, list[str]] = {}
        for name in mods:
            self.by_short.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        self.defined: dict[str, list[str]] = {}  # top-level name -> the modules defining it (not importing)
        for m in mods.values():
            for n in m.names - set(m.imports):
                self.defined.setdefault(n, []).append(m.name)

    def is_module_head(self, head: str) -> bool:
        return head in self.by_short or head in ALIASES or head in ("mismatch_probe",)

    def _modules_for(self, head: str, at: ModInfo) -> list[str]:
        pkg = at.name if at.is_pkg else at.name.rsplit(".", 1)[0]
        parts = pkg.split(".")
        out = [".".join(parts[:i] + [head]) for i in range(len(parts), 0, -1)]
        out += [ALIASES[head]] if head in ALIASES else []
        out += [head] + self.by_short.get(head, [])
        return [m for m in dict.fromkeys(out) if m in self.mods]

    def _walk(self, obj: tuple[str, str, str | None], rest: list[str], depth: int = 0) -> bool:
        """obj: ("mod", module) | ("cls", module, class) | ("ext"/"leaf", ...); rest: parts left."""
        if not rest or obj[0] in ("ext", "leaf") or depth > 20:
            return True
        kind, modname, cls = obj
        part, more = rest[0], rest[1:]
        if kind == "mod":
            sub = f"{modname}.{part}"
            if sub in self.mods:
                return self._walk(("mod", sub, None), more, depth + 1)
            mod = self.mods[modname]
            if part not in mod.names:
                return False
            return self._walk(self._follow(mod, part), more, depth + 1)
        info = self.mods[modname].classes[cls]
        if part in info.members:
            return True  # a member's attributes are values: not followed
        for base in info.bases:  # inherited: a base of the package's (followed) or an external one (accepted)
            b = self._follow(self.mods[modname], base.split(".")[0].split("[")[0])
            if b[0] == "cls" and self._walk(b, rest, depth + 1):
                return True
            if b[0] == "ext":
                return True
        return False

    def _follow(self, mod: ModInfo, name: str) -> tuple[str, str, str | None]:
        if name in mod.classes:
            return ("cls", mod.name, name)
        if name in mod.imports:
            target = mod.imports[name]
            if target in self.mods:
                return ("mod", target, None)
            owner, _, attr = target.rpartition(".")
            if owner in self.mods:
                if attr in self.mods[owner].names and attr not in self.mods[owner].imports:
                    return self._follow(self.mods[owner], attr)
                if attr in self.mods[owner].imports and self.mods[owner].imports[attr] != target:
                    return self._follow(self.mods[owner], attr)
                return ("leaf", owner, attr) if attr in self.mods[owner].names else ("ext", target, None)
            if target.split(".")[0] in ("mismatch_probe",):
                return ("leaf", target, None) if False else ("missing", target, None)
            return ("ext", target, None)
        return ("leaf", mod.name, name)

    def resolves(self, ref: str, at: ModInfo, role: str | None) -> bool:
        ref = ref.strip().lstrip("~").rstrip("()")
        if "<" in ref and ref.endswith(">"):
            ref = ref[ref.index("<") + 1: -1]
        ref = ref.lstrip(".")
        parts = ref.split(".")
        head, rest = parts[0], parts[1:]
        starts: list[tuple[str, str, str | None]] = []
        if head in at.names and not (role == "mod" and head not in at.imports):
            starts.append(self._follow(at, head))
        for c in at.classes.values():  # :meth:`name` inside a class's docstrings
            if head in c.members and not rest:
                return True
        starts += [("mod", m, None) for m in self._modules_for(head, at)]
        if role is not None and role != "mod":  # Sphinx's global search for a name (a class's members checked)
            found = [self._follow(self.mods[m], head) for m in self.defined.get(head, [])]
            starts += [f for f in found if not rest or f[0] in ("mod", "cls")]
        for s in starts:
            if s[0] != "missing" and self._walk(s, rest):
                return True
        return not starts and head not in self.by_short and _external(head)


def _external(head: str) -> bool:
    """An installed top-level module (stdlib or a dependency): its names are not ours to check."""
    try:
        return importlib.util.find_spec(head) is not None
    except (ImportError, ValueError):
        return False


def _object_named_like_its_module(r: Resolver, head: str) -> bool:
    return any(head in r.mods[m].values for m in r.by_short.get(head, []))


def bad_references(mods: dict[str, ModInfo]) -> list[str]:
    """``module:line: reference`` for every docstring reference that does not resolve."""
    r = Resolver(mods)
    bad: list[str] = []
    for mod in mods.values():
        for line, doc, params in mod.docstrings:
            refs: list[tuple[str, str | None]] = [(m.group(2), m.group(1)) for m in ROLE.finditer(doc)]
            plain = ROLE.sub(" ", doc)
            for m in DOTTED.finditer(plain):
                text = m.group(1)
                parts = text.lstrip(".").split(".")
                if (parts[-1] in FILE_SUFFIXES or not r.is_module_head(parts[0]) or parts[0] in params
                        or parts[0] in SHARED_NAMES or any(p.isupper() and len(p) > 1 for p in parts[1:-1])
                        or (parts[0] == "mismatch_probe" and f"mismatch_probe.{parts[1]}" not in mods)):
                    continue
                if _object_named_like_its_module(r, parts[0]):
                    continue  # ``app.command``: the object ``app`` of module ``app`` (a value: not followed)
                refs.append((text, None))
            for ref, role in refs:
                if not r.resolves(ref, mod, role):
                    bad.append(f"{mod.name}:{line}: {':' + role + ':' if role else ''}{ref}")
    return bad


def test_every_name_a_docstring_cites_exists() -> None:
    bad = bad_references(index())
    assert not bad, "docstrings cite names that do not exist:\n" + "\n".join(bad)


def test_a_planted_bad_name_is_caught() -> None:
    """The check fails on names that do not exist (the kinds issue 29 found), and passes good ones."""
    mods = index()
    planted = '''"""Planted: :func:`ref.w4a4_gemm_ref` and :mod:`tc_linear` exist; these do not:
:func:`nvfp4_ref.w4a4_gemm_ref`, :mod:`.strict_ops`, :mod:`_triton_common`, :func:`tc_linear.no_such_fn`,
:class:`linear.NVFP4Linear.no_such_method`, and in plain text kernels.patch_hf and tc_linear.NSEG_GONE."""
from .ref import w4a4_gemm_ref
'''
    name = "mismatch_probe.kernels.nvfp4.planted"
    mods[name] = parse_module(name, planted, False)
    bad = [b.split(": ", 1)[1] for b in bad_references(mods) if b.startswith(name + ":")]
    assert bad == [":func:nvfp4_ref.w4a4_gemm_ref", ":mod:.strict_ops", ":mod:_triton_common",
                   ":func:tc_linear.no_such_fn", ":class:linear.NVFP4Linear.no_such_method", "kernels.patch_hf",
                   "tc_linear.NSEG_GONE"], bad
