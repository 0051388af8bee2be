#!/usr/bin/env bash
# The H200 round of BENCHMARKS.md "Op capture (issue #11)". Builds an importable package under $PKG
# (the repo's package-dir layout, no `pip install` needed on the GPU machine), then runs from /tmp:
#   1. the CUDA digest/stats check against numpy (9 dtypes, digest-only kernel too),
#   2. the Qwen3-0.6B-shaped forwards with the cost-attribution variants (modes interleaved, 5 repeats;
#      see bench_capture.py time_modes) and a cProfile of one digest score(),
#   3. the Qwen3-8B-shaped forwards (3 repeats).
# The 15:40 round also ran --kernel-bench (the kernel alone) and full-window; add them with MODES= / by hand.
# 18:10 round (fewer launches): SHAPES=qwen3-0.6b MODES=off,digest,stats,digest@keep,... EXTRA=--kernel-bench;
#   final round: MODES=off,digest,stats REPEATS=9 (both shapes). See BENCHMARKS.md, "launches round".
# Raw JSON and logs go to $OUT. Round 1 of 2026-12-01 (the kernel alone per block/warps, writer process vs
# thread, profiler table) was: bench_capture.py --device cuda --shapes qwen3-0.6b,qwen3-8b --repeats 3 --mbs 3
#   --modes off,digest,stats,full-window,digest@thread,stats@thread --kernel-bench --kernel-auto --profile
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pkg="${PKG:-/tmp/mp_capture_pkg}"
rm -rf "$pkg" && mkdir -p "$pkg"
cp -r "$root/mismatch_probe" "$pkg/mismatch_probe"
for sub in probes kernels reports; do cp -r "$root/$sub" "$pkg/mismatch_probe/$sub"; done
export PYTHONPATH="$pkg" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
cd /tmp  # not a folder with a partial mismatch_probe/ (the writer process imports the package)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton, transformers, pyarrow, os; print(torch.__version__, triton.__version__, transformers.__version__, pyarrow.__version__, 'cpus', os.cpu_count())" | tee -a "$OUT/gpu.txt"
# one process, both shapes (one start, one digest check): 0.6B with the variants and a cProfile of
# one digest score() after its timed rounds, then 8B (fewer repeats: each capture round writes ~6-8 M rows)
# SHAPES= picks the shapes, EXTRA= adds arguments (e.g. --kernel-bench)
python "$root/bench/bench_capture.py" --device cuda --shapes "${SHAPES:-qwen3-0.6b,qwen3-8b}" --repeats "${REPEATS:-5}" \
  --shape-repeats "qwen3-8b=${REPEATS_8B:-3}" --mbs 3 --modes "${MODES:-off,digest,stats,digest@hooks,digest@nolaunch}" \
  --variant-shapes qwen3-0.6b --cprofile digest ${EXTRA:-} --out "$OUT/h200_capture.json" 2>&1 | tee "$OUT/h200_capture.log"
