"""Batch-invariant op implementations shared by both engines (the ``strict`` recipe).

One set of functions, imported by the HF/FSDP patch (``probes/hf/patch.py``) and by the vLLM plugin
(``probes/vllm/plugin.py``). Every function computes each output row from that row's inputs only, with
a reduction order that is fixed by the row's own length and never by the number of rows, the
padding or the thread count. The blocking is fixed, never chosen from M:

* **Linear** (CPU): the CPU BLAS GEMM (oneDNN for bf16 operands, MKL for fp32) on the rows
  zero-padded to a multiple of ``ROW_BLOCK``; fp32 accumulation, rounded once to the input dtype.
  A library GEMM is batch invariant only for a fixed shape (torch's CPU fp32 matmul gives a row
  different bits alone than inside a 300-row batch: ``tests/test_align.py``), so the row count is
  always a whole number of blocks and the first call per weight shape checks that a block gives
  the same bits alone as inside the call; if it does not (another BLAS or CPU), that shape falls
  back to one GEMM call per ``ROW_BLOCK`` rows (every call the same shape).
* **Attention** (CPU): scores and the value sum are GEMMs of fixed shapes only: ``[QB, D] x [D, KB]``
  per (query block, key block) and ``[QB, KB] x [KB, D]`` per block pair, blocks aligned at
  position 0 of the sequence; the key blocks' partial value sums and the softmax denominator are
  fp32 pairwise trees (:func:`tree_sum`). A query sees the same bits in a learner batch padded to
  any width, in a vLLM prefill and in a vLLM decode step (fully masked key blocks contribute exact
  zeros).
* **Other reductions** (RMSNorm's sum of squares, softmax sums, MoE renorm) are fp32 pairwise trees
  built from elementwise adds (:func:`tree_sum`): zero-padded to a power of two and halved,
  ``x[:L/2] + x[L/2:]``, until one value is left (zero padding is exact, so the bits do not depend
  on the padded length).
* **Products** of bf16 operands are exact in fp32; **casts** round to nearest even once.
* **Transcendentals** (exp, log, sin, cos, pow, tanh) go through :func:`ew` in fixed-size chunks
  below ATen's parallel grain, so every element takes the vectorized path of one thread (an element
  never moves between the vectorized body and the scalar tail of an ATen loop).

On CUDA the learner uses fixed-configuration Triton kernels (:mod:`.triton_ops`, one numerics
definition for CUDA, documented there: bits differ from the CPU definition); elementwise CUDA ops
compute each element alone, so :func:`ew` calls them directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

CHUNK = 16384  # elements per transcendental call: a multiple of every SIMD width, below ATen's grain (32768)
ROW_BLOCK = 16  # linear: rows per GEMM block (M is padded to a multiple)
QB, KB = 16, 64  # attention: query rows and keys per GEMM block
ATTN_BUDGET = 1 << 24  # attention: fp32 elements of scores per query-block group (bounds memory)
OUT_DTYPE = torch.bfloat16


def ew(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` in fixed ``CHUNK``-element calls (position-independent bits).
    CUDA tensors: one call (a CUDA elementwise kernel computes every element alike)."""
    if x.is_cuda:
        return fn(x)
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    if n == 0:
        return fn(flat).reshape(x.shape)
    pad = (-n) % CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, CHUNK)
    first = fn(blocks[0])
    out = first.new_empty(blocks.shape)
    out[0] = first
    for i in range(1, blocks.shape[0]):
        out[i] = fn(blocks[i])
    return out.reshape(-1)[:n].reshape(x.shape)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pairwise sum over ``dim`` in a fixed tree (see module doc); ``dim`` is removed."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    size = 1
    while size < n:
        size *= 2
    if size != n:
        x = torch.nn.functional.pad(x, (0, size - n))
    while size > 1:
        size //= 2
        x = x[..., :size] + x[..., size:]
    return x[..., 0]


