"""The local-vs-inherited chart at real depth: a synthetic 60-layer run (902 ops) gets charts
aggregated by layer and op kind and the top contributors instead of 1800 bars."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fixtures.synthetic import make_run

from mismatch_probe.reports import build_report
from mismatch_probe.reports.depth import kind_group, op_kind


def _figure(html: str, name: str) -> str:
    m = re.search(rf'<figure class="chart" data-chart="{name}".*?</figure>', html, re.S)
    assert m, f"no figure {name}"
    return m.group(0)


def _bars(svg: str) -> int:
    return len(re.findall(r'<g id="patch_\d+"', svg))


@pytest.fixture(scope="module")
def deep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("deep") / "run60", ops=True, bisect=True, n_layers=60, n_seq=2, seq_len=24)


def test_sixty_layers_aggregated(deep_run: Path, tmp_path: Path) -> None:
    html = build_report(deep_run, tmp_path / "r.html")[0].read_text()
    local = json.loads((deep_run / "bisect.json").read_text())["local_errors"]
    assert len(local) == 60 * 15 + 2
    drift = _figure(html, "drift")
    assert "Local vs inherited error (input substitution)" not in drift  # no per-op bar panel
    by_layer = _figure(html, "local-by-layer")
    assert _bars(by_layer) <= 60 + 10  # one bar per layer (plus legend/frame patches), not 2 per op
    assert "L0" in by_layer and "L57" in by_layer and "attn.core" in by_layer and "mlp.down" in by_layer
    top = _figure(html, "local-top")
    want = [d["op"] for d in sorted(local, key=lambda d: -d["local_error"])[:15]]
    labels = [t for t in re.findall(r"<text[^>]*>([^<]*)</text>", top) if re.fullmatch(r"\d+\.[a-z_.]+", t)]
    assert labels == want[::-1]  # the 15 largest local errors, named, largest at the top
    assert len(html) < 3_000_000


def test_shallow_run_keeps_per_op_bars(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run4", ops=True, bisect=True, n_layers=4)
    html = build_report(run, tmp_path / "r.html")[0].read_text()
    assert "Local vs inherited error (input substitution)" in _figure(html, "drift")
    assert 'data-chart="local-by-layer"' not in html


def test_op_kinds_and_groups() -> None:
    assert op_kind("12.attn.q") == "attn.q" and op_kind("final_norm") == "final_norm"
    assert [kind_group(k) for k in ("input_norm", "attn.k_norm", "attn.core", "mlp.down", "moe.out", "out", "logits")] == [
        "norm", "norm", "attention", "mlp / moe", "mlp / moe", "residual", "other",
    ]  # fmt: skip
