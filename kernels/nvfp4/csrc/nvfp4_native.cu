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
//    STAGES chunks (codes, scales and the activation tile) keeps the weight bytes in flight
//    (decode_gemm_kernel), or a producer warp's cp.async.bulk copies on mbarriers
//    (decode_bulk_kernel; with TOKC the token operand chunk-major, one bulk copy per stage: the
//    default, variant 14 of native.py).
//    Register decode: byte i of word w holds the k16-step-2w value of fragment slot i in bits
//    {1,2,3,7} and the step-2w+1 value in bits {4,5,6,0}; (W & 0x8E8E8E8E) and
//    ((W >> 3) & 0x0E0E0E0E) | ((W << 7) & 0x80808080) put each value's bits where an fp16's high
//    byte has them (fp16 = E2M1 * 2^-14 exactly), prmt moves two such bytes into an f16x2, one
//    mul.f16x2 by sf * 2^7 (fp16 bits (b << 7) = sf * 2^-8 for every E4M3 byte b, times 2^15)
//    gives E2M1 * sf * 2^-7 exactly. On sm_90a variant 15 (decode_wg.cuh, included below) runs the
//    same fragments through wgmma.mma_async with the tokens on its N side (core-matrix operand).
// 2. quantize_rows: the per-token (or given-amax) NVFP4 quantizer of ref.py, bit for bit; one CTA
//    of 128 threads per row, whole 16-value blocks per thread held in registers, 16-byte loads,
//    integer E2M1 rounding, hardware E4M3 conversion, packed 8-byte code stores; the fp16 operand
//    row-major, chunk-major or core-matrix ordered (CM 0, 1, 2) for the decode kernel that takes it.
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
// a word of 8 E2M1 codes (the prepared layout) -> its two words of code bytes for steps 2*wi (lo) and
// 2*wi + 1 (hi), each code at bits 7 (sign) and 1-3 of its byte, where the byte-permute or shift decode
// turns them into fp16 E2M1 * 2^-14 (emulated bit for bit in tests/kernels/test_native.py)
__device__ __forceinline__ void code_halves(uint32_t W, uint32_t& lo, uint32_t& hi) {
  lo = W & 0x8E8E8E8Eu;
  hi = ((W >> 3) & 0x0E0E0E0Eu) | ((W << 7) & 0x80808080u);
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

__device__ __forceinline__ uint32_t hmul2_lo(uint32_t a, uint32_t s) {  // a * {s.lo, s.lo}
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), __low2half2(*reinterpret_cast<const __half2*>(&s)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t hmul2_hi(uint32_t a, uint32_t s) {  // a * {s.hi, s.hi}
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), __high2half2(*reinterpret_cast<const __half2*>(&s)));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// the B fragment (b0, b1) of one 8-row weight tile at k16 step s (0-7) of a 128-wide chunk, from the
// step's code half v (code_halves of the tile's word s / 2) and the tile's scale words sc
template <bool SC16, int DEC, bool NODEC>
__device__ __forceinline__ void frag_b(uint32_t v, const uint32_t (&sc)[4], int s, uint32_t& b0, uint32_t& b1) {
  // fp16 pairs E2M1 * 2^-14 {k = 2q, 2q+1} (bytes 0, 2) and {k = 2q+8, 2q+9} (bytes 1, 3)
  const uint32_t f0 = DEC ? (v << 8) & 0xFF00FF00u : prmt(v, 0u, 0x2404u);
  const uint32_t f1 = DEC ? v & 0xFF00FF00u : prmt(v, 0u, 0x3414u);
  if (NODEC) {
    b0 = f0;
    b1 = sc[0];
  } else if (SC16) {  // sc word s/2 = {sf(s even) * 2^7, sf(s odd) * 2^7}
    b0 = (s & 1) ? hmul2_hi(f0, sc[s >> 1]) : hmul2_lo(f0, sc[s >> 1]);
    b1 = (s & 1) ? hmul2_hi(f1, sc[s >> 1]) : hmul2_lo(f1, sc[s >> 1]);
  } else {
    // {b, 0, b, 0} << 7: fp16 bits of sf * 2^-8 in both halves; * 2^15 -> sf * 2^7 (exact)
    const uint32_t sbits = prmt(sc[s >> 2], 0u, 0x4040u | ((s & 3) * 0x0101u)) << 7;
    const uint32_t scale = hmul2(sbits, 0x78007800u);
    b0 = hmul2(f0, scale);
    b1 = hmul2(f1, scale);
  }
}

// one 128-wide K chunk, shared by both decode kernels: NT weight tiles (code words wv; scale words sc:
// 2 of E4M3 bytes, or 4 of fp16 pairs with SC16) x MT token tiles (ldmatrix.x4 from a_base, MTS bytes
// between token tiles; HALF: M <= 8, ldmatrix.x2, rows 8-15 of the MMA's A operand are zero registers)
template <int MT, int NT, int MTS, bool SC16, int DEC, bool NODEC, bool HALF = false>
__device__ __forceinline__ void bulk_chunk(float (&acc)[MT][NT][4], const uint32_t (&wv)[NT][4],
                                           const uint32_t (&sc)[NT][4], uint32_t a_base) {
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    uint32_t va[NT], vb[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) code_halves(wv[t][wi], va[t], vb[t]);
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
          ldmatrix_x4(af[mt], a_base + mt * MTS + s * 32);
        }
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        uint32_t b0, b1;
        frag_b<SC16, DEC, NODEC>(h ? vb[t] : va[t], sc[t], s, b0, b1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma16816(acc[mt][t], af[mt], b0, b1);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// the decode epilogue, shared by both decode kernels: nseg == 1 scales and rounds to bf16; else the
// segment's fp32 partials go to ``part`` (reduced in segment order by reduce_kernel)

template <int MT, int NT>
__device__ __forceinline__ void decode_epilogue(const float (&acc)[MT][NT][4], const float* __restrict__ w_amax,
                                                int w_amax_row, const float* __restrict__ a_amax,
                                                uint16_t* __restrict__ out, float* __restrict__ part, int M, int N,
                                                int nseg, int nb, int m0, int seg, int warp, int lane) {
  const int g = lane >> 2, q = lane & 3;
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

// ------------------------------------------------------------------------------------------
// decode GEMM, bulk-copy pipeline (the same contract and bits as decode_gemm_kernel): a producer warp
// fills a ring of S stages (CPS chunks each): the chunk's codes and scales, contiguous per 64-row
// block, by two cp.async.bulk copies (the copy engine, completing on the stage's "full" mbarrier with
// their byte count), the token rows by per-lane 16-byte cp.async (cp.async.mbarrier.arrive.noinc on
// the same barrier: many small rows are slow on the copy engine); 8/NT consumer warps wait on
// "full", decode and run the mma.sync chain, and release the slot on its "empty" mbarrier. No
// CTA-wide barrier and no copy work in the consumers. Token rows >= M are zeroed once, never copied
// (so M <= 8 needs no separate instance). SC16: scales as fp16 sf * 2^7 (made at weight-prepare
// time, 2 bytes per block) applied by HMUL2 with a half-swizzled operand; DEC 1: the B fragments by
// masks and shifts instead of byte permutes (same bits). MODE 1-4: bench only (1: loads, no
// arithmetic; 2: no fragment decode; 3: no loads, the consumers compute on whatever stage 0 holds;
// 4: 3 without decode).

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {  // when this thread's cp.asyncs land
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Token operand in the chunk-major layout (TOKC 1): [ceil(M/16) blocks][K/128 chunks][16 rows][136]
// fp16 (rows padded by 8 halves: 272 B, 16 mod 128, conflict-free ldmatrix), so one stage's token tile
// of a 16-row block is one contiguous copy of CPS * 4352 bytes; rows >= M of the last block are zero.
constexpr int TROW = (KC + 8) * 2;  // bytes per token row of a chunk
constexpr int TCH = 16 * TROW;      // bytes per (16-row block, chunk)

// One k-chunk's weight words and scales of a consumer warp's NT tiles, from a stage in shared memory
// (both consumer loops of decode_bulk_kernel).
template <int NT, int CPS, bool SC16, int SB>
__device__ __forceinline__ void load_wsc(const uint8_t* st, int j, int warp, int lane, int g, uint32_t (&wv)[NT][4],
                                         uint32_t (&sc)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int tile = warp * NT + t;
    const uint4 w = *reinterpret_cast<const uint4*>(st + j * W_BYTES + (tile * 32 + lane) * 16);
    wv[t][0] = w.x; wv[t][1] = w.y; wv[t][2] = w.z; wv[t][3] = w.w;
    const uint8_t* sp = st + CPS * W_BYTES + j * SB + (tile * 8 + g) * (SB / 64);
    if (SC16) {
      const uint4 v = *reinterpret_cast<const uint4*>(sp);
      sc[t][0] = v.x; sc[t][1] = v.y; sc[t][2] = v.z; sc[t][3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(sp);
      sc[t][0] = v.x; sc[t][1] = v.y; sc[t][2] = sc[t][3] = 0u;
    }
  }
}

// The consumer loop of decode_bulk_kernel with the chunk-major token tile (TOKC == 1), software-
// pipelined across steps, chunks and stages: the A fragments (ldmatrix) LA = 2 k16 steps ahead, the B
// fragments decoded one step ahead, the next chunk's weight words loaded 3-4 steps before use (the
// next stage's after waiting on its "full" barrier 4 steps before the stage ends), so that the MMA of
// step u issues first and waits only on its own accumulator chain. Same operands, same MMAs in the
// same order per accumulator: the same bits as bulk_chunk. MODE 3 (bench): no waits, stage 0 only.
template <int MT, int NT, int S, int CPS, bool SC16, int DEC, int MODE, int STAGE, int A_OFF, int SB>
__device__ __forceinline__ void consume_pipe(float (&acc)[MT][NT][4], uint8_t* smem, uint32_t full0, uint32_t empty0,
                                             int steps, int warp, int lane) {
  constexpr int U = CPS * 8;  // k16 steps per stage
  constexpr int LA = 2;       // A-fragment lookahead (steps)
  constexpr int WPRE = U - 4; // step of a stage at which the next stage is waited on and its first words loaded
  static_assert(CPS >= 1 && U % 4 == 0, "ring of 4 A fragments over whole stages");
  const int g = lane >> 2;
  const uint32_t a_lane = smem_u32(smem) + A_OFF + (lane & 15) * TROW + (lane >> 4) * 16;
  auto lda = [&](uint32_t (&af)[MT][4], int slot, int u) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a_lane + slot * STAGE + mt * CPS * TCH + (u / 8) * TCH + (u % 8) * 32);
  };
  auto ldw = [&](uint32_t (&wv)[NT][4], uint32_t (&sc)[NT][4], int slot, int j) {
    load_wsc<NT, CPS, SC16, SB>(smem + slot * STAGE, j, warp, lane, g, wv, sc);
  };
  auto decb = [&](uint32_t (&b)[NT][2], const uint32_t (&wv)[NT][4], const uint32_t (&sc)[NT][4], int s) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      uint32_t lo, hi;
      code_halves(wv[t][s >> 1], lo, hi);
      frag_b<SC16, DEC, false>((s & 1) ? hi : lo, sc[t], s, b[t][0], b[t][1]);
    }
  };
  uint32_t af[4][MT][4], bf[2][NT][2], wc[NT][4], scc[NT][4], wn[NT][4], scn[NT][4];
  if (MODE < 3) mbar_wait(full0, 0);
  lda(af[0], 0, 0);
  lda(af[1], 0, 1);
  ldw(wc, scc, 0, 0);
  decb(bf[0], wc, scc, 0);
  for (int i = 0; i < steps; ++i) {
    const int slot = MODE >= 3 ? 0 : i % S;
    const int ns = MODE >= 3 ? 0 : (i + 1) % S;
    const bool more = i + 1 < steps;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      // the MMAs of step u first: their operands are in registers already
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma16816(acc[mt][t], af[u % 4][mt], bf[u % 2][t][0], bf[u % 2][t][1]);
      // then the loads and the decode for later steps
      if (u == WPRE && more) {
        if (MODE < 3) mbar_wait(full0 + 8 * ns, ((i + 1) / S) & 1);
        ldw(wn, scn, ns, 0);
      }
      if (CPS > 1 && u % 8 == 4 && u / 8 + 1 < CPS) ldw(wn, scn, slot, u / 8 + 1);
      if (u + LA < U) {
        lda(af[(u + LA) % 4], slot, u + LA);
      } else if (more) {
        lda(af[(u + LA) % 4], ns, u + LA - U);
      }
      if (u == U - 1 - LA + 1 && MODE < 3) {  // every read of this stage issued (the last A fragment at U-1-LA)
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * slot);
      }
      if (u % 8 == 7) {  // next chunk (of this stage or the next one): its words become current
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            wc[t][w] = wn[t][w];
            scc[t][w] = scn[t][w];
          }
      }
      if (u + 1 < U || more) decb(bf[(u + 1) % 2], wc, scc, (u + 1) % 8);
    }
  }
}

