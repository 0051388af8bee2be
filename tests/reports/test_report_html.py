"""The HTML report on synthetic run directories: content, absent sections, input errors (exit 2)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures.synthetic import make_run

from mismatch_probe.errors import SchemaError
from mismatch_probe.reports import build_report
from mismatch_probe.reports.load import _summary_from_gaps, load_run
from mismatch_probe.run.schema import read_table, write_table

CHARTS_ALWAYS = ("scatter", "histogram", "decomposition")
CHARTS_OPS = ("drift", "ablation")


def charts(html: str) -> set[str]:
    return set(re.findall(r'<figure class="chart" data-chart="([a-z]+)"[^>]*><svg', html))


def test_token_only_run_renders_and_names_absent_sections(token_run: Path, tmp_path: Path) -> None:
    out, absent = build_report(token_run, tmp_path / "r.html")
    html = out.read_text()
    assert charts(html) == set(CHARTS_ALWAYS)
    assert set(absent) == {"Where drift starts", "Op table", "Bisect ranking"}
    for section, why in absent.items():
        assert f'data-absent="{section}"' in html
        assert why.split(":")[0] in html
    assert 'id="absent-sections"' in html
    assert 'id="worst-tokens"' in html and 'id="decomposition-table"' in html and 'id="versions"' in html


@pytest.fixture(scope="module")
def full_html(full_run: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    out, absent = build_report(full_run, tmp_path_factory.mktemp("html") / "r.html")
    assert absent == {}
    return out.read_text()


def test_full_run_has_every_section(full_run: Path, full_html: str) -> None:
    html = full_html
    assert charts(html) == set(CHARTS_ALWAYS + CHARTS_OPS)
    assert "data-absent" not in html
    for tid in ("op-table", "local-errors", "ablation-table", "first-divergent", "recipe", "auto", "weight-parity"):
        assert f'id="{tid}"' in html, tid
    # the first divergent op (from bisect.json) is marked in the op table and named in the text
    bis = json.loads((full_run / "bisect.json").read_text())
    op = bis["first_divergent"]["bitwise"]["op"]
    assert re.search(rf'<tr class="first-div"><td>{re.escape(op)}</td>', html)
    assert f"first divergent (bitwise): {op}" in html


def test_headline_metrics_and_verdict(full_run: Path, full_html: str) -> None:
    html = full_html
    summ = json.loads((full_run / "compare" / "summary.json").read_text())["pairs"]["learner_vs_decode"]
    from mismatch_probe.analysis.gate import fmt_num

    for metric in ("mean_abs_dlogp", "max_abs_dlogp", "k3", "clip_frac"):
        card = re.search(rf'data-metric="{metric}"><div class="k">[^<]+</div><div class="v">([^<]+)<', html)
        assert card and card.group(1) == fmt_num(summ[metric]), metric
    assert re.search(r'<body data-verdict="(identical|small|moderate|large|nonfinite|nodata)"', html)


def test_self_contained_no_external_resources(full_html: str) -> None:
    html = full_html
    assert "<link" not in html and "@import" not in html
    assert not re.search(r'\b(src|href)="(?!#|data:)', html), "only in-page anchors and data: URIs"
    assert "url(http" not in html
    assert "Content-Security-Policy" in html


def test_worst_tokens_show_decoded_text(full_html: str) -> None:
    html = full_html
    table = html[html.index('id="worst-tokens"') :]
    table = table[: table.index("</table>")]
    assert table.count("<tr>") == 26  # header + 25 worst tokens
    assert 'class="tok hit"' in table
    assert re.search(r'<span class="tok hit" title="id \d+, pos \d+">[a-z]+\d+</span>', table)


def test_missing_tokenizer_degrades_to_ids(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", tokenizer=False)
    data = load_run(run)
    assert data.decode is None and any("token ids" in n for n in data.notes)
    html = build_report(run)[0].read_text()
    assert re.search(r'<span class="tok hit" title="id (\d+), pos \d+">&lt;\1&gt;</span>', html)


def test_missing_summary_is_recomputed(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    expected = json.loads((run / "compare" / "summary.json").read_text())
    (run / "compare" / "summary.json").unlink()
    data = load_run(run)
    assert any("recomputed" in n for n in data.notes)
    got = data.summary["pairs"]["learner_vs_decode"]
    assert got["mean_abs_dlogp"] == pytest.approx(expected["pairs"]["learner_vs_decode"]["mean_abs_dlogp"])
    build_report(run)


def test_nonfinite_logprobs_render(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    path = run / "compare" / "token_gaps.parquet"
    df = read_table(path, "token_gaps").to_pandas()
    i = df.index[df["is_response"]][3]
    df.loc[i, "lp_learner"] = float("-inf")
    df.loc[i, "d_learner_decode"] = float("-inf")
    write_table(path, pa.Table.from_pandas(df, preserve_index=False), "token_gaps")
    (run / "compare" / "summary.json").write_text(json.dumps(_summary_from_gaps(df)))  # writes Infinity
    html = build_report(run)[0].read_text()
    assert 'data-verdict="nonfinite"' in html
    assert ">-inf<" in html


def test_html_is_escaped(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    m = json.loads((run / "manifest.json").read_text())
    m["notes"] = ["<script>alert('x')</script>"]
    (run / "manifest.json").write_text(json.dumps(m))
    html = build_report(run)[0].read_text()
    assert "<script>alert" not in html and "&lt;script&gt;alert" in html


def test_svg_ids_are_unique_across_charts(full_html: str) -> None:
    html = full_html
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids))


def test_cli_report_writes_default_path(cli, tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    r = cli("report", run)
    assert r.code == 0, r.err
    assert (run / "report.html").is_file()
    r = cli("report", run, "--out", tmp_path)  # a directory: report.html inside it
    assert r.code == 0 and (tmp_path / "report.html").is_file()
    text = r.out + r.err  # Rich may resolve the stream once
    assert "absent: Where drift starts" in text and "wrote" in text


# ----------------------------------------------------------------------------- input errors: exit 2


def _broken(tmp_path: Path, how: str) -> Path:
    run = make_run(tmp_path / "run", ops=True, bisect=True)
    gaps = run / "compare" / "token_gaps.parquet"
    if how == "no_run":
        shutil.rmtree(run)
    elif how == "no_manifest":
        (run / "manifest.json").unlink()
    elif how == "no_gaps":
        gaps.unlink()
    elif how == "corrupt_gaps":
        gaps.write_bytes(gaps.read_bytes()[:200] + b"garbage")
    elif how == "newer_gaps":
        t = pq.read_table(gaps)
        meta = dict(t.schema.metadata)
        meta[b"mismatch_probe.schema_version"] = b"99"
        pq.write_table(t.replace_schema_metadata(meta), gaps)
    elif how == "corrupt_summary":
        (run / "compare" / "summary.json").write_text("{not json")
    elif how == "newer_manifest":
        m = json.loads((run / "manifest.json").read_text())
        m["schema_version"] = 99
        (run / "manifest.json").write_text(json.dumps(m))
    elif how == "corrupt_op_errors":
        (run / "compare" / "op_errors.parquet").write_bytes(b"PAR1 not really")
    elif how == "corrupt_bisect":
        (run / "bisect.json").write_text("[1, 2")
    return run


ERRORS = {
    "no_run": "run directory not found",
    "no_manifest": "missing run manifest",
    "no_gaps": "missing file",
    "corrupt_gaps": "corrupt Parquet",
    "newer_gaps": "newer than this mismatch-probe reads",
    "corrupt_summary": "corrupt comparison summary",
    "newer_manifest": "newer than this mismatch-probe reads",
    "corrupt_op_errors": "corrupt Parquet",
    "corrupt_bisect": "corrupt bisect result",
}


@pytest.mark.parametrize("how", sorted(ERRORS))
def test_bad_inputs_exit_2_with_clear_error(how: str, tmp_path: Path, cli) -> None:
    run = _broken(tmp_path, how)
    with pytest.raises(SchemaError, match=ERRORS[how]):
        load_run(run)
    r = cli("report", run, "--out", tmp_path / "r.html")
    assert r.code == 2
    assert "error:" in r.err and ERRORS[how] in " ".join(r.err.split())
    assert "Traceback" not in r.err
    assert not (tmp_path / "r.html").exists()


def test_report_with_gate_config(full_run: Path, tmp_path: Path, cli) -> None:
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[gate]\nmax_k3 = 1.0\nmax_mean_abs_dlogp = 0.0\n")
    r = cli("report", full_run, "--out", tmp_path / "r.html", "--gate-config", cfg)
    assert r.code == 0, r.out + r.err
    html = (tmp_path / "r.html").read_text()
    assert 'data-verdict="fail"' in html and 'id="gate-table"' in html
    assert "gate fail: 1 of 2 checks failed" in html


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize(
    ("kwargs", "verdict"),
    [
        ({"scale": 0.0, "ops": True}, "identical"),  # what strict alignment aims for: every gap exactly 0
        ({"seq_len": 16, "prompt_len": 16}, "nodata"),  # no response tokens at all
        ({"n_seq": 1, "seq_len": 17, "n_layers": 1, "ops": True, "bisect": True}, None),  # one token
    ],
)
def test_degenerate_runs_render_without_warnings(kwargs: dict, verdict: str | None, tmp_path: Path) -> None:
    html = build_report(make_run(tmp_path / "run", **kwargs))[0].read_text()
    assert charts(html) >= set(CHARTS_ALWAYS)
    if verdict:
        assert f'data-verdict="{verdict}"' in html


def test_bisect_as_written_by_bisect_command(tmp_path: Path) -> None:
    """bisect.json with NaN/None local errors, extra columns, ops not replayed and no ablation yet."""
    run = make_run(tmp_path / "run", ops=True, bisect=True)
    b = json.loads((run / "bisect.json").read_text())
    b["local_errors"][5]["local_error"] = float("nan")
    b["local_errors"][6]["local_error"] = None
    for d in b["local_errors"]:
        d.update(reverse_local_error=1e-3, total_error=2e-3, local_bitwise_frac=0.5)
    b.update(ablation=[], ablation_note="ablation needs the alignment recipes; not run", not_replayed=["embed", "0.out"])
    (run / "bisect.json").write_text(json.dumps(b))  # NaN as the json module writes it
    html = build_report(run)[0].read_text()
    assert "reverse local" in html and "total error" in html and "local bitwise-equal" in html
    assert 'data-absent="Ablation ranking">Section absent: ablation needs the alignment recipes' in html
    assert "Not replayed: embed, 0.out" in html
    assert charts(html) == set(CHARTS_ALWAYS) | {"drift"}


def test_op_capture_files_are_summarized_not_read(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", n_seq=2, seq_len=20, ops=True, full_ops=True)
    rank = run / "learner" / "ops_by_rank" / "rank=1"
    rank.mkdir(parents=True)
    (rank / "part-0.parquet").write_bytes(b"not parquet")  # a broken capture file does not block the report
    html = build_report(run)[0].read_text()
    assert re.search(r"<li>sampler: [\d,]+ rows, [\d.]+ MB</li>", html)
    assert "learner op capture not summarized: corrupt run: " in html and "corrupt Parquet" in html
    assert 'id="op-filter"' in html
