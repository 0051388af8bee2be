"""CUDA (learner side) kernels of the ``strict`` recipe: Triton, one fixed configuration each.

No configuration depends on the number of rows (tokens), the batch or the padding, so a row's bits
never depend on which micro-batch it sits in. This is the strict definition on CUDA; it is a
different function from the CPU definition (:mod:`.ops`), so CPU and GPU bits differ (per
op below; the recipe's description records it: ``recipes.OP_DOC_CUDA``).

* :func:`linear`: persistent GEMM ``x @ w.T (+ b)``, fixed tile 128x128x64, 8 warps, no split-K,
  K in ascending order, fp32 accumulation (tensor-core MMA), bias added in fp32, rounded once.
  CPU: the BLAS GEMM over fixed row blocks (another accumulation order).
* :func:`attention` and :func:`paged_attention` (one kernel: the learner's contiguous K/V and vLLM's
  paged KV cache differ only in integer addressing): flash-style causal attention, one program per
  (query block of 64 aligned at the sequence's first new token, head, sequence); key blocks of 64 at
  position 0 in ascending order, online softmax in fp32
  (``exp`` of the scaled scores), ``P`` rounded to bf16 for the ``P @ V`` MMA; right padding and
  fully masked key blocks leave a row's bits unchanged, so prefill and decode agree. Optional
  sliding window. CPU: max-subtracted softmax with tree sums and fp32 ``P``.
* :func:`rmsnorm`, :func:`add_rmsnorm`: one program per row, fixed block over the hidden size,
  ``tl.sum`` tree, correctly rounded sqrt and division, HF's roundings; the fused add rounds
  ``x + residual`` to bf16 first (as vLLM's fused kernel and the HF decoder). CPU: a pairwise tree
  (another summation order).
* :func:`act_and_mul`: ``bf16(bf16(act(g)) * u)``, SiLU, GELU-tanh or GELU-erf in fp32 (Triton's exp/erf).
* :func:`rope`: neox rotation in fp32 from the same fp64-built cos/sin table as the CPU
  (the rotation may fuse multiply-adds: bits may differ from the CPU in the last place).
* :func:`max_logz_rows`, :func:`log_softmax_fp32`, :func:`token_logprobs`: per row, fixed
  4096-wide chunks in ascending order; log-softmax is ``(x - max) - log(sum)``. CPU: tree sum.

The Triton interpreter's bf16 ``tl.dot`` is broken (measured with Triton 3.6-3.9), so CPU tensors never
come here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mismatch_probe.kernels.launch_math import cdiv, next_pow2

BM, BN, BK, WARPS, STAGES, GROUP = 128, 128, 64, 8, 3, 8
ATT_BM, ATT_BN, ATT_WARPS, ATT_STAGES = 64, 64, 4, 2
LSE_BLOCK = 4096



def _sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


@triton.jit
def _linear_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, sam, sak, sbn, sbk, scm, scn,
                   HAS_BIAS: tl.constexpr, NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    n_tiles = n_m * n_n
    for tile in range(pid, n_tiles, NUM_PROGS):  # persistent: each program walks its tiles in order
        group = tile // (GROUP_M * n_n)
        first_m = group * GROUP_M
        gsize = min(n_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * n_n)) % gsize
        pid_n = (tile % (GROUP_M * n_n)) // gsize
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # one fixed K order, no split
            kk = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + rn[:, None] * sbn + kk[None, :] * sbk, mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not x.is_cuda:
        raise ValueError("strict linear (Triton) runs on CUDA tensors (CPU: kernels.strict.ops.linear)")
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out.reshape(*shape[:-1], n)
    progs = _sms(x.device)
    _linear_kernel[(progs,)](a, weight, out, bias if bias is not None else out, m, n, k, a.stride(0), a.stride(1),
                             weight.stride(0), weight.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                             NUM_PROGS=progs, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GROUP, num_warps=WARPS,
                             num_stages=STAGES)
    return out.reshape(*shape[:-1], n)


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, qstart_ptr, qlen_ptr, kvlen_ptr, table_ptr, H, REP, scale, window,
                 sqb, sqt, sqh, skb, skp, skt, skh, svb, svp, svt, svh, sob, sot, soh, spb, stb,
                 D: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, GQ: tl.constexpr):
    # One kernel for both engines: the learner's contiguous K/V are pages of PAGE keys through an
    # identity table, vLLM's paged KV cache goes through its block table. Only integer addressing
    # differs between the two; every floating-point operation is the same instruction sequence.
    # GQ query heads of one KV head share a program (row r: head r % GQ of the group, token r // GQ
    # of the block): the sampler's decode packs its GQA group into the 64-row tile instead of one
    # live row in 64; each row's bits are the same (the MMA and the row reductions never mix rows,
    # and key blocks a row cannot see leave it unchanged).
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // (H // GQ)
    hg = (bh % (H // GQ)) * GQ
    r = tl.arange(0, BLOCK_M)
    h = hg + r % GQ
    kh = hg // REP
    q0 = tl.load(qstart_ptr + b)
    tq = tl.load(qlen_ptr + b)
    tk = tl.load(kvlen_ptr + b)
    rm = qb * (BLOCK_M // GQ) + r // GQ
    rd = tl.arange(0, D)
    qmask = rm < tq
    rows = (q0 + rm).to(tl.int64)
    pos = tl.load(pos_ptr + b * spb + rows, mask=qmask, other=-1)
    q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + rows[:, None] * sqt + rd[None, :], mask=qmask[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, tk)
    lo = 0
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(tl.min(tl.where(qmask, pos, 1 << 30), axis=0) - window + 1, 0)
        lo = (first // BLOCK_N) * BLOCK_N
    for n0 in range(lo, hi, BLOCK_N):  # key blocks aligned at 0, ascending
        rn = n0 + tl.arange(0, BLOCK_N)
        # keys no query of this block can see are never read (vLLM may have freed their pages)
        kmask = (rn < tk) & (rn >= first)
        page = tl.load(table_ptr + b * stb + rn // PAGE, mask=kmask, other=0).to(tl.int64)
        koff = page * skp + (rn % PAGE) * skt
        voff = page * svp + (rn % PAGE) * svt
        kt = tl.load(k_ptr + b * skb + kh * skh + koff[None, :] + rd[:, None], mask=kmask[None, :], other=0.0)
        s = tl.dot(q, kt) * scale
        vis = (rn[None, :] <= pos[:, None]) & kmask[None, :]
        if HAS_WINDOW:
            vis = vis & (rn[None, :] > pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * svb + kh * svh + voff[:, None] + rd[None, :], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * sob + h[:, None] * soh + rows[:, None] * sot + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None])


LEARNER_PAGE = 16  # keys per page of the learner's identity table (vLLM's default KV block size)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, pos: torch.Tensor, qstart: torch.Tensor,
            qlen: torch.Tensor, kvlen: torch.Tensor, table: torch.Tensor, n_seq: int, max_q: int, scale: float,
            window: int | None, kstrides: tuple[int, int, int, int], vstrides: tuple[int, int, int, int],
            qstrides: tuple[int, int, int], ostrides: tuple[int, int, int], spb: int, stb: int, hq: int, hkv: int,
            page: int, gq: int = 1) -> None:
    d = q.shape[-1]
    if n_seq == 0 or max_q == 0:
        return
    grid = (cdiv(max_q, ATT_BM // gq), n_seq * (hq // gq))
    _attn_kernel[grid](q, k, v, out, pos, qstart, qlen, kvlen, table, hq, hq // hkv, float(scale), int(window or 0),
                       *qstrides, *kstrides, *vstrides, *ostrides, spb, stb,
                       D=d, PAGE=page, HAS_WINDOW=window is not None, BLOCK_M=ATT_BM, BLOCK_N=ATT_BN, GQ=gq,
                       num_warps=ATT_WARPS, num_stages=ATT_STAGES)


@functools.lru_cache(maxsize=16)
def _learner_meta(b: int, tq: int, tk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The batch description of :func:`attention` with the last Tq positions (``q_pos=None``): per row
    its positions, first query (0), queries, keys, and the identity block table; made once per shape."""
    i32 = torch.int32
    pos = torch.arange(tk - tq, tk, device=device, dtype=i32).expand(b, tq).contiguous()
    return (pos, torch.zeros(b, device=device, dtype=i32), torch.full((b,), tq, device=device, dtype=i32),
            torch.full((b,), tk, device=device, dtype=i32),
            torch.arange(cdiv(max(tk, 1), LEARNER_PAGE), device=device, dtype=i32))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None, scale: float,
              window: int | None = None) -> torch.Tensor:
    """``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]`` (any strides, last dim contiguous), ``q_pos [B, Tq]``
    (None: the last Tq positions, every layer's batch description made once per shape; the learner;
    vLLM's paged cache: :func:`paged_attention`, the same kernel)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    dev = q.device
    if q_pos is None:
        pos, zeros, qlen, kvlen, table = _learner_meta(b, tq, tk, dev)
    else:
        i32 = torch.int32
        pos = q_pos.to(device=dev, dtype=i32).expand(b, tq).contiguous()
        zeros, qlen = torch.zeros(b, device=dev, dtype=i32), torch.full((b,), tq, device=dev, dtype=i32)
        kvlen = torch.full((b,), tk, device=dev, dtype=i32)
        table = torch.arange(cdiv(max(tk, 1), LEARNER_PAGE), device=dev, dtype=i32)
    out = torch.empty(b, tq, hq, d, device=dev, dtype=q.dtype)
    _launch(q, k, v, out, pos, zeros, qlen, kvlen, table, b, tq, scale, window,
            (k.stride(0), LEARNER_PAGE * k.stride(1), k.stride(1), k.stride(2)),
            (v.stride(0), LEARNER_PAGE * v.stride(1), v.stride(1), v.stride(2)),
            (q.stride(0), q.stride(1), q.stride(2)), (out.stride(0), out.stride(1), out.stride(2)),
            pos.stride(0), 0, hq, hkv, LEARNER_PAGE)
    return out


class PagedMeta(NamedTuple):
    """What :func:`paged_attention` derives from vLLM's batch description, the same for every layer of a
    step (:func:`paged_meta`; the vLLM plugin computes it once per step, not once per layer):
    per token its position, per request its first token, new tokens, context and block table rows."""

    pos: torch.Tensor
    qstart: torch.Tensor
    qlen: torch.Tensor
    kvlen: torch.Tensor
    table: torch.Tensor


def paged_meta(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, t: int) -> PagedMeta:
    """:class:`PagedMeta` of ``t`` tokens: a handful of small device ops, no host synchronization."""
    n_seq = seq_lens.shape[0]
    qsl = query_start_loc[: n_seq + 1]
    ends = qsl[1:].to(torch.int32)
    qstart = qsl[:-1].to(torch.int32)
    qlen = ends - qstart
    kvlen = seq_lens.to(torch.int32)
    tok = torch.arange(t, device=seq_lens.device, dtype=torch.int32)
    req = torch.searchsorted(ends, tok, right=True).clamp_(max=max(n_seq - 1, 0))
    pos = (kvlen[req] - (ends[req] - tok)).to(torch.int32)
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    return PagedMeta(pos, qstart, qlen, kvlen, table)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, max_query_len: int,
                    scale: float, window: int | None = None, meta: PagedMeta | None = None) -> torch.Tensor:
    """vLLM's varlen batch from its paged KV cache, the learner's numerics (same kernel as :func:`attention`).

    ``q, out [T, Hq, D]`` (requests' tokens back to back, ``query_start_loc [R + 1]``), ``key_cache,
    value_cache [blocks, page, Hkv, D]`` (any strides, last dim contiguous), ``seq_lens [R]`` (context +
    new tokens), ``block_table [R, max_blocks]``. The new tokens of request r sit at positions
    ``seq_lens[r] - q_len .. seq_lens[r] - 1``. ``meta``: :func:`paged_meta` of these, computed once
    for all layers of a step (None: computed here). No host synchronization (CUDA-graph capturable)."""
    n_seq = seq_lens.shape[0]
    hq = q.shape[1]
    hkv, page = key_cache.shape[2], key_cache.shape[1]
    m = meta if meta is not None else paged_meta(query_start_loc, seq_lens, block_table, q.shape[0])
    _launch(q, key_cache, value_cache, out, m.pos, m.qstart, m.qlen, m.kvlen, m.table, n_seq, int(max_query_len), scale,
            window, (0, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)),
            (0, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)),
            (0, q.stride(0), q.stride(1)), (0, out.stride(0), out.stride(1)), 0, m.table.stride(0), hq, hkv, page,
            gqa_pack(hq, hkv))
    return out


def gqa_pack(hq: int, hkv: int) -> int:
    """Query heads per program of the paged kernel: the whole GQA group where it is a power of two of at
    most 16 (a decode step then fills 4-16 of the tile's 64 rows instead of 1), else 1."""
    rep = hq // hkv if hkv else 1
    return rep if 1 <= rep <= 16 and rep & (rep - 1) == 0 else 1


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, H, eps, offset, NI, sxo, sxi, HAS_W: tl.constexpr,
                    HAS_RES: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    rmsnorm_row(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, tl.program_id(0).to(tl.int64), H, eps, offset, NI, sxo, sxi,
                HAS_W, HAS_RES, ROUND_FIRST, BLOCK)


@triton.jit
def rmsnorm_row(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, row, H, eps, offset, NI, sxo, sxi, HAS_W: tl.constexpr,
                HAS_RES: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """One row of the strict RMSNorm (the kernel above; kernels.nvfp4.norm_quant's fused norm + quantize
    runs this same code, so its rows are these bits).
    x row ``row`` at (row // NI) * sxo + (row % NI) * sxi: vLLM's per-head q/k norms read the heads
    straight out of the fused qkv output (no copy); y, residual and its output are contiguous."""
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + (row // NI) * sxo + (row % NI) * sxi + cols, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * H + cols, mask=m, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(rout_ptr + row * H + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.div_rn(tl.sum(xf * xf, axis=0), H * 1.0)
    inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = xf * inv
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) + offset
        if ROUND_FIRST:
            y = w * y.to(y_ptr.dtype.element_ty).to(tl.float32)
        else:
            y = y * w
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, offset: float,
          round_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    xv = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, x.shape[-2] if x.dim() > 2 else 1, h)  # a view where it can
    rows = xv.shape[0] * xv.shape[1]
    y = torch.empty(rows, h, device=x.device, dtype=x.dtype)
    rc = residual.contiguous().reshape(-1, h) if residual is not None else y
    rout = torch.empty_like(y) if residual is not None else y
    if rows:
        _rmsnorm_kernel[(rows,)](xv, rc, weight if weight is not None else y, y, rout, h, float(eps), float(offset),
                                 xv.shape[1], xv.stride(0), xv.stride(1), HAS_W=weight is not None,
                                 HAS_RES=residual is not None, ROUND_FIRST=round_first,
                                 BLOCK=next_pow2(h), num_warps=norm_warps(h))
    return y.reshape(x.shape), (rout.reshape(x.shape) if residual is not None else None)


def norm_warps(h: int) -> int:
    """Warps of the RMSNorm programs (with the block, what fixes ``tl.sum``'s order: part of the bits)."""
    return 4 if h <= 4096 else 8


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0,
            round_before_weight: bool = True) -> torch.Tensor:
    if not x.is_cuda:
        raise ValueError("strict rmsnorm (Triton) runs on CUDA tensors (CPU: kernels.strict.ops.rmsnorm)")
    return _norm(x, None, weight, eps, offset, round_before_weight)[0]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0,
                round_before_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    y, r = _norm(x, residual, weight, eps, offset, round_before_weight)
    assert r is not None
    return y, r


@triton.jit
def act_value(g, ACT: tl.constexpr):
    """The activation of fp32 ``g`` in fp32 (0 SiLU, 1 GELU-tanh, 2 GELU-erf), elementwise: every kernel
    that calls it on the same value gets the same bits (:func:`act_and_mul`, the NVFP4 ``act_quant``)."""
    if ACT == 1:  # gelu_tanh
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        a = 0.5 * g * (1.0 + t)
    elif ACT == 2:  # gelu (erf)
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        a = g / (1.0 + tl.exp(-g))
    return a


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, o_ptr, n, cols, sg, su, ACT: tl.constexpr, HAS_UP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = offs // cols
    col = offs % cols
    g = tl.load(g_ptr + row * sg + col, mask=mask, other=0.0).to(tl.float32)
    a = act_value(g, ACT).to(o_ptr.dtype.element_ty)
    if HAS_UP:
        u = tl.load(u_ptr + row * su + col, mask=mask, other=0.0).to(tl.float32)
        a = (a.to(tl.float32) * u).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + offs, a, mask=mask)


