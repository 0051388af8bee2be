"""The suite's forked CLI calls (``mp_forked``/``mp_zygote``) behave as a fresh ``python -m
mismatch_probe`` does: the same exit status, output and error line; a timeout stops the call's whole
tree. (That a forked ``compare`` writes the same bits as a fresh one: tests/steps/test_compare_real.py.)"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from mp_forked import get_server, start
from mp_testlib import cli


@pytest.fixture
def needs_server() -> None:
    if get_server() is None:
        pytest.skip("no pre-imported server here (a CUDA machine, or MP_TESTS_FRESH=1)")


@pytest.mark.usefixtures("needs_server")
@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("compare", "--model", "no-such-model", "--out", "OUT"),
        ("compare", "--no-such-option"),
        ("report", "/no/such/run"),
    ],
    ids=["help", "unknown-model", "unknown-option", "missing-run"],
)
def test_forked_call_prints_and_exits_as_a_fresh_interpreter(args: tuple[str, ...], tmp_path: Path) -> None:
    args = tuple(str(tmp_path / "r") if a == "OUT" else a for a in args)
    forked = cli(*args)
    fresh = cli(*args, env={})  # ``env`` given: a fresh interpreter
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    # the fresh interpreter may print import-time warnings first; the tool's own lines are the same
    assert forked.stderr.strip().splitlines()[-3:] == fresh.stderr.strip().splitlines()[-3:]


@pytest.mark.usefixtures("needs_server")
def test_a_timeout_stops_the_forked_call(tmp_path: Path) -> None:
    call = start("compare", "--model", "tiny-qwen3", "--out", str(tmp_path / "r"))
    with pytest.raises(subprocess.TimeoutExpired):
        call.wait(timeout=1.0)
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the group is gone (reaped by the server)
        os.killpg(call.pid, 0)
