"""The report's RL-framework sections: overview, --convention view, bad names."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mismatch_probe.reports import build_report


def test_overview_and_one_frameworks_view(token_run: Path, tmp_path: Path, cli) -> None:
    out, _ = build_report(token_run, tmp_path / "all.html")
    html = out.read_text()
    assert 'id="convention-overview"' in html and "verl: rollout_corr/k3_kl" in html
    assert "nemo_rl: train/token_mult_prob_error" in html
    assert 'id="training-run"' not in html  # not a --rollouts run: no section
    r = cli("report", token_run, "--out", tmp_path / "verl.html", "--convention", "verl")
    assert r.code == 0, r.err
    html = (tmp_path / "verl.html").read_text()
    summ = json.loads((token_run / "compare/summary.json").read_text())
    conv = summ["pairs"]["learner_vs_decode"]["conventions"]["verl"]
    rows = re.findall(r"<tr><td>rollout_corr/([a-z0-9_]+)</td>", html)
    assert sorted(rows) == sorted(conv) and len(rows) > 40
    assert "mis_kl" not in html.split('id="convention-table"')[1].split("</table>")[0]
    r = cli("report", token_run, "--out", tmp_path / "slime.html", "--convention", "slime")
    assert r.code == 0 and "train/mis_kl" in (tmp_path / "slime.html").read_text()


def test_unknown_convention_exit_2(token_run: Path, tmp_path: Path, cli) -> None:
    r = cli("report", token_run, "--out", tmp_path / "x.html", "--convention", "trl")
    assert r.code == 2 and "--convention must be one of verl, slime, nemo_rl" in r.err
    assert not (tmp_path / "x.html").exists()
