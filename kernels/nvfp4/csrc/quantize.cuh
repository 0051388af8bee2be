// The per-token / given-amax NVFP4 quantizer of bf16 rows (quant_rows_kernel), bit for bit the
// reference quantizer of ref.py; writes the fp16 GEMM operand row-major, chunk-major (TROW of
// decode_bulk.cuh) or core-matrix ordered (CMB of decode_wg.cuh).
// Included by nvfp4_native.cu (the one translation unit, built by kernels/nvfp4/native.py) inside its
// anonymous namespace, after the headers listed there before it; not a standalone header.
#pragma once

// ------------------------------------------------------------------------------------------
// quantizer

constexpr float FLT_MAX_F = 3.4028234663852886e38f;
constexpr float RCP6 = 0.1666666716337204f;  // RN(1/6) = 0x3E2AAAAB

__device__ __forceinline__ uint32_t e2m1_code(float y) {  // same codes as quant_fast.e2m1_encode_int
  // RNE E2M1 index of min(|y|, 6) = RNE(min(2a, a + 2, a / 2 + 4, 7)) (piecewise linear, monotone
  // RNE commutes with min); each candidate rounded once by the 2^23 magic constant (FMA pipe).
  const float ay = fabsf(y);
  const float m = fminf(fminf(__fmaf_rn(ay, 2.0f, 8388608.0f), __fadd_rn(ay, 8388610.0f)),
                        fminf(__fmaf_rn(ay, 0.5f, 8388612.0f), 8388615.0f));
  const uint32_t neg = __umulhi(__float_as_uint(__fadd_rn(y, 0.0f)), 2u);  // y < 0 (y + 0 maps -0 to +0)
  return __float_as_uint(m) + 8u * neg;  // code + 0x4B000000
}
constexpr uint32_t CODE_BIAS = 0x4B000000u;

__device__ __forceinline__ uint32_t absmax_bf16x2(uint32_t a, uint32_t b) {  // NaN-propagating max of |.|
  uint32_t d;
  asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ uint32_t e4m3_byte(float v) {  // RNE, saturating; v in [0, 448]
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  return r & 0xFFu;
}
__device__ __forceinline__ float e4m3_value(uint32_t b) {  // exact
  uint32_t h;
  const uint16_t in = static_cast<uint16_t>(b);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(in));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu)));
}

