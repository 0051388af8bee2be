"""run/ owns the run folder: RunDir's typed readers validate what they return ("corrupt run: FILE:
what"), the --out policy and rename helpers, the typed manifest updates, and no module outside
run/ spells a run-folder file name in code (issue 29 point 3, issue 30)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures.synthetic import make_run

from mismatch_probe.errors import SchemaError, UsageError
from mismatch_probe.run import outpath
from mismatch_probe.run import reader as layout
from mismatch_probe.run.reader import RunDir
from mismatch_probe.run.rundir import OutputConflict, RunWriter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run", ops=True, bisect=True)


def test_readers_return_validated_content(run: Path) -> None:
    rd = RunDir(run).require_complete()
    assert rd.config["model"] == "synthetic-qwen3" and set(rd.summary()["pairs"]) >= {"learner_vs_decode"}
    assert rd.bisect() is not None and rd.op_errors() is not None and rd.token_gaps().num_rows > 0
    assert rd.tokens("learner").num_rows > 0 and rd.ops("learner") is None


@pytest.mark.parametrize(("damage", "needle"), [
    ("[]", "expected a JSON object, got a list"), ('{"schema_version": "abc", "status": "complete", "config": {}}', "abc"),
    ('{"schema_version": 2, "status": "complete"}', "'config'"), ("{", "not valid JSON"),
    ('{"schema_version": 2, "status": 1, "config": {}}', "'status'"),
])
def test_a_damaged_manifest_is_a_corrupt_run(run: Path, damage: str, needle: str) -> None:
    (run / layout.MANIFEST).write_text(damage)
    with pytest.raises(SchemaError, match="corrupt run: .*manifest.json") as e:
        _ = RunDir(run).manifest
    assert needle in str(e.value)


def test_a_captured_run_without_op_errors_is_corrupt(run: Path) -> None:
    m = json.loads((run / layout.MANIFEST).read_text())
    m["config"]["capture"] = "stats"
    (run / layout.MANIFEST).write_text(json.dumps(m))
    (run / layout.OP_ERRORS).unlink()
    with pytest.raises(SchemaError, match="corrupt run: .*op_errors.parquet: missing"):
        RunDir(run).op_errors()


def test_a_column_of_another_type_is_a_corrupt_run(run: Path) -> None:
    t = pq.read_table(run / layout.TOKEN_GAPS)
    t = t.set_column(t.column_names.index("lp_decode"), "lp_decode", pa.array(["x"] * t.num_rows))
    pq.write_table(t.replace_schema_metadata(pq.read_schema(run / layout.TOKEN_GAPS).metadata), run / layout.TOKEN_GAPS)
    with pytest.raises(SchemaError, match="corrupt run: .*token_gaps.parquet: .*lp_decode"):
        RunDir(run).token_gaps()


def test_rename_noreplace_never_replaces_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "keep").write_text("x")
    with pytest.raises(OSError):
        outpath.rename_noreplace(a, b)
    assert (b / "keep").read_text() == "x" and a.is_dir()
    outpath.rename_noreplace(a, tmp_path / "c")
    assert (tmp_path / "c").is_dir() and not a.exists()


def test_run_writer_replaces_a_run_by_rename_and_refuses_what_appeared(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    with RunWriter(out) as w:
        (w.path("x.txt")).write_text("first")
        w.finish()
    with pytest.raises(UsageError, match="--overwrite"):
        RunWriter(out)
    with RunWriter(out, overwrite=True) as w:
        w.set_config({"a": 1}, kind="capture")
        w.record_engine("learner", "hf", {"dtype": "bf16"}, {"k": {"value": 1}}, ["n1"])
        w.note("n2")
        w.set_parity("weights", {"ok": True})
        w.finish()
    m = RunDir(out).manifest
    assert not (out / "x.txt").exists() and m["kind"] == "capture" and m["engines"]["learner"]["engine"] == "hf"
    assert m["auto"] == {"learner.k": {"value": 1}} and m["notes"] == ["n1", "n2"] and m["parity"]["weights"]["ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(OutputConflict, match="changed while"), RunWriter(tmp_path / "new") as w:
        (tmp_path / "new").mkdir()
        (tmp_path / "new" / "mine").write_text("mine")
        w.finish()
    assert (tmp_path / "new" / "mine").read_text() == "mine"
    with pytest.raises(ValueError):
        w.set_section("status", {})


@pytest.mark.parametrize("out", [".", "..", "", "sub/.."])
def test_out_policy_refuses_the_cwd_and_above(tmp_path: Path, monkeypatch, out: str) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub" if out == ".." else tmp_path)
    with pytest.raises(UsageError):
        outpath.check_out_dir(out, overwrite=True)


def test_write_output_refuses_non_regular_files(tmp_path: Path) -> None:
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        outpath.write_output(fifo, b"x")
    outpath.write_output(tmp_path / "ok.txt", b"x")
    assert (tmp_path / "ok.txt").read_bytes() == b"x"


RUN_FILES = ("manifest.json", "summary.json", "op_errors.parquet", "tokens.parquet", "sequences.parquet",
             "token_gaps.parquet", "bisect.json", "ops.parquet", "ops_by_rank", "tokens_by_rank", "weights.json",
             "weight_parity.json", "report.html")


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module's code (docstrings, messages in raise/print/f-strings excluded)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr | ast.Raise):
            skip.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Constant))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "print", "append", "missing", "UsageError", "SchemaError", "Option", "Argument", "note", "field", "Flag"):
            skip.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Constant))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_no_module_outside_run_spells_a_run_folder_file_name() -> None:
    found = []
    for folder in ("mismatch_probe", "reports", "probes"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if "run" in f.relative_to(ROOT / folder).parts[:1]:
                continue
            for line, s in _code_strings(f):
                if any(name in s for name in RUN_FILES):
                    found.append(f"{f.relative_to(ROOT)}:{line}: {s!r}")
    assert not found, "run-folder file names outside run/ (use mismatch_probe.run.reader):\n" + "\n".join(found)
