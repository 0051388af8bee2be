// The wgmma decode GEMM (variant 15), included by nvfp4_native.cu inside its anonymous namespace: it uses
// the helpers of common.cuh (code_halves, frag_b, KC, W_BYTES, S_BYTES, RCP_ALPHA, bf16_bits_rne) and of
// decode_bulk.cuh (load_wsc, the mbarrier and bulk-copy wrappers). Not a standalone header.
#pragma once

// ------------------------------------------------------------------------------------------
// decode GEMM on wgmma (sm_90a; variant 15): weights on the MMA's M side, tokens on its N side.
// One consumer warpgroup (4 warps) per 64 weight rows decodes the weight fragments into registers
// (the same native weight layout and register decode as above: warp w's A fragment of step s is the B
// fragments of tiles 2w and 2w + 1: a0 = b0(2w), a1 = b0(2w+1), a2 = b1(2w), a3 = b1(2w+1)) and issues
// one wgmma.mma_async m64nNTOKk16 (f32 += f16 * f16, A from registers, B = the stage's token tile by a
// shared-memory descriptor) per k16 step into one accumulator in K order: per output the same
// products and the same one fp32 chain along K as the mma.sync kernels. The token operand is
// "core-matrix" ordered, [K/128 chunks][16 k-groups of 8][NTOK/8 row groups][8 rows][8 halves] fp16
// (rows >= M zero), so a stage's tokens are one bulk copy and a k16 step's B operand is 2 x NTOK/8
// core matrices of 128 contiguous bytes (no swizzle; leading-dimension offset NTOK * 16 bytes
// between k-groups, stride offset 128 bytes between row groups). The wgmmas of one 128-wide chunk
// are one commit group; decoding chunk j + 1 overlaps the tensor core's work on chunk j (two
// register sets of A fragments, wait_group 1), and a stage is released once its last group is done.
// A producer warp streams weights, scales and tokens by cp.async.bulk as in decode_bulk_kernel.

__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// D[64 x NTOK] (+)= A (registers) * B (descriptor); NTOK in {8, 16, 32, 64}; acc == 0: D = A * B
template <int NTOK>
__device__ __forceinline__ void wgmma_rs(float (&d)[NTOK / 2], const uint32_t (&a)[4], uint64_t desc, int acc = 1) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (NTOK == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
  } else if constexpr (NTOK == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, "
        "0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
  } else if constexpr (NTOK == 32) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
  } else {
    static_assert(NTOK == 64, "NTOK in {8, 16, 32, 64}");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
  }
#else
  __trap();  // wgmma: sm_90a only (the dispatcher runs variant 15 on sm_90 only)
#endif
}

constexpr int CMB = 128;  // bytes per core matrix (8 rows x 8 halves)

// the 8 A fragments of one 128-wide chunk for warp w (tiles 2w, 2w + 1) from the stage's words and scales,
// by masks and shifts (frag_b's DEC 1: the shift is an IMAD on the multiply-add pipe) rather than byte
// permutes: the permutes, masks and shifts of the decode all load the half-rate integer ALU pipe, which
// bounds the consumer (H200 lab 2026-12-02 00:41 and 00:43, same bits: M = 16 15.7 -> 15.4 us, the in-CTA
// halves 13.3 -> 12.9-13.0; the code halves' shifts as multiplies too: no faster).
template <bool NODEC>
__device__ __forceinline__ void wg_decode_chunk(uint32_t (&af)[8][4], const uint32_t (&wv)[2][4], const uint32_t (&sc)[2][4]) {
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    uint32_t va[2], vb[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) code_halves(wv[t][wi], va[t], vb[t]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = 2 * wi + h;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        uint32_t b0, b1;
        frag_b<true, 1, NODEC>(h ? vb[t] : va[t], sc[t], s, b0, b1);
        af[s][t] = b0;      // rows g (t = 0) and g + 8 (t = 1), k 2q, 2q + 1
        af[s][2 + t] = b1;  // k 2q + 8, 2q + 9
      }
    }
  }
}

