"""The front door: the parser's own errors through the installed ``mismatch-probe`` script and
``python -m mismatch_probe`` (issue #16).

Every case runs in a fresh subprocess and asserts behaviour only (exit code, usage line, message, no
traceback), never exception classes: a typer/click release that changes its classes again fails
here. Commands are enumerated from the app, so a new command is covered without editing this file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script() -> str:
    """The console script pip installed next to this interpreter (else the one on PATH)."""
    here = Path(sys.executable).parent / "mismatch-probe"
    found = str(here) if here.exists() else shutil.which("mismatch-probe")
    assert found, "the mismatch-probe console script is not installed (pip install -e .)"
    return found


ENTRY_POINTS = {"script": [_script()], "module": [sys.executable, "-m", "mismatch_probe"]}


def _commands() -> tuple[list[tuple[str, ...]], list[tuple[tuple[str, ...], object]]]:
    """(groups, leaf commands) of the app as (path, click command); the root group is ``()``."""
    import typer

    from mismatch_probe.cli import main as cli

    cli._register()
    groups: list[tuple[str, ...]] = []
    leaves: list[tuple[tuple[str, ...], object]] = []

    def walk(cmd: object, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if isinstance(subs, dict):
            groups.append(path)
            for name, sub in subs.items():
                walk(sub, (*path, name))
        else:
            leaves.append((path, cmd))

    walk(typer.main.get_command(cli.app), ())
    return groups, leaves


def _param_kind(p: object) -> str:
    """``int``/``float``/... for what a parameter converts to (typer 0.29: ``bare_type()``, a type or
    an annotation string; click: ``type.name``)."""
    bare = getattr(p, "bare_type", None)
    if callable(bare):
        try:
            kind = bare()
        except Exception:
            return ""
        return str(getattr(kind, "__name__", kind))
    return {"integer": "int", "float": "float"}.get(getattr(getattr(p, "type", None), "name", ""), "")


def _long_opts(p: object) -> list[str]:
    return [o for o in getattr(p, "opts", []) if o.startswith("--")] if getattr(p, "param_type_name", "") == "option" else []


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    exit_code: int
    stdout_has: tuple[str, ...] = ()
    stderr_has: tuple[str, ...] = ()
    output_has: tuple[str, ...] = ()  # on either stream


def _cases() -> list[Case]:
    groups, leaves = _commands()
    names = [path[-1] for path, _ in leaves if len(path) == 1]
    cases = [
        Case("version", ("--version",), 0, stdout_has=("mismatch-probe ", "torch ")),
        # No arguments: the help (typer's Rich help goes to stdout), exit 2 like any usage error.
        *(Case(f"noargs[{' '.join(g) or 'root'}]", g, 2, output_has=("Usage:", "Commands")) for g in groups),
        *(Case(f"help[{' '.join(g) or 'root'}]", (*g, "--help"), 0, stdout_has=("Usage:",)) for g in groups),
        Case("unknown-command", ("nosuchcmd",), 2, stderr_has=("Usage:", "Error:", "nosuchcmd")),
        # A typo of a real command: click's "did you mean" hint names it.
        Case("typo-command", (names[0][:-1] + names[0][-1] * 2,), 2, stderr_has=("Error:", "Did you mean", names[0])),
        # Choices the tool validates itself (before any engine starts).
        Case("bad-choice[compare --align]", ("compare", "--align", "bogus"), 2, stderr_has=("--align", "bogus")),
        Case("bad-choice[capture --engine]", ("capture", "--engine", "bogus", "--from", "x", "--out", "y"), 2,
             stderr_has=("--engine", "bogus")),
    ]
    for path, cmd in leaves:
        label = " ".join(path)
        params = list(getattr(cmd, "params", []))
        cases.append(Case(f"help[{label}]", (*path, "--help"), 0, stdout_has=("Usage:",)))
        cases.append(Case(f"unknown-option[{label}]", (*path, "--no-such-option-xyz"), 2,
                          stderr_has=("Usage:", "Error:", "--no-such-option-xyz", f"{label} --help")))
        longs = [o for p in params for o in _long_opts(p) if len(o) > 4 and o != "--help"]
        if longs:  # one letter doubled: click's hint names the real option
            typo = longs[0] + longs[0][-1]
            cases.append(Case(f"typo-option[{label}]", (*path, typo), 2, stderr_has=("Error:", typo, longs[0])))
        if any(getattr(p, "required", False) for p in params):
            cases.append(Case(f"missing-required[{label}]", path, 2, stderr_has=("Usage:", "Error:", "Missing")))
        for p in params:
            kind = _param_kind(p)
            if _long_opts(p) and kind in ("int", "float") and not getattr(p, "is_flag", False):
                opt = _long_opts(p)[0]
                cases.append(Case(f"bad-number[{label} {opt}]", (*path, opt, "notanumber"), 2,
                                  stderr_has=("Error:", "Invalid value", opt)))
                break
            choices = getattr(getattr(p, "type", None), "choices", None)
            if _long_opts(p) and choices:
                opt = _long_opts(p)[0]
                cases.append(Case(f"bad-choice[{label} {opt}]", (*path, opt, "not-a-choice"), 2,
                                  stderr_has=("Error:", "Invalid value", opt)))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every case through both entry points, run concurrently (each is a fresh interpreter)."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    jobs = [(ep, c) for ep in ENTRY_POINTS for c in CASES]

    def run(job: tuple[str, Case]) -> subprocess.CompletedProcess:
        ep, c = job
        return subprocess.run([*ENTRY_POINTS[ep], *c.args], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return {(ep, c.id): p for (ep, c), p in zip(jobs, pool.map(run, jobs))}


def test_cases_cover_every_command() -> None:
    groups, leaves = _commands()
    assert len(leaves) >= 8 and () in groups
    ids = {c.id for c in CASES}
    for path, _ in leaves:
        assert f"help[{' '.join(path)}]" in ids and f"unknown-option[{' '.join(path)}]" in ids
    assert any(i.startswith("missing-required[") for i in ids) and any(i.startswith("bad-number[") for i in ids)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_front_door(results: dict, entry: str, case: Case) -> None:
    p = results[(entry, case.id)]
    shown = f"$ mismatch-probe {' '.join(case.args)}\nexit {p.returncode}\n"
    shown += f"stdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-2000:]}"
    assert p.returncode == case.exit_code, shown
    assert "Traceback" not in p.stdout + p.stderr, shown
    for s in case.stdout_has:
        assert s in p.stdout, shown
    for s in case.stderr_has:
        assert s in p.stderr, shown
    for s in case.output_has:
        assert s in p.stdout + p.stderr, shown
    if case.exit_code == 2 and not case.output_has:
        # One usage message, not a help page or a wall of text.
        assert len(p.stderr.strip().splitlines()) <= 6, shown


def test_version_names_the_package_version() -> None:
    from mismatch_probe import __version__

    p = subprocess.run([*ENTRY_POINTS["script"], "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith(f"mismatch-probe {__version__} ("), p.stdout
    assert len(p.stdout.strip().splitlines()) == 1


def test_startup_imports_no_engine() -> None:
    """Parsing (help, usage errors, --version) never imports torch, transformers or vLLM."""
    code = (
        "import sys\n"
        "from mismatch_probe.cli import main as cli\n"
        "for argv in (['--version'], ['compare', '--help'], ['compare', '--bogus'], []):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'triton') if m in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == "[]", p.stdout + p.stderr


def test_parser_exit_is_duck_typed() -> None:
    """Any exception shaped like click's (``exit_code`` + ``show()``) is reported, whatever its class."""
    from mismatch_probe.cli.app import parser_exit

    shown: list[bool] = []

    class FutureUsageError(Exception):
        exit_code = 2

        def show(self) -> None:
            shown.append(True)

    class FutureExit(RuntimeError):
        def __init__(self, code: int) -> None:
            self.exit_code = code

    class Abort(RuntimeError):
        pass

    assert parser_exit(FutureUsageError()) == 2 and shown == [True]
    assert parser_exit(FutureExit(0)) == 0 and parser_exit(FutureExit(3)) == 3
    assert parser_exit(Abort()) == 1
    assert parser_exit(ValueError("a bug")) is None