template <int MT, int NT, int S, int CPS, bool SC16, int DEC, int MODE = 0, int TOKC = 0, bool PIPE = false>
__global__ void __launch_bounds__(256 / NT + 32, 1) decode_bulk_kernel(
    const uint8_t* __restrict__ wq, const uint8_t* __restrict__ wsc, const float* __restrict__ w_amax, int w_amax_row,
    const __half* __restrict__ a, const float* __restrict__ a_amax, uint16_t* __restrict__ out,
    float* __restrict__ part, int M, int N, int K, int nseg) {
  // TOKC 0: token rows [M, K] by per-lane cp.async; 1: chunk-major tokens, one bulk copy per 16-row
  // block and stage, on the weights' "full" barrier (a multicast of that copy over clusters of 2-4
  // CTAs was tried in the lab, 2026-12-01 18:00: 40-70 us at M = 16, removed). PIPE: consume_pipe.
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int CW = 256 / NT / 32;  // consumer warps
  constexpr int KS = KC * CPS;
  constexpr int AROW = (KS + 8) * 2;  // padded token row (16 mod 128 bytes: conflict-free ldmatrix)
  constexpr int ROWS = MT * 16;
  constexpr int SB = SC16 ? 2 * S_BYTES : S_BYTES;  // scale bytes per chunk
  constexpr int A_OFF = CPS * (W_BYTES + SB);
  constexpr int ABYTES = TOKC ? MT * CPS * TCH : ROWS * AROW;
  constexpr int STAGE = A_OFF + ABYTES;  // a multiple of 16
  constexpr int PIECES = KS / 8;         // 16-byte pieces per token row and stage
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S * STAGE);  // full[S], empty[S]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nb = blockIdx.x, m0 = blockIdx.y * ROWS, seg = blockIdx.z;
  const int chunks = K / KC;
  const int steps = chunks / nseg / CPS;
  const int c0 = seg * (chunks / nseg);
  const int rows = min(ROWS, M - m0);  // token rows copied; the rest stay zero
  const int mts = TOKC ? (rows + 15) / 16 : MT;  // 16-row token blocks present (chunk-major)
  const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + S);
  if constexpr (!TOKC) {
    const int per = (ROWS - rows) * (AROW / 16);
    for (int i = tid; i < S * per; i += blockDim.x) {
      const int st = i / per, r = rows + (i % per) / (AROW / 16), col = i % (AROW / 16);
      *reinterpret_cast<uint4*>(smem + st * STAGE + A_OFF + r * AROW + col * 16) = make_uint4(0, 0, 0, 0);
    }
  } else {  // token blocks past M: zero once, never copied
    const int per = (MT - mts) * (CPS * TCH / 16);
    for (int i = tid; i < S * per; i += blockDim.x)
      *reinterpret_cast<uint4*>(smem + (i / per) * STAGE + A_OFF + mts * CPS * TCH + (i % per) * 16) = make_uint4(0, 0, 0, 0);
  }
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, TOKC ? 1 : 1 + 32);  // the producer's expect_tx arrive (+ its lanes' cp.async arrives)
      mbar_init(empty0 + 8 * s, CW);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == CW) {  // producer warp
    if (MODE < 3) {
      const uint32_t tx = CPS * (W_BYTES + SB) + (TOKC ? mts * CPS * TCH : 0);
      for (int i = 0; i < steps; ++i) {
        const int slot = i % S;
        if (i >= S) mbar_wait(empty0 + 8 * slot, ((i / S) - 1) & 1);
        const uint32_t full = full0 + 8 * slot;
        const uint32_t st = smem_u32(smem + slot * STAGE);
        const size_t c = (size_t)nb * chunks + c0 + i * CPS;
        if (lane == 0) {
          mbar_expect_tx(full, tx);
          bulk_g2s(st, wq + c * W_BYTES, CPS * W_BYTES, full);
          bulk_g2s(st + CPS * W_BYTES, wsc + c * SB, CPS * SB, full);
          if (TOKC) {
            const uint8_t* ab = reinterpret_cast<const uint8_t*>(a);
            for (int mt = 0; mt < mts; ++mt) {
              const size_t off = ((size_t)(m0 / 16 + mt) * chunks + c0 + i * CPS) * TCH;
              bulk_g2s(st + A_OFF + mt * CPS * TCH, ab + off, CPS * TCH, full);
            }
          }
        }
        if (!TOKC) {
          const __half* ak = a + (size_t)m0 * K + (size_t)(c0 + i * CPS) * KC;
          for (int p = lane; p < rows * PIECES; p += 32) {
            const int r = p / PIECES, col = p % PIECES;
            cp_async16(st + A_OFF + r * AROW + col * 16, ak + (size_t)r * K + col * 8, 16);
          }
          mbar_arrive_cp_async(full);
        }
      }
    }
  } else {
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[i][t][0] = acc[i][t][1] = acc[i][t][2] = acc[i][t][3] = 0.0f;
    uint32_t sink = 0;
    if constexpr (PIPE) {
      static_assert(TOKC == 1 && MODE != 1 && MODE != 2 && MODE != 4, "pipelined consumer: chunk-major tokens");
      consume_pipe<MT, NT, S, CPS, SC16, DEC, MODE, STAGE, A_OFF, SB>(acc, smem, full0, empty0, steps, warp, lane);
    } else {
      const int g = lane >> 2;
      const uint32_t a_lane = TOKC ? (lane & 15) * TROW + (lane >> 4) * 16 : (lane & 15) * AROW + (lane >> 4) * 16;
      for (int i = 0; i < steps; ++i) {
        const int slot = MODE >= 3 ? 0 : i % S;
        if (MODE < 3) mbar_wait(full0 + 8 * slot, (i / S) & 1);
        const uint8_t* st = smem + slot * STAGE;
#pragma unroll
        for (int j = 0; j < CPS; ++j) {
          uint32_t wv[NT][4], sc[NT][4];
          load_wsc<NT, CPS, SC16, SB>(st, j, warp, lane, g, wv, sc);
          if (MODE == 1) {
#pragma unroll
            for (int t = 0; t < NT; ++t) sink ^= wv[t][0] ^ wv[t][3] ^ sc[t][0];
          } else if (TOKC) {
            bulk_chunk<MT, NT, CPS * TCH, SC16, DEC, MODE == 2 || MODE == 4>(acc, wv, sc,
                                                                           smem_u32(st + A_OFF) + a_lane + j * TCH);
          } else {
            bulk_chunk<MT, NT, 16 * AROW, SC16, DEC, MODE == 2 || MODE == 4>(acc, wv, sc,
                                                                            smem_u32(st + A_OFF) + a_lane + j * (KC * 2));
          }
        }
        __syncwarp();
        if (MODE < 3 && lane == 0) mbar_arrive(empty0 + 8 * slot);
      }
    }
    if (MODE == 1) {
      if (sink == 0x9E3779B9u) out[0] = 1;
    } else {
      decode_epilogue<MT, NT>(acc, w_amax, w_amax_row, a_amax, out, part, M, N, nseg, nb, m0, seg, warp, lane);
    }
  }
}