// One consumer warpgroup's K loop into its accumulator ``acc`` (in K order): R register sets of A
// fragments (one 128-wide chunk each, a commit group per chunk, R - 1 groups left in flight while the
// next chunk is decoded); ``hb``: the byte offset of its K half's block in each stage (KS2), ``arrive``:
// it releases the stages. MODE (bench only): 3 = no waits, every step computes on stage 0; 4 = 3 without
// the decode; 5 = the copies only (each stage released once it has landed). The descriptors are
// warp-uniform values (the slot and the K-half offset through a shuffle from lane 0) and only their low
// word changes (32-bit adds): they live in uniform registers, with no per-wgmma 64-bit arithmetic and
// register-to-uniform moves on the issue path (H200 lab 2026-12-01 22:58: M = 16 17.3 -> 15.9 us).
template <int NTOK, int S, int CPS, int MODE, int R, int STAGE, int A_OFF, int TB, int SB>
__device__ __forceinline__ void wg_consume(float (&acc)[NTOK / 2], uint8_t* smem, uint64_t* bars, const uint64_t* zt,
                                           int hb, int steps, int wl, int lane) {
  const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + S);
  const int g = lane >> 2;
  uint32_t af[R][8][4];
  const uint64_t desc0 = wg_desc(smem_u32(smem) + __shfl_sync(0xFFFFFFFFu, hb, 0) + A_OFF, NTOK * 16, CMB);
  const uint32_t lo0 = (uint32_t)desc0, hi0 = (uint32_t)(desc0 >> 32);
  {  // acc = +0 exactly as the mma.sync kernels' (0.0f): D = (+0 A) * (+0 B), B the zeroed tile after
     // the barriers (a zero-filled register array makes ptxas serialize the wgmmas; D = A * B of the first
     // step alone could give -0 where the mma.sync kernels give +0)
    const uint32_t zero[4] = {0u, 0u, 0u, 0u};
    wg_fence();
    wgmma_rs<NTOK>(acc, zero, wg_desc(smem_u32(zt), NTOK * 16, CMB), 0);
    wg_commit();
  }
  for (int i = 0; i < steps; ++i) {
    const int slot = MODE == 3 || MODE == 4 ? 0 : __shfl_sync(0xFFFFFFFFu, i % S, 0);  // warp-uniform
    if (MODE < 3 || MODE == 5) mbar_wait(full0 + 8 * slot, (i / S) & 1);
    if constexpr (MODE == 5) {
      if (lane == 0) mbar_arrive(empty0 + 8 * slot);
      continue;
    }
    const uint8_t* st = smem + slot * STAGE + hb;
#pragma unroll
    for (int j = 0; j < CPS; ++j) {
      uint32_t wv[2][4], sc[2][4];
      load_wsc<2, CPS, true, SB>(st, j, wl, lane, g, wv, sc);
      wg_decode_chunk<MODE == 4>(af[j % R], wv, sc);
      wg_fence();
      // the start-address field is the low 14 bits (shared memory < 256 KB): 32-bit adds, no carry
      const uint32_t lj = lo0 + ((uint32_t)(slot * STAGE + j * TB) >> 4);
#pragma unroll
      for (int s = 0; s < 8; ++s)
        wgmma_rs<NTOK>(acc, af[j % R][s], ((uint64_t)hi0 << 32) | (lj + ((uint32_t)(s * 2 * NTOK * 16) >> 4)));
      wg_commit();
      wg_wait<R - 1>();  // the groups before the last R - 1 are done: their A registers and stage reads are free
      if (MODE < 3 && j == R - 2 && i > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((i - 1) % S));
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int i = 0; i < NTOK / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // reads after the wait
}

// KS2: the weight's two K segments inside the CTA (nseg == 2): two consumer warpgroups, warpgroup h the
// K half h fed by producer warp h through its own ring (a stage's block of each half: CPS chunks, three
// bulk copies on that ring's barrier); at the end warpgroup 1 hands its fp32 sums to warpgroup 0 through
// shared memory, which adds them to its own (p0 + p1, the order of reduce_kernel and of the prefill's
// segment total) and writes the bf16 rows: each chain is 256 steps at K = 8192 instead of 512, with no partials in global
// memory and no reduce launch. (Measured and dropped, H200 lab 2026-12-01 20:33-21:02: two n8
// accumulators per warpgroup, the producer waiting for stage 0 first, programmatic dependent launch,
// the next chunk decoded between the wgmmas of this one, two warpgroups of one tile per warp: each
// slower; 2026-12-02 00:33-00:49: E4M3 scale bytes again, deeper rings, the copies of stage i + 5..8
// prefetched into the L2, no token copies at all (the bound of sharing them across a CTA pair): none
// faster with the weights rotating past the L2.)
//
// Shards (WgShards): one launch computes up to WG_SHARDS weights that read the same tokens (a fused layer's
// q, k, v or gate, up: each its own amax, K segments and 64-row tiles) into one bf16 output of row stride
// ``ldo``, shard i at columns [col_i, col_i + n_i); CTAs [cta0_i, cta0_{i+1}) are shard i's, segment-major
// (the order of the grid (tiles, 1, nseg) of one weight). Every output is the one a launch of that weight
// alone computes (the same CTA code, the same epilogue). K segments across CTAs (nseg_i > 1, no KS2): each
// CTA writes its fp32 partials [nseg, M, n]; with arrival counters (``cnt``; native.REDUCE_IN_KERNEL), the
// last CTA of a tile to finish (a per-tile counter, reset to 0 by it) adds them in segment order,
// ((p0 + p1) + p2) + ..., and writes the bf16 rows: the arithmetic of gemm_tc.reduce_kernel, without its
// launch; without (``cnt`` null, the default: measured slower, BENCHMARKS.md issue 28 round 20) the caller's
// reduce launch does. The ring of 2 stages x 2 chunks at NTOK 64 (``crowded``) runs two
// CTAs per SM: its registers are bounded for that (launch bounds).
constexpr int WG_SHARDS = 4;
struct WgShards {
  const uint8_t* wq[WG_SHARDS];
  const uint8_t* wsc[WG_SHARDS];
  const float* w_amax[WG_SHARDS];
  float* part[WG_SHARDS];  // [nseg, M, n] fp32 (nseg > 1)
  int* cnt[WG_SHARDS];     // [tiles] arrival counters, 0 between launches (nseg > 1), or null: no in-kernel sum
  int n[WG_SHARDS], nseg[WG_SHARDS], col[WG_SHARDS], cta0[WG_SHARDS], amax_row[WG_SHARDS];
  int count, ldo;
};

// field f of the CTA's shard si (unrolled selects: no dynamic indexing of the parameter space)
template <typename T>
__device__ __forceinline__ T wg_pick(const T (&v)[WG_SHARDS], int si) {
  T r = v[0];
#pragma unroll
  for (int i = 1; i < WG_SHARDS; ++i)
    if (si == i) r = v[i];
  return r;
}

// K segments across CTAs: the tile's last CTA to arrive adds the partials in segment order and writes the bf16
// rows (the one consumer warpgroup, threads 0-127; the producer warp has returned). Out of line: the K loop's
// registers are dead here, and inlined it raised the kernel's register count by ~50 (ptxas -v, sm_90a)
template <int NTOK>
__device__ __noinline__ void wg_last_tile(int* cnt, const float* w_amax, int w_amax_row, const float* part,
                                          const float* __restrict__ a_amax, uint16_t* out, int M, int N, int nseg, int nb,
                                          int ldo, int col, int tid, int wl, int g, int q) {
  __shared__ int last;
  __threadfence();  // this CTA's partials before its arrival
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (tid == 0) {
    int* c = cnt + nb;
    last = atomicAdd(c, 1) == nseg - 1;
    if (last) atomicExch(c, 0);  // every CTA of the tile has arrived: ready for the next launch
  }
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (!last) return;
  __threadfence();  // the other CTAs' partials after their arrivals
  // the thread's outputs (as the epilogue's: weight row 16 wl + g + 8 hh, token 8 j + 2 q + e), summed one
  // segment at a time over all of them, so each segment's loads are in flight together
  constexpr int E = NTOK / 4;
  float t[2][E];
  const size_t mn = (size_t)M * N;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int n = nb * 64 + wl * 16 + g + 8 * hh, m = 8 * (i >> 1) + 2 * q + (i & 1);
      t[hh][i] = m < M && n < N ? __ldcg(part + (size_t)m * N + n) : 0.0f;
    }
  for (int s2 = 1; s2 < nseg; ++s2)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const int n = nb * 64 + wl * 16 + g + 8 * hh, m = 8 * (i >> 1) + 2 * q + (i & 1);
        if (m < M && n < N) t[hh][i] = __fadd_rn(t[hh][i], __ldcg(part + s2 * mn + (size_t)m * N + n));
      }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int n = nb * 64 + wl * 16 + g + 8 * hh;
    if (n >= N) continue;
    const float b = w_amax[w_amax_row ? n : 0];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int m = 8 * (i >> 1) + 2 * q + (i & 1);
      if (m >= M) continue;
      const float r = __fmul_rn(__fmul_rn(t[hh][i], 128.0f), __fmul_rn(__fmul_rn(a_amax[m], b), RCP_ALPHA));
      out[(size_t)m * ldo + col + n] = bf16_bits_rne(r);
    }
  }
}

