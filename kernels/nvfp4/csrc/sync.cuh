// The weight sync (kernels/nvfp4/sync.py): bf16 weights -> every prepared NVFP4 layout, bit for bit
// the Triton kernels' (_amax_kernel, _sync_kernel) and so the reference path's.
// Included by nvfp4_native.cu (the one translation unit, built by kernels/nvfp4/native.py) inside its
// anonymous namespace, after quantize.cuh (e2m1_code, e4m3_byte, e4m3_value, FLT_MAX_F, RCP6, CODE_BIAS)
// and common.cuh (prmt); not a standalone header.
//
// One int64 table row per shard (SYNC_COLS columns), shared by both kernels:
//   0 x offset (bf16 elements from x_base: the shard's first element; 16-byte aligned), 1 rows n, 2 K,
//   3 amax slot (float index in ab: the amax kernel's max; its flag, int32 bits, at slot + 3),
//   4 amax index the quantizer reads (ab float index), 5-10 byte offsets in ``out`` of codes, scales,
//   dec, dsc, wq, ws16 (wq < 0: no native layout; dec < 0: none, the shards with the native layout),
//   11 first program of the amax kernel, 12 first
//   program of the fused kernel, 13 chunk groups per 64-row tile (fused kernel).
// A program finds its shard by a binary search of its first-program column (no per-program table).
#pragma once

constexpr int SYNC_COLS = 16;
constexpr int SYNC_THREADS = 256;
constexpr int SYNC_AMAX_VEC = 8;    // uint4 loads per thread and step (in flight together)
constexpr int SYNC_AMAX_STEPS = 4;  // steps per program
constexpr int SYNC_AMAX_ELEMS = SYNC_THREADS * SYNC_AMAX_VEC * SYNC_AMAX_STEPS * 8;  // bf16 per program (128 KB)
constexpr int SYNC_CH = 8;  // 128-wide K chunks per program of the fused kernel (2 per step of 256 threads)

// the item whose first program (column col) is the last <= p (items without programs are skipped)
__device__ __forceinline__ int sync_find(const long long* __restrict__ tab, int items, int col, long long p) {
  int lo = 0, hi = items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(tab + (size_t)mid * SYNC_COLS + col) <= p) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// |bits| of two bf16 (0x7FFF7FFF masked) -> their finite parts (non-finite halves 0) and the
// non-finite mask (0xFFFF per non-finite half)
__device__ __forceinline__ uint32_t sync_nonfinite(uint32_t a) { return __vcmpgeu2(a, 0x7F807F80u); }

// Program p: SYNC_AMAX_ELEMS elements of one shard (contiguous: rows of a row-major weight). The finite
// max |x| (as bf16 bits: order of the non-negative values) and the non-finite flag (2 NaN, 1 Inf: the
// max of |bits| over everything is > 0x7F80 iff a NaN, == 0x7F80 iff an Inf and no NaN), max-ed into
// ab[slot] (fp32 bits as int: non-negative) and ab[slot + 3] (int32; ab zeroed). Exactly _amax_kernel's.
__global__ void __launch_bounds__(SYNC_THREADS) sync_amax_kernel(const uint16_t* __restrict__ x_base,
                                                                 const long long* __restrict__ tab, int items,
                                                                 int* __restrict__ ab) {
  const long long p = blockIdx.x;
  const int it = sync_find(tab, items, 11, p);
  const long long* row = tab + (size_t)it * SYNC_COLS;
  const long long numel = __ldg(row + 1) * __ldg(row + 2);
  const long long e0 = (p - __ldg(row + 11)) * SYNC_AMAX_ELEMS;
  const uint4* xp = reinterpret_cast<const uint4*>(x_base + __ldg(row) + e0);
  const long long left = (numel - e0) >> 3;  // uint4 left in the shard (numel % 32 == 0)
  const int nv = left < SYNC_AMAX_ELEMS / 8 ? static_cast<int>(left) : SYNC_AMAX_ELEMS / 8;
  const int tid = threadIdx.x;
  uint32_t mfin = 0u, mall = 0u;  // u16x2 maxima of the finite |bits| and of all |bits|
#pragma unroll 1
  for (int s = 0; s < SYNC_AMAX_STEPS; ++s) {
    uint4 v[SYNC_AMAX_VEC];
#pragma unroll
    for (int i = 0; i < SYNC_AMAX_VEC; ++i) {
      const int idx = (s * SYNC_AMAX_VEC + i) * SYNC_THREADS + tid;
      v[i] = idx < nv ? __ldcs(xp + idx) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < SYNC_AMAX_VEC; ++i) {
      const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t a = w[e] & 0x7FFF7FFFu;
        mall = __vmaxu2(mall, a);
        mfin = __vmaxu2(mfin, a & ~sync_nonfinite(a));
      }
    }
  }
  uint32_t fin = max(mfin & 0xFFFFu, mfin >> 16), all = max(mall & 0xFFFFu, mall >> 16);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    fin = max(fin, __shfl_xor_sync(0xFFFFFFFFu, fin, o));
    all = max(all, __shfl_xor_sync(0xFFFFFFFFu, all, o));
  }
  __shared__ uint32_t red[2][SYNC_THREADS / 32];
  if ((tid & 31) == 0) {
    red[0][tid >> 5] = fin;
    red[1][tid >> 5] = all;
  }
  __syncthreads();
  if (tid == 0) {
#pragma unroll
    for (int i = 1; i < SYNC_THREADS / 32; ++i) {
      fin = max(fin, red[0][i]);
      all = max(all, red[1][i]);
    }
    const int slot = static_cast<int>(__ldg(row + 3));
    if (fin) atomicMax(ab + slot, static_cast<int>(fin << 16));  // fp32 bits of a non-negative value
    const int flag = all > 0x7F80u ? 2 : all == 0x7F80u ? 1 : 0;
    if (flag) atomicMax(ab + slot + 3, flag);
  }
}

