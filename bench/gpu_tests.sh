#!/usr/bin/env bash
# The gpu-marked tests on the GPU machine, against the installed package (CUDA vLLM bundle installed,
# `. /tmp/site/mp-env.sh` done): tests/ is copied out of the checkout, because the checkout's
# mismatch_probe/ has no kernels/ or probes/ (pyproject maps them in at install time).
#   bash bench/gpu_tests.sh [pytest args...]      (default: every gpu-marked test)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dst="${MP_GPU_TESTS:-/tmp/mp-gpu-tests}"
rm -rf "$dst" && mkdir -p "$dst" && cp -r "$root/tests" "$root/pyproject.toml" "$dst/"
cd "$dst"
if [[ $# -eq 0 ]]; then set -- -m gpu tests/gpu tests/kernels/test_strict_gpu.py tests/kernels/test_kernels_gpu.py tests/kernels/test_nvfp4_sync_gpu.py; fi
python3 -m pytest -q -p no:cacheprovider "$@"
