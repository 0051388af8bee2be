"""Batch-invariant op implementations shared by both engines (the ``strict`` recipe).

One set of functions, imported by the HF/FSDP patch (:mod:`.patch_hf`) and by the vLLM plugin
(:mod:`.vllm_plugin`). Every function computes each output row from that row's inputs only, with
a reduction order that is fixed by the row's own length and never by the number of rows, the
padding, the thread count or the kernel library's blocking:

* **Reductions** (dot products, RMSNorm's sum of squares, softmax sums, attention) are fp32
  pairwise trees built from elementwise adds (:func:`tree_sum`): the operand is zero-padded to a
  power of two and halved, ``x[:L/2] + x[L/2:]``, until one value is left. Zero padding is exact,
  so the tree over ``n`` values gives the same bits for any padded length (a query that sees 7 keys
  gets the same sum in a learner batch padded to 40 tokens and in a vLLM decode step).
  Measured here (``bench/bench_strict.py``): torch's CPU fp32 matmul gives a row different bits
  alone than inside a 300-row batch (every row differed), so library GEMMs are never used.
* **Products** of bf16 operands are exact in fp32; **casts** round to nearest even once.
* **Transcendentals** (exp, log, sin, cos, pow) go through :func:`ew` in fixed-size chunks, so an
  element never moves between the vectorized body and the scalar tail of an ATen loop.

On CUDA the same definitions hold (elementwise ops are row independent there too); the learner-side
linear uses a fixed-configuration Triton kernel instead (:mod:`.strict_triton`) when asked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK = 2048  # elements per transcendental call: a multiple of every SIMD width, below ATen's grain size
ROW_CHUNK = 16  # rows per tree-dot block (bounds the [rows, N, K] product buffer)
OUT_DTYPE = torch.bfloat16


def ew(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` in fixed ``CHUNK``-element calls (position-independent bits)."""
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    if n == 0:
        return fn(flat).reshape(x.shape)
    pad = (-n) % CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, CHUNK)
    out = torch.cat([fn(blocks[i]) for i in range(blocks.shape[0])])
    return out[:n].reshape(x.shape)


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with fp32 tree reductions, rounded once to x's dtype (CUDA: the
    fixed-configuration Triton GEMM of :mod:`.strict_triton`)."""
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.linear(x, weight, bias)  # type: ignore[attr-defined]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    wf = weight.float()
    outs = [tree_dot(x2[i : i + ROW_CHUNK, None, :], wf[None]) for i in range(0, x2.shape[0], ROW_CHUNK)]
    acc = torch.cat(outs) if outs else x2.new_zeros(0, weight.shape[0], dtype=torch.float32)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


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
    if unit_offset:
        return _rmsnorm_unit_offset(x, weight, eps)
    cu = _cuda_kernels(x)
    if cu is not None:
        return cu.rmsnorm(x, weight, eps)  # type: ignore[attr-defined]
    xf = x.float()
    var = tree_sum(xf * xf, -1) / float(x.shape[-1])
    inv = 1.0 / torch.sqrt(var + eps)
    y = (xf * inv[..., None]).to(x.dtype)
    if weight is None:
        return y
    return (weight.float() * y.float()).to(x.dtype)


def _rmsnorm_unit_offset(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    var = tree_sum(xf * xf, -1) / float(x.shape[-1])
    y = xf * (1.0 / torch.sqrt(var + eps))[..., None]
    if weight is not None:
        y = y * (1.0 + weight.float())
    return y.to(x.dtype)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                unit_offset: bool = False):
    """vLLM's fused add + norm, as the HF decoder computes it: ``r = bf16(x + residual)``."""
    r = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm(r, weight, eps, unit_offset=unit_offset), r


def silu(x: torch.Tensor) -> torch.Tensor:
    """``bf16(x / (1 + exp(-x)))`` in fp32."""
    xf = x.float()
    return (xf / (1.0 + ew(torch.exp, -xf))).to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``bf16(silu(gate) * up)``: the HF MLP's two roundings (silu, then the product)."""
    return (silu(gate).float() * up.float()).to(up.dtype)


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


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``bf16(act(gate) * up)`` with the strict ``act`` (:data:`ACTIVATIONS`): two roundings, as
    the HF MLPs compute ``act_fn(gate_proj(x)) * up_proj(x)``."""
    return (ACTIVATIONS[act](gate).float() * up.float()).to(up.dtype)


_ROPE: dict[tuple[float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(base: float, dim: int, n_pos: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin ``[>= n_pos, dim/2]`` of ``pos * base^(-2i/dim)`` computed in fp64."""
    key = (float(base), int(dim))
    have = _ROPE.get(key)
    if have is None or have[0].shape[0] < n_pos:
        size = 1 << max(8, (max(n_pos, 1) - 1).bit_length())
        expo = torch.arange(0, dim, 2, dtype=torch.float64) / float(dim)
        inv = ew(lambda e: torch.pow(torch.tensor(float(base), dtype=torch.float64), -e), expo)
        ang = torch.arange(size, dtype=torch.float64)[:, None] * inv[None, :]
        have = (ew(torch.cos, ang).float(), ew(torch.sin, ang).float())
        _ROPE[key] = have
    cos, sin = have
    return cos.to(device), sin.to(device)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Neox-style rotary embedding of ``x[..., T, H, D]`` at ``positions[..., T]`` (fp32 math)."""
    d = x.shape[-1]
    cos, sin = rope_table(base, d, int(positions.max()) + 1 if positions.numel() else 1, x.device)
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
    including the query's own). Invisible keys add exact zeros at their own index of the trees,
    so a query gets the same bits whatever the window clips or how many keys follow.

    Scores, softmax sums and the weighted value sum are fp32 trees; the output is rounded once.
    Used for the learner's teacher-forced prefill and for vLLM prefill and decode (keys read back
    from the paged KV cache): a query gets the same bits in all three.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    s = tree_dot(qf[:, :, None, :], kf[:, None, :, :]) * scale  # [Hq, Tq, Tk]
    j, qp = torch.arange(tk, device=q.device)[None, :], q_pos.to(q.device)[:, None]
    visible = j <= qp  # [Tq, Tk]
    if window is not None and window > 0:
        visible &= j > qp - window
    s = torch.where(visible[None], s, torch.full_like(s, float("-inf")))
    m = s.amax(dim=-1, keepdim=True)
    p = ew(torch.exp, s - m)
    denom = tree_sum(p, -1)  # [Hq, Tq]
    num = tree_sum(p[..., None] * vf[:, None, :, :], -2)  # [Hq, Tq, D]
    return (num / denom[..., None]).transpose(0, 1).to(q.dtype)  # [Tq, Hq, D]


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    lf = logits.float()
    e = ew(torch.exp, lf - lf.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, -1)[..., None]


def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last dim: ``s - log(tree_sum(exp(s)))``, ``s = x - max x``."""
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
