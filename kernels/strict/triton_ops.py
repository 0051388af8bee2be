"""CUDA (learner side) kernels of the ``strict`` recipe: Triton with one fixed configuration.

* :func:`linear`: ``x @ w.T`` with a tile shape, K step and warp count that never depend on M,
  and no split-K: a row's K reduction is the same ``tl.dot`` sequence whichever batch it sits in
  (the MMA of a tile computes each output from its own row and column only; masked rows are 0).
* :func:`rmsnorm`: one program per row, a fixed block over the hidden size, ``tl.sum`` reduction,
  correctly rounded sqrt and division: HF's roundings (``bf16(x*inv)``, then ``bf16(w*y)``).

These define strict numerics on CUDA; the CPU definition (:mod:`.strict_ops`, fp32 trees) is
another, equally batch-invariant, function (bits differ between the two devices). The Triton
interpreter's bf16 ``tl.dot`` is broken (shared/ENVIRONMENT.md), so CPU tensors never come here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BM, BN, BK, WARPS, STAGES = 64, 64, 64, 4, 3


@triton.jit
def _linear_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbn, sbk, scm, scn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[None, :] * sbn + kk[:, None] * sbk, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)
    var = tl.div_rn(tl.sum(x * x, axis=0), H * 1.0)
    inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = (x * inv).to(y_ptr.dtype.element_ty)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = (w * y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * H + cols, y, mask=m)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not x.is_cuda:
        raise ValueError("strict_triton.linear runs on CUDA tensors (CPU: strict_ops.linear)")
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    m, k = a.shape
    n = weight.shape[0]
    acc = torch.empty(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    _linear_kernel[grid](a, weight, acc, m, n, k, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1),
                         acc.stride(0), acc.stride(1), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=WARPS, num_stages=STAGES)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*shape[:-1], n)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not x.is_cuda:
        raise ValueError("strict_triton.rmsnorm runs on CUDA tensors (CPU: strict_ops.rmsnorm)")
    h = x.shape[-1]
    xc = x.contiguous().reshape(-1, h)
    y = torch.empty_like(xc)
    block = triton.next_power_of_2(h)
    _rmsnorm_kernel[(xc.shape[0],)](xc, weight if weight is not None else xc, y, h, float(eps),
                                    HAS_W=weight is not None, BLOCK=block, num_warps=4)
    return y.reshape(x.shape)
