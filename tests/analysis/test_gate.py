"""The CI gate: check parsing, TOML + flags, verdicts (NaN/inf, skipped, strict), first divergent op,
Markdown and JUnit output, exit codes 0/1/2 through the real CLI entry point (synthetic runs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fixtures.synthetic import make_run

from mismatch_probe.analysis import gate as g
from mismatch_probe.errors import SchemaError, UsageError


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    from mismatch_probe.cli.main import main

    capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    cap = capsys.readouterr()
    return code, " ".join((cap.out + cap.err).split())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("gate") / "run", ops=True, bisect=True)


@pytest.fixture(scope="module")
def token_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("gate") / "tok")


def summary(**metrics: float) -> dict:
    return {"schema_version": 1, "pairs": {p: dict(metrics) for p in g.PAIRS}}


# ----------------------------------------------------------------------------- parsing and config


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("k3<=1e-4", g.Check("k3", "<=", 1e-4, "learner_vs_decode")),
        (" mean_abs_dlogp < 0.5 ", g.Check("mean_abs_dlogp", "<", 0.5, "learner_vs_decode")),
        ("prefill_vs_decode.max_abs_dlogp<=0", g.Check("max_abs_dlogp", "<=", 0.0, "prefill_vs_decode")),
        ("top1_agree>=0.99", g.Check("top1_agree", ">=", 0.99, "learner_vs_decode")),
        ("clip_frac==0", g.Check("clip_frac", "==", 0.0, "learner_vs_decode")),
    ],
)
def test_parse_check(spec: str, expected: g.Check) -> None:
    assert g.parse_check(spec, "learner_vs_decode") == expected


@pytest.mark.parametrize("spec", ["k3", "k3=<1", "nosuch<=1", "k3<=abc", "bogus_pair.k3<=1", "k3<=1 2"])
def test_parse_check_rejects(spec: str) -> None:
    with pytest.raises(UsageError):
        g.parse_check(spec, "learner_vs_decode")


def test_flags_override_toml(tmp_path: Path) -> None:
    f = tmp_path / "gate.toml"
    f.write_text('[gate]\npair = "learner_vs_prefill"\nmax_k3 = 1e-3\nmax_kl = 0.1\nchecks = ["tis_frac <= 0"]\n')
    cfg = g.build_config(toml=g.load_toml(f), flag_max={"max_k3": 5e-4}, checks=["clip_frac<=0.01"])
    assert cfg.pair == "learner_vs_prefill"
    got = {(c.metric, c.threshold, c.pair) for c in cfg.checks}
    assert got == {
        ("k3", 5e-4, "learner_vs_prefill"),
        ("kl_fwd", 0.1, "learner_vs_prefill"),
        ("kl_rev", 0.1, "learner_vs_prefill"),
        ("tis_frac", 0.0, "learner_vs_prefill"),
        ("clip_frac", 0.01, "learner_vs_prefill"),
    }


@pytest.mark.parametrize(
    "text",
    ["max_k3 = 'x'\n", "max_kk3 = 1\n", "checks = 'k3<=1'\n", "max_k3 = \n", "strict = 1\n", "pair = 'nope'\n"],
)
def test_bad_toml_is_usage_error(text: str, tmp_path: Path) -> None:
    f = tmp_path / "gate.toml"
    f.write_text(text)
    with pytest.raises(UsageError):
        g.build_config(toml=g.load_toml(f))


def test_no_checks_is_usage_error() -> None:
    with pytest.raises(UsageError, match="no checks"):
        g.build_config()


# ----------------------------------------------------------------------------- evaluation


def test_nan_and_inf_never_pass_upper_bounds() -> None:
    cfg = g.build_config(checks=["mean_abs_dlogp<=1", "max_abs_dlogp<=1e9", "k3<=1"])
    res = g.evaluate(cfg, summary(mean_abs_dlogp=math.nan, max_abs_dlogp=math.inf, k3=0.0))
    assert [r.verdict for r in res] == ["fail", "fail", "pass"]
    assert g.overall(res) == "fail"


def test_full_vocab_metrics_skip_unless_strict() -> None:
    s = summary(k3=0.0)
    res = g.evaluate(g.build_config(flag_max={"max_kl": 0.1}), s)
    assert [r.verdict for r in res] == ["skip", "skip"] and g.overall(res) == "pass"
    res = g.evaluate(g.build_config(flag_max={"max_kl": 0.1}, strict=True), s)
    assert g.overall(res) == "fail"
    s["pairs"]["learner_vs_decode"]["full_vocab"] = {"kl_fwd": 0.05, "kl_rev": 0.2, "top1_agree": 1.0}
    res = g.evaluate(g.build_config(flag_max={"max_kl": 0.1}, checks=["top1_agree>=0.999"]), s)
    assert [(r.name, r.verdict) for r in res] == [("kl_fwd", "pass"), ("kl_rev", "fail"), ("top1_agree", "pass")]


def test_first_divergent_from_bisect_op_errors_or_absent(run: Path, token_run: Path, tmp_path: Path) -> None:
    s = summary(k3=0.0)
    bis = json.loads((run / "bisect.json").read_text())["first_divergent"]["bitwise"]
    res = g.evaluate(g.build_config(allow_first_divergent=False), s, run)
    assert res[0].verdict == "fail" and bis["op"] in str(res[0].value) and "bisect.json" in res[0].detail
    assert g.evaluate(g.build_config(allow_first_divergent=True), s, run)[0].verdict == "pass"
    # without bisect.json the first op whose outputs are not bitwise equal comes from op_errors.parquet
    only_ops = make_run(tmp_path / "ops", ops=True)
    res = g.evaluate(g.build_config(allow_first_divergent=False), s, only_ops)
    assert res[0].verdict == "fail" and bis["op"] in str(res[0].value) and "op_errors" in res[0].detail
    res = g.evaluate(g.build_config(allow_first_divergent=False), s, token_run)
    assert res[0].verdict == "skip" and "no op capture" in res[0].detail
    res = g.evaluate(g.build_config(allow_first_divergent=False, strict=True), s, token_run)
    assert res[0].verdict == "fail"


def test_markdown_lists_every_check_and_junit_parses(run: Path) -> None:
    cfg = g.build_config(checks=["k3<=1", "mean_abs_dlogp<=0", "kl_fwd<=1"], allow_first_divergent=False)
    res, manifest = g.run_gate(run, cfg)
    md = g.to_markdown(res, run, manifest)
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) == len(res) == 4
    for r, line in zip(res, rows, strict=True):
        assert line.startswith(f"| {r.name} | {r.pair} |") and r.verdict in line
    assert "FAIL" in md.splitlines()[0]
    root = ET.fromstring(g.to_junit(res, run, 0.5))
    suite = root.find("testsuite")
    assert suite is not None and int(suite.get("tests")) == 4
    assert int(suite.get("failures")) == 2 and int(suite.get("skipped")) == 1
    assert [c.get("name") for c in suite.findall("testcase")] == [f"{r.name} {r.threshold}" for r in res]


# ----------------------------------------------------------------------------- CLI exit codes


def test_cli_exit_codes(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mean = json.loads((run / "compare" / "summary.json").read_text())["pairs"]["learner_vs_decode"]["mean_abs_dlogp"]
    md, xml = tmp_path / "g.md", tmp_path / "g.xml"
    code, out = run_cli(capsys, "gate", run, "--max-mean-abs-dlogp", mean * 2, "--markdown", md, "--junit", xml)
    assert code == 0 and "gate passed" in out
    assert md.is_file() and ET.parse(xml).getroot().tag == "testsuites"
    code, out = run_cli(capsys, "gate", run, "--max-mean-abs-dlogp", mean / 2, "--junit", xml)
    assert code == 1 and "FAIL" in out
    assert ET.parse(xml).getroot().get("failures") == "1"
    code, out = run_cli(capsys, "gate", run, "--max-k3", "1", "--markdown", "-")
    assert code == 0 and "| k3 | learner_vs_decode |" in out
    code, out = run_cli(capsys, "gate", run, "--no-first-divergent")
    assert code == 1
    code, out = run_cli(capsys, "gate", run, "--allow-first-divergent")
    assert code == 0


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("no_checks", "no checks given"),
        ("bad_check", "unknown metric"),
        ("bad_pair", "unknown pair"),
        ("no_config", "gate config not found"),
        ("no_run", "run directory not found"),
        ("no_summary", "missing comparison summary"),
        ("corrupt_summary", "corrupt comparison summary"),
        ("newer_summary", "newer than this mismatch-probe reads"),
        ("running", "not complete"),
        ("corrupt_bisect", "corrupt bisect result"),
        ("corrupt_op_errors", "corrupt Parquet"),
    ],
)
def test_cli_input_errors_exit_2(how: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run", ops=True)
    args: list[object] = ["gate", run, "--max-k3", "1"]
    summ = run / "compare" / "summary.json"
    if how == "no_checks":
        args = ["gate", run]
    elif how == "bad_check":
        args += ["--check", "kl<=1"]
    elif how == "bad_pair":
        args += ["--pair", "learner_vs_nothing"]
    elif how == "no_config":
        args += ["--config", tmp_path / "missing.toml"]
    elif how == "no_run":
        args[1] = tmp_path / "nowhere"
    elif how == "no_summary":
        summ.unlink()
    elif how == "corrupt_summary":
        summ.write_text('{"pairs": ')
    elif how == "newer_summary":
        s = json.loads(summ.read_text())
        s["schema_version"] = 7
        summ.write_text(json.dumps(s))
    elif how == "running":
        m = json.loads((run / "manifest.json").read_text())
        m["status"] = "running"
        (run / "manifest.json").write_text(json.dumps(m))
    elif how == "corrupt_bisect":
        (run / "bisect.json").write_text("nope")
        args.append("--no-first-divergent")
    elif how == "corrupt_op_errors":
        (run / "compare" / "op_errors.parquet").write_bytes(b"not parquet")
        args.append("--no-first-divergent")
    code, out = run_cli(capsys, *args)
    assert code == 2, out
    assert message in out and "Traceback" not in out


ENGINES = ("torch", "vllm", "transformers", "triton")
BLOCK = "import sys\nfor m in {engines!r}:\n    sys.modules[m] = None  # as on a laptop without them\n"


def _no_engine_python(code: str) -> subprocess.CompletedProcess[str]:
    src = BLOCK.format(engines=ENGINES) + code
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)


def test_report_and_gate_code_needs_no_engine(token_run: Path, tmp_path: Path) -> None:
    """The report and gate code paths run with torch, vLLM, transformers and triton unimportable."""
    code = (
        "from pathlib import Path\n"
        "from mismatch_probe.analysis import gate as g\n"
        "from mismatch_probe.reports import build_report\n"
        f"run = Path({str(token_run)!r})\n"
        "res, _ = g.run_gate(run, g.build_config(checks=['k3<=1'], allow_first_divergent=False))\n"
        "g.to_junit(res, run); g.to_markdown(res, run)\n"
        f"build_report(run, Path({str(tmp_path / 'r.html')!r}))\n"
    )
    p = _no_engine_python(code)
    assert p.returncode == 0, p.stderr


def test_cli_report_and_gate_need_no_engine(token_run: Path, tmp_path: Path) -> None:
    """The same through the `mismatch-probe` entry point (every command module gets imported)."""
    code = (
        "from mismatch_probe.cli.main import main\n"
        f"main(['gate', {str(token_run)!r}, '--max-k3', '1'])\n"
        f"main(['report', {str(token_run)!r}, '--out', {str(tmp_path / 'r.html')!r}])\n"
    )
    p = _no_engine_python(code)
    assert p.returncode == 0, "the CLI needs an engine at import time:\n" + p.stderr[-3000:]


def test_schema_error_is_exit_2() -> None:
    assert SchemaError.exit_code == 2 and UsageError.exit_code == 2


def test_tolerance_first_divergent_needs_bisect(run: Path, tmp_path: Path) -> None:
    s = summary(k3=0.0)
    tol = json.loads((run / "bisect.json").read_text())["first_divergent"]["tolerance"]
    res = g.evaluate(g.build_config(allow_first_divergent=False, first_divergent_kind="tolerance"), s, run)
    assert res[0].verdict == "fail" and tol["op"] in str(res[0].value)
    only_ops = make_run(tmp_path / "ops", ops=True)
    res = g.evaluate(g.build_config(allow_first_divergent=False, first_divergent_kind="tolerance"), s, only_ops)
    assert res[0].verdict == "skip" and "bisect" in res[0].detail
