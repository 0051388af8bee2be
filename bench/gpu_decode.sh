#!/usr/bin/env bash
# The H200 round of BENCHMARKS 'NVFP4 kernels' (issue #13), one call: the standalone decode lab
# (bench/decode_lab.cu: bit equality of the native decode variants, their timings, the streaming and
# read ceilings, the mma.sync chain latency, pipe throughputs), then bench/bench_kernels.py (every
# path, the issue's table) with the native decode variant that was fastest at M = 16 in the lab (all
# variants give the same bits; 0, the cp.async kernel, if any lab comparison differed). OUT=dir.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/decode_lab bench/decode_lab.cu >"$out/lab_build.txt" 2>&1
timeout 120 /tmp/decode_lab >"$out/lab.log" 2>&1
cat "$out/lab.log"
v=$(python3 - "$out/lab.log" <<'PY'
import re
import sys

text = open(sys.argv[1]).read()
best = {}
for line in text.splitlines():
    m = re.match(r".*\(v(\d+)\)\s+16\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+(IDENTICAL|\(reference\))", line)
    if m:
        best[int(m.group(1))] = float(m.group(2))
print(min(best, key=best.get) if best and "DIFFER" not in text and "LAB_DONE" in text else 0)
PY
)
echo "native decode variant for the run: $v"
P=$(bash bench/gpu_shim.sh /tmp/mp) && export PYTHONPATH=$P:$PWD/bench
PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-480}" python3 bench/bench_kernels.py --native-variant "$v" --out "$out" \
  >"$out/bench.log" 2>&1
echo "bench_kernels rc=$?"
