"""The exact per-16-block W4A4 GEMM kernel of :mod:`reference.aligned_linear` and :mod:`reference.grouped`.

Per output element (m, n), whatever the tile shape, the number of rows or the expert:

* for each 16-wide K block b, in increasing order: ``P_b = dot(a_b * sfA_b, b_b * sfB_b)``. The
  operands ``E2M1 * E4M3`` are exact in bf16 (<= 6 significant bits) and all 16 products and
  their partial sums are exact in fp32, so P_b is exact on any tensor core or in the interpreter.
* ``acc = acc + P_b`` with one IEEE fp32 round-to-nearest add (``add.rn.f32`` inline PTX on the
  GPU, so Triton cannot fuse the add into the MMA accumulator, whose rounding is not IEEE).
* epilogue: ``out = acc * ((amaxA[m] * amaxB[n]) * RN(1/(36*448^2)))``, then RNE to bf16.

No split-K, fixed K order, alpha in the epilogue: row m of the output is bitwise identical for
any M (batch invariance), and equals :func:`ref.w4a4_gemm_ref`.

Operands come either as packed FP4 codes + E4M3 block scales (``*_FP4``: the decode path reads
them directly) or as bf16 ``E2M1*sf`` values made by ``nvfp4_dequantize(apply_global=False)``
(exact, so both forms give the same bits; the large-M path uses it to keep the mainloop on the
tensor cores instead of the decode ALUs). MODE 1 swaps the operands (weights on the MMA's M side)
for small M; MODE 2 uses CUDA-core FMAs (exact too, slow).

Known compiler issue (Triton 3.6, H200, 2026-11-29): mma.sync tiles (an MMA dimension < 64)
whose operand is decoded in registers (``tl.join``/``tl.reshape`` -> dot-operand layout) give
wrong values; wgmma tiles (operands through shared memory) and mma.sync fed from memory are exact.
``aligned_linear.gemm_config`` therefore never picks such tiles; the checks would catch them.
"""

from __future__ import annotations

import triton.language as tl

from ..common import bf16_bits_rne, e4m3_decode, kjit, rsum, unpack_decode_tile


@kjit
def _add_rn(acc, p, USE_ASM: tl.constexpr):
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, p], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return acc + p


@kjit
def _load_operand(ptr, sf_ptr, rows, rmask, K, kb, FP4: tl.constexpr, BR: tl.constexpr, F32: tl.constexpr):
    """[BR, 16] operand values E2M1*sf for K block kb (bf16, or fp32 when F32)."""
    if FP4:
        j8 = tl.arange(0, 8)
        p = tl.load(ptr + rows[:, None] * (K // 2) + kb * 8 + j8[None, :], mask=rmask[:, None], other=0)
        sb = tl.load(sf_ptr + rows * (K // 16) + kb, mask=rmask, other=0)
        v = unpack_decode_tile(p) * e4m3_decode(sb.to(tl.int32))[:, None]
        if F32:
            return v
        else:
            return v.to(tl.bfloat16)
    else:
        j16 = tl.arange(0, 16)
        v = tl.load(ptr + rows[:, None] * K + kb * 16 + j16[None, :], mask=rmask[:, None], other=0.0)
        if F32:
            return v.to(tl.float32)
        else:
            return v


@kjit
def w4a4_kernel(
    a_ptr, asf_ptr, a_amax_ptr, b_ptr, bsf_ptr, b_amax_ptr, out_ptr,
    tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    M, N, K, b_estride, bsf_estride, b_amax_estride,
    A_FP4: tl.constexpr, B_FP4: tl.constexpr, A_AMAX_ROW: tl.constexpr, B_AMAX_ROW: tl.constexpr,
    GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KSTEP: tl.constexpr,
    F32: tl.constexpr, USE_ASM: tl.constexpr, OUT_BF16: tl.constexpr, MODE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_e_ptr + pid_m)
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
    else:
        e = pid_m * 0
        r0 = pid_m * BM
        r1 = M
    if e >= 0:
        rm = (r0 + tl.arange(0, BM)).to(tl.int64)
        mmask = rm < r1
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        nmask = rn < N
        eb = e.to(tl.int64)
        bp = b_ptr + eb * b_estride
        bsp = bsf_ptr + eb * bsf_estride
        if A_AMAX_ROW:
            aa = tl.load(a_amax_ptr + rm, mask=mmask, other=0.0)
        else:
            aa = tl.load(a_amax_ptr + rm * 0)
        if B_AMAX_ROW:
            ba = tl.load(b_amax_ptr + eb * b_amax_estride + rn, mask=nmask, other=0.0)
        else:
            ba = tl.load(b_amax_ptr + eb * b_amax_estride + rn * 0)
        if MODE == 1:
            # swap-AB: out^T = W . A^T, weight rows on the MMA's M side (wgmma needs M >= 64)
            acct = tl.full([BN, BM], 0.0, tl.float32)
            for k0 in range(0, K // 16, KSTEP):
                for j in tl.static_range(KSTEP):
                    kb = k0 + j
                    av = _load_operand(a_ptr, asf_ptr, rm, mmask, K, kb, A_FP4, BM, F32)
                    bv = _load_operand(bp, bsp, rn, nmask, K, kb, B_FP4, BN, F32)
                    if F32:
                        p = tl.dot(bv, tl.trans(av), input_precision="ieee")
                    else:
                        p = tl.dot(bv, tl.trans(av))
                    acct = _add_rn(acct, p, USE_ASM)
            outt = acct * ((aa[None, :] * ba[:, None]) * 1.3840171675383317e-07)
            optr = out_ptr + rm[None, :] * N + rn[:, None]
            omask = mmask[None, :] & nmask[:, None]
            if OUT_BF16:
                tl.store(optr, bf16_bits_rne(outt).to(tl.int16), mask=omask)
            else:
                tl.store(optr, outt, mask=omask)
        else:
            acc = tl.full([BM, BN], 0.0, tl.float32)
            for k0 in range(0, K // 16, KSTEP):
                for j in tl.static_range(KSTEP):
                    kb = k0 + j
                    if MODE == 2:
                        # CUDA cores: the 16 products and any partial sum are exact in fp32, so the
                        # reduction order inside the block does not matter
                        av = _load_operand(a_ptr, asf_ptr, rm, mmask, K, kb, A_FP4, BM, True)
                        bv = _load_operand(bp, bsp, rn, nmask, K, kb, B_FP4, BN, True)
                        p = rsum(av[:, None, :] * bv[None, :, :], 2)
                    else:
                        av = _load_operand(a_ptr, asf_ptr, rm, mmask, K, kb, A_FP4, BM, F32)
                        bv = _load_operand(bp, bsp, rn, nmask, K, kb, B_FP4, BN, F32)
                        if F32:
                            p = tl.dot(av, tl.trans(bv), input_precision="ieee")
                        else:
                            p = tl.dot(av, tl.trans(bv))
                    acc = _add_rn(acc, p, USE_ASM)
            out = acc * ((aa[:, None] * ba[None, :]) * 1.3840171675383317e-07)  # alpha: RN(1/7225344)
            optr = out_ptr + rm[:, None] * N + rn[None, :]
            omask = mmask[:, None] & nmask[None, :]
            if OUT_BF16:
                tl.store(optr, bf16_bits_rne(out).to(tl.int16), mask=omask)
            else:
                tl.store(optr, out, mask=omask)
