// Decode GEMM, bulk-copy pipeline (variants 6-14): the mbarrier and cp.async.bulk wrappers, the
// chunk-major token layout (TROW, TCH; also written by quantize.cuh), the consumer loops and
// decode_bulk_kernel. Needs common.cuh.
// Included by nvfp4_native.cu (the one translation unit, built by kernels/nvfp4/native.py) inside its
// anonymous namespace, after the headers listed there before it; not a standalone header.
#pragma once

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
