// Decode GEMM, cp.async pipeline (variants 0 and 3, and the fallback of every other variant):
// decode_gemm_kernel. Needs common.cuh.
// Included by nvfp4_native.cu (the one translation unit, built by kernels/nvfp4/native.py) inside its
// anonymous namespace, after the headers listed there before it; not a standalone header.
#pragma once

template <int MT, int STAGES, int CPS, int NT, bool HALF>
__global__ void __launch_bounds__(256 / NT, 1) decode_gemm_kernel(
    const uint4* __restrict__ wq, const uint4* __restrict__ wsc, const float* __restrict__ w_amax, int w_amax_row,
    const __half* __restrict__ a, const float* __restrict__ a_amax, uint16_t* __restrict__ out,
    float* __restrict__ part, int M, int N, int K, int nseg) {
  // 8 / NT warps, each NT tiles of 8 weight rows (64 rows per CTA). One pipeline stage = CPS
  // chunks of 128 K: codes [CPS][4096 B], scales [CPS][512 B], activations [ROWS][CPS*128 + 8] fp16
  // (ROWS = 8 when HALF: M <= 8, ldmatrix.x2, rows 8-15 of the MMA's A operand are zero registers).
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int THREADS = 256 / NT;
  constexpr int KS = KC * CPS;
  constexpr int AROW = (KS + 8) * 2;  // bytes per smem activation row (16 mod 128: conflict-free)
  constexpr int A_OFF = CPS * (W_BYTES + S_BYTES);
  constexpr int ROWS = HALF ? 8 : MT * 16;
  constexpr int STAGE = A_OFF + ROWS * AROW;
  constexpr int PIECES = KS / 8;  // 16-byte pieces per activation row
  constexpr int A_PIECES = ROWS * PIECES;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nb = blockIdx.x;
  const int m0 = blockIdx.y * (16 * MT);
  const int seg = blockIdx.z;
  const int chunks = K / KC;
  const int steps = chunks / nseg / CPS;  // pipeline steps of this K segment
  const int c0 = seg * (chunks / nseg);
  const uint4* wq_blk = wq + (size_t)nb * chunks * (W_BYTES / 16);
  const uint4* sc_blk = wsc + (size_t)nb * chunks * (S_BYTES / 16);

  auto load_stage = [&](int slot, int c) {  // chunks c .. c+CPS-1
    uint8_t* st = smem + slot * STAGE;
#pragma unroll
    for (int j = 0; j < CPS; ++j) {
#pragma unroll
      for (int i = 0; i < 256 / THREADS; ++i) {
        const int p = tid + i * THREADS;
        cp_async16(smem_u32(st + j * W_BYTES + p * 16), wq_blk + (size_t)(c + j) * (W_BYTES / 16) + p, 16);
      }
      if (tid < S_BYTES / 16)
        cp_async16(smem_u32(st + CPS * W_BYTES + j * S_BYTES + tid * 16), sc_blk + (size_t)(c + j) * (S_BYTES / 16) + tid, 16);
    }
#pragma unroll
    for (int i = 0; i < (A_PIECES + THREADS - 1) / THREADS; ++i) {
      const int p = tid + i * THREADS;
      if (A_PIECES % THREADS == 0 || p < A_PIECES) {
        const int r = p / PIECES, col = p % PIECES;
        const int m = m0 + r;
        const __half* src = a + (size_t)(m < M ? m : 0) * K + (size_t)c * KC + col * 8;
        cp_async16(smem_u32(st + A_OFF + r * AROW + col * 16), src, m < M ? 16u : 0u);
      }
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[i][t][0] = acc[i][t][1] = acc[i][t][2] = acc[i][t][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) load_stage(s, c0 + s * CPS);
    cp_commit();
  }
  const int g = lane >> 2;
  const uint32_t a_lane = HALF ? (lane & 7) * AROW + ((lane >> 3) & 1) * 16 : (lane & 15) * AROW + (lane >> 4) * 16;
  for (int i = 0; i < steps; ++i) {
    cp_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nxt = i + STAGES - 1;
      if (nxt < steps) load_stage(nxt % STAGES, c0 + nxt * CPS);
      cp_commit();
    }
    const uint8_t* st = smem + (i % STAGES) * STAGE;
#pragma unroll
    for (int j = 0; j < CPS; ++j) {
      uint32_t wv[NT][4], sc[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int tile = warp * NT + t;
        const uint4 w = *reinterpret_cast<const uint4*>(st + j * W_BYTES + (tile * 32 + lane) * 16);
        wv[t][0] = w.x; wv[t][1] = w.y; wv[t][2] = w.z; wv[t][3] = w.w;
        const uint2 v = *reinterpret_cast<const uint2*>(st + CPS * W_BYTES + j * S_BYTES + tile * 64 + g * 8);
        sc[t][0] = v.x; sc[t][1] = v.y; sc[t][2] = sc[t][3] = 0u;
      }
      bulk_chunk<MT, NT, 16 * AROW, false, 0, false, HALF>(acc, wv, sc, smem_u32(st + A_OFF) + a_lane + j * (KC * 2));
    }
  }
  cp_wait<0>();

  decode_epilogue<MT, NT>(acc, w_amax, w_amax_row, a_amax, out, part, M, N, nseg, nb, m0, seg, warp, lane);
}