template <int NTOK, int S, int CPS, int MODE = 0, int R = 2, bool KS2 = false>
__global__ void __launch_bounds__(KS2 ? 320 : 160, NTOK == 64 && S == 2 && !KS2 ? 2 : 1) decode_wg_kernel(
    const WgShards sh, const __half* __restrict__ a, const float* __restrict__ a_amax, uint16_t* __restrict__ out,
    int M, int K) {
  static_assert(CPS % R == 0 && R >= 2 && R - 2 < CPS, "register sets alternate over the chunks of a stage");
  int si = 0;
#pragma unroll
  for (int i = 1; i < WG_SHARDS; ++i)
    if (i < sh.count && (int)blockIdx.x >= sh.cta0[i]) si = i;
  const uint8_t* __restrict__ wq = wg_pick(sh.wq, si);
  const uint8_t* __restrict__ wsc = wg_pick(sh.wsc, si);
  const int N = wg_pick(sh.n, si), nseg = KS2 ? 2 : wg_pick(sh.nseg, si);
  const int ntiles = (N + 63) / 64, local = (int)blockIdx.x - wg_pick(sh.cta0, si);
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int SB = 2 * S_BYTES;                  // fp16 scales per chunk
  constexpr int TB = 16 * (NTOK / 8) * CMB;        // token bytes per chunk
  constexpr int A_OFF = CPS * (W_BYTES + SB);
  constexpr int HALF = A_OFF + CPS * TB;            // one K half's block of a stage
  constexpr int H = KS2 ? 2 : 1;
  constexpr int STAGE = H * HALF;
  // KS2: one ring per K half, each with its own producer warp and barriers (full[S], empty[S]), so that
  // neither warpgroup waits for the other's stage release (H200 lab 2026-12-02 00:46: M = 16 with the
  // weights rotating past the L2 14.1 -> 13.7 us; one shared ring: the slower half gated both)
  constexpr int NR = KS2 ? 2 : 1;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S * STAGE);  // NR x (full[S], empty[S]), zero B, exchange
  uint64_t* zt = bars + 2 * S * NR;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nb = local % ntiles, seg = KS2 ? 0 : local / ntiles;
  const int chunks = K / KC;
  const int steps = chunks / nseg / CPS;
  for (int i = tid; i < 2 * NTOK; i += blockDim.x)  // the zero B tile of the accumulators' first wgmma
    reinterpret_cast<uint4*>(zt)[i] = make_uint4(0, 0, 0, 0);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to the wgmma (async proxy)
  if (tid == 0) {
    for (int r = 0; r < NR; ++r)
      for (int s = 0; s < S; ++s) {
        mbar_init(smem_u32(bars + 2 * S * r + s), 1);
        mbar_init(smem_u32(bars + 2 * S * r + S + s), 4);
      }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp >= 4 * H) {  // producer warp(s): warp 4 H + h fills ring h (the K half h with KS2)
    const int h = warp - 4 * H;
    const uint32_t full0 = smem_u32(bars + 2 * S * h), empty0 = full0 + 8 * S;
    if ((MODE < 3 || MODE == 5) && lane == 0) {
      const uint8_t* ab = reinterpret_cast<const uint8_t*>(a);
      // the first ring's weights and scales are requested before the wait for the grid before this one (a
      // programmatic dependent launch: the quantizer writing the tokens), its tokens after it
      const int pre = steps < S ? steps : S;
      for (int i = 0; i < steps; ++i) {
        const int slot = i % S;
        if (i >= S) mbar_wait(empty0 + 8 * slot, ((i / S) - 1) & 1);
        const uint32_t full = full0 + 8 * slot;
        mbar_expect_tx(full, CPS * (W_BYTES + SB + TB));
        const uint32_t st = smem_u32(smem + slot * STAGE + h * HALF);
        const size_t cl = (size_t)(KS2 ? h : seg) * (chunks / (KS2 ? 2 : nseg)) + i * CPS;
        const size_t c = (size_t)nb * chunks + cl;
        bulk_g2s(st, wq + c * W_BYTES, CPS * W_BYTES, full);
        bulk_g2s(st + CPS * W_BYTES, wsc + c * SB, CPS * SB, full);
        if (i >= pre) bulk_g2s(st + A_OFF, ab + cl * TB, CPS * TB, full);
        if (i == pre - 1) {
          pdl_wait();
          for (int j = 0; j < pre; ++j) {
            const size_t clj = (size_t)(KS2 ? h : seg) * (chunks / (KS2 ? 2 : nseg)) + j * CPS;
            bulk_g2s(smem_u32(smem + j * STAGE + h * HALF) + A_OFF, ab + clj * TB, CPS * TB, full0 + 8 * j);
          }
        }
      }
    }
    return;
  }
  pdl_wait();  // the token amax below and every global write after it: the grid before this one is done
  const int wg = warp >> 2, wl = warp & 3;
  const float* __restrict__ w_amax = wg_pick(sh.w_amax, si);
  const int w_amax_row = wg_pick(sh.amax_row, si);
  // the epilogue's amax values, loaded before the K loop: their latency hides behind it (lab 23:14:
  // M = 16 15.9 -> 15.5 us, KS2 13.8 -> 13.2)
  const int g = lane >> 2, q = lane & 3;
  const bool final_rows = KS2 || nseg == 1;
  float ba[2], am[NTOK / 4];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int n = nb * 64 + wl * 16 + g + 8 * hh;
    ba[hh] = final_rows ? w_amax[w_amax_row ? (n < N ? n : N - 1) : 0] : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < NTOK / 4; ++i) {
    const int m = 8 * (i >> 1) + 2 * q + (i & 1);
    am[i] = final_rows && m < M ? a_amax[m] : 0.0f;
  }
  float acc[NTOK / 2];
  wg_consume<NTOK, S, CPS, MODE, R, STAGE, A_OFF, TB, SB>(acc, smem, bars + 2 * S * wg, zt, wg * HALF, steps, wl, lane);
  if constexpr (KS2) {  // segment 1's sums to warpgroup 0: p0 + p1
    float* xch = reinterpret_cast<float*>(zt) + 8 * NTOK;  // after the zero B tile (32 NTOK bytes)
    const int t = tid & 127;
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < NTOK / 2; ++i) xch[i * 128 + t] = acc[i];
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (wg == 1) return;
#pragma unroll
    for (int i = 0; i < NTOK / 2; ++i) acc[i] = __fadd_rn(acc[i], xch[i * 128 + t]);
  }
  const int ldo = sh.ldo, col = wg_pick(sh.col, si);
  float* __restrict__ part = wg_pick(sh.part, si);
  // epilogue: acc[4 j + 2 h + e]: weight row 16 wl + g + 8 h, token 8 j + 2 q + e; KS2: nseg 2 summed here
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int n = nb * 64 + wl * 16 + g + 8 * hh;
#pragma unroll
    for (int j = 0; j < NTOK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = 8 * j + 2 * q + e;
        if (m >= M || n >= N) continue;
        const float t = acc[4 * j + 2 * hh + e];
        if (final_rows) {
          const float r = __fmul_rn(__fmul_rn(t, 128.0f), __fmul_rn(__fmul_rn(am[2 * j + e], ba[hh]), RCP_ALPHA));
          out[(size_t)m * ldo + col + n] = bf16_bits_rne(r);
        } else {
          part[((size_t)seg * M + m) * N + n] = t;
        }
      }
    }
  }
  if constexpr (!KS2) {
    int* cnt = wg_pick(sh.cnt, si);
    if (final_rows || cnt == nullptr) return;  // no counters: the partials for a reduce launch (gemm_tc.reduce_kernel)
    wg_last_tile<NTOK>(cnt, w_amax, w_amax_row, part, a_amax, out, M, N, nseg, nb, ldo, col, tid, wl, g, q);
  }
}

// a one-weight table (the launcher of one weight, the lab): columns [0, n) of rows of stride n
inline WgShards wg_one(const uint8_t* wq, const uint8_t* wsc, const float* w_amax, int amax_row, float* part, int* cnt,
                       int n, int nseg) {
  WgShards t = {};
  t.wq[0] = wq;
  t.wsc[0] = wsc;
  t.w_amax[0] = w_amax;
  t.part[0] = part;
  t.cnt[0] = cnt;
  t.n[0] = n;
  t.nseg[0] = nseg;
  t.amax_row[0] = amax_row;
  t.count = 1;
  t.ldo = n;
  return t;
}