// One 1x16 block (bf16 bits in two uint4) -> its standard-packed codes (nibble i = code i), scale
// byte (0x7F and codes 0 for a non-finite block or a NaN amax row) and sf (from the finite max |x|,
// as the Triton kernel's); the arithmetic of _quant_half / quant_rows_kernel.
__device__ __forceinline__ void sync_block(const uint4& lo, const uint4& hi, float s_dec, float mult, bool nanrow,
                                           uint32_t (&packed)[2], uint32_t& sbyte, float& sf) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint32_t mf = 0u, nf = 0u;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t a = w[e] & 0x7FFF7FFFu;
    const uint32_t m = sync_nonfinite(a);
    nf |= m;
    mf = __vmaxu2(mf, a & ~m);
  }
  const float vmax = __uint_as_float(max(mf & 0xFFFFu, mf >> 16) << 16);
  const bool bad = nanrow || nf != 0u;
  const uint32_t sb = e4m3_byte(fminf(__fmul_rn(vmax, mult), 448.0f));
  sf = e4m3_value(sb);
  const float enc = fminf(__fdiv_rn(1.0f, __fmul_rn(sf, s_dec)), FLT_MAX_F);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t p = 0u;  // sum of (code + bias) * 16^i, bias removed at the end
#pragma unroll
    for (int e = 3; e >= 0; --e) {
      const uint32_t x = w[4 * h + e];
      const uint32_t c1 = e2m1_code(__fmul_rn(bf16_hi(x), enc));
      const uint32_t c0 = e2m1_code(__fmul_rn(bf16_lo(x), enc));
      p = (p * 16u + c1) * 16u + c0;
    }
    p -= CODE_BIAS * 0x11111111u;
    packed[h] = bad ? 0u : p;
  }
  sbyte = bad ? 0x7Fu : sb;
}

// eight codes a (nibble i = code i) with eight codes b -> the 8 bytes a_i | b_i << 4 (two words)
__device__ __forceinline__ void sync_pair(uint32_t a, uint32_t b, uint32_t& w0, uint32_t& w1) {
  const uint32_t even = (a & 0x0F0F0F0Fu) | ((b << 4) & 0xF0F0F0F0u);  // i = 0, 2, 4, 6
  const uint32_t odd = ((a >> 4) & 0x0F0F0F0Fu) | (b & 0xF0F0F0F0u);   // i = 1, 3, 5, 7
  w0 = prmt(even, odd, 0x5140u);
  w1 = prmt(even, odd, 0x7362u);
}

// per byte: (lo | hi << 4) -> native_layout's byte: lo in bits {1,2,3,7}, hi in bits {4,5,6,0}
__device__ __forceinline__ uint32_t sync_native_bits(uint32_t m) {
  return ((m & 0x07070707u) << 1) | ((m & 0x08080808u) << 4) | (m & 0x70707070u) | ((m >> 7) & 0x01010101u);
}

