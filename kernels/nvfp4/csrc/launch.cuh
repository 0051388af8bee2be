// Host launchers of the kernel instances (launch_decode, launch_bulk, launch_wg, launch_quant, launch_sync): shared
// memory sizes, grids, streams. Needs torch (not in the kernels-only build); included inside a second
// anonymous namespace, after every kernel header.
// Included by nvfp4_native.cu (the one translation unit, built by kernels/nvfp4/native.py) inside its
// anonymous namespace, after the headers listed there before it; not a standalone header.
#pragma once

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

// ``pdl``: launched with programmatic stream serialization (the caller's promise: the kernel before it on the
// stream writes none of the weights' fields; it may be running still while this one streams the weights, see
// decode_wg_kernel's producer; every read of the tokens and every write waits for it to finish). ``sh``: the
// shard table (decode_wg.cuh), ``ctas`` its CTAs in all
template <int NTOK, int S, int CPS, int R = 2, bool KS2 = false>
void launch_wg(const WgShards& sh, const torch::Tensor& a, const torch::Tensor& a_amax, torch::Tensor& out, int M,
               int K, int ctas, bool pdl) {
  constexpr int SMEM = wg_smem(NTOK, S, CPS, KS2);
  auto kern = decode_wg_kernel<NTOK, S, CPS, 0, R, KS2>;
  static bool attr = false;
  if (!attr) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    attr = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(KS2 ? 320 : 160);
  cfg.dynamicSmemBytes = SMEM;
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, sh, reinterpret_cast<const __half*>(a.data_ptr()),
                                    static_cast<const float*>(a_amax.data_ptr<float>()),
                                    reinterpret_cast<uint16_t*>(out.data_ptr()), M, K));
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

// the weight sync (sync.cuh): the amax kernel (amax_progs programs) then the fused kernel (quant_progs),
// both over the one shard table; either count 0 skips that kernel
void launch_sync(const torch::Tensor& x_base, const torch::Tensor& tab, torch::Tensor& ab, torch::Tensor& out,
                 int64_t amax_progs, int64_t quant_progs) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x_base.data_ptr());
  const long long* tp = reinterpret_cast<const long long*>(tab.data_ptr());
  const int items = static_cast<int>(tab.size(0));
  if (amax_progs > 0) {
    sync_amax_kernel<<<static_cast<unsigned>(amax_progs), SYNC_THREADS, 0, stream>>>(
        xp, tp, items, reinterpret_cast<int*>(ab.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (quant_progs > 0) {
    sync_quant_kernel<<<static_cast<unsigned>(quant_progs), SYNC_THREADS, 0, stream>>>(
        xp, tp, items, ab.data_ptr<float>(), out.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
