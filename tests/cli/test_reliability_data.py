"""Issue 30, section 1: never lose a user's files, never pass a broken run (real CLI, subprocesses).

``--out`` is only a new folder, an empty one, or an existing run that ``--overwrite`` replaces by
rename; output files are never pipes or devices; the gate never passes a run that lost what a
check needs; option values out of range are usage errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_lib import REPO, mp, one_line_error, snapshot

pytestmark = pytest.mark.vllm


@pytest.fixture
def base(real_run_qwen3: Path, tmp_path: Path) -> Path:
    """A private copy of one real compare run (tiny-qwen3, op capture on) to damage."""
    return Path(shutil.copytree(real_run_qwen3, tmp_path / "run"))


def _user_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "sub").mkdir()
    (root / "notes.txt").write_text("my notes")
    (root / "sub" / "data.csv").write_text("1,2\n")
    return root


# ----------------------------------------------------------------------- 1-4: --out


@pytest.mark.parametrize("out", [".", "", "..", "./", "sub/.."])
@pytest.mark.parametrize("overwrite", [True, False])
def test_out_is_never_the_current_folder_or_above(tmp_path: Path, out: str, overwrite: bool) -> None:
    cwd = _user_folder(tmp_path / "work" / "here")
    before, parent_before = snapshot(cwd), snapshot(tmp_path / "work")
    p = mp("compare", "--out", out, *(["--overwrite"] if overwrite else []), cwd=cwd)
    one_line_error(p, "current folder")
    assert snapshot(cwd) == before and snapshot(tmp_path / "work") == parent_before


def test_overwrite_never_replaces_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    d = _user_folder(tmp_path / "d")
    before = snapshot(d)
    for out in (d, d / "sub" / ".."):
        one_line_error(mp("compare", "--out", out, "--overwrite"), "not a mismatch-probe run")
    assert snapshot(d) == before


def test_a_run_inside_the_cwd_tree_is_refused_without_overwrite(base: Path) -> None:
    before = snapshot(base)
    one_line_error(mp("compare", "--out", base), "--overwrite")
    assert snapshot(base) == before


def _capture_and_tamper(base: Path, out: Path, tamper, *extra: str) -> subprocess.CompletedProcess:
    """``capture --engine hf --from base --out out``; ``tamper(out)`` runs as soon as the staging
    folder exists (the engine is still loading then)."""
    pp = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "mismatch_probe", "capture", "--engine", "hf", "--from", str(base),
                             "--out", str(out), "--capture", "off", *extra], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": pp})
    deadline = time.monotonic() + 300
    while not list(out.parent.glob(f".{out.name}.partial-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    tamper(out)
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _fake_run(path: Path, tag: str) -> None:
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"schema_version": 2, "status": "complete", "config": {},
                                                    "tag": tag}))
    (path / "results.txt").write_text(tag)


def test_a_run_that_appears_meanwhile_is_never_replaced(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "cap"
    p = _capture_and_tamper(base, out, lambda o: _fake_run(o, "appeared"))
    one_line_error(p, "changed while this run was running", engines=True)
    assert (out / "results.txt").read_text() == "appeared"
    staged = list(tmp_path.glob(".cap.partial-*"))
    assert len(staged) == 1 and (staged[0] / "hf" / "tokens.parquet").is_file()  # the results are kept


def test_overwrite_replaces_a_run_by_rename_and_leaves_nothing_beside(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "cap"
    _fake_run(out, "old run")
    p = _capture_and_tamper(base, out, lambda o: None, "--overwrite")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert not (out / "results.txt").exists() and (out / "hf" / "tokens.parquet").is_file()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["cap", "run"]  # no .partial, no .old left


# ----------------------------------------------------------------------- 5: output files


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_output_files_are_never_pipes_or_devices(base: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [("report", base, "--out", fifo), ("gate", base, "--max-k3", "1", "--junit", fifo),
             ("gate", base, "--max-k3", "1", "--markdown", fifo), ("gate", base, "--max-k3", "1", "--junit", "/dev/full"),
             ("report", base, "--out", "/dev/null")]
    for args in cases:
        one_line_error(mp(*args), "not a regular file")
    assert fifo.exists() and not fifo.is_file()
    assert Path("/dev/full").is_char_device() and Path("/dev/null").is_char_device()


# ----------------------------------------------------------------------- 6: gate on damaged runs


def test_gate_never_passes_a_captured_run_without_op_errors(base: Path) -> None:
    assert mp("gate", base, "--allow-first-divergent").returncode == 0  # intact: the check runs
    (base / "compare" / "op_errors.parquet").unlink()
    for flag in ("--no-first-divergent", "--allow-first-divergent"):
        one_line_error(mp("gate", base, flag), "corrupt run", "op_errors.parquet")


@pytest.mark.parametrize("damage", ["list", "missing_pair", "string_metric", "no_metric", "pairs_list"])
def test_gate_never_passes_a_corrupt_summary(base: Path, damage: str) -> None:
    path = base / "compare" / "summary.json"
    s = json.loads(path.read_text())
    pair = s["pairs"]["learner_vs_decode"]
    if damage == "list":
        s["pairs"]["learner_vs_decode"] = list(pair.values())
    elif damage == "missing_pair":
        del s["pairs"]["learner_vs_decode"]
    elif damage == "string_metric":
        pair["k3"] = "0.0"
    elif damage == "no_metric":
        del pair["k3"]
    else:
        s["pairs"] = [pair]
    path.write_text(json.dumps(s))
    one_line_error(mp("gate", base, "--max-k3", "1"), "corrupt run", "summary.json")


# ----------------------------------------------------------------------- 7: diff --out


def test_diff_never_writes_into_a_run(base: Path, tmp_path: Path) -> None:
    before = snapshot(base)
    for out in (base / "compare", base, base / "learner"):
        one_line_error(mp("diff", f"{base}:learner", f"{base}:sampler", "--out", out), "never written into")
    assert snapshot(base) == before
    d = tmp_path / "diff"
    assert mp("diff", f"{base}:learner", f"{base}:sampler", "--out", d).returncode == 0
    one_line_error(mp("diff", f"{base}:learner", f"{base}:sampler", "--out", d), "--overwrite")
    assert mp("diff", f"{base}:learner", f"{base}:sampler", "--out", d, "--overwrite").returncode == 0


# ----------------------------------------------------------------------- 8-9: values


@pytest.mark.parametrize(("args", "needle"), [
    (("--max-rows", "-5"), "--max-rows"), (("--max-rows", "0"), "--max-rows"), (("--top", "-1"), "--top"),
    (("--ablation-seqs", "-2"), "--ablation-seqs"), (("--min-share", "nan"), "--min-share"),
    (("--min-share", "2"), "--min-share"),
])
def test_bisect_refuses_out_of_range_options(base: Path, args: tuple[str, ...], needle: str) -> None:
    before = snapshot(base)
    one_line_error(mp("bisect", base, *args), needle)
    assert snapshot(base) == before


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_fsdp_timeout_must_be_a_positive_finite_number(tmp_path: Path, value: str) -> None:
    out = tmp_path / "run"
    one_line_error(mp("compare", "--learner", "fsdp", "--fsdp-timeout", value, "--out", out), "--fsdp-timeout")
    assert not out.exists() and not list(tmp_path.iterdir())
