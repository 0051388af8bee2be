// The extension's entry points: decode_gemm (the dispatcher from (variant, M, chunk counts) to one of the
// kernel instances of variants 0-14), decode_wg (variant 15 over 1-4 weight shards, from (M, chunk counts, ks2,
// crowded); native.decode_variant records the same choice), quantize_rows and sync_weights (the weight sync's two kernels). Included by nvfp4_native.cu at global
// scope after launch.cuh (needs torch); the bindings there expose these functions.
#pragma once

void decode_gemm(torch::Tensor wq, torch::Tensor wsc, torch::Tensor wsc16, torch::Tensor w_amax, bool w_amax_row,
                 torch::Tensor a, torch::Tensor a_amax, torch::Tensor out, torch::Tensor part, int64_t M, int64_t N,
                 int64_t K, int64_t nseg, int64_t variant, bool ks2, bool crowded, bool pdl) {
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
  // variant 15 (sm_90a, M <= 64, an even chunk count per K segment): decode_wg below (native.decode_gemm
  // routes it there)
  TORCH_CHECK(!(variant == 15 && two && M <= 64), "decode_gemm: variant 15 runs through decode_wg");
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

// the weight sync (kernels/nvfp4/sync.py, sync.cuh): ``x_base`` the lowest-addressed bf16 weight (the
// table's x offsets count from it), ``tab`` the int64 shard table [shards, SYNC_COLS] on the device,
// ``ab`` fp32 [weights, 8] (zeroed: the amax kernel max-es into it), ``out`` the uint8 output buffer
void sync_weights(torch::Tensor x_base, torch::Tensor tab, torch::Tensor ab, torch::Tensor out, int64_t amax_progs,
                  int64_t quant_progs) {
  TORCH_CHECK(x_base.is_cuda() && x_base.element_size() == 2 && x_base.data_ptr() != nullptr &&
                  reinterpret_cast<uintptr_t>(x_base.data_ptr()) % 16 == 0,
              "sync_weights: x_base a 16-byte aligned 2-byte tensor on the GPU");
  TORCH_CHECK(tab.scalar_type() == at::kLong && tab.is_contiguous() && tab.dim() == 2 && tab.size(1) == SYNC_COLS &&
                  tab.size(0) >= 1 && tab.device() == x_base.device(),
              "sync_weights: int64 table [shards, 16] on the weights' device");
  TORCH_CHECK(ab.scalar_type() == at::kFloat && ab.is_contiguous() && ab.device() == x_base.device(),
              "sync_weights: fp32 amax buffer");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.device() == x_base.device() &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 256 == 0,
              "sync_weights: uint8 output buffer, 256-byte aligned");
  TORCH_CHECK(amax_progs >= 0 && amax_progs < (1LL << 31) && quant_progs >= 0 && quant_progs < (1LL << 31),
              "sync_weights: program counts");
  const c10::cuda::CUDAGuard guard(x_base.device());
  launch_sync(x_base, tab, ab, out, amax_progs, quant_progs);
}

