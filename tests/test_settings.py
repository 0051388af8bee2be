"""The MISMATCH_PROBE_* environment variables: declared once in mismatch_probe/settings.py, read
nowhere else, validated with a one-line error, listed in the README (no engine, < 1 s)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mismatch_probe import settings
from mismatch_probe.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
SOURCES = [f for d in ("mismatch_probe", "probes", "kernels", "reports") for f in sorted((REPO / d).rglob("*.py"))]
NAME = re.compile(r"MISMATCH_PROBE_[A-Z0-9_]*[A-Z0-9]")


def test_every_variable_in_the_source_is_declared():
    extra = [*sorted((REPO / "bench").rglob("*.py")), *sorted((REPO / "tests").rglob("*.py")),
             *sorted(REPO.glob("*.md"))]
    used = {m for f in [*SOURCES, *extra] for m in NAME.findall(f.read_text())}
    assert used, "the grep found nothing: wrong folders?"
    assert used <= set(settings.SETTINGS), sorted(used - set(settings.SETTINGS))


def test_only_settings_reads_the_environment_for_them():
    bad = []
    for f in SOURCES:
        if f.name == "settings.py" and f.parent.name == "mismatch_probe":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            ours = "MISMATCH_PROBE_" in line or re.search(r"\b(ENV|FAULT_ENV)\b", line)
            if ours and re.search(r"os\.environ|getenv\(", line):
                bad.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, bad


def test_defaults_are_unchanged(monkeypatch):
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert settings.get("MISMATCH_PROBE_CACHE") == Path("/home/someone/.cache/mismatch-probe")
    assert settings.get("MISMATCH_PROBE_NATIVE_CACHE") == Path("/home/someone/.cache/mismatch-probe/native")
    assert settings.get("MISMATCH_PROBE_NATIVE") is True
    assert settings.get("MISMATCH_PROBE_NATIVE_VERBOSE") is False
    assert settings.get("MISMATCH_PROBE_CAPTURE_WRITER") == "auto"
    assert settings.get("MISMATCH_PROBE_CAPTURE_STREAM") == "side"
    assert settings.get("MISMATCH_PROBE_DIGEST_BLOCK") == 256
    assert settings.get("MISMATCH_PROBE_DIGEST_WARPS") == 1
    assert settings.get("MISMATCH_PROBE_TRITON_MODE") == "auto"
    assert settings.get("MISMATCH_PROBE_RECIPE") is None
    assert settings.get("MISMATCH_PROBE_TEST_FSDP_FAULT") is None
    assert settings.non_default() == {}


def test_values_are_parsed_and_the_native_cache_follows_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv("MISMATCH_PROBE_NATIVE_CACHE", raising=False)
    monkeypatch.setenv("MISMATCH_PROBE_CACHE", str(tmp_path))
    monkeypatch.setenv("MISMATCH_PROBE_NATIVE", "0")
    monkeypatch.setenv("MISMATCH_PROBE_DIGEST_BLOCK", "512")
    assert settings.get("MISMATCH_PROBE_NATIVE_CACHE") == tmp_path / "native"
    assert settings.get("MISMATCH_PROBE_NATIVE") is False
    assert settings.get("MISMATCH_PROBE_DIGEST_BLOCK") == 512
    monkeypatch.setenv("MISMATCH_PROBE_NATIVE_CACHE", str(tmp_path / "elsewhere"))
    assert settings.get("MISMATCH_PROBE_NATIVE_CACHE") == tmp_path / "elsewhere"
    got = settings.non_default(kinds=("user", "tuning"))
    assert got["MISMATCH_PROBE_NATIVE"] == "0" and got["MISMATCH_PROBE_DIGEST_BLOCK"] == "512"
    monkeypatch.setenv("MISMATCH_PROBE_TEST_FSDP_FAULT", "rank:0:after_batches:1:raise")
    assert "MISMATCH_PROBE_TEST_FSDP_FAULT" not in settings.non_default(kinds=("user", "tuning"))


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("MISMATCH_PROBE_CAPTURE_WRITER", "threads", "auto, process or thread"),
        ("MISMATCH_PROBE_CAPTURE_STREAM", "aux", "side, side-equal or main"),
        ("MISMATCH_PROBE_NATIVE", "false", "0 or 1"),
        ("MISMATCH_PROBE_DIGEST_BLOCK", "300", "a power of two in 16..16384"),
        ("MISMATCH_PROBE_DIGEST_WARPS", "two", "a power of two in 1..32"),
        ("MISMATCH_PROBE_TRITON_MODE", "aot", "auto or jit"),
    ],
)
def test_a_bad_value_is_a_one_line_error_naming_the_variable(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as e:
        settings.get(name)
    msg = str(e.value)
    assert "\n" not in msg and name in msg and repr(value) in msg and allowed in msg
    with pytest.raises(UsageError):
        settings.validate_all()


def test_the_readme_table_lists_exactly_the_user_and_tuning_variables():
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- settings-table:begin -->\n", 1)[1].split("<!-- settings-table:end -->", 1)[0]
    assert block == settings.markdown_table(), "regenerate: python -c 'from mismatch_probe import settings; " \
        "print(settings.markdown_table())'"
    listed = set(re.findall(r"^\| `(MISMATCH_PROBE_\w+)`", block, re.M))
    assert listed == {n for n, s in settings.SETTINGS.items() if s.kind in ("user", "tuning")}


def test_the_run_manifest_records_the_user_and_tuning_settings_set(monkeypatch, tmp_path):
    from mismatch_probe.run.rundir import RunWriter

    monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_WRITER", "thread")
    monkeypatch.setenv("MISMATCH_PROBE_DIGEST_WARPS", "1")  # set to its default: not recorded
    monkeypatch.setenv("MISMATCH_PROBE_RECIPE", "strict")  # internal: not recorded
    with RunWriter(tmp_path / "run") as run:
        got = dict(run.manifest["settings"])
        run.finish()
    assert got["MISMATCH_PROBE_CAPTURE_WRITER"] == "thread"
    assert "MISMATCH_PROBE_DIGEST_WARPS" not in got and "MISMATCH_PROBE_RECIPE" not in got
    assert (tmp_path / "run" / "manifest.json").read_text().count("MISMATCH_PROBE_CAPTURE_WRITER") == 1
