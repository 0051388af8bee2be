#!/usr/bin/env bash
# Make `import mismatch_probe.kernels` work without `pip install -e .` (e.g. on the GPU machine):
# builds $1 (default /tmp/mp_pkg) with mismatch_probe/{__init__,errors}.py and kernels/ as
# mismatch_probe/kernels, then prints the PYTHONPATH to use.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dst="${1:-/tmp/mp_pkg}"
rm -rf "$dst" && mkdir -p "$dst/mismatch_probe"
cp "$root"/mismatch_probe/__init__.py "$root"/mismatch_probe/errors.py "$dst/mismatch_probe/"
cp -r "$root/kernels" "$dst/mismatch_probe/kernels"
echo "$dst"