#include "decode_wg.cuh"  // the wgmma decode GEMM (variant 15)

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

template <int MT, int NT, bool SC16, int DEC, int TOKC = 0, bool PIPE = false, int CPS = 2, int S = (MT == 4 ? 4 : 6)>
void launch_bulk(const torch::Tensor& wq, const torch::Tensor& wsc, const torch::Tensor& w_amax, bool w_amax_row,
                 const torch::Tensor& a, const torch::Tensor& a_amax, torch::Tensor& out, torch::Tensor& part, int M,
                 int N, int K, int nseg) {
  constexpr int ABYTES = TOKC ? MT * CPS * TCH : MT * 16 * (KC * CPS + 8) * 2;
  constexpr int SMEM = S * (CPS * (W_BYTES + (SC16 ? 2 : 1) * S_BYTES) + ABYTES) + 16 * S;
  auto kern = decode_bulk_kernel<MT, NT, S, CPS, SC16, DEC, 0, TOKC, PIPE>;
  static bool attr = false;
  if (!attr) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    attr = true;
  }
  dim3 grid((N + 63) / 64, (M + 16 * MT - 1) / (16 * MT), nseg);
  auto stream = c10::cuda::getCurrentCUDAStream();
  kern<<<grid, 256 / NT + 32, SMEM, stream>>>(
      reinterpret_cast<const uint8_t*>(wq.data_ptr()), reinterpret_cast<const uint8_t*>(wsc.data_ptr()),
      w_amax.data_ptr<float>(), w_amax_row ? 1 : 0, reinterpret_cast<const __half*>(a.data_ptr()),
      a_amax.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()), part.data_ptr<float>(), M, N, K, nseg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// wgmma decode (variant 15): NTOK token columns (M <= NTOK), S stages of CPS chunks, R register sets
