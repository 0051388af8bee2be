// Native (CUDA C++) NVFP4 kernels for sm_89+ (built at first use by kernels/nvfp4/native.py).
//
// 1. decode_gemm: the decode-path GEMM of gemm_tc.py's contract, for M <= 64 tokens.
//    Operands exactly those of the Triton paths: activations fp16 E2M1*sfA, weights fp16
//    E2M1*sfW*2^-7; mma.sync m16n8k16 (f32 += f16*f16) with tokens on the MMA's M side and 8 weight
//    rows per warp on its N side; one fp32 accumulator chain per output along K in increasing
//    order (k16 blocks in order, each k16 fed in natural order to the fragment positions), over
//    the K segment [seg*K/nseg, (seg+1)*K/nseg); nseg == 1: epilogue
//    RN_bf16((acc * 2^7) * ((amaxA * amaxB) * RN(1/(36*448^2)))); nseg > 1: fp32 partials for
//    gemm_tc.reduce_kernel (the same reduction as the Triton decode path).
//    Weights stream in the "native layout" (native.py: native_layout), arranged once per weight
//    version: per 64 rows x 128 K chunk, 4 KB of codes where each thread's 16 bytes are exactly its
//    B fragments for the chunk's 8 k16 steps, then 512 B of scale bytes. A cp.async ring of
//    STAGES chunks (codes, scales and the activation tile) keeps the weight bytes in flight.
//    Register decode: byte i of word w holds the k16-step-2w value of fragment slot i in bits
//    {1,2,3,7} and the step-2w+1 value in bits {4,5,6,0}; (W & 0x8E8E8E8E) and
//    ((W >> 3) & 0x0E0E0E0E) | ((W << 7) & 0x80808080) put each value's bits where an fp16's high
//    byte has them (fp16 = E2M1 * 2^-14 exactly), prmt moves two such bytes into an f16x2, one
//    mul.f16x2 by sf * 2^7 (fp16 bits (b << 7) = sf * 2^-8 for every E4M3 byte b, times 2^15)
//    gives E2M1 * sf * 2^-7 exactly.
// 2. quantize_rows: the per-token (or given-amax) NVFP4 quantizer of ref.py, bit for bit; one CTA
//    of 128 threads per row, whole 16-value blocks per thread held in registers, 16-byte loads,
//    integer E2M1 rounding, hardware E4M3 conversion, packed 8-byte code stores.
#ifndef NVFP4_KERNELS_ONLY  // (defined for a compile check of the kernels without torch)
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <cuda_fp16.h>
#include <cstdint>

