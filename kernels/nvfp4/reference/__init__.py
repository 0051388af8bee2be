"""The older exact NVFP4 GEMM stack, kept as a slow cross-check (the named checks, tests, benches).

Each 16-wide K block's exact partial sum is added to an fp32 accumulator with one IEEE add, in K
order, so every output equals the pure-torch :func:`ref.w4a4_gemm_ref` bit for bit; that costs one
MMA per block and is 3-4x slower than BF16 on the H200, so the recipes do not run it (their GEMM is
:mod:`tc_linear`, see docs/nvfp4.md "What is bitwise").

* :mod:`.aligned_linear`: :func:`aligned_linear`, :func:`w4a4_matmul` (paths fp4, fp4w, fp4w-swap,
  bf16, fma; identical bits).
* :mod:`.grouped`: :func:`grouped_w4a4`, :func:`moe_grouped_linear` (MoE, one launch).
* :mod:`.w4a4`: the Triton kernel both use.
"""