constexpr int wg_smem(int ntok, int s, int cps, bool ks2 = false) {  // stages, barriers (a ring per K half
  // with ks2), zero B tile, exchange
  return s * cps * (ks2 ? 2 : 1) * (W_BYTES + 2 * S_BYTES + 16 * (ntok / 8) * CMB) + 16 * s * (ks2 ? 2 : 1) +
         32 * ntok + (ks2 ? 256 * ntok : 0);
}

template <int NTOK, int S, int CPS, int R = 2, bool KS2 = false>
void launch_wg(const torch::Tensor& wq, const torch::Tensor& wsc16, const torch::Tensor& w_amax, bool w_amax_row,
               const torch::Tensor& a, const torch::Tensor& a_amax, torch::Tensor& out, torch::Tensor& part, int M,
               int N, int K, int nseg) {
  constexpr int SMEM = wg_smem(NTOK, S, CPS, KS2);
  auto kern = decode_wg_kernel<NTOK, S, CPS, 0, R, KS2>;
  static bool attr = false;
  if (!attr) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    attr = true;
  }
  dim3 grid((N + 63) / 64, 1, KS2 ? 1 : nseg);
  auto stream = c10::cuda::getCurrentCUDAStream();
  kern<<<grid, KS2 ? 320 : 160, SMEM, stream>>>(
      reinterpret_cast<const uint8_t*>(wq.data_ptr()), reinterpret_cast<const uint8_t*>(wsc16.data_ptr()),
      w_amax.data_ptr<float>(), w_amax_row ? 1 : 0, reinterpret_cast<const __half*>(a.data_ptr()),
      a_amax.data_ptr<float>(), reinterpret_cast<uint16_t*>(out.data_ptr()), part.data_ptr<float>(), M, N, K, nseg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int BPT>
void launch_quant(const torch::Tensor& x, torch::Tensor& amax, torch::Tensor& codes, torch::Tensor& scales,
                  torch::Tensor& op, bool emit_op, int amax_mode, int op_cm) {
  const int rows = x.size(0), K = x.size(1);
  const int groups = op_cm == 2 ? op.size(2) : 0;
  const int grid = op_cm == 1 ? (rows + 15) / 16 * 16 : op_cm == 2 ? groups * 8 : rows;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint4* xp = reinterpret_cast<const uint4*>(x.data_ptr());
  uint2* cp = reinterpret_cast<uint2*>(codes.data_ptr());
  uint8_t* sp = scales.data_ptr<uint8_t>();
  uint4* opp = reinterpret_cast<uint4*>(op.data_ptr());
  float* ap = amax.data_ptr<float>();
  if (op_cm == 2)
    quant_rows_kernel<BPT, true, 2><<<grid, 128, 0, stream>>>(xp, ap, cp, sp, opp, K, amax_mode, rows, groups);
  else if (op_cm == 1)
    quant_rows_kernel<BPT, true, 1><<<grid, 128, 0, stream>>>(xp, ap, cp, sp, opp, K, amax_mode, rows, 0);
  else if (emit_op)
    quant_rows_kernel<BPT, true><<<grid, 128, 0, stream>>>(xp, ap, cp, sp, opp, K, amax_mode, rows, 0);
  else
    quant_rows_kernel<BPT, false><<<grid, 128, 0, stream>>>(xp, ap, cp, sp, opp, K, amax_mode, rows, 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void decode_gemm(torch::Tensor wq, torch::Tensor wsc, torch::Tensor wsc16, torch::Tensor w_amax, bool w_amax_row,
                 torch::Tensor a, torch::Tensor a_amax, torch::Tensor out, torch::Tensor part, int64_t M, int64_t N,
                 int64_t K, int64_t nseg, int64_t variant, bool ks2, bool crowded) {
  TORCH_CHECK(K % KC == 0 && (K / KC) % nseg == 0, "decode_gemm: K must be a multiple of 128 * nseg");
  TORCH_CHECK(a.scalar_type() == at::kHalf && a.is_contiguous(), "decode_gemm: fp16 contiguous activations");
  TORCH_CHECK(M >= 1, "decode_gemm: M >= 1");
  const c10::cuda::CUDAGuard guard(a.device());
  const int m = M, n = N, k = K, s = nseg;
  // variants 6-11: the bulk-copy pipeline (6: E4M3 scale bytes + byte-permute decode, 7: fp16 scales +
  // permutes, 8: fp16 scales + mask/shift decode, 9: scale bytes + mask/shift; 10, 11: 7, 8 with 8
  // consumer warps of one weight tile each instead of 4 of two); it needs an even chunk count per K
  // segment and M <= 64, else (and for variants 0, 3) the cp.async kernel: 0: 6 stages x 2 chunks, 3: 8
  // stages x 1 chunk (M <= 16; M > 16: 2 or 4 token tiles, M > 64 (forced decode path) in 64-row
  // blocks). M <= 8: token rows 0-7 only there.
  const bool two = (K / KC / nseg) % 2 == 0;
  // variants 12, 13: 7 with the token operand chunk-major (``a`` [ceil(M/16), K/128, 16, 136], as
  // quantize_rows writes it with op_cm), one bulk copy per 16-row block and stage on the weights'
  // mbarrier; M <= 16: 4 stages x 4 chunks when the segment's chunk count allows it; 13: the
  // software-pipelined consumer loop (consume_pipe); 14: 12 with 8 consumer warps of one 8-row weight
  // tile each at M <= 16 (4 stages x 4 chunks). Same conditions as 6-11, else the cp.async kernel.
  // variant 15 (sm_90a): decode_wg_kernel, the token operand core-matrix ordered ([K/128][16][G][8][8]
  // fp16, G = NTOK / 8 row groups, NTOK = 8, 16, 32 or 64: the least >= M); 4 stages x 4 chunks where
  // the segment's chunk count allows it (M <= 16: 4 register sets), else 2 chunks per stage (the lab's
  // fastest, 2026-12-01 20:33-20:47). Same conditions as 6-14.
  if (variant == 15 && two && M <= 64) {
    const int ntok = M <= 8 ? 8 : M <= 16 ? 16 : M <= 32 ? 32 : 64;
    TORCH_CHECK(wsc16.numel() == wsc.numel() * 2, "decode_gemm: fp16 scales");
    TORCH_CHECK(a.dim() == 5 && a.size(0) == K / KC && a.size(1) == 16 && a.size(2) == ntok / 8 && a.size(3) == 8 &&
                    a.size(4) == 8 && a.is_contiguous(),
                "decode_gemm: variant 15 takes the core-matrix token operand [K/128, 16, NTOK/8, 8, 8]");
    const bool four = (K / KC / nseg) % 4 == 0;
#define MP_WG(...) launch_wg<__VA_ARGS__>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s)
    if (ks2) {  // both K segments in one CTA: the bf16 rows, no partials (native.fused_segments)
      TORCH_CHECK(nseg == 2 && ntok <= 32, "decode_gemm: in-CTA K segments need nseg == 2 and M <= 32");
      if (ntok == 8) MP_WG(8, 4, 2, 2, true);
      else if (ntok == 16) MP_WG(16, 4, 2, 2, true);
      else MP_WG(32, 4, 2, 2, true);
      return;
    }
    // M > 32 with K segments across CTAs that would not fit one wave at one CTA per SM (``crowded``, decided
    // by native.crowded, which decode_variant records): a ring of 2 stages x 2 chunks (86 KB), two CTAs per SM
    if (ntok == 64 && crowded) {
      MP_WG(64, 2, 2);
      return;
    }
    if (ntok == 8) { if (four) MP_WG(8, 4, 4, 4); else MP_WG(8, 6, 2); }
    else if (ntok == 16) { if (four) MP_WG(16, 4, 4, 4); else MP_WG(16, 6, 2); }
    else if (ntok == 32) { if (four) MP_WG(32, 4, 4); else MP_WG(32, 6, 2); }
    else MP_WG(64, 4, 2);
#undef MP_WG
    return;
  }
  if (variant >= 12 && variant <= 14 && two && M <= 64) {
    TORCH_CHECK(wsc16.numel() == wsc.numel() * 2, "decode_gemm: fp16 scales");
    TORCH_CHECK(a.dim() == 4 && a.size(0) >= (M + 15) / 16 && a.size(1) == K / KC && a.size(2) == 16 &&
                    a.size(3) == TROW / 2,
                "decode_gemm: variants 12, 13 take the chunk-major token operand [ceil(M/16), K/128, 16, 136]");
    const bool four = (K / KC / nseg) % 4 == 0;
#define MP_TOK(P_)                                                                                                \
  if (M <= 16 && four && variant == 14) launch_bulk<1, 1, true, 0, 1, P_, 4, 4>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); \
  else if (M <= 16 && four) launch_bulk<1, 2, true, 0, 1, P_, 4, 4>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); \
  else if (M <= 16) launch_bulk<1, 2, true, 0, 1, P_>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); \
  else if (M <= 32) launch_bulk<2, 2, true, 0, 1, P_>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); \
  else launch_bulk<4, 2, true, 0, 1, P_>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s);
    if (variant == 13) {
      MP_TOK(true)
    } else {
      MP_TOK(false)
    }