namespace {

constexpr int KC = 128;        // K per chunk (one pipeline stage)
constexpr int W_BYTES = 4096;  // codes per (64 rows, chunk)
constexpr int S_BYTES = 512;   // scales per (64 rows, chunk)
constexpr float RCP_ALPHA = 1.3840171675383317e-07f;  // RN(1 / (36 * 448^2))

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint16_t bf16_bits_rne(float x) {  // as gemm_tc.bf16_bits_rne
  uint32_t u = __float_as_uint(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

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
      uint32_t wv[NT][4];
      uint2 sc[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int tile = warp * NT + t;
        const uint4 w = *reinterpret_cast<const uint4*>(st + j * W_BYTES + (tile * 32 + lane) * 16);
        wv[t][0] = w.x; wv[t][1] = w.y; wv[t][2] = w.z; wv[t][3] = w.w;
        sc[t] = *reinterpret_cast<const uint2*>(st + CPS * W_BYTES + j * S_BYTES + tile * 64 + g * 8);
      }
      const uint32_t a_base = smem_u32(st + A_OFF) + a_lane + j * (KC * 2);
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        uint32_t va[NT], vb[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const uint32_t W = wv[t][wi];
          va[t] = W & 0x8E8E8E8Eu;
          vb[t] = ((W >> 3) & 0x0E0E0E0Eu) | ((W << 7) & 0x80808080u);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = 2 * wi + h;
          uint32_t af[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if (HALF) {
              ldmatrix_x2(af[mt][0], af[mt][2], a_base + s * 32);
              af[mt][1] = 0u;
              af[mt][3] = 0u;
            } else {
              ldmatrix_x4(af[mt], a_base + mt * 16 * AROW + s * 32);
            }
          }
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            const uint32_t v = h ? vb[t] : va[t];
            const uint32_t sw = s < 4 ? sc[t].x : sc[t].y;
            // {b, 0, b, 0} << 7: fp16 bits of sf * 2^-8 in both halves; * 2^15 -> sf * 2^7 (exact)
            const uint32_t sbits = prmt(sw, 0u, 0x4040u | ((s & 3) * 0x0101u)) << 7;
            const uint32_t scale = hmul2(sbits, 0x78007800u);
            const uint32_t b0 = hmul2(prmt(v, 0u, 0x1404u), scale);  // {k = 2q, 2q+1}
            const uint32_t b1 = hmul2(prmt(v, 0u, 0x3424u), scale);  // {k = 2q+8, 2q+9}
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma16816(acc[mt][t], af[mt], b0, b1);
          }
        }
      }
    }
  }
  cp_wait<0>();

  const int q = lane & 3;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int n = nb * 64 + (warp * NT + t) * 8 + 2 * q;
    float ba0 = 0.0f, ba1 = 0.0f;
    if (nseg == 1) {
      ba0 = w_amax[w_amax_row ? (n < N ? n : N - 1) : 0];
      ba1 = w_amax[w_amax_row ? (n + 1 < N ? n + 1 : N - 1) : 0];
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = m0 + mt * 16 + g + 8 * hh;
        if (m >= M) continue;
        const float t0 = acc[mt][t][2 * hh], t1 = acc[mt][t][2 * hh + 1];
        if (nseg == 1) {
          const float aa = a_amax[m];
          const float r0 = __fmul_rn(__fmul_rn(t0, 128.0f), __fmul_rn(__fmul_rn(aa, ba0), RCP_ALPHA));
          const float r1 = __fmul_rn(__fmul_rn(t1, 128.0f), __fmul_rn(__fmul_rn(aa, ba1), RCP_ALPHA));
          if (n < N) out[(size_t)m * N + n] = bf16_bits_rne(r0);
          if (n + 1 < N) out[(size_t)m * N + n + 1] = bf16_bits_rne(r1);
        } else {
          float* pp = part + ((size_t)seg * M + m) * N;
          if (n < N) pp[n] = t0;
          if (n + 1 < N) pp[n + 1] = t1;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// decode GEMM on wgmma (sm_90a): the same contract; one warpgroup per 64 weight rows, weights as the
// register A operand (m64: warp w's two 8-row tiles 2w, 2w+1 are exactly its m16 A fragment in the
// native layout), the NTOK tokens as the shared-memory B operand (K-major core matrices, no
// swizzle), one m64nNTOKk16 wgmma per k16 block in K order into one accumulator (the tensor core
// pipelines the dependent accumulation, where mma.sync waits for each result).

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }

template <int NTOK>
__device__ __forceinline__ void wgmma_k16(float (&d)[NTOK / 2], const uint32_t (&a)[4], uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (NTOK == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
#endif
}

__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {  // no swizzle
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

template <int NTOK, int STAGES, int CPS>
__global__ void __launch_bounds__(128, 1) decode_wgmma_kernel(
    const uint4* __restrict__ wq, const uint4* __restrict__ wsc, const float* __restrict__ w_amax, int w_amax_row,
    const __half* __restrict__ a, const float* __restrict__ a_amax, uint16_t* __restrict__ out,
    float* __restrict__ part, int M, int N, int K, int nseg) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // stage = CPS chunks: codes [CPS][4096 B], scales [CPS][512 B], tokens [NTOK/8][KS/8] core
  // matrices of 8 tokens x 8 k (128 B): byte (n/8)*SBO + (k/8)*128 + (n%8)*16 + (k%8)*2
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int KS = KC * CPS;
  constexpr int SBO = (KS / 8) * 128;
  constexpr int B_OFF = CPS * (W_BYTES + S_BYTES);
  constexpr int STAGE = B_OFF + (NTOK / 8) * SBO;
  constexpr int B_PIECES = NTOK * (KS / 8);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nb = blockIdx.x;
  const int m0 = blockIdx.y * NTOK;
  const int seg = blockIdx.z;
  const int chunks = K / KC;
  const int steps = chunks / nseg / CPS;
  const int c0 = seg * (chunks / nseg);
  const uint4* wq_blk = wq + (size_t)nb * chunks * (W_BYTES / 16);
  const uint4* sc_blk = wsc + (size_t)nb * chunks * (S_BYTES / 16);

  auto load_stage = [&](int slot, int c) {
    uint8_t* st = smem + slot * STAGE;
#pragma unroll
    for (int j = 0; j < CPS; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int p = tid + i * 128;
        cp_async16(smem_u32(st + j * W_BYTES + p * 16), wq_blk + (size_t)(c + j) * (W_BYTES / 16) + p, 16);
      }
      if (tid < S_BYTES / 16)
        cp_async16(smem_u32(st + CPS * W_BYTES + j * S_BYTES + tid * 16), sc_blk + (size_t)(c + j) * (S_BYTES / 16) + tid, 16);
    }
#pragma unroll
    for (int i = 0; i < (B_PIECES + 127) / 128; ++i) {
      const int p = tid + i * 128;
      if (B_PIECES % 128 == 0 || p < B_PIECES) {
        const int n = p / (KS / 8), kg = p % (KS / 8);
        const int m = m0 + n;
        const __half* src = a + (size_t)(m < M ? m : 0) * K + (size_t)c * KC + kg * 8;
        cp_async16(smem_u32(st + B_OFF + (n >> 3) * SBO + kg * 128 + (n & 7) * 16), src, m < M ? 16u : 0u);
      }
    }
  };

  float d[NTOK / 2];
#pragma unroll
  for (int i = 0; i < NTOK / 2; ++i) d[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < steps) load_stage(s, c0 + s * CPS);
    cp_commit();
  }
  const int g = lane >> 2;
  uint32_t abuf[CPS][8][4];  // A fragments of the stage's CPS chunks (8 k16 blocks each)
  for (int i = 0; i < steps; ++i) {
    cp_wait<STAGES - 3>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    {
      const int nxt = i + STAGES - 2;  // slot of stage i-2: its wgmmas completed (waited below)
      if (nxt < steps) load_stage(nxt % STAGES, c0 + nxt * CPS);
      cp_commit();
    }
    const uint8_t* st = smem + (i % STAGES) * STAGE;
    const uint32_t b_base = smem_u32(st + B_OFF);
#pragma unroll
    for (int j = 0; j < CPS; ++j) {
      uint32_t wv[2][4];
      uint2 sc[2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int tile = warp * 2 + t;
        const uint4 w = *reinterpret_cast<const uint4*>(st + j * W_BYTES + (tile * 32 + lane) * 16);
        wv[t][0] = w.x; wv[t][1] = w.y; wv[t][2] = w.z; wv[t][3] = w.w;
        sc[t] = *reinterpret_cast<const uint2*>(st + CPS * W_BYTES + j * S_BYTES + tile * 64 + g * 8);
      }
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const uint32_t W = wv[t][wi];
          const uint32_t va = W & 0x8E8E8E8Eu;
          const uint32_t vb = ((W >> 3) & 0x0E0E0E0Eu) | ((W << 7) & 0x80808080u);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int s = 2 * wi + h;
            const uint32_t v = h ? vb : va;
            const uint32_t sw = s < 4 ? sc[t].x : sc[t].y;
            const uint32_t scale = hmul2(prmt(sw, 0u, 0x4040u | ((s & 3) * 0x0101u)) << 7, 0x78007800u);
            abuf[j][s][t] = hmul2(prmt(v, 0u, 0x1404u), scale);      // a0a1 (t=0) / a2a3 (t=1): k 2q, 2q+1
            abuf[j][s][2 + t] = hmul2(prmt(v, 0u, 0x3424u), scale);  // a4a5 / a6a7: k 2q+8, 2q+9
          }
        }
      }
      wg_fence();
