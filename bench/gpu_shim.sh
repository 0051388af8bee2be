#!/usr/bin/env bash
# Make `import mismatch_probe.kernels` work without `pip install -e .` (e.g. on the GPU machine):
# builds $1 (default /tmp/mp_pkg) with mismatch_probe/*.py (errors, versions, settings, ...) and families/, kernels/ as
# mismatch_probe/kernels and probes/ as mismatch_probe/probes, then prints the PYTHONPATH to use.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dst="${1:-/tmp/mp_pkg}"
rm -rf "$dst" && mkdir -p "$dst/mismatch_probe"
cp "$root"/mismatch_probe/*.py "$dst/mismatch_probe/"
# the model families (the HF patch's op-name registry), for the recipes' forward
[ -d "$root/mismatch_probe/families" ] && cp -r "$root/mismatch_probe/families" "$dst/mismatch_probe/families"
cp -r "$root/kernels" "$dst/mismatch_probe/kernels"
# the HF probe (recipes' patch) for bench_kernels.py's forward section; the probes package's own
# imports are lazy, so the shim needs nothing else
[ -d "$root/probes" ] && cp -r "$root/probes" "$dst/mismatch_probe/probes"
echo "$dst"