_ACTS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


def act_code(kind: str) -> int:
    """:func:`act_value`'s ``ACT`` for the strict activation ``kind`` (one clear error for any other)."""
    if kind not in _ACTS:
        raise ValueError(f"strict activation {kind!r} not supported; one of {sorted(_ACTS)}")
    return _ACTS[kind]


def rows2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last dim]: a view where the last dim has unit stride (strided rows, e.g. the gate and
    up halves of one gate_up output), else a contiguous copy."""
    d = t.shape[-1]
    return (t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, d)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor | None, kind: str = "silu") -> torch.Tensor:
    """``bf16(bf16(act(gate)) * up)`` (``up=None``: the activation alone). Rows may be strided views."""
    code = act_code(kind)
    cols = gate.shape[-1]
    g = rows2d(gate)
    u = None if up is None else rows2d(up)
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    n = g.shape[0] * cols
    if n:
        blk = 1024
        _act_mul_kernel[(cdiv(n, blk),)](g, u if u is not None else g, out, n, cols, g.stride(0),
                                                (u if u is not None else g).stride(0), ACT=code,
                                                HAS_UP=u is not None, BLOCK=blk, num_warps=4)
    return out


@triton.jit
def _rope_kernel(x_ptr, o_ptr, pos_ptr, cos_ptr, sin_ptr, H, sxt, sxh, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rh = tl.arange(0, BLOCK_H)
    rd = tl.arange(0, HALF)
    hm = rh < H
    p = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + p * HALF + rd)[None, :]
    s = tl.load(sin_ptr + p * HALF + rd)[None, :]
    base = x_ptr + t * sxt + rh[:, None] * sxh
    x1 = tl.load(base + rd[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + rd[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    ob = o_ptr + t * H * 2 * HALF + rh[:, None] * 2 * HALF
    tl.store(ob + rd[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=hm[:, None])
    tl.store(ob + HALF + rd[None, :], (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=hm[:, None])


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., T, H, D]`` at ``positions [..., T]`` (broadcast over leading dims) with fp32 tables ``[P, D/2]``."""
    d, h = x.shape[-1], x.shape[-2]
    lead = x.shape[:-2]
    pos = positions.expand(lead).reshape(-1).contiguous()
    xs = x.reshape(-1, h, d) if x.stride(-1) == 1 else x.contiguous().reshape(-1, h, d)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if xs.shape[0]:
        _rope_kernel[(xs.shape[0],)](xs, out, pos, cos.contiguous(), sin.contiguous(), h, xs.stride(0), xs.stride(1),
                                     HALF=d // 2, BLOCK_H=next_pow2(h), num_warps=4)
    return out


@triton.jit
def _lse_kernel(x_ptr, mx_ptr, lz_ptr, V, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for c0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * sx + c0 + cols, mask=c0 + cols < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    mx = tl.max(m, axis=0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, V, BLOCK):  # fixed chunks, ascending; lanes summed by tl.sum's fixed tree
        x = tl.load(x_ptr + row * sx + c0 + cols, mask=c0 + cols < V, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - mx)
    tl.store(mx_ptr + row, mx)
    tl.store(lz_ptr + row, tl.log(tl.sum(acc, axis=0)))


def max_logz_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (last dim): fp32 ``max x`` and ``log(sum(exp(x - max)))`` (fixed chunking, batch invariant)."""
    v = x.shape[-1]
    xs = rows2d(x)
    mx = torch.empty(xs.shape[0], device=x.device, dtype=torch.float32)
    lz = torch.empty_like(mx)
    if xs.shape[0]:
        _lse_kernel[(xs.shape[0],)](xs, mx, lz, v, xs.stride(0), BLOCK=LSE_BLOCK, num_warps=8)
    return mx.reshape(x.shape[:-1]), lz.reshape(x.shape[:-1])


def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """``(x - max) - log(sum(exp(x - max)))`` in fp32 (the CPU formula; another summation order)."""
    mx, lz = max_logz_rows(logits)
    return (logits.float() - mx[..., None]) - lz[..., None]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., ids]`` without the full fp32 ``[.., V]`` tensor."""
    mx, lz = max_logz_rows(logits)
    return (logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float() - mx) - lz