#undef MP_TOK
    return;
  }
  TORCH_CHECK(a.dim() == 2, "decode_gemm: row-major token operand [M, K] for this kernel");
  if (variant >= 6 && variant <= 11 && two && M <= 64) {
    TORCH_CHECK(variant == 6 || variant == 9 || wsc16.numel() == wsc.numel() * 2, "decode_gemm: fp16 scales");
#define MP_BULK(MT_)                                                                                            \
  switch (variant) {                                                                                           \
    case 6: launch_bulk<MT_, 2, false, 0>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); break;  \
    case 7: launch_bulk<MT_, 2, true, 0>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); break; \
    case 8: launch_bulk<MT_, 2, true, 1>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); break; \
    case 9: launch_bulk<MT_, 2, false, 1>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); break;  \
    case 10: launch_bulk<MT_, 1, true, 0>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); break; \
    default: launch_bulk<MT_, 1, true, 1>(wq, wsc16, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s); break; \
  }
    if (M <= 16) {
      MP_BULK(1)
    } else if (M <= 32) {
      MP_BULK(2)
    } else {
      MP_BULK(4)
    }
#undef MP_BULK
    return;
  }
  const bool half = M <= 8;
#define MP_DEC(MT_, ST_, CPS_, NT_, H_) \
  launch_decode<MT_, ST_, CPS_, NT_, H_>(wq, wsc, w_amax, w_amax_row, a, a_amax, out, part, m, n, k, s)
  if (M <= 16) {
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
                   bool emit_op, int64_t amax_mode, int64_t op_cm) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2, "quantize_rows: bf16 [rows, K]");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 16 == 0 && k <= 16384, "quantize_rows: K % 16 == 0 and K <= 16384");
  TORCH_CHECK(op_cm != 1 || (emit_op && k % KC == 0 && op.is_contiguous() && op.dim() == 4 && op.size(0) == (x.size(0) + 15) / 16 &&
                             op.size(1) == k / KC && op.size(2) == 16 && op.size(3) == TROW / 2),
              "quantize_rows: chunk-major operand [ceil(rows/16), K/128, 16, 136]");
  TORCH_CHECK(op_cm != 2 || (emit_op && k % KC == 0 && op.is_contiguous() && op.dim() == 5 && op.size(0) == k / KC &&
                             op.size(1) == 16 && op.size(2) * 8 >= x.size(0) && op.size(3) == 8 && op.size(4) == 8),
              "quantize_rows: core-matrix operand [K/128, 16, G, 8, 8] with 8 G >= rows");
  TORCH_CHECK(op_cm >= 0 && op_cm <= 2, "quantize_rows: op_cm 0, 1 or 2");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t nblk = k / 16;
  const int mode = static_cast<int>(amax_mode);
  if (nblk <= 128) launch_quant<1>(x, amax, codes, scales, op, emit_op, mode, op_cm);
  else if (nblk <= 256) launch_quant<2>(x, amax, codes, scales, op, emit_op, mode, op_cm);
  else if (nblk <= 512) launch_quant<4>(x, amax, codes, scales, op, emit_op, mode, op_cm);
  else launch_quant<8>(x, amax, codes, scales, op, emit_op, mode, op_cm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_gemm", &decode_gemm, "NVFP4 decode GEMM (native layout weights, fp16 activation operand)");
  m.def("quantize_rows", &quantize_rows, "NVFP4 per-token / given-amax quantizer, bf16 rows (op_cm 1: chunk-major operand, 2: core-matrix operand)");
}
#else
// kernels-only build (compile check): take the instances' addresses so they are compiled
void* nvfp4_instances[] = {(void*)decode_gemm_kernel<1, 6, 2, 2, false>, (void*)decode_gemm_kernel<1, 6, 2, 2, true>,
                           (void*)decode_gemm_kernel<4, 4, 2, 2, false>, (void*)decode_bulk_kernel<1, 2, 6, 2, true, 0>,
                           (void*)decode_bulk_kernel<1, 2, 6, 2, true, 1>, (void*)decode_bulk_kernel<4, 2, 4, 2, false, 0>,
                           (void*)decode_bulk_kernel<1, 2, 4, 4, true, 0, 0, 1, false>,
                           (void*)decode_bulk_kernel<1, 2, 4, 4, true, 0, 0, 1, true>,
                           (void*)decode_bulk_kernel<4, 2, 4, 2, true, 0, 0, 1, true>,
                           (void*)decode_wg_kernel<8, 4, 4, 0, 4>, (void*)decode_wg_kernel<8, 6, 2>,
                           (void*)decode_wg_kernel<16, 4, 4, 0, 4>, (void*)decode_wg_kernel<16, 6, 2>,
                           (void*)decode_wg_kernel<8, 4, 2, 0, 2, true>, (void*)decode_wg_kernel<16, 4, 2, 0, 2, true>,
                           (void*)decode_wg_kernel<32, 4, 2, 0, 2, true>,
                           (void*)decode_wg_kernel<32, 4, 4>, (void*)decode_wg_kernel<32, 6, 2>,
                           (void*)decode_wg_kernel<64, 4, 2>, (void*)decode_wg_kernel<64, 2, 2>, (void*)quant_rows_kernel<4, false>,
                           (void*)quant_rows_kernel<4, true>, (void*)quant_rows_kernel<4, true, 2>};
#endif
