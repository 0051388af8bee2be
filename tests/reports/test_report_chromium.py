"""The report in real headless Chromium (Debian's chromium): loads with no console errors, the DOM
holds the headline metrics and every chart, a screenshot is produced. Synthetic runs here; the
real-run version of the same checks is in test_report_real_run.py."""

from __future__ import annotations

import re
from pathlib import Path

from report_chromium import CHROMIUM, load, screenshot

from mismatch_probe.reports import build_report


def test_chromium_is_installed() -> None:
    """The browser tests fail, never skip, without chromium (`bash install.sh --dev` installs it)."""
    assert CHROMIUM, "chromium not installed: `bash install.sh --dev` installs Debian's chromium (as root)"


def check_page(html: Path, charts: set[str], shot: Path) -> str:
    """Load ``html`` in Chromium and assert the acceptance points; returns the DOM."""
    page = load(html)
    assert page.console == [], f"console errors: {page.console}"
    dom = page.dom
    assert 'data-js-ok="1"' in dom, "the page script did not run to the end"
    assert not re.search(r"<body[^>]*data-js-errors", dom)
    assert re.search(r'id="headline-metrics"', dom)
    for metric in ("mean_abs_dlogp", "max_abs_dlogp", "k3", "clip_frac"):
        card = re.search(rf'data-metric="{metric}"><div class="k">[^<]+</div><div class="v">([^<]+)<', dom)
        assert card and card.group(1) not in ("-", "nan"), metric
    got = set(re.findall(r'<figure class="chart" data-chart="([a-z]+)"[^>]*><svg', dom))
    assert got == charts
    screenshot(html, shot)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    return dom


def test_detector_sees_console_errors(tmp_path: Path) -> None:
    """Sanity check of the harness: a page that throws is reported."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('boom'); undefinedFn();</script></body></html>")
    page = load(bad)
    assert any("boom" in line for line in page.console)
    assert any("Uncaught" in line for line in page.console)


def test_full_run_in_chromium(full_run: Path, tmp_path: Path) -> None:
    html, _ = build_report(full_run, tmp_path / "full.html")
    dom = check_page(html, {"drift", "scatter", "histogram", "decomposition", "ablation"}, tmp_path / "full.png")
    assert 'class="first-div"' in dom


def test_token_only_run_in_chromium(token_run: Path, tmp_path: Path) -> None:
    html, absent = build_report(token_run, tmp_path / "tok.html")
    dom = check_page(html, {"scatter", "histogram", "decomposition"}, tmp_path / "tok.png")
    for section in absent:
        assert f'data-absent="{section}"' in dom