// the native words (q = 0..3) of the block pair (A: block 2w, B: block 2w + 1; standard-packed codes,
// [0] codes 0-7, [1] codes 8-15): byte i of word q holds k = KK[q][i] = (2q, 2q+8, 2q+1, 2q+9)
__device__ __forceinline__ void sync_native_words(const uint32_t (&A)[2], const uint32_t (&B)[2], uint32_t (&out)[4]) {
  const uint32_t e0 = (A[0] & 0x0F0F0F0Fu) | ((B[0] << 4) & 0xF0F0F0F0u);  // k = 0, 2, 4, 6
  const uint32_t o0 = ((A[0] >> 4) & 0x0F0F0F0Fu) | (B[0] & 0xF0F0F0F0u);  // k = 1, 3, 5, 7
  const uint32_t e1 = (A[1] & 0x0F0F0F0Fu) | ((B[1] << 4) & 0xF0F0F0F0u);  // k = 8, 10, 12, 14
  const uint32_t o1 = ((A[1] >> 4) & 0x0F0F0F0Fu) | (B[1] & 0xF0F0F0F0u);  // k = 9, 11, 13, 15
  const uint32_t x = prmt(e0, e1, 0x5140u), y = prmt(e0, e1, 0x7362u);
  const uint32_t xo = prmt(o0, o1, 0x5140u), yo = prmt(o0, o1, 0x7362u);
  out[0] = sync_native_bits(prmt(x, xo, 0x5410u));
  out[1] = sync_native_bits(prmt(x, xo, 0x7632u));
  out[2] = sync_native_bits(prmt(y, yo, 0x5410u));
  out[3] = sync_native_bits(prmt(y, yo, 0x7632u));
}

