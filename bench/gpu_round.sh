#!/usr/bin/env bash
# One round of GPU checks on the lent H200, in stages that each fit one 10-minute command (run from the
# checkout after `. /tmp/site/mp-env.sh`; stages share /tmp/gs, so run them on one warm machine, in order).
#   bash bench/gpu_round.sh tests   # tests/gpu (8 tests, ~8 min: the CLI against CUDA vLLM)        (#26, #27)
#   bash bench/gpu_round.sh kernels # the kernel gpu tests; tiny-llama / tiny-qwen3-moe / tiny-gemma3 strict (#26)
#   bash bench/gpu_round.sh bisect  # the 0.6B engine run, nvfp4-per-token in graphs, bisect with ablation (#26)
#   bash bench/gpu_round.sh speed   # sampler / learner speed, 0.6B (#26) and the 8B shape (#28)
#   bash bench/gpu_round.sh capture # the whole cost of op capture (#27), then the NVFP4 kernels (#28)
#   bash bench/gpu_round.sh profile # where an 8B decode step goes, bf16 vs nvfp4-per-token, 16 and 64 seqs (#28)
#   bash bench/gpu_round.sh speed8b # #28 pt 1: vLLM generate on the 8B shape, bf16 vs nvfp4-per-token (+ A/B), --mem 0.85, ~8 min
#   bash bench/gpu_round.sh q8b     # the 8B shape's nvfp4-per-token logprobs vs the learner's, sampler in graphs (#28)
#   bash bench/gpu_round.sh sync    # the weight sync, Triton and native kernels: bitwise and vs a D2D copy (#28 pt 4)
#   bash bench/gpu_round.sh shapes  # the native decode GEMM at the 8B layer shapes, per variant and M (#28 pt 1)
#   bash bench/gpu_round.sh cap06   # #27 pt 1 on the 0.6B shape alone: capture modes and chunk sizes, ~2 min
#   bash bench/gpu_round.sh graphs  # #28 pt 3: the graphed learner's GPU test and its forward, bf16 vs nvfp4-per-token, ~3 min
#   bash bench/gpu_round.sh producers # #28 pt 1: the fused producers' GPU bit tests, then their time (chunked vs a program per row), ~2 min
#   bash bench/gpu_round.sh learner # #28 pt 3: HF forward bf16 vs nvfp4-per-token, 0.6B and 8B, a profile of each, both in CUDA graphs, ~3 min
# Logs and JSON go to $OUT (the device tool's output folder) or /tmp/gs-out; each stage prints its tables last.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp/gs-out}"
mkdir -p "$out"
gs=/tmp/gs
left() { echo $(( ${1} - SECONDS )); }
case "${1:?stage: tests, kernels, bisect, speed, speed8b, capture, profile, q8b, sync, shapes, cap06, graphs, producers or learner}" in
  tests)
    timeout "$(left 585)" bash "$here/gpu_tests.sh" -m gpu tests/gpu -rA > "$out/tests.log" 2>&1
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -15
    ;;
  kernels)
    bash "$here/gpu_tests.sh" -m gpu tests/kernels/test_strict_gpu.py tests/kernels/test_kernels_gpu.py tests/kernels/test_nvfp4_sync_gpu.py > "$out/kernels.log" 2>&1
    python "$here/gpu_stack.py" --out "$gs" --only tiny --tiny-models tiny-llama,tiny-qwen3-moe,tiny-gemma3 \
      --tag kernels --budget "$(left 575)" > "$out/stack_kernels.log" 2>&1
    cp "$gs/kernels.json" "$out/" 2>/dev/null
    grep -E "passed|failed|error" "$out/kernels.log" | tail -15
    sed -n '/^| step/,$p' "$out/stack_kernels.log"
    ;;
  bisect)
    python "$here/gpu_stack.py" --out "$gs" --only q06b,bisect --q06b engine,nvfp4-graphs --tag bisect \
      --budget 575 > "$out/stack_bisect.log" 2>&1
    cp "$gs/bisect.json" "$out/" 2>/dev/null
    sed -n '/^| step/,$p' "$out/stack_bisect.log"
    ;;
  speed)  # STEPS: gpu_stack steps (default speed,speed8b)
    python "$here/gpu_stack.py" --out "$gs" --only "${STEPS:-speed,speed8b}" --tag speed --budget 575 > "$out/stack_speed.log" 2>&1
    cp "$gs/speed.json" "$out/" 2>/dev/null
    sed -n '/^| step/,$p' "$out/stack_speed.log"
    ;;
  profile)  # SEQS: batch sizes (default 16 64); RECIPES: default engine,nvfp4-per-token
    for n in ${SEQS:-16 64}; do
      timeout "$(left 585)" python "$here/gpu_decode_profile.py" --out "$out/profile$n" --seqs "$n" \
        --recipes "${RECIPES:-engine,nvfp4-per-token}" --timeout 200 > "$out/profile$n.log" 2>&1
      sed -n '/^| recipe/,$p' "$out/profile$n.log"
    done
    ;;
  speed8b)  # RECIPES8B: --speed8b-recipes (default: bf16, nvfp4, the shards' reduce A/B); first on a fresh machine
    python "$here/gpu_stack.py" --out "$gs" --only speed8b --mem 0.85 --tag speed8b --budget 560 \
      --speed8b-recipes "${RECIPES8B:-engine,nvfp4-per-token,nvfp4-per-token@reduce-ab}" > "$out/speed8b.log" 2>&1
    cp "$gs/speed8b.json" "$out/" 2>/dev/null
    sed -n '/^| step/,$p' "$out/speed8b.log"
    ;;
  q8b)  # 0.85 of the card: the NVFP4 layouts need the room (docs/gpu.md); the learner loads after the sampler
    python "$here/gpu_stack.py" --out "$gs" --only q8b --mem 0.85 --tag q8b --budget 560 > "$out/q8b.log" 2>&1
    cp "$gs/q8b.json" "$out/" 2>/dev/null
    sed -n '/^| step/,$p' "$out/q8b.log"
    ;;
  sync)  # the first call on a fresh machine builds the native extension (csrc/ changed): ~2 min of it
    python "$here/gpu_nvfp4_check.py" --out "$out/nvfp4" --only b --budget "$(left 585)" > "$out/sync.log" 2>&1
    sed -n '/^| /,$p' "$out/sync.log" | tail -30
    ;;
  shapes)
    timeout "$(left 585)" python "$here/gpu_decode_shapes.py" --out "$out/shapes" > "$out/shapes.log" 2>&1
    sed -n '/^| M /,$p' "$out/shapes.log"
    ;;
  cap06)  # MODES: capture modes and variants (MODE@rNk: chunks of N Ki rows; MODE@noslot: see gpu_capture_check.py)
    timeout "$(left 585)" python "$here/gpu_capture_check.py" --out "$out/cap06" --rounds "${ROUNDS:-7}" --skip-compare \
      --shapes "${SHAPES:-qwen3-0.6b}" --trace \
      --modes "${MODES:-off,digest,stats,digest@noslot,stats@noslot}" > "$out/cap06.log" 2>&1
    sed -n '/stages per score/,$p' "$out/cap06.log"
    ;;
  graphs)  # --learner-arg cuda_graphs=true: its GPU test, then the learner bench with the product's graphs (#28 pt 3), ~3 min
    timeout "$(left 300)" bash "$here/gpu_tests.sh" -m gpu tests/gpu/test_learner_graphs.py -rA > "$out/graphs_test.log" 2>&1
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" "$out/graphs_test.log" | tail -12
    python "$here/gpu_nvfp4_check.py" --out "$out/learner" --only c --graphs --budget "$(left 585)" > "$out/learner.log" 2>&1
    sed -n '/^| /,$p' "$out/learner.log" | tail -8
    ;;
  producers)  # a bare machine is enough (no vLLM): pip install --target /tmp/site . and PYTHONPATH=/tmp/site first
    timeout "$(left 300)" bash "$here/gpu_tests.sh" -m gpu tests/kernels/test_kernels_gpu.py -k "fused_norm_quantize or fused_act_quantize or recipe_linear or all_checks" -rA > "$out/producers_tests.log" 2>&1
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$out/producers_tests.log" | tail -12
    timeout "$(left 585)" python "$here/gpu_producers.py" > "$out/producers.log" 2>&1
    sed -n '/^| producer/,$p' "$out/producers.log"
    ;;
  learner)
    python "$here/gpu_nvfp4_check.py" --out "$out/learner" --only c --profile --graphs --budget "$(left 585)" > "$out/learner.log" 2>&1
    sed -n '/^| /,$p' "$out/learner.log" | tail -8
    ;;
  capture)
    # CAPTURE_ARGS: extra arguments (e.g. --modes off,digest,stats,digest@r128k); NVFP4_ONLY: sections (default bac)
    python "$here/gpu_capture_check.py" --out "$out/capture" --rounds "${ROUNDS:-5}" --compare-reps 1 ${CAPTURE_ARGS:-} \
      > "$out/capture.log" 2>&1
    python "$here/gpu_nvfp4_check.py" --out "$out/nvfp4" --only "${NVFP4_ONLY:-bac}" --budget "$(left 585)" > "$out/nvfp4.log" 2>&1
    tail -30 "$out/capture.log"
    sed -n '/^| /,$p' "$out/nvfp4.log" | tail -40
    ;;
  *)
    echo "gpu_round.sh: no stage '$1' (tests, kernels, bisect, speed, speed8b, capture, profile, q8b, sync, shapes, cap06, graphs, producers, learner)" >&2
    exit 2
    ;;
esac
