"""Issue 30, section 3: clear messages (real CLI, subprocesses). Square brackets survive, NaN
thresholds and TOML keys beside [gate] are usage errors, a piped prompts file is read, huge values
are not echoed digit by digit, staging folders of failed runs are listed and removed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from fixtures.synthetic import make_run
from reliability_lib import mp, one_line_error


@pytest.fixture(scope="module")
def srun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic complete run (no engine needed): the gate and report read it."""
    return make_run(tmp_path_factory.mktemp("msg") / "run", ops=True)


def test_square_brackets_survive_in_messages(tmp_path: Path) -> None:
    one_line_error(mp("compare", "--prompts", tmp_path / "in" / "set[v2].jsonl", "--out", tmp_path / "r"),
                   "set[v2].jsonl")
    old = tmp_path / "runs" / "[old]"
    old.mkdir(parents=True)
    (old / "f").write_text("x")
    one_line_error(mp("compare", "--out", old), "runs/[old]")
    toml = tmp_path / "g[1].toml"
    toml.write_text("gate = 1\n")
    one_line_error(mp("gate", tmp_path, "--config", toml), "g[1].toml: [gate] must be a table")


@pytest.mark.parametrize("args", [("--check", "k3<=nan"), ("--max-k3", "nan"), ("--check", "mean_abs_dlogp < NaN"),
                                  ("--max-mean-abs-dlogp", "nan")])
def test_nan_thresholds_are_usage_errors(srun: Path, args: tuple[str, ...]) -> None:
    one_line_error(mp("gate", srun, *args), "NaN")


@pytest.mark.parametrize("text", ["[gate]\nmax_k3 = nan\n", "max_k3 = nan\n", '[gate]\nchecks = ["k3 <= nan"]\n'])
def test_nan_thresholds_in_toml_are_usage_errors(srun: Path, tmp_path: Path, text: str) -> None:
    (tmp_path / "g.toml").write_text(text)
    one_line_error(mp("gate", srun, "--config", tmp_path / "g.toml"), "NaN")


def test_top_level_keys_beside_a_gate_table_are_refused(srun: Path, tmp_path: Path) -> None:
    (tmp_path / "g.toml").write_text('max_k3 = 0.0\n[gate]\nmax_mean_abs_dlogp = 1.0\n')
    one_line_error(mp("gate", srun, "--config", tmp_path / "g.toml"), "max_k3", "[gate]")


def test_prompts_from_a_pipe_are_read(tmp_path: Path) -> None:
    """/dev/stdin (a pipe) is read, not reported missing: its bad line is named."""
    p = mp("compare", "--prompts", "/dev/stdin", "--out", tmp_path / "r", stdin='{"prompt": "ok"}\n{"prompt": oops}\n')
    one_line_error(p, "/dev/stdin:2", "not valid JSON")


@pytest.mark.parametrize(("args", "flag"), [(("--max-tokens", "1" + "0" * 308), "--max-tokens"),
                                            (("--seed", "9" * 400), "--seed"), (("--n", "1" + "0" * 40), "--n")])
def test_huge_values_are_not_echoed_digit_by_digit(tmp_path: Path, args: tuple[str, ...], flag: str) -> None:
    line = one_line_error(mp("compare", *args, "--out", tmp_path / "r"), flag)
    assert len(line) < 200, line


def test_huge_token_ids_are_refused_briefly(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [10**400]}) + "\n")
    line = one_line_error(mp("compare", "--prompts", p, "--out", tmp_path / "r"), "p.jsonl:1")
    assert len(line) < 300, line


def _staged(parent: Path, name: str, pid: int, status: str) -> Path:
    d = parent / f".{name}.partial-{pid}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"schema_version": 2, "status": status, "config": {}}))
    return d


def test_clean_lists_and_removes_stale_partial_folders(tmp_path: Path) -> None:
    stale = _staged(tmp_path, "run1", 2**22 + 12345, "failed")  # above Linux's default pid_max: never alive
    live = _staged(tmp_path, "run2", os.getpid(), "running")  # this test's process: in use
    mine = tmp_path / ".notes.partial-1"  # not a run folder: never touched
    mine.mkdir()
    (mine / "x").write_text("mine")
    p = mp("clean", tmp_path)
    assert p.returncode == 0 and str(stale) in p.stdout and "stale" in p.stdout and "--yes" in p.stdout
    assert "in use" in p.stdout and ".notes.partial-1" not in p.stdout and stale.exists()
    old = tmp_path / f".gone.old-{2**22 + 7}"  # a replaced run whose replacement never landed: the only copy
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"schema_version": 2, "status": "complete", "config": {}}))
    p = mp("clean", tmp_path, "--yes")
    assert p.returncode == 0 and not stale.exists() and live.exists() and (mine / "x").exists()
    assert old.exists() and "move it back" in p.stdout
    shutil.rmtree(old)
    shutil.rmtree(live)
    assert "no staging folders" in mp("clean", tmp_path).stdout
    one_line_error(mp("clean", tmp_path / "nowhere"), "not a folder")