// one CTA (128 threads) per row; thread t holds blocks t, t+128, ... (BPT of them) in registers
// CM: the fp16 operand (EMIT_OP) in the decode kernel's chunk-major token layout (TROW / TCH above):
// [ceil(rows/16)][K/128][16][136]; the grid then covers ceil(rows/16)*16 rows, the rows past ``rows``
// writing zero operand rows only (a separate instance: the row-major kernels are the measured ones)
// CM 2: the core-matrix layout of decode_wg_kernel, [K/128][16][G][8][8] fp16 (G row groups of 8, the
// grid covering 8 G rows, rows past ``rows`` zero); a block's two 8-value halves are G * 8 uint4 apart
template <int BPT, bool EMIT_OP, int CM = 0>
__global__ void __launch_bounds__(128) quant_rows_kernel(const uint4* __restrict__ x, float* __restrict__ amax_p,
                                                         uint2* __restrict__ codes, uint8_t* __restrict__ scales,
                                                         uint4* __restrict__ op, int K, int amax_mode, int rows,
                                                         int groups) {
  pdl_trigger();  // a decode GEMM launched after this with the PDL attribute may start streaming its weights
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int nblk = K >> 4;
  const int o2 = CM == 2 ? groups * 8 : 1;  // uint4 from a block's first 8 operand halves to its last 8
  auto op_at = [&](int b) -> uint4* {  // the first 8 operand halves of block b of this row
    if (CM == 0) return op + ((size_t)row * K + (size_t)b * 16) / 8;
    if (CM == 2) return op + (((size_t)(b >> 3) * 16 + 2 * (b & 7)) * groups + (row >> 3)) * 8 + (row & 7);
    return op + ((((size_t)(row >> 4) * (K >> 7) + (b >> 3)) * 16 + (row & 15)) * TROW + (b & 7) * 32) / 16;
  };
  if (CM && row >= rows) {  // padding row of the last row block
    for (int b = tid; b < nblk; b += 128) {
      uint4* o = op_at(b);
      o[0] = o[o2] = make_uint4(0, 0, 0, 0);
    }
    return;
  }
  const uint4* xr = x + (size_t)row * (K >> 3);
  uint4 v[BPT][2];
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    const int b = tid + j * 128;
    if (b < nblk) {
      v[j][0] = __ldg(xr + 2 * b);
      v[j][1] = __ldg(xr + 2 * b + 1);
    } else {
      v[j][0] = v[j][1] = make_uint4(0, 0, 0, 0);
    }
  }
  float vmax[BPT];
  bool anybad = false;
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    const uint32_t m4 = absmax_bf16x2(absmax_bf16x2(absmax_bf16x2(v[j][0].x, v[j][0].y), absmax_bf16x2(v[j][0].z, v[j][0].w)),
                                      absmax_bf16x2(absmax_bf16x2(v[j][1].x, v[j][1].y), absmax_bf16x2(v[j][1].z, v[j][1].w)));
    const float m = max_nan(fabsf(bf16_lo(m4)), fabsf(bf16_hi(m4)));
    vmax[j] = m;
    anybad |= !(m <= FLT_MAX_F);  // NaN or Inf in the block
  }
  __shared__ float red[4];
  float amax;
  if (amax_mode == 0) {
    const bool rowbad = __syncthreads_or(anybad);
    float m = 0.0f;
    if (!rowbad) {
#pragma unroll
      for (int j = 0; j < BPT; ++j) m = fmaxf(m, vmax[j]);
    } else {  // rare: a block holds NaN/Inf; amax over the finite values only
#pragma unroll
      for (int j = 0; j < BPT; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t ws[4] = {v[j][h].x, v[j][h].y, v[j][h].z, v[j][h].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lo = fabsf(bf16_lo(ws[e])), hi = fabsf(bf16_hi(ws[e]));
            if (lo <= FLT_MAX_F) m = fmaxf(m, lo);
            if (hi <= FLT_MAX_F) m = fmaxf(m, hi);
          }
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    if (tid == 0) amax_p[row] = amax;
  } else {
    amax = amax_p[amax_mode == 1 ? row : 0];
  }
  float s_enc = fminf(__fdiv_rn(2688.0f, amax), FLT_MAX_F);
  if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  const float s_dec = __fdiv_rn(1.0f, s_enc);
  const float mult = __fmul_rn(s_enc, RCP6);
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    const int b = tid + j * 128;
    if (b >= nblk) continue;
    const bool bad = !(vmax[j] <= FLT_MAX_F);
    const uint32_t sb = e4m3_byte(fminf(__fmul_rn(vmax[j], mult), 448.0f));
    const float sf = e4m3_value(sb);
    const float enc = fminf(__fdiv_rn(1.0f, __fmul_rn(sf, s_dec)), FLT_MAX_F);
    uint32_t packed[2];
    uint32_t cds[16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t ws[4] = {v[j][h].x, v[j][h].y, v[j][h].z, v[j][h].w};
      uint32_t p = 0;  // sum of (code + bias) * 16^i, bias removed at the end (IMAD chain, FMA pipe)
#pragma unroll
      for (int e = 3; e >= 0; --e) {
        const uint32_t c1 = e2m1_code(__fmul_rn(bf16_hi(ws[e]), enc));
        const uint32_t c0 = e2m1_code(__fmul_rn(bf16_lo(ws[e]), enc));
        p = (p * 16u + c1) * 16u + c0;
        cds[8 * h + 2 * e] = c0 - CODE_BIAS;
        cds[8 * h + 2 * e + 1] = c1 - CODE_BIAS;
      }
      p -= CODE_BIAS * 0x11111111u;
      packed[h] = bad ? 0u : p;
    }
    codes[(size_t)row * nblk + b] = make_uint2(packed[0], packed[1]);
    scales[(size_t)row * nblk + b] = static_cast<uint8_t>(bad ? 0x7Fu : sb);
    if (EMIT_OP) {  // fp16 E2M1 * sf (exact); NaN for a flagged block
      uint32_t hv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        __half h2[2];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const uint32_t c = cds[2 * e + t];
          const float val = __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28)) * 8.507059173023462e37f * sf;
          h2[t] = __float2half_rn(bad ? __uint_as_float(0x7FC00000u) : val);
        }
        hv[e] = static_cast<uint32_t>(__half_as_ushort(h2[0])) | (static_cast<uint32_t>(__half_as_ushort(h2[1])) << 16);
      }
      uint4* o = op_at(b);
      o[0] = make_uint4(hv[0], hv[1], hv[2], hv[3]);
      o[o2] = make_uint4(hv[4], hv[5], hv[6], hv[7]);
    }
  }
}
