// Shared by the three decode pipelines (and the wgmma one): constants of the native weight layout, the
// PTX wrappers (cp.async, prmt, ldmatrix, mma.sync, f16x2 multiplies), the register decode of the
// weight fragments (code_halves, frag_b), one 128-wide K chunk of MMAs (bulk_chunk) and the decode
// epilogue.
// Included by nvfp4_native.cu (the one translation unit, built by kernels/nvfp4/native.py) inside its
// anonymous namespace, after the headers listed there before it; not a standalone header.
#pragma once

constexpr int KC = 128;        // K per chunk (one pipeline stage)
constexpr int W_BYTES = 4096;  // codes per (64 rows, chunk)
constexpr int S_BYTES = 512;   // scales per (64 rows, chunk)
constexpr float RCP_ALPHA = 1.3840171675383317e-07f;  // RN(1 / (36 * 448^2))

// programmatic dependent launch (sm_90+; no-ops before sm_90 and in a grid launched without the attribute):
// pdl_wait() returns once the grid before this one on the stream has completed and its writes are visible;
// pdl_trigger() lets the next grid (launched with programmatic stream serialization) start its blocks now
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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
