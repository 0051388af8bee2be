"""Tensor-core NVFP4 GEMM kernels under the GEMM contract of docs/nvfp4.md.

Numerics (every path, every tile shape, every M):

* operands are exact: activations ``E2M1 * sfA`` and weights ``E2M1 * sfW * 2^-7`` as fp16 (both
  have at most 6 significant bits and lie in fp16's normal range: ``2^-10 .. 2688`` and
  ``2^-17 .. 21``, so fp16 holds them exactly, like bf16 would). The weight carries ``2^-7`` so
  that its register decode is a single packed ``mul.f16x2`` by ``sf * 2^7`` (<= 57344, no fp16
  overflow); the epilogue multiplies by ``2^7`` (exact: every partial sum is a multiple of
  ``2^-27``, far from fp32 subnormals);
* fp32 accumulation on the tensor cores along K in increasing order, within ``NSEG`` segments of
  ``K / NSEG`` (``NSEG`` depends only on (N, K), never on M); segment sums added in segment order
  with IEEE fp32 adds (the first segment's sum taken as is);
* epilogue ``out = RN_bf16((total * 2^7) * ((amaxA[m] * amaxB[n]) * RN(1/(36*448^2))))``.

Two kernels implement it:

* :func:`decode_kernel` (small M): weight rows on the MMA's M side (swap-AB), tokens on its N
  side. The weights stream as packed FP4 in the *decode layout* (per ``BKC``-wide K chunk, byte j
  holds the codes of k = j (low nibble) and k = j + BKC/2 (high nibble), arranged once per weight
  version), so a byte tile decodes into two K-contiguous halves, each fed to its own MMA in K order:
  no interleave. Decode: ``prmt`` + masks + one ``mul.f16x2`` per pair of values (inline PTX), the
  block scale by the hardware E4M3 -> fp16 conversion. Split over N, and over the ``NSEG`` K
  segments (fp32 partials, reduced in order by :func:`reduce_kernel`).
* :func:`prefill_kernel` (large M): both operands pre-dequantized fp16 (weights once per weight
  version), a fixed-config wgmma mainloop.

In the Triton interpreter (CPU, CI) operands are fp32 (exact) and ``tl.dot`` is numpy's, so only
the tolerance against the per-block reference holds there; the bitwise properties are GPU tests.
"""

from __future__ import annotations

import triton.language as tl

from .common import bf16_bits_rne, e2m1_decode, e4m3_decode, kjit

RCP_ALPHA = 1.3840171675383317e-07  # RN(1 / (36 * 448^2))
W_SHIFT = 128.0  # 2^7: weight operand = E2M1 * sf / 2^7

# lo/hi: 4 packed bytes -> 4 low-nibble and 4 high-nibble values, fp16, times the per-element
# fp16 factor sf*2^7. Nibble s|e1 e0|m placed as fp16 bits (sign 15, exponent 11-10, mantissa 9)
# is exactly E2M1 * 2^-14 (e = 0 lands on the fp16 subnormal 2^-15 * m), so one mul gives
# E2M1 * sf * 2^-7 exactly.
_DECODE_ASM = tl.constexpr("""
{
.reg .b32 x01, x23, t0, t1, z;
mov.b32 z, 0;
prmt.b32 x01, $4, z, 0x4140;
prmt.b32 x23, $4, z, 0x4342;
and.b32 t0, x01, 0x00070007; shl.b32 t0, t0, 9; and.b32 t1, x01, 0x00080008; shl.b32 t1, t1, 12;
or.b32 t0, t0, t1; mul.rn.f16x2 $0, t0, $5;
and.b32 t0, x23, 0x00070007; shl.b32 t0, t0, 9; and.b32 t1, x23, 0x00080008; shl.b32 t1, t1, 12;
or.b32 t0, t0, t1; mul.rn.f16x2 $1, t0, $6;
and.b32 t0, x01, 0x00700070; shl.b32 t0, t0, 5; and.b32 t1, x01, 0x00800080; shl.b32 t1, t1, 8;
or.b32 t0, t0, t1; mul.rn.f16x2 $2, t0, $7;
and.b32 t0, x23, 0x00700070; shl.b32 t0, t0, 5; and.b32 t1, x23, 0x00800080; shl.b32 t1, t1, 8;
or.b32 t0, t0, t1; mul.rn.f16x2 $3, t0, $8;
}
""")


