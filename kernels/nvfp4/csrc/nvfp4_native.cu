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
//
// Sources by role (each .cuh is included once, here, in this order; all of csrc/ keys the build cache):
//   common.cuh          constants, PTX wrappers, fragment decode, one K chunk of MMAs, the decode epilogue
//   decode_cpasync.cuh  decode pipeline 1: cp.async ring (variants 0, 3; the fallback)
//   decode_bulk.cuh     decode pipeline 2: producer warp + cp.async.bulk on mbarriers (variants 6-14)
//   decode_wg.cuh       decode pipeline 3: wgmma on sm_90a (variant 15)
//   quantize.cuh        the quantizer kernel
//   sync.cuh            the weight sync (sync.py): amax pass and the fused bf16 -> every prepared layout kernel
//   launch.cuh          host launchers of the kernel instances (torch)
//   dispatch.cuh        decode_gemm / quantize_rows / sync_weights: argument checks and the dispatch over the variants (torch)
//   nvfp4_native.cu     this file: includes, namespaces, the Python bindings, the kernels-only instance list
#ifndef NVFP4_KERNELS_ONLY  // (defined for a compile check of the kernels without torch)
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <cuda_fp16.h>
#include <cstdint>

namespace {

#include "common.cuh"
#include "decode_cpasync.cuh"
#include "decode_bulk.cuh"
#include "decode_wg.cuh"  // the wgmma decode GEMM (variant 15)
#include "quantize.cuh"
#include "sync.cuh"  // the weight sync's amax and fused kernels

}  // namespace

#ifndef NVFP4_KERNELS_ONLY
namespace {

#include "launch.cuh"

}  // namespace

#include "dispatch.cuh"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_gemm", &decode_gemm, "NVFP4 decode GEMM (native layout weights, fp16 activation operand)");
  m.def("decode_wg", &decode_wg, "NVFP4 decode GEMM on wgmma (sm_90a) over 1-4 weight shards into one output");
  m.def("quantize_rows", &quantize_rows, "NVFP4 per-token / given-amax quantizer, bf16 rows (op_cm 1: chunk-major operand, 2: core-matrix operand)");
  m.def("sync_weights", &sync_weights, "weight sync: amax pass and fused bf16 -> NVFP4 layouts kernel over a shard table");
  m.attr("sync_cols") = SYNC_COLS;              // the shard table's columns (sync.cuh)
  m.attr("sync_amax_elems") = SYNC_AMAX_ELEMS;  // bf16 elements per amax program
  m.attr("sync_chunks") = SYNC_CH;              // 128-wide K chunks per fused program
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
                           (void*)quant_rows_kernel<4, true>, (void*)quant_rows_kernel<4, true, 2>,
                           (void*)sync_amax_kernel, (void*)sync_quant_kernel};
#endif