#pragma unroll
      for (int k = 0; k < NTOK / 2; ++k) pin(d[k]);
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const uint32_t addr = b_base + (j * 16 + s * 2) * 128;
        wgmma_k16<NTOK>(d, abuf[j][s], smem_desc(addr, 128, SBO));
      }
      wg_commit();
#pragma unroll
      for (int k = 0; k < NTOK / 2; ++k) pin(d[k]);
      // all groups but this one done: the other A buffer and the stage before are free again (one
      // chunk per stage: wait for this one too, its A buffer is rewritten next)
      wg_wait<CPS == 1 ? 0 : 1>();
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int k = 0; k < NTOK / 2; ++k) pin(d[k]);
  cp_wait<0>();

  const int q = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int n = nb * 64 + warp * 16 + g + 8 * hh;  // weight row
    if (n >= N) continue;
    const float ba = nseg == 1 ? w_amax[w_amax_row ? n : 0] : 0.0f;
#pragma unroll
    for (int nt = 0; nt < NTOK / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + nt * 8 + 2 * q + e;  // token
        if (m >= M) continue;
        const float acc = d[nt * 4 + 2 * hh + e];
        if (nseg == 1) {
          const float r = __fmul_rn(__fmul_rn(acc, 128.0f), __fmul_rn(__fmul_rn(a_amax[m], ba), RCP_ALPHA));
          out[(size_t)m * N + n] = bf16_bits_rne(r);
        } else {
          part[((size_t)seg * M + m) * N + n] = acc;
        }
      }
    }
  }
