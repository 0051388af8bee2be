"""Fixtures for the report tests: synthetic run directories (no engines) and the CLI in-process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures.synthetic import make_run


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Call ``mismatch-probe ARGV`` through ``cli.main``: exit codes as the shell sees them."""
    from mismatch_probe.cli.main import main

    def run(*argv: object) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        cap = capsys.readouterr()
        return CliResult(code, cap.out, cap.err)

    return run


@pytest.fixture(scope="session")
def token_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with token tables only (no op capture, no bisect)."""
    return make_run(tmp_path_factory.mktemp("runs") / "tokens_only", seed=1)


@pytest.fixture(scope="session")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with token tables, op errors and a bisect result."""
    return make_run(tmp_path_factory.mktemp("runs") / "full", ops=True, bisect=True, seed=2)
