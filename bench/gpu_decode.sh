#!/usr/bin/env bash
# The H200 round of BENCHMARKS 'NVFP4 kernels' (issue #13), one call. LAB=1 first builds and runs the
# standalone decode lab (bench/decode_lab.cu: bit equality of the native decode variants with the
# shipped cp.async kernel, their timings, the streaming / read ceilings, the mma.sync chain latency,
# pipe throughputs). Then bench/bench_kernels.py with the native decode default VARIANT (15: wgmma, core-matrix
# token operand) and per-variant rows / checks / sweeps for VARIANTS: the named checks, the quantizer,
# N = K = 8192 at M = 1, 16, 64, 8192 (cuBLAS, FP8, ours), the row sweep. OUT=dir; ONLY= sections.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
if [ "${LAB:-0}" = 1 ]; then
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/decode_lab bench/decode_lab.cu >"$out/lab_build.txt" 2>&1
  timeout 120 /tmp/decode_lab >"$out/lab.log" 2>&1
  tail -n 25 "$out/lab.log"
fi
P=$(bash bench/gpu_shim.sh /tmp/mp) && export PYTHONPATH=$P:$PWD/bench
PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-480}" python3 bench/bench_kernels.py --native-variant "${VARIANT:-15}" \
  --variants "${VARIANTS:-14,15}" --triton-decode default --only "${ONLY:-checks,quantize,linear,sweep}" --out "$out" ${BENCH_ARGS:-} \
  >"$out/bench.log" 2>&1
echo "bench_kernels rc=$?"
grep -E "^\[check\] (fail|err)" "$out/bench.log" | cut -c1-300
sed -n '/^| workload/,$p' "$out/bench.log" | cut -c1-330