// Program p: one 64-row tile of a shard x SYNC_CH 128-wide K chunks (K % 128 == 0). Thread t: row
// (t >> 1) & 63 of the tile, chunk parity t >> 7, and wp = t & 1: the blocks {2wp, 2wp+1, 4+2wp, 5+2wp}
// of the chunk (64 values, 8 uint4 loads), whose outputs it produces alone (codes, dec: 16-byte stores)
// or with its partner lane t ^ 1 (one shuffle per word: scales, dsc 4-byte, ws16 8-byte, wq 16-byte
// stores). Padding rows of the last tile: dec, dsc, wq, ws16 zero (as the reference's zero padding).
__global__ void __launch_bounds__(SYNC_THREADS) sync_quant_kernel(const uint16_t* __restrict__ x_base,
                                                                  const long long* __restrict__ tab, int items,
                                                                  const float* __restrict__ ab,
                                                                  uint8_t* __restrict__ out) {
  const long long p = blockIdx.x;
  const int it = sync_find(tab, items, 12, p);
  const long long* row = tab + (size_t)it * SYNC_COLS;
  const long long n = __ldg(row + 1);
  const int K = static_cast<int>(__ldg(row + 2));
  const int cg = static_cast<int>(__ldg(row + 13));
  const long long q = p - __ldg(row + 12);
  const long long tile = q / cg;
  const int g = static_cast<int>(q - tile * cg);
  const int chunks = K >> 7;
  const int tid = threadIdx.x, wp = tid & 1, rl = (tid >> 1) & 63;
  const long long r = tile * 64 + rl;
  const bool real = r < n;
  const float amax = __ldg(ab + __ldg(row + 4));
  float s_enc = fminf(__fdiv_rn(2688.0f, amax), FLT_MAX_F);
  if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  const float s_dec = __fdiv_rn(1.0f, s_enc);
  const float mult = __fmul_rn(s_enc, RCP6);
  const bool nanrow = real && amax != amax;  // a NaN shared amax: every block flagged (real rows only)
  const uint16_t* xr = x_base + __ldg(row) + r * K;
  uint8_t* codes = out + __ldg(row + 5) + r * (K >> 1);
  uint8_t* scales = out + __ldg(row + 6) + r * (K >> 4);
  const long long dec_off = __ldg(row + 7);  // < 0: no decode-layout tiles (a shard with the native layout)
  uint8_t* dec = out + dec_off + rl * 64;
  uint8_t* dsc = out + __ldg(row + 8) + rl * 8;
  const long long wq_off = __ldg(row + 9);
  uint8_t* wq = out + wq_off + rl * 64;
  uint8_t* ws16 = out + __ldg(row + 10) + rl * 16;
  const int c_end = min(chunks, (g + 1) * SYNC_CH);
#pragma unroll 1
  for (int c = g * SYNC_CH + (tid >> 7); c < c_end; c += 2) {  // uniform per warp (one chunk parity)
    uint4 v[8];
    if (real) {
      const uint4* xc = reinterpret_cast<const uint4*>(xr + c * 128);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = __ldg(xc + 4 * wp + i);
        v[4 + i] = __ldg(xc + 8 + 4 * wp + i);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    // local blocks 0, 1: 2wp, 2wp + 1 (half 0); 2, 3: 4 + 2wp, 5 + 2wp (half 1)
    uint32_t pk[4][2], sb[4];
    float sf[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      sync_block(v[2 * b], v[2 * b + 1], s_dec, mult, nanrow, pk[b], sb[b], sf[b]);
      if (!real) {
        pk[b][0] = pk[b][1] = sb[b] = 0u;
        sf[b] = 0.0f;
      }
    }
    const size_t tix = (size_t)tile * chunks + c;
    if (real) {  // codes: bytes 16wp and 32 + 16wp of the chunk's 64; scales below
      uint4* cp = reinterpret_cast<uint4*>(codes + c * 64);
      cp[wp] = make_uint4(pk[0][0], pk[0][1], pk[1][0], pk[1][1]);
      cp[2 + wp] = make_uint4(pk[2][0], pk[2][1], pk[3][0], pk[3][1]);
    }
    if (dec_off >= 0) {  // dec: byte j = code j | code 64 + j << 4: bytes [32wp, 32wp + 32) pair blocks (0, 2), (1, 3)
      uint32_t d[8];
      sync_pair(pk[0][0], pk[2][0], d[0], d[1]);
      sync_pair(pk[0][1], pk[2][1], d[2], d[3]);
      sync_pair(pk[1][0], pk[3][0], d[4], d[5]);
      sync_pair(pk[1][1], pk[3][1], d[6], d[7]);
      uint4* dp = reinterpret_cast<uint4*>(dec + tix * 4096);
      dp[2 * wp] = make_uint4(d[0], d[1], d[2], d[3]);
      dp[2 * wp + 1] = make_uint4(d[4], d[5], d[6], d[7]);
    }
    {  // scale bytes of blocks 2wp, 2wp+1 (s0) and 4+2wp, 5+2wp (s1); lane wp stores bytes [4wp, 4wp + 4)
      const uint32_t s0 = sb[0] | (sb[1] << 8), s1 = sb[2] | (sb[3] << 8);
      const uint32_t got = __shfl_xor_sync(0xFFFFFFFFu, wp ? s0 : s1, 1);
      const uint32_t word = wp ? (got | (s1 << 16)) : (s0 | (got << 16));
      if (real) *reinterpret_cast<uint32_t*>(scales + c * 8 + 4 * wp) = word;
      *reinterpret_cast<uint32_t*>(dsc + tix * 512 + 4 * wp) = word;
    }
    if (wq_off >= 0) {  // the native layout: words q * 4 + 2s + wp (s: half), fp16 sf * 2^7 at 4s + j
      uint32_t nw[2][4];
      sync_native_words(pk[0], pk[1], nw[0]);
      sync_native_words(pk[2], pk[3], nw[1]);
      uint32_t got[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // lane 0 keeps q = 0, 1 and lane 1 q = 2, 3 (j = 2 qq + s)
        const int qq = j >> 1, s = j & 1;
        got[j] = __shfl_xor_sync(0xFFFFFFFFu, wp ? nw[s][qq] : nw[s][2 + qq], 1);
      }
      uint4* wp4 = reinterpret_cast<uint4*>(wq + tix * 4096);
#pragma unroll
      for (int qq = 0; qq < 2; ++qq) {
        wp4[2 * wp + qq] = wp ? make_uint4(got[2 * qq], nw[0][2 + qq], got[2 * qq + 1], nw[1][2 + qq])
                              : make_uint4(nw[0][qq], got[2 * qq], nw[1][qq], got[2 * qq + 1]);
      }
      uint32_t h[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) h[b] = __half_as_ushort(__float2half_rn(__fmul_rn(sf[b], 128.0f)));
      const uint32_t f0 = h[0] | (h[1] << 16), f1 = h[2] | (h[3] << 16);
      const uint32_t fg = __shfl_xor_sync(0xFFFFFFFFu, wp ? f0 : f1, 1);
      *reinterpret_cast<uint2*>(ws16 + tix * 1024 + 8 * wp) = wp ? make_uint2(fg, f1) : make_uint2(f0, fg);
    }
  }
}
