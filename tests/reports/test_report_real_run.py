"""Acceptance on a real run (tiny model, real vLLM sampler, real HF learner): the report in headless
Chromium, and the gate's exit codes, JUnit XML and Markdown.

Uses the session fixture ``real_run`` from tests/conftest.py (``compare --model tiny-llama`` with the
default capture, so its op tables exist: a missing one fails, never skips)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from report_chromium import load, screenshot

from mismatch_probe.analysis.gate import fmt_num
from mismatch_probe.reports import build_report

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run_dir(real_run: Path) -> Path:
    assert (real_run / "compare" / "op_errors.parquet").exists(), "capture is on by default: op_errors.parquet missing"
    return real_run


def _summary(run: Path) -> dict:
    return json.loads((run / "compare" / "summary.json").read_text())["pairs"]["learner_vs_decode"]


def test_real_run_report_in_chromium(run_dir: Path, tmp_path: Path) -> None:
    html, absent = build_report(run_dir, tmp_path / "report.html")
    assert html.stat().st_size < 5_000_000
    page = load(html)
    assert page.console == [], f"console errors: {page.console}"
    dom = page.dom
    assert 'data-js-ok="1"' in dom and not re.search(r"<body[^>]*data-js-errors", dom)
    summ = _summary(run_dir)
    for metric in ("mean_abs_dlogp", "max_abs_dlogp", "k3", "clip_frac"):
        card = re.search(rf'data-metric="{metric}"><div class="k">[^<]+</div><div class="v">([^<]+)<', dom)
        assert card and card.group(1) == fmt_num(summ[metric]), metric
    expected = {"scatter", "histogram", "decomposition", "drift"}
    bisect = run_dir / "bisect.json"
    if bisect.exists() and json.loads(bisect.read_text()).get("ablation"):
        expected.add("ablation")
    assert set(re.findall(r'<figure class="chart" data-chart="([a-z]+)"[^>]*><svg', dom)) == expected
    for section in absent:  # a run without op capture says which sections are absent and why
        assert f'data-absent="{section}"' in dom
    # worst tokens carry decoded text when the model folder's tokenizer is there
    model_dir = json.loads((run_dir / "manifest.json").read_text())["config"].get("model_dir")
    if model_dir and (Path(model_dir) / "tokenizer.json").exists():
        hits = re.findall(r'<span class="tok hit" title="id (\d+), pos \d+">([^<]*)</span>', dom)
        assert hits and any(text != f"&lt;{tid}&gt;" for tid, text in hits)
    shot = screenshot(html, tmp_path / "report.png")
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000


def _gate(cli, run: Path, tmp_path: Path, *args: str):  # cli: the conftest fixture
    """``mismatch-probe gate`` in-process (exit code as the shell sees it) with Markdown and JUnit outputs."""
    md, xml = tmp_path / "gate.md", tmp_path / "gate.xml"
    r = cli("gate", run, "--markdown", md, "--junit", xml, *args)
    return r, md, xml


def _check_junit(xml: Path, n_checks: int, n_fail: int) -> None:
    root = ET.parse(xml).getroot()
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    assert len(cases) == n_checks == int(suite.get("tests")) == int(root.get("tests"))
    assert int(suite.get("failures")) == n_fail == sum(c.find("failure") is not None for c in cases)
    assert int(suite.get("skipped")) == sum(c.find("skipped") is not None for c in cases)
    assert int(suite.get("errors")) == 0
    float(suite.get("time"))
    for c in cases:
        assert c.get("name") and c.get("classname")
        f = c.find("failure")
        if f is not None:
            assert f.get("message")


def test_real_run_gate_passes_and_fails(run_dir: Path, tmp_path: Path, cli) -> None:
    m = _summary(run_dir)
    mean, mx = m["mean_abs_dlogp"], m["max_abs_dlogp"]
    loose = ["--max-mean-abs-dlogp", repr(mean * 2 + 1e-9), "--max-max-abs-dlogp", repr(mx * 2 + 1e-9),
             "--max-k3", "1", "--max-clip-frac", "0.5", "--check", "pearson_prob>=0.5"]  # fmt: skip
    p, md, xml = _gate(cli, run_dir, tmp_path, *loose)
    assert p.code == 0, p.out + p.err
    _check_junit(xml, 5, 0)
    text = md.read_text()
    for name in ("mean_abs_dlogp", "max_abs_dlogp", "k3", "clip_frac", "pearson_prob"):
        assert re.search(rf"^\| {name} \| learner_vs_decode \| .* pass \|", text, re.M), name
    assert "PASS" in text

    tight = repr(mean / 2) if mean > 0 else "-1"
    p, md, xml = _gate(cli, run_dir, tmp_path, "--max-mean-abs-dlogp", tight, "--max-k3", "1")
    assert p.code == 1, p.out + p.err
    assert "FAIL" in p.out
    _check_junit(xml, 2, 1)
    text = md.read_text()
    assert re.search(r"^\| mean_abs_dlogp \| .* fail \| threshold exceeded \|$", text, re.M)
    assert re.search(r"^\| k3 \| .* pass \|", text, re.M)


def test_real_run_gate_max_kl(run_dir: Path, tmp_path: Path, cli) -> None:
    """--max-kl bounds the top-K KL that compare records by default (capture on: --topk 20)."""
    fv = json.loads((run_dir / "compare" / "summary.json").read_text())["pairs"]["learner_vs_decode"]["full_vocab"]
    kl = max(fv["kl_fwd"], fv["kl_rev"])
    assert kl > 0
    p, md, xml = _gate(cli, run_dir, tmp_path, "--max-kl", repr(kl * 2))
    assert p.code == 0, p.out + p.err
    _check_junit(xml, 2, 0)
    for name in ("kl_fwd", "kl_rev"):
        assert re.search(rf"^\| {name} \| learner_vs_decode \| .* pass \|", md.read_text(), re.M), name
    p, md, xml = _gate(cli, run_dir, tmp_path, "--max-kl", repr(kl / 2))
    assert p.code == 1, p.out + p.err


def test_real_run_gate_from_toml(run_dir: Path, tmp_path: Path, cli) -> None:
    cfg = tmp_path / "gate.toml"
    cfg.write_text('[gate]\nmax_k3 = 1.0\nchecks = ["prefill_vs_decode.max_abs_dlogp <= 10"]\n')
    p, md, xml = _gate(cli, run_dir, tmp_path, "--config", str(cfg))
    assert p.code == 0, p.out + p.err
    _check_junit(xml, 2, 0)
    p, _, _ = _gate(cli, run_dir, tmp_path, "--config", str(cfg), "--max-k3", "-1")  # flags win over the file
    assert p.code == 1


def test_real_run_first_divergent_op(run_dir: Path, tmp_path: Path, cli) -> None:
    ope = run_dir / "compare" / "op_errors.parquet"
    import pyarrow.parquet as pq

    diverges = min(pq.read_table(ope, columns=["bitwise_equal_frac"]).column(0).to_pylist()) < 1.0
    p, md, xml = _gate(cli, run_dir, tmp_path, "--no-first-divergent")
    assert p.code == (1 if diverges else 0), p.out + p.err
    _check_junit(xml, 1, int(diverges))
    assert "first_divergent_op (bitwise)" in md.read_text()
    p, _, _ = _gate(cli, run_dir, tmp_path, "--allow-first-divergent")
    assert p.code == 0