// variant 15 (sm_90a): decode_wg_kernel over a table of 1 to WG_SHARDS weights that read the same tokens (a fused
// layer's shards; native.decode_shards), each its own K segments, written into one output ``out`` [M, ldo] at
// columns [col_i, col_i + n_i); K segments across CTAs: the fp32 partials ``part[i]`` [nseg, M, n_i], added by
// the tile's last CTA (decode_wg.cuh) with the arrival counters ``cnt`` (int32, zero, entries cnt_off_i ..
// cnt_off_i + tiles_i - 1, left at zero), or, for cnt_off_i < 0, by the caller's reduce launch. The token operand
// core-matrix ordered ([K/128][16][G][8][8] fp16, G = NTOK / 8 row groups, NTOK = 8, 16, 32 or 64: the least
// >= M); 4 stages x 4 chunks where the segments' chunk count allows it (M <= 16: 4 register sets), else 2 chunks
// per stage (the lab's fastest, 2026-12-01 20:33-20:47): every shard must choose the same instance. ``ks2``
// (native.fused_segments): both K segments in one CTA; ``crowded`` (native.crowded): M > 32 with a ring of 2
// stages x 2 chunks, two CTAs per SM. ``pdl``: a programmatic dependent launch (launch_wg), for a call right
// after the quantizer of its tokens.
void decode_wg(std::vector<torch::Tensor> wq, std::vector<torch::Tensor> wsc16, std::vector<torch::Tensor> w_amax,
               std::vector<int64_t> amax_row, std::vector<torch::Tensor> part, torch::Tensor cnt,
               std::vector<int64_t> cnt_off, std::vector<int64_t> n, std::vector<int64_t> nseg, std::vector<int64_t> col,
               int64_t ldo, torch::Tensor a, torch::Tensor a_amax, torch::Tensor out, int64_t M, int64_t K, bool ks2,
               bool crowded, bool pdl) {
  const size_t cnt_shards = wq.size();
  TORCH_CHECK(cnt_shards >= 1 && cnt_shards <= WG_SHARDS, "decode_wg: 1 to 4 shards");
  TORCH_CHECK(wsc16.size() == cnt_shards && w_amax.size() == cnt_shards && amax_row.size() == cnt_shards &&
                  part.size() == cnt_shards && cnt_off.size() == cnt_shards && n.size() == cnt_shards &&
                  nseg.size() == cnt_shards && col.size() == cnt_shards,
              "decode_wg: one entry per shard in every list");
  TORCH_CHECK(M >= 1 && M <= 64 && K % KC == 0, "decode_wg: 1 <= M <= 64, K % 128 == 0");
  const int ntok = M <= 8 ? 8 : M <= 16 ? 16 : M <= 32 ? 32 : 64;
  TORCH_CHECK(a.scalar_type() == at::kHalf && a.dim() == 5 && a.size(0) == K / KC && a.size(1) == 16 &&
                  a.size(2) == ntok / 8 && a.size(3) == 8 && a.size(4) == 8 && a.is_contiguous(),
              "decode_wg: the core-matrix token operand [K/128, 16, NTOK/8, 8, 8] fp16");
  TORCH_CHECK(out.element_size() == 2 && out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == ldo,
              "decode_wg: a 2-byte output [M, ldo]");
  TORCH_CHECK(cnt.scalar_type() == at::kInt && cnt.is_contiguous() && cnt.device() == a.device(), "decode_wg: int32 counters");
  TORCH_CHECK(!ks2 || ntok <= 32, "decode_wg: in-CTA K segments need M <= 32");
  const c10::cuda::CUDAGuard guard(a.device());
  WgShards sh = {};
  sh.count = static_cast<int>(cnt_shards);
  sh.ldo = static_cast<int>(ldo);
  int ctas = 0, four = -1;
  for (size_t i = 0; i < cnt_shards; ++i) {
    const int64_t s = nseg[i], tiles = (n[i] + 63) / 64;
    TORCH_CHECK(s >= 1 && (K / KC) % s == 0 && (K / KC / s) % 2 == 0, "decode_wg: an even chunk count per K segment");
    TORCH_CHECK(!ks2 || s == 2, "decode_wg: in-CTA K segments need nseg == 2");
    const int f = (K / KC / s) % 4 == 0;
    TORCH_CHECK(four < 0 || f == four, "decode_wg: every shard must take the same kernel instance (chunks per stage)");
    four = f;
    TORCH_CHECK(col[i] >= 0 && col[i] + n[i] <= ldo, "decode_wg: shard columns inside the output");
    TORCH_CHECK(wsc16[i].numel() * 4 == wq[i].numel(), "decode_wg: fp16 scales");
    TORCH_CHECK(w_amax[i].scalar_type() == at::kFloat, "decode_wg: fp32 weight amax");
    TORCH_CHECK(s == 1 || ks2 || (part[i].scalar_type() == at::kFloat && part[i].numel() >= s * M * n[i] &&
                                  cnt_off[i] + tiles <= cnt.numel()),
                "decode_wg: fp32 partials [nseg, M, n] for K segments across CTAs (counters: offset < 0 for none)");
    sh.wq[i] = reinterpret_cast<const uint8_t*>(wq[i].data_ptr());
    sh.wsc[i] = reinterpret_cast<const uint8_t*>(wsc16[i].data_ptr());
    sh.w_amax[i] = w_amax[i].data_ptr<float>();
    sh.part[i] = part[i].scalar_type() == at::kFloat ? part[i].data_ptr<float>() : nullptr;
    sh.cnt[i] = cnt_off[i] >= 0 ? cnt.data_ptr<int>() + cnt_off[i] : nullptr;  // none: partials for a reduce launch
    sh.n[i] = static_cast<int>(n[i]);
    sh.nseg[i] = static_cast<int>(s);
    sh.col[i] = static_cast<int>(col[i]);
    sh.cta0[i] = ctas;
    sh.amax_row[i] = amax_row[i] ? 1 : 0;
    ctas += static_cast<int>(tiles * (ks2 ? 1 : s));
  }
  const int m = M, k = K;
#define MP_WG(...) launch_wg<__VA_ARGS__>(sh, a, a_amax, out, m, k, ctas, pdl)
  if (ks2) {  // both K segments in one CTA: the bf16 rows, no partials (native.fused_segments)
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
}