def tree_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum_k a[..., k] * b[..., k]`` with the fixed tree (broadcasting)."""
    return tree_sum(a.float() * b.float(), -1)


def _cuda_kernels(x: torch.Tensor) -> object | None:
    """The Triton strict kernels for CUDA tensors (None on CPU or where Triton is missing)."""
    if not x.is_cuda:
        return None
    try:
        from . import triton_ops as strict_triton
    except ImportError:
        return None
    return strict_triton


_GEMM_BLOCKED: dict[tuple, bool] = {}  # (N, K, dtype) -> True where the BLAS is not row invariant


def _pad_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-x.shape[0]) % block
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def _gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Padded-rows CPU GEMM (see module doc): ``[M, K] -> [M, N]`` in the operands' dtype."""
    m = x2.shape[0]
    xp = _pad_rows(x2, ROW_BLOCK)
    key = (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)
    if _GEMM_BLOCKED.get(key):
        out = torch.cat([F.linear(xp[i : i + ROW_BLOCK], weight, bias) for i in range(0, xp.shape[0], ROW_BLOCK)])
        return out[:m]
    out = F.linear(xp, weight, bias)
    if key not in _GEMM_BLOCKED and xp.shape[0] > ROW_BLOCK:
        alone = F.linear(xp[:ROW_BLOCK], weight, bias)
        _GEMM_BLOCKED[key] = not torch.equal(alone, out[:ROW_BLOCK])
        if _GEMM_BLOCKED[key]:
            return _gemm(x2, weight, bias)
    return out[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: fp32 accumulation, rounded once to x's dtype, batch invariant
    (CPU: fixed row blocks of the BLAS GEMM; CUDA: the fixed-configuration Triton GEMM)."""
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.linear(x, weight, bias)  # type: ignore[attr-defined]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        out = _gemm(x2, weight, None if bias is None else bias.to(x.dtype))  # oneDNN: fp32 accumulate (+bias), one rounding
    else:
        out = _gemm(x2.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Row gather (exact in every engine). ``scale`` (a 0-d tensor in the weight's dtype, e.g.
    Gemma's bf16 ``sqrt(hidden)``) multiplies each row in fp32, rounded once: the bits of a bf16
    elementwise product."""
    out = weight.index_select(0, ids.reshape(-1)).reshape(*ids.shape, weight.shape[1])
    if scale is None:
        return out
    return (out.float() * scale.to(weight.dtype).float()).to(weight.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """``w * bf16(x * 1/sqrt(tree_sum(x^2)/H + eps))``: HF's order of roundings, fixed reduction.

    ``unit_offset=True`` is Gemma's norm: ``bf16(x * inv * (1 + w))`` in fp32, rounded once (the
    weight stores ``w``, the scale is ``1 + w``; HF's Gemma RMSNorm rounds in this order)."""
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.rmsnorm(x, weight, eps, 1.0 if unit_offset else 0.0, not unit_offset)  # type: ignore[attr-defined]
    xf = x.float()
    var = tree_sum(xf * xf, -1) / float(x.shape[-1])
    y = xf * (1.0 / torch.sqrt(var + eps))[..., None]
    if unit_offset:
        return (y * (1.0 + weight.float()) if weight is not None else y).to(x.dtype)
    y = y.to(x.dtype)
    if weight is None:
        return y
    return (weight.float() * y.float()).to(x.dtype)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused add + norm, as the HF decoder computes it: ``r = bf16(x + residual)``."""
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.add_rmsnorm(x, residual, weight, eps, 1.0 if unit_offset else 0.0, not unit_offset)  # type: ignore[attr-defined]
    r = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm(r, weight, eps, unit_offset=unit_offset), r


def silu(x: torch.Tensor) -> torch.Tensor:
    """``bf16(x / (1 + exp(-x)))`` in fp32."""
    xf = x.float()
    return (xf / (1.0 + ew(torch.exp, -xf))).to(x.dtype)


_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_INV_SQRT_2 = 0.7071067811865476


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``bf16(0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))))`` in fp32 (GELU, tanh approximation)."""
    xf = x.float()
    inner = _SQRT_2_OVER_PI * (xf + 0.044715 * (xf * xf * xf))
    return (0.5 * xf * (1.0 + ew(torch.tanh, inner))).to(x.dtype)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """``bf16(0.5 x (1 + erf(x / sqrt 2)))`` in fp32 (exact GELU)."""
    xf = x.float()
    return (0.5 * xf * (1.0 + ew(torch.erf, xf * _INV_SQRT_2))).to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu, "gelu_tanh": gelu_tanh, "gelu": gelu_erf,
}


def act(x: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """The strict activation ``kind`` (:data:`ACTIVATIONS`), rounded once to x's dtype."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"strict activation {kind!r} not supported; one of {sorted(ACTIVATIONS)}")
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.act_and_mul(x, None, kind)  # type: ignore[attr-defined]
    return ACTIVATIONS[kind](x)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``bf16(act(gate) * up)`` with the strict ``act`` (:data:`ACTIVATIONS`): two roundings, as
    the HF MLPs compute ``act_fn(gate_proj(x)) * up_proj(x)``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"strict activation {act!r} not supported; one of {sorted(ACTIVATIONS)}")
    cu = _cuda_kernels(gate)
    if cu is not None:
        return cu.act_and_mul(gate, up, act)  # type: ignore[attr-defined]
    return (ACTIVATIONS[act](gate).float() * up.float()).to(up.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``bf16(silu(gate) * up)``: the HF MLP's two roundings (silu, then the product)."""
    return act_and_mul(gate, up, "silu")


_ROPE: dict[tuple[float, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(base: float, dim: int, n_pos: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin ``[>= n_pos, dim/2]`` of ``pos * base^(-2i/dim)`` computed in fp64 on the CPU
    (cached per device, so a CUDA forward copies the table once, not per call)."""
    key = (float(base), int(dim), str(torch.device(device)))
    have = _ROPE.get(key)
    if have is None or have[0].shape[0] < n_pos:
        size = 1 << max(8, (max(n_pos, 1) - 1).bit_length())
        expo = torch.arange(0, dim, 2, dtype=torch.float64) / float(dim)
        inv = ew(lambda e: torch.pow(torch.tensor(float(base), dtype=torch.float64), -e), expo)
        ang = torch.arange(size, dtype=torch.float64)[:, None] * inv[None, :]
        have = (ew(torch.cos, ang).float().to(device), ew(torch.sin, ang).float().to(device))
        _ROPE[key] = have
    return have


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Neox-style rotary embedding of ``x[..., T, H, D]`` at ``positions[..., T]`` (fp32 math)."""
    d = x.shape[-1]
    if x.is_cuda:  # no host sync: a table long enough for every position of the call
        n_pos = max(8192, positions.shape[-1])
    else:
        n_pos = int(positions.max()) + 1 if positions.numel() else 1
    cos, sin = rope_table(base, d, n_pos, x.device)
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.rope(x, positions, cos, sin)  # type: ignore[attr-defined]
    c = cos[positions][..., None, :]  # [..., T, 1, D/2]
    s = sin[positions][..., None, :]
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
              window: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence: ``q [Tq, Hq, D]`` at absolute positions ``q_pos [Tq]``
    over keys/values ``[Tk, Hkv, D]`` at positions ``0..Tk-1`` (key j visible iff j <= q_pos;
    with a sliding ``window`` W also iff j > q_pos - W, HF's and vLLM's convention: W keys
    including the query's own). See :func:`attention_batch`."""
    return attention_batch(q[None], k[None], v[None], q_pos.reshape(1, -1), scale, window)[0]


@functools.lru_cache(maxsize=16)
def tail_positions(b: int, tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """``[B, Tq]`` positions ``Tk - Tq .. Tk - 1`` (the queries of a right-padded batch: key j at position j),
    one tensor per shape and device, shared by every layer (:func:`attention_batch`'s ``q_pos=None``)."""
    return torch.arange(tk - tq, tk, device=device).expand(b, tq)


def attention_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of ``B`` sequences at once: ``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]``
    (key j at position j; right padding is never visible to a real query), ``q_pos [B, Tq]`` (None: the
    last Tq positions, :func:`tail_positions`; the CUDA kernel then reuses its batch description per shape).

    CPU definition (module doc): scores ``dot(q, k) * scale`` from fixed ``[QB, D] x [D, KB]`` fp32
    GEMMs; ``m`` = max over visible keys; ``p = exp(s - m)``; denominator ``tree_sum(p)``;
    numerator = ``tree_sum`` over key blocks of fixed ``[QB, KB] x [KB, D]`` fp32 GEMMs; output
    ``bf16(num / den)``. CUDA: the Triton kernel of :mod:`.triton_ops` (online softmax).
    A query gets the same bits in any batch, padding, prefill or decode step."""
    if window is not None and window <= 0:
        window = None
    cu = _cuda_kernels(q)
    if cu is not None:
        return cu.attention(q, k, v, q_pos, scale, window)  # type: ignore[attr-defined]
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if q_pos is None:
        q_pos = tail_positions(b, tq, tk, q.device)
    rep = hq // hkv
    tqp, tkp = -(-tq // QB) * QB, -(-max(tk, 1) // KB) * KB
    nqb, nkb = tqp // QB, tkp // KB
    qf = F.pad(q.float(), (0, 0, 0, 0, 0, tqp - tq)).permute(0, 2, 1, 3).reshape(b, hq, nqb, 1, QB, d)
    kf = F.pad(k.float(), (0, 0, 0, 0, 0, tkp - tk)).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    vf = F.pad(v.float(), (0, 0, 0, 0, 0, tkp - tk)).permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    kt = kf.reshape(b, hq, 1, nkb, KB, d).transpose(-1, -2)  # [B, H, 1, nkb, D, KB]
    vb = vf.reshape(b, hq, 1, nkb, KB, d)
    qp = F.pad(q_pos.to(q.device).long(), (0, tqp - tq))  # padded queries see key 0 (dropped below)
    kpos = torch.arange(tkp, device=q.device)
    out = torch.empty(b, hq, tqp, d, dtype=torch.float32, device=q.device)
    group = max(1, ATTN_BUDGET // max(1, b * hq * QB * tkp))  # query blocks per pass (memory bound)
    for g0 in range(0, nqb, group):
        g1 = min(nqb, g0 + group)
        s = torch.matmul(qf[:, :, g0:g1], kt)  # [B, H, g, nkb, QB, KB]
        s = s.permute(0, 1, 2, 4, 3, 5).reshape(b, hq, (g1 - g0) * QB, tkp) * scale
        pos = qp[:, g0 * QB : g1 * QB]
        visible = (kpos[None, None, :] <= pos[:, :, None]) & (kpos < tk)[None, None, :]
        if window is not None:
            visible &= kpos[None, None, :] > pos[:, :, None] - window
        s = torch.where(visible[:, None], s, torch.full_like(s, float("-inf")))
        m = s.amax(dim=-1, keepdim=True)
        p = ew(torch.exp, s - m)  # [B, H, g*QB, tkp]
        den = tree_sum(p, -1)
        pb = p.reshape(b, hq, g1 - g0, QB, nkb, KB).permute(0, 1, 2, 4, 3, 5)  # [B, H, g, nkb, QB, KB]
        part = torch.matmul(pb, vb)  # [B, H, g, nkb, QB, D]
        num = tree_sum(part, 3).reshape(b, hq, (g1 - g0) * QB, d) + 0.0  # + 0.0: one sign for zeros
        out[:, :, g0 * QB : g1 * QB] = num / den[..., None]
    return out[:, :, :tq].permute(0, 2, 1, 3).to(q.dtype)


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    lf = logits.float()
    e = ew(torch.exp, lf - lf.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, -1)[..., None]


def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim: ``s - log(tree_sum(exp(s)))``, ``s = x - max x``."""
    cu = _cuda_kernels(logits)
    if cu is not None:
        return cu.log_softmax_fp32(logits)  # type: ignore[attr-defined]
    lf = logits.float()
    s = lf - lf.amax(dim=-1, keepdim=True)
    z = tree_sum(ew(torch.exp, s), -1)
    return s - ew(torch.log, z)[..., None]


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k by a stable sort (ties: lower expert id first), optional renorm.
    Returns ``(weights fp32 [T, k], ids int64 [T, k])``."""
    probs = softmax_fp32(router_logits)
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    w, ids = vals[:, :top_k], ids[:, :top_k]
    if renormalize:
        w = w / tree_sum(w, -1)[:, None]
    return w, ids


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    linear_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Experts and combine in a fixed order. ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``. Each (token, slot) output is computed row by row (batch invariant); the
    combine is ``sum over slots 0..k-1 in rank order of w * y`` in fp32, rounded once.
    ``linear_fn(x, w, expert=(e, part))`` replaces the expert GEMMs (NVFP4 recipes)."""
    t, k = ids.shape
    inter = w2.shape[2]
    ys = torch.zeros(t, k, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok]
        if linear_fn is None:
            gu = linear(xe, w13[e])
            a = silu_and_mul(gu[:, :inter], gu[:, inter:])
            y = linear(a, w2[e])
        else:
            g = linear_fn(xe, w13[e, :inter], key=(e, "gate"))
            u = linear_fn(xe, w13[e, inter:], key=(e, "up"))
            y = linear_fn(silu_and_mul(g, u), w2[e], key=(e, "down"))
        ys[tok, slot] = y.float()
    acc = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):
        acc = acc + weights[:, j, None].float() * ys[:, j]
    return acc.to(x.dtype)