@kjit
def _scale_f(sb, F32: tl.constexpr):
    """E4M3 scale bytes (uint8) -> sf * 2^7 (fp16 on the GPU via the hardware cvt; fp32 in the
    interpreter)."""
    if F32:
        return e4m3_decode(sb.to(tl.int32)) * 128.0
    else:
        return (sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 128.0).to(tl.float16)


@kjit
def decode_pair(p, sl, sh, USE_ASM: tl.constexpr, F32: tl.constexpr):
    """Decode-layout bytes p -> (lo, hi) = E2M1 * sf * 2^-7 for the low / high nibbles."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _DECODE_ASM, "=r,=r,=r,=r,r,r,r,r,r", [p, sl, sh], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        p32 = p.to(tl.int32)
        lo = e2m1_decode(p32 & 15) * (sl.to(tl.float32) * 0.00006103515625)
        hi = e2m1_decode((p32 >> 4) & 15) * (sh.to(tl.float32) * 0.00006103515625)
        if F32:
            return lo, hi
        else:
            return lo.to(tl.float16), hi.to(tl.float16)


@kjit
def _epilogue(total, aa, ba):
    return (total * 128.0) * ((aa * ba) * 1.3840171675383317e-07)


@kjit
def _store_rows(total, a_amax_ptr, w_amax_ptr, out_ptr, rm, rn, mmask, nmask, eb, N, W_AMAX_ROW: tl.constexpr):
    """The bf16 rows of a [rows m, cols n] tile of fp32 sums: scaled by the token's and the weight
    row's (or tensor's) amax, rounded once."""
    aa = tl.load(a_amax_ptr + rm, mask=mmask, other=0.0)
    if W_AMAX_ROW:
        ba = tl.load(w_amax_ptr + eb * N + rn, mask=nmask, other=0.0)
    else:
        ba = tl.load(w_amax_ptr + eb + rn * 0)
    res = _epilogue(total, aa[:, None], ba[None, :])
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], bf16_bits_rne(res).to(tl.int16),
             mask=mmask[:, None] & nmask[None, :])


@kjit
def _add_store_cols(acc_c, p_ptr, a_amax_ptr, w_amax_ptr, out_ptr, rm, mmask, c0, eb, N, BC: tl.constexpr,
                    W_AMAX_ROW: tl.constexpr):
    """PHASE 2's epilogue on columns [c0, c0 + BC): segment 0's sums read from ``p_ptr`` plus segment 1's
    (``acc_c``), then :func:`_store_rows` (the whole tile, or one half of it: the same elementwise p0 + p1)."""
    rn = (c0 + tl.arange(0, BC)).to(tl.int64)
    nmask = rn < N
    p0 = tl.load(p_ptr + rm[:, None] * N + rn[None, :], mask=mmask[:, None] & nmask[None, :], other=0.0)
    _store_rows(p0 + acc_c, a_amax_ptr, w_amax_ptr, out_ptr, rm, rn, mmask, nmask, eb, N, W_AMAX_ROW)


@kjit
def _w_dec(cp, sp, k, nmask, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """The [BK, BN] weight operand ``E2M1 * sf * 2^-7`` of K columns [k, k + BK) decoded in registers
    from the standard codes [N, K/2] and E4M3 scale bytes [N, K/16] (``cp`` / ``sp``: the tile's
    [BN, BK/2] / [BN, BK/16] pointer blocks at K column 0): exactly the values ``TCWeight.op()`` holds
    (``tc_linear.weight_operand``: ``(E2M1 * sf) * 2^-7`` in fp32, exact, then the operand dtype), so the
    same products and sums as the kernel reading the operand from memory (rows past N: zero)."""
    c = tl.load(cp + k // 2, mask=nmask[:, None], other=0).to(tl.int32)
    v = tl.reshape(tl.join(c & 15, c >> 4), (BN, BK))  # byte j holds codes 2j (low nibble) and 2j + 1
    sb = tl.load(sp + k // 16, mask=nmask[:, None], other=0).to(tl.int32)
    sf = tl.reshape(tl.broadcast_to(e4m3_decode(sb)[:, :, None], (BN, BK // 16, 16)), (BN, BK))
    w = e2m1_decode(v) * sf * 0.0078125
    if F32:
        return tl.trans(w)
    else:
        return tl.trans(w.to(tl.float16))


@kjit
def _seg_sum(ap, wp, k0, kseg, mmask, nmask, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             F32: tl.constexpr, cp=None, sp=None, WDEC: tl.constexpr = False):
    """One K segment's fp32 sums of a [BM, BN] tile, from 0, its BK steps in K order (``WDEC``: the
    weights decoded from codes and scales by :func:`_w_dec`, else read as the fp16 operand at ``wp``)."""
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for k in range(k0, k0 + kseg, BK):
        a = tl.load(ap + k, mask=mmask[:, None], other=0.0)
        if WDEC:
            w = _w_dec(cp, sp, k, nmask, BN, BK, F32)
        else:
            w = tl.load(wp + k, mask=nmask[None, :], other=0.0)
        if F32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@kjit
def _tile_rows(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, M, BM: tl.constexpr, GROUPED: tl.constexpr):
    if GROUPED:
        e = tl.load(tile_e_ptr + pid_m)
        r0 = tl.load(tile_r0_ptr + pid_m)
        r1 = tl.load(tile_r1_ptr + pid_m)
    else:
        e = pid_m * 0
        r0 = pid_m * BM
        r1 = M
    return e, r0, r1


@kjit
def _dec_ptrs(dec_ptr, dsc_ptr, eb, pid_n, N, K, BN: tl.constexpr, BKC: tl.constexpr):
    """Pointers of chunk 0 of this program's BN weight rows in the tiled decode layout
    [(E,) N/64, K/BKC, 64, BKC/2] (scales [(E,) N/64, K/BKC, 64, BKC/16]): each (64-row tile,
    chunk) is one contiguous block, so every pipeline stage streams contiguous bytes."""
    nt_count = (N + 63) // 64
    chunks = K // BKC
    row0 = pid_n * BN
    tile = (eb * nt_count + row0 // 64) * chunks
    r = row0 % 64 + tl.arange(0, BN)
    b3 = tl.arange(0, BKC // 32)
    j16 = tl.arange(0, 16)
    wp = dec_ptr + tile * (64 * (BKC // 2)) + r[:, None, None] * (BKC // 2) + b3[None, :, None] * 16 + j16[None, None, :]
    sp = dsc_ptr + tile * (64 * (BKC // 16)) + r[:, None] * (BKC // 16) + b3[None, :]
    return wp, sp


@kjit
def decode_kernel(
    w_ptr, wsf_ptr, w_amax_ptr, a_ptr, a_amax_ptr, out_ptr, part_ptr,
    tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    M, N, K,
    BN: tl.constexpr, BM: tl.constexpr, BKC: tl.constexpr, NSEG: tl.constexpr,
    GROUPED: tl.constexpr, W_AMAX_ROW: tl.constexpr, USE_ASM: tl.constexpr, F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2)
    e, r0, r1 = _tile_rows(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, M, BM, GROUPED)
    if e >= 0:
        eb = e.to(tl.int64)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        nmask = rn < N
        rm = (r0 + tl.arange(0, BM)).to(tl.int64)
        mmask = rm < r1
        kk = tl.arange(0, BKC // 2)
        wrow, srow = _dec_ptrs(w_ptr, wsf_ptr, eb, pid_n, N, K, BN, BKC)
        arow = a_ptr + rm[None, :] * K + kk[:, None]
        cps = (K // BKC) // NSEG
        acc = tl.full([BN, BM], 0.0, tl.float32)
        for c in range(seg * cps, seg * cps + cps):
            p = tl.load(wrow + c * (64 * (BKC // 2)))
            sl = _scale_f(tl.load(srow + c * (64 * (BKC // 16))), F32)
            sh = _scale_f(tl.load(srow + c * (64 * (BKC // 16)) + BKC // 32), F32)
            lo, hi = decode_pair(p, sl[:, :, None], sh[:, :, None], USE_ASM, F32)
            lo = tl.reshape(lo, (BN, BKC // 2))
            hi = tl.reshape(hi, (BN, BKC // 2))
            a_lo = tl.load(arow + c * BKC, mask=mmask[None, :], other=0.0)
            a_hi = tl.load(arow + c * BKC + BKC // 2, mask=mmask[None, :], other=0.0)
            if F32:
                acc = tl.dot(lo, a_lo, acc, input_precision="ieee")
                acc = tl.dot(hi, a_hi, acc, input_precision="ieee")
            else:
                acc = tl.dot(lo, a_lo, acc)
                acc = tl.dot(hi, a_hi, acc)
        omask = nmask[:, None] & mmask[None, :]
        if NSEG == 1:
            aa = tl.load(a_amax_ptr + rm, mask=mmask, other=0.0)
            if W_AMAX_ROW:
                ba = tl.load(w_amax_ptr + eb * N + rn, mask=nmask, other=0.0)
            else:
                ba = tl.load(w_amax_ptr + eb + rn * 0)
            res = _epilogue(acc, aa[None, :], ba[:, None])
            tl.store(out_ptr + rm[None, :] * N + rn[:, None], bf16_bits_rne(res).to(tl.int16), mask=omask)
        else:
            tl.store(part_ptr + seg.to(tl.int64) * M * N + rm[None, :] * N + rn[:, None], acc, mask=omask)


@kjit
def decode_ns_kernel(
    w_ptr, wsf_ptr, w_amax_ptr, a_ptr, a_amax_ptr, out_ptr, part_ptr,
    tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    M, N, K,
    BN: tl.constexpr, BM: tl.constexpr, BKC: tl.constexpr, NSEG: tl.constexpr, CPI: tl.constexpr,
    GROUPED: tl.constexpr, W_AMAX_ROW: tl.constexpr, USE_ASM: tl.constexpr, F32: tl.constexpr,
):
    """Decode path, tokens on the MMA's M side (16 rows: mma.sync; 64: wgmma) and a narrow weight
    tile on its N side (many programs without splitting K). Same numerics as decode_kernel."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2)
    e, r0, r1 = _tile_rows(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, M, BM, GROUPED)
    if e >= 0:
        eb = e.to(tl.int64)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        nmask = rn < N
        rm = (r0 + tl.arange(0, BM)).to(tl.int64)
        mmask = rm < r1
        kk = tl.arange(0, BKC // 2)
        wrow, srow = _dec_ptrs(w_ptr, wsf_ptr, eb, pid_n, N, K, BN, BKC)
        arow = a_ptr + rm[:, None] * K + kk[None, :]
        cps = (K // BKC) // NSEG
        acc = tl.full([BM, BN], 0.0, tl.float32)
        for c0 in range(seg * cps, seg * cps + cps, CPI):
            for ci in tl.static_range(CPI):
                c = c0 + ci
                p = tl.load(wrow + c * (64 * (BKC // 2)))
                sl = _scale_f(tl.load(srow + c * (64 * (BKC // 16))), F32)
                sh = _scale_f(tl.load(srow + c * (64 * (BKC // 16)) + BKC // 32), F32)
                lo, hi = decode_pair(p, sl[:, :, None], sh[:, :, None], USE_ASM, F32)
                lo = tl.reshape(lo, (BN, BKC // 2))
                hi = tl.reshape(hi, (BN, BKC // 2))
                a_lo = tl.load(arow + c * BKC, mask=mmask[:, None], other=0.0)
                a_hi = tl.load(arow + c * BKC + BKC // 2, mask=mmask[:, None], other=0.0)
                if F32:
                    acc = tl.dot(a_lo, tl.trans(lo), acc, input_precision="ieee")
                    acc = tl.dot(a_hi, tl.trans(hi), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a_lo, tl.trans(lo), acc)
                    acc = tl.dot(a_hi, tl.trans(hi), acc)
        if NSEG == 1:
            _store_rows(acc, a_amax_ptr, w_amax_ptr, out_ptr, rm, rn, mmask, nmask, eb, N, W_AMAX_ROW)
        else:
            tl.store(part_ptr + seg.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc,
                     mask=mmask[:, None] & nmask[None, :])


@kjit
def _reduce_block(part_ptr, a_amax_ptr, w_amax_ptr, row_e_ptr, out_ptr, M, N, ldo, b,
                  NSEG: tl.constexpr, BLOCK: tl.constexpr, W_AMAX_ROW: tl.constexpr, GROUPED: tl.constexpr):
    """Block ``b`` of BLOCK outputs of one weight: out[m, n] (row stride ``ldo``) = epilogue(((p_0 + p_1) +
    p_2) + ...), its K segments' fp32 partials ``part`` [NSEG, M, N] in segment order."""
    i = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = i < M * N
    m = i // N
    n = i % N
    total = tl.load(part_ptr + i, mask=msk, other=0.0)
    for s in tl.static_range(1, NSEG):
        total = total + tl.load(part_ptr + s * M * N + i, mask=msk, other=0.0)
    aa = tl.load(a_amax_ptr + m, mask=msk, other=0.0)
    if GROUPED:
        e = tl.load(row_e_ptr + m, mask=msk, other=0).to(tl.int64)
    else:
        e = m * 0
    if W_AMAX_ROW:
        ba = tl.load(w_amax_ptr + e * N + n, mask=msk, other=0.0)
    else:
        ba = tl.load(w_amax_ptr + e, mask=msk, other=0.0)
    tl.store(out_ptr + m * ldo + n, bf16_bits_rne(_epilogue(total, aa, ba)).to(tl.int16), mask=msk)


@kjit
def reduce_kernel(part_ptr, a_amax_ptr, w_amax_ptr, row_e_ptr, out_ptr, M, N,
                  NSEG: tl.constexpr, BLOCK: tl.constexpr, W_AMAX_ROW: tl.constexpr, GROUPED: tl.constexpr, LDO=None):
    """out = epilogue(((p_0 + p_1) + p_2) + ...): the segment partials in segment order. ``LDO``: the
    output's row stride (None: N; a fused layer's shard writes its columns of the layer's output)."""
    ldo = N if LDO is None else LDO
    _reduce_block(part_ptr, a_amax_ptr, w_amax_ptr, row_e_ptr, out_ptr, M, N, ldo, tl.program_id(0),
                  NSEG, BLOCK, W_AMAX_ROW, GROUPED)


@kjit
def reduce_shards_kernel(a_amax_ptr, out_ptr, M, LDO,
                         p0, w0, n0, b1, p1, w1, n1, c1, b2, p2, w2, n2, c2, b3, p3, w3, n3, c3,
                         S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                         R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`reduce_kernel` of up to four dense weights in one launch (a fused layer's shards whose K segments
    the decode kernel left to a reduce: q, k, v): shard i's partials ``p_i`` [S_i, M, n_i] (``S_i`` segments,
    ``R_i`` its amax per row) into its n_i columns of ``out`` (row stride LDO) from column c_i (``out_ptr`` at
    shard 0's first column: c_0 = 0); programs [b_i, b_{i+1}) are shard i's, b_0 = 0 (an absent shard: its b the
    grid's size). Each output is the bits of the shard's own launch (the same block code)."""
    pid = tl.program_id(0)
    if pid < b1:
        _reduce_block(p0, a_amax_ptr, w0, a_amax_ptr, out_ptr, M, n0, LDO, pid, S0, BLOCK, R0, False)
    elif pid < b2:
        _reduce_block(p1, a_amax_ptr, w1, a_amax_ptr, out_ptr + c1, M, n1, LDO, pid - b1, S1, BLOCK, R1, False)
    elif pid < b3:
        _reduce_block(p2, a_amax_ptr, w2, a_amax_ptr, out_ptr + c2, M, n2, LDO, pid - b2, S2, BLOCK, R2, False)
    else:
        _reduce_block(p3, a_amax_ptr, w3, a_amax_ptr, out_ptr + c3, M, n3, LDO, pid - b3, S3, BLOCK, R3,
                      False)


@kjit
def prefill_kernel(
    a_ptr, w_ptr, a_amax_ptr, w_amax_ptr, out_ptr,
    tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    M, N, K, w_estride,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NSEG: tl.constexpr, GROUP_M: tl.constexpr,
    GROUPED: tl.constexpr, W_AMAX_ROW: tl.constexpr, F32: tl.constexpr, FLAT: tl.constexpr = True,
    p_ptr=None, PHASE: tl.constexpr = 0, wc_ptr=None, ws_ptr=None, WDEC: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
):
    """Prefill path. ``FLAT`` (default): one K loop over all segments, so the software pipeline
    keeps its loads in flight across segment boundaries; at the end of each segment its
    accumulator is added to the running total and restarts at 0. The total starts at -0.0, the
    identity of IEEE addition (-0 + x == x for every x, +0 included), so the first segment's sum is
    taken as is, like :func:`reduce_kernel` does: the same bits as ``FLAT=False`` (one loop per
    segment, the pipeline drained and refilled at each segment). ``PHASE`` 1 / 2 (NSEG == 2, dense): one
    segment per launch with one accumulator (the one-segment tile): 1 stores segment 0's fp32 sums to
    ``p_ptr`` [M, N], 2 adds segment 1's to them (p0 + p1, as the total above) and runs the epilogue:
    the same bits as FLAT, without a second accumulator live through the loop. ``WDEC`` (dense weights
    only): the weights decoded in registers from ``wc_ptr`` (codes [N, K/2]) and ``ws_ptr`` (scale bytes
    [N, K/16]) instead of read from the fp16 operand at ``w_ptr`` (not needed then): the same operand
    values, so the same bits, without the 2 bytes per weight the operand keeps in memory. ``SPLIT``
    (PHASE 2): the epilogue on the tile's two column halves one after the other (segment 0's sums
    loaded half by half: fewer registers live at once than the whole [BM, BN] fp32 buffer tile beside
    the accumulator); elementwise the same, so the same bits."""
    pid = tl.program_id(0)
    nn = (N + BN - 1) // BN
    if GROUPED:
        pid_m = pid // nn
        pid_n = pid % nn
    else:  # grouped launch order: GROUP_M row tiles share each weight tile while it is in L2
        nm = (M + BM - 1) // BM
        width = GROUP_M * nn
        g = pid // width
        first = g * GROUP_M
        gsz = tl.minimum(nm - first, GROUP_M)
        pid_m = first + (pid % width) % gsz
        pid_n = (pid % width) // gsz
    e, r0, r1 = _tile_rows(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pid_m, M, BM, GROUPED)
    if e >= 0:
        eb = e.to(tl.int64)
        rm = (r0 + tl.arange(0, BM)).to(tl.int64)
        mmask = rm < r1
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        nmask = rn < N
        kk = tl.arange(0, BK)
        ap = a_ptr + rm[:, None] * K + kk[None, :]
        wp = w_ptr + eb * w_estride + rn[None, :] * K + kk[:, None]
        cp = wc_ptr
        sp = ws_ptr
        if WDEC:
            cp = wc_ptr + rn[:, None] * (K // 2) + tl.arange(0, BK // 2)[None, :]
            sp = ws_ptr + rn[:, None] * (K // 16) + tl.arange(0, BK // 16)[None, :]
        kseg = K // NSEG
        if PHASE > 0:
            acc = _seg_sum(ap, wp, (PHASE - 1) * kseg, kseg, mmask, nmask, BM, BN, BK, F32, cp, sp, WDEC)
            c0 = pid_n * BN
            if PHASE == 1:
                tl.store(p_ptr + rm[:, None] * N + rn[None, :], acc, mask=mmask[:, None] & nmask[None, :])
            elif SPLIT:
                h0, h1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                _add_store_cols(h0, p_ptr, a_amax_ptr, w_amax_ptr, out_ptr, rm, mmask, c0, eb, N, BN // 2, W_AMAX_ROW)
                _add_store_cols(h1, p_ptr, a_amax_ptr, w_amax_ptr, out_ptr, rm, mmask, c0 + BN // 2, eb, N, BN // 2,
                                W_AMAX_ROW)
            else:
                _add_store_cols(acc, p_ptr, a_amax_ptr, w_amax_ptr, out_ptr, rm, mmask, c0, eb, N, BN, W_AMAX_ROW)
        elif FLAT and NSEG > 1:
            kps = kseg // BK  # K steps per segment
            total = tl.full([BM, BN], -0.0, tl.float32)
            acc = tl.full([BM, BN], 0.0, tl.float32)
            for i in range(0, K // BK):
                a = tl.load(ap + i * BK, mask=mmask[:, None], other=0.0)
                if WDEC:
                    w = _w_dec(cp, sp, i * BK, nmask, BN, BK, F32)
                else:
                    w = tl.load(wp + i * BK, mask=nmask[None, :], other=0.0)
                if F32:
                    acc = tl.dot(a, w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
                if i % kps == kps - 1:
                    total = total + acc
                    acc = tl.full([BM, BN], 0.0, tl.float32)
        else:
            total = tl.full([BM, BN], 0.0, tl.float32)
            for s in tl.static_range(NSEG):
                acc = _seg_sum(ap, wp, s * kseg, kseg, mmask, nmask, BM, BN, BK, F32, cp, sp, WDEC)
                if s == 0:
                    total = acc
                else:
                    total = total + acc
        if PHASE == 0:
            _store_rows(total, a_amax_ptr, w_amax_ptr, out_ptr, rm, rn, mmask, nmask, eb, N, W_AMAX_ROW)