#else
  __trap();  // built without sm_90a: never launched (native.py checks the architecture)
#endif
}

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
template <int BPT, bool EMIT_OP>
__global__ void __launch_bounds__(128) quant_rows_kernel(const uint4* __restrict__ x, float* __restrict__ amax_p,
                                                         uint2* __restrict__ codes, uint8_t* __restrict__ scales,
                                                         uint4* __restrict__ op, int K, int amax_mode) {
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int nblk = K >> 4;
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
      uint4* o = op + ((size_t)row * K + (size_t)b * 16) / 8;
      o[0] = make_uint4(hv[0], hv[1], hv[2], hv[3]);
      o[1] = make_uint4(hv[4], hv[5], hv[6], hv[7]);
    }
  }
}

}  // namespace

#ifndef NVFP4_KERNELS_ONLY
namespace {

template <int MT, int STAGES, int CPS, int NT, bool HALF>
void launch_decode(const torch::Tensor& wq, const torch::Tensor& wsc, const torch::Tensor& w_amax, bool w_amax_row,
                   const torch::Tensor& a, const torch::Tensor& a_amax, torch::Tensor& out, torch::Tensor& part, int M,
                   int N, int K, int nseg) {
  constexpr int STAGE = CPS * (W_BYTES + S_BYTES) + (HALF ? 8 : MT * 16) * (KC * CPS + 8) * 2;
  constexpr int SMEM = STAGES * STAGE;
  auto kern = decode_gemm_kernel<MT, STAGES, CPS, NT, HALF>;
  static bool attr = false;
  if (!attr) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    attr = true;
  }
  dim3 grid((N + 63) / 64, (M + 16 * MT - 1) / (16 * MT), nseg);
  auto stream = c10::cuda::getCurrentCUDAStream();
  kern<<<grid, 256 / NT, SMEM, stream>>>(
      reinterpret_cast<const uint4*>(wq.data_ptr()), reinterpret_cast<const uint4*>(wsc.data_ptr()),
      w_amax.data_ptr<float>(), w_amax_row ? 1 : 0, reinterpret_cast<const __half*>(a.data_ptr()),
      a_amax.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()), part.data_ptr<float>(), M, N, K, nseg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int NTOK, int STAGES, int CPS>
void launch_wgmma(const torch::Tensor& wq, const torch::Tensor& wsc, const torch::Tensor& w_amax, bool w_amax_row,
                  const torch::Tensor& a, const torch::Tensor& a_amax, torch::Tensor& out, torch::Tensor& part, int M,
                  int N, int K, int nseg) {
  constexpr int STAGE = CPS * (W_BYTES + S_BYTES) + (NTOK / 8) * (KC * CPS / 8) * 128;
  constexpr int SMEM = STAGES * STAGE;
  auto kern = decode_wgmma_kernel<NTOK, STAGES, CPS>;
  static bool attr = false;
  if (!attr) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    attr = true;
  }
  dim3 grid((N + 63) / 64, (M + NTOK - 1) / NTOK, nseg);
  auto stream = c10::cuda::getCurrentCUDAStream();
  kern<<<grid, 128, SMEM, stream>>>(
      reinterpret_cast<const uint4*>(wq.data_ptr()), reinterpret_cast<const uint4*>(wsc.data_ptr()),
      w_amax.data_ptr<float>(), w_amax_row ? 1 : 0, reinterpret_cast<const __half*>(a.data_ptr()),
      a_amax.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()), part.data_ptr<float>(), M, N, K, nseg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int BPT>
void launch_quant(const torch::Tensor& x, torch::Tensor& amax, torch::Tensor& codes, torch::Tensor& scales,
                  torch::Tensor& op, bool emit_op, int amax_mode) {
  const int rows = x.size(0), K = x.size(1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint4* xp = reinterpret_cast<const uint4*>(x.data_ptr());
  uint2* cp = reinterpret_cast<uint2*>(codes.data_ptr());
  uint8_t* sp = scales.data_ptr<uint8_t>();
  uint4* opp = reinterpret_cast<uint4*>(op.data_ptr());
  if (emit_op)
    quant_rows_kernel<BPT, true><<<rows, 128, 0, stream>>>(xp, amax.data_ptr<float>(), cp, sp, opp, K, amax_mode);
  else
    quant_rows_kernel<BPT, false><<<rows, 128, 0, stream>>>(xp, amax.data_ptr<float>(), cp, sp, opp, K, amax_mode);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void decode_gemm(torch::Tensor wq, torch::Tensor wsc, torch::Tensor w_amax, bool w_amax_row, torch::Tensor a,
                 torch::Tensor a_amax, torch::Tensor out, torch::Tensor part, int64_t M, int64_t N, int64_t K,
                 int64_t nseg, int64_t variant) {
  TORCH_CHECK(K % KC == 0 && (K / KC) % nseg == 0, "decode_gemm: K must be a multiple of 128 * nseg");
  TORCH_CHECK(a.scalar_type() == at::kHalf && a.is_contiguous(), "decode_gemm: fp16 contiguous activations");
  TORCH_CHECK(M >= 1, "decode_gemm: M >= 1");
  const c10::cuda::CUDAGuard guard(a.device());
  const int m = M, n = N, k = K, s = nseg;
  // variants (M <= 16): 0: mma.sync, 2 weight tiles per warp, 6 stages x 2 chunks; 3: 8 stages x 1
  // chunk; 4, 5: wgmma, 6 or 8 stages x 2 chunks. Two chunks per stage need an even chunk count per
  // K segment (else one). M <= 8: token rows 0-7 only (ldmatrix.x2 / m64n8).
  const bool two = (K / KC / nseg) % 2 == 0;
  const bool half = M <= 8;
#define MP_DEC(MT_, ST_, CPS_, NT_, H_) \
  launch_decode<MT_, ST_, CPS_, NT_, H_>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s)
  if (M <= 16 && variant >= 4) {  // wgmma (sm_90a builds only; native.py checks): 4: 6 stages, 5: 8 stages
    if (two) {
      if (variant == 5) {
        if (half) launch_wgmma<8, 8, 2>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
        else launch_wgmma<16, 8, 2>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
      } else {
        if (half) launch_wgmma<8, 6, 2>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
        else launch_wgmma<16, 6, 2>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
      }
    } else {
      if (half) launch_wgmma<8, 8, 1>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
      else launch_wgmma<16, 8, 1>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
    }
  } else if (M <= 16) {
    if (!two || variant == 3) {
      if (half) MP_DEC(1, 8, 1, 2, true); else MP_DEC(1, 8, 1, 2, false);
    } else {
      if (half) MP_DEC(1, 6, 2, 2, true); else MP_DEC(1, 6, 2, 2, false);
    }
  } else if (M <= 32) {
    if (two) MP_DEC(2, 6, 2, 2, false); else MP_DEC(2, 6, 1, 2, false);
  } else {
    if (two) MP_DEC(4, 4, 2, 2, false); else MP_DEC(4, 4, 1, 2, false);
  }
#undef MP_DEC
}

void quantize_rows(torch::Tensor x, torch::Tensor amax, torch::Tensor codes, torch::Tensor scales, torch::Tensor op,
                   bool emit_op, int64_t amax_mode) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2, "quantize_rows: bf16 [rows, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 16 == 0 && k <= 16384, "quantize_rows: K % 16 == 0 and K <= 16384");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t nblk = k / 16;
  const int mode = static_cast<int>(amax_mode);
  if (nblk <= 128) launch_quant<1>(x, amax, codes, scales, op, emit_op, mode);
  else if (nblk <= 256) launch_quant<2>(x, amax, codes, scales, op, emit_op, mode);
  else if (nblk <= 512) launch_quant<4>(x, amax, codes, scales, op, emit_op, mode);
  else launch_quant<8>(x, amax, codes, scales, op, emit_op, mode);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_gemm", &decode_gemm, "NVFP4 decode GEMM (native layout weights, fp16 activation operand)");
  m.def("quantize_rows", &quantize_rows, "NVFP4 per-token / given-amax quantizer, bf16 rows");
}
#else
// kernels-only build (compile check): take the instances' addresses so they are compiled
void* nvfp4_instances[] = {(void*)decode_gemm_kernel<1, 6, 2, 2, false>, (void*)decode_gemm_kernel<1, 6, 2, 2, true>,
                           (void*)decode_gemm_kernel<4, 4, 2, 2, false>,
                           (void*)decode_wgmma_kernel<16, 6, 2>, (void*)decode_wgmma_kernel<8, 6, 2>, (void*)quant_rows_kernel<4, false>,
                           (void*)quant_rows_kernel<4, true>};
#endif
