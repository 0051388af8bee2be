"""Weight sync: bf16 weights -> the prepared NVFP4 weights of the GEMM, at memory speed.

What :meth:`linear.NVFP4Linear.prepared` computes for a 1x16-block scheme (``nvfp4-per-token``:
one amax per logical weight; ``nvfp4-static``: one amax over the fused shards), i.e.
``tc_linear.prepare(nvfp4_quantize_ref(shard, amax=...))`` per shard plus the native decode
layout :func:`native.decode_ok` would make at first use, in two launches per weight instead of
dozens of torch passes:

* ``_amax_kernel``: per row the max |x| over finite values and a non-finite flag (2 NaN, 1 Inf),
  ``atomic_max``-ed into the weight's shard slots (float max: order free, so exact);
* ``_sync_kernel``: per 64-row tile and ``bkc``-wide K chunk, reads the bf16 tile once and writes
  the codes (standard packing), the E4M3 scale bytes, the decode-layout tiles (``dec``/``dsc`` of
  :func:`tc_linear.decode_layout`) and, where K % 128 == 0, the native layout
  (``native.native_layout``: code bytes, scale bytes = ``dsc``, fp16 ``sf * 2^7``).

The quantizer arithmetic is the spec's (:func:`ref.nvfp4_quantize_ref`), with the exact helpers of
:mod:`common` (``tl.div_rn``, integer E4M3 rounding), so every field is bitwise equal to the
reference path (``tests/kernels/test_nvfp4_sync.py``). Padding rows of the last tile come out
zero, as the reference's. ``native`` (no NaN-flagged block) is known from the flags; the host
reads all flags of :func:`sync_model` with one synchronization at the end.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from .common import INTERPRET, e2m1_encode, e4m3_round, kjit, launch, rmax, rsum
from .schemes import SCHEMES, Scheme, quantize_weight_ref, shard_sizes
from .tuning import DEFAULT, GemmTuning

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
TILE = 64  # rows per program = tc_linear.TILE_ROWS (one decode-layout tile)
# launch configurations (H200, bench/gpu_nvfp4_check.py --only b: BENCHMARKS.md, "Issue 28"); they change
# no bit (max-reductions and disjoint-bit sums), only the speed
AMAX_CFG = (16, 256, 4)  # amax pass: rows per program, K block, warps
SYNC_WARPS = 8  # the fused kernel, per 64-row tile
ROWS = tl.constexpr(TILE)
MAX_SHARDS = 3


@kjit
def _amax_kernel(x_ptr, amax_ptr, flag_ptr, n, K, b1, b2, R: tl.constexpr, BK: tl.constexpr):
    """Rows [pid*R, pid*R+R): finite max |x| and non-finite flag per row, max-ed into slot
    (row >= b1) + (row >= b2) of ``amax_ptr`` / ``flag_ptr`` (zero-initialized)."""
    rows = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    rmask = rows < n
    cols = tl.arange(0, BK)
    am = tl.full([R, BK], 0.0, tl.float32)
    nf = tl.full([R, BK], 0, tl.int32)
    for k0 in range(0, K, BK):
        m = rmask[:, None] & ((k0 + cols) < K)[None, :]
        bits = tl.load(x_ptr + rows[:, None] * K + k0 + cols[None, :], mask=m, other=0)
        a = tl.abs((bits.to(tl.int32) << 16).to(tl.float32, bitcast=True))
        am = tl.maximum(am, tl.where(a < float("inf"), a, 0.0))
        nf = tl.maximum(nf, tl.where(a != a, 2, tl.where(a == float("inf"), 1, 0)))
    slot = (rows >= b1).to(tl.int32) + (rows >= b2).to(tl.int32)
    ram = rmax(am, 1)
    rnf = rmax(nf, 1)
    for s in range(3):  # one scalar atomic per slot and program (a 0 where no row is in the slot: harmless)
        sel = rmask & (slot == s)
        tl.atomic_max(amax_ptr + s, rmax(tl.where(sel, ram, 0.0), 0))
        tl.atomic_max(flag_ptr + s, rmax(tl.where(sel, rnf, 0), 0))


@kjit
def _quant_half(x, s_dec, mult, nanrow, R: tl.constexpr, H: tl.constexpr):
    """fp32 [R, H] -> (E2M1 codes [R, H/16, 16] int32, scale bytes [R, H/16] int32, sf fp32);
    ``nanrow`` [R]: rows quantized with a NaN amax (flagged as the reference's NaN arithmetic makes them)."""
    xb = tl.reshape(x, (R, H // 16, 16))
    a = tl.abs(xb)
    vmax = rmax(tl.where(a < float("inf"), a, 0.0), 2)
    bad = rmax(((a < float("inf")) == 0).to(tl.int32), 2)
    bad = tl.where(nanrow[:, None], 1, bad)  # a NaN amax (static, NaN weight): torch's NaN scales, codes 0
    sbyte, sf = e4m3_round(tl.minimum(vmax * mult, 448.0))
    den = sf * s_dec
    enc = tl.minimum(tl.div_rn(tl.full(den.shape, 1.0, tl.float32), den), _FLT_MAX)
    y = tl.minimum(tl.maximum(xb * enc[:, :, None], -6.0), 6.0)
    codes = tl.where(bad[:, :, None] != 0, 0, e2m1_encode(y))
    return codes, tl.where(bad != 0, 127, sbyte), sf


@kjit
def _store_half(codes, sbyte, rows, rmask, rl, c, s, K, codes_ptr, scales_ptr, dsc_ptr, tile, H: tl.constexpr,
                BKC: tl.constexpr):
    """Half ``s`` (K columns c*BKC + s*H + [0, H)) of a tile: codes, scales, dsc."""
    lo, hi = tl.split(tl.reshape(codes, (ROWS, H // 2, 2)))
    j2 = tl.arange(0, H // 2)
    tl.store(codes_ptr + rows[:, None] * (K // 2) + c * (BKC // 2) + s * (H // 2) + j2[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None])
    j16 = tl.arange(0, H // 16)
    tl.store(scales_ptr + rows[:, None] * (K // 16) + c * (BKC // 16) + s * (H // 16) + j16[None, :],
             sbyte.to(tl.uint8), mask=rmask[:, None])
    tl.store(dsc_ptr + tile * (ROWS * (BKC // 16)) + rl[:, None] * (BKC // 16) + s * (H // 16) + j16[None, :],
             sbyte.to(tl.uint8))


@kjit
def _native_words(codes):
    """One half's codes [ROWS, 4, 16] (H = 64) -> the native layout's int32 words of each row [ROWS, 2, 4]
    (w', q): byte (w', kk = 8a + 2q + b) of :func:`native.native_layout` (its codes of blocks 2w' and
    2w' + 1, k position kk) goes to byte 2b + a of word (q, w') of the half."""
    c4 = tl.reshape(codes, (ROWS, 2, 2, 16))  # [row, w', h, kk]
    h = tl.arange(0, 2)[None, None, :, None]
    part = tl.where(h == 0, ((c4 & 7) << 1) | ((c4 & 8) << 4), ((c4 & 7) << 4) | (c4 >> 3))
    byte = rsum(part, 2)  # [row, w', kk]; disjoint bits: the sum is the OR
    b5 = tl.reshape(byte, (ROWS, 2, 2, 4, 2))  # [row, w', a, q, b]
    a = tl.arange(0, 2)[None, None, :, None, None]
    b = tl.arange(0, 2)[None, None, None, None, :]
    return rsum(rsum(b5 << (8 * (2 * b + a)), 4), 2)  # [row, w', q]; disjoint bytes: the sums are ORs


@kjit
def _store_native(c0, c1, f0, f1, rl, tile, wq_ptr, ws16_ptr):
    """The native layout of a 64 x 128 tile (BKC == 128): 64 contiguous bytes per row at ``64 * row``,
    word q * 4 + 2s + w' from half s (as int32 words: 16-byte stores, not byte scatters), and the
    8 fp16 ``sf * 2^7`` of the row's blocks (half s: blocks 4s + j)."""
    w = tl.join(_native_words(c0), _native_words(c1))  # [row, w', q, s]
    w = tl.reshape(tl.permute(w, (0, 2, 3, 1)), (ROWS, 16))  # [row, q * 4 + 2s + w']
    j = tl.arange(0, 16)
    tl.store(wq_ptr + tile * 1024 + rl[:, None] * 16 + j[None, :], w)
    f = tl.reshape(tl.permute(tl.join(f0, f1), (0, 2, 1)), (ROWS, 8))  # [row, 4s + j]
    j8 = tl.arange(0, 8)
    tl.store(ws16_ptr + tile * 512 + rl[:, None] * 8 + j8[None, :], (f * 128.0).to(tl.float16))


@kjit
def _sync_kernel(x_ptr, amax_ptr, codes_ptr, scales_ptr, dec_ptr, dsc_ptr, wq_ptr, ws16_ptr, n, K,
                 BKC: tl.constexpr, H: tl.constexpr, NATIVE: tl.constexpr):
    """Program (t, c): rows [64t, 64t+64) x K chunk c; bf16 bits in, every prepared layout out."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    chunks = K // BKC
    tile = (t * chunks + c).to(tl.int64)
    rl = tl.arange(0, ROWS)
    rows = t.to(tl.int64) * ROWS + rl
    rmask = rows < n
    amax = tl.load(amax_ptr + tl.arange(0, 1))
    s_enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), _FLT_MAX)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    s_dec = tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    mult = s_enc * 0.1666666716337204
    jh = tl.arange(0, H)
    base = x_ptr + rows[:, None] * K + c * BKC + jh[None, :]
    x0 = (tl.load(base, mask=rmask[:, None], other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    x1 = (tl.load(base + H, mask=rmask[:, None], other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    nanrow = rmask & (amax != amax)  # real rows only: padding stays 0
    c0, s0, f0 = _quant_half(x0, s_dec, mult, nanrow, ROWS, H)
    c1, s1, f1 = _quant_half(x1, s_dec, mult, nanrow, ROWS, H)
    dec = tl.reshape(c0, (ROWS, H)) | (tl.reshape(c1, (ROWS, H)) << 4)
    tl.store(dec_ptr + tile * (ROWS * H) + rl[:, None] * H + jh[None, :], dec.to(tl.uint8))
    _store_half(c0, s0, rows, rmask, rl, c, 0, K, codes_ptr, scales_ptr, dsc_ptr, tile, H, BKC)
    _store_half(c1, s1, rows, rmask, rl, c, 1, K, codes_ptr, scales_ptr, dsc_ptr, tile, H, BKC)
    if NATIVE:  # BKC == 128, H == 64
        _store_native(c0, c1, f0, f1, rl, tile, wq_ptr, ws16_ptr)


def supported(w: torch.Tensor, scheme: Any, partitions: list[int] | None = None) -> bool:
    """The fused path computes this weight: a plain bf16 [N, K] tensor (no subclass such as DTensor),
    K % 32 == 0, a 1x16-block scheme, at most MAX_SHARDS shards."""
    from .tc_linear import chunk_for

    return (type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == torch.bfloat16 and w.dim() == 2
            and chunk_for(w.shape[1]) > 0 and w.shape[0] > 0
            and not _scheme(scheme).weight_tile16 and len(shard_sizes(w.shape[0], partitions)) <= MAX_SHARDS)


def _scheme(scheme: Any) -> Any:
    return scheme if isinstance(scheme, Scheme) else SCHEMES[scheme]


def _amaxes(w: torch.Tensor, sizes: list[int], fused: bool, amax: torch.Tensor, flag: torch.Tensor) -> list[torch.Tensor]:
    """Launch the amax pass into ``amax``/``flag`` ([MAX_SHARDS], zeroed); the [1] amax per shard."""
    n, k = w.shape
    b = [sum(sizes[:i]) for i in range(1, len(sizes))] + [n] * MAX_SHARDS
    r, bk, warps = (4, 64, 4) if INTERPRET else AMAX_CFG
    bk = min(triton.next_power_of_2(k), bk)
    launch(_amax_kernel, (triton.cdiv(n, r),), w.view(torch.int16), amax, flag, n, k, b[0], b[1], r, bk, num_warps=warps)
    if not fused:
        return [amax[i:i + 1] for i in range(len(sizes))]
    # NVFP4Linear.weight: w.float().abs().amax(), non-finite values included (NaN wins, then Inf)
    f = flag[: len(sizes)].amax()
    shared = torch.where(f == 2, float("nan"), torch.where(f == 1, float("inf"), amax[: len(sizes)].amax())).reshape(1)
    return [shared] * len(sizes)


@functools.lru_cache(maxsize=256)
def _plan(n: int, k: int, tuning: GemmTuning) -> tuple[int, int, int, bool, tuple[int, ...]]:
    """(bkc, chunks, nseg, native, byte sizes of codes, scales, dec, dsc, wq, ws16) of one shard."""
    from .tc_linear import chunk_for, nseg_for

    bkc = chunk_for(k)
    nt, chunks = -(-n // TILE), k // bkc
    nseg = nseg_for(n, k, False, tuning.segments)
    native = bkc == 128 and (k // 128) % nseg == 0  # decode_ok's shape conditions
    pad = nt * TILE * k
    sizes = (n * k // 2, n * k // 16, pad // 2, pad // 16, pad // 2 if native else 0, pad // 8 if native else 0)
    return bkc, chunks, nseg, native, sizes


def _carve(buf: torch.Tensor, off: int, nbytes: int) -> tuple[torch.Tensor, int]:
    """A view of ``nbytes`` of ``buf`` at ``off``; the next offset, 256-byte aligned."""
    return buf[off:off + nbytes], off + (nbytes + 255) // 256 * 256


def _launch_shard(x: torch.Tensor, amax: torch.Tensor, tuning: GemmTuning, buf: torch.Tensor, off: int) -> tuple[Any, int]:
    """One shard [n, K] (contiguous bf16) -> TCWeight (``native`` still undecided if K % 128 == 0), its
    tensors carved from ``buf`` (one allocation per weight) at ``off``; the next offset."""
    from .tc_linear import TCWeight

    n, k = x.shape
    bkc, chunks, nseg, native, sizes = _plan(n, k, tuning)
    nt = -(-n // TILE)
    parts = []
    for nbytes in sizes:
        t, off = _carve(buf, off, max(nbytes, 4))  # (wq is viewed as int32 words)
        parts.append(t)
    codes, scales = parts[0].view(n, k // 2), parts[1].view(n, k // 16)
    dec = parts[2].view(1, nt, chunks, TILE, bkc // 2)
    dsc = parts[3].view(1, nt, chunks, TILE, bkc // 16)
    wq, ws16 = parts[4], parts[5].view(torch.float16)
    launch(_sync_kernel, (nt, chunks), x.view(torch.int16), amax, codes, scales, dec, dsc, wq.view(torch.int32), ws16, n, k,
           bkc, bkc // 2, native, num_warps=SYNC_WARPS)
    tw = TCWeight(codes, scales, amax, False, dec, dsc, bkc, nseg, False, tuning=tuning)
    if native:
        tw.native_w = (wq, dsc.view(-1), parts[5])
    return tw, off


def _sync_async(w: torch.Tensor, scheme: Any, partitions: list[int] | None, tuning: GemmTuning,
                amax: torch.Tensor, flag: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
    s = _scheme(scheme)
    w = w.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    sizes = shard_sizes(w.shape[0], partitions)
    amaxes = _amaxes(w, sizes, s.fused_weight_amax, amax, flag)
    k = w.shape[1]
    total = sum((max(nb, 4) + 255) // 256 * 256 for size in sizes for nb in _plan(size, k, tuning)[4])
    buf = torch.empty(total, dtype=torch.uint8, device=w.device)
    tws, r0, off = [], 0, 0
    for size, a in zip(sizes, amaxes):
        tw, off = _launch_shard(w[r0:r0 + size], a, tuning, buf, off)
        tws.append(tw)
        r0 += size
    # a shard's blocks are NaN-flagged iff it holds a non-finite value (or, shared amax, a NaN anywhere)
    flags = flag[: len(sizes)]
    if s.fused_weight_amax:
        flags = torch.maximum(flags, torch.where(flags.amax() == 2, 2, 0))
    return tws, flags


def _decide_native(tws: list[Any], flags: list[int]) -> None:
    for tw, f in zip(tws, flags):
        if tw.native_w is not None:
            tw.native = f == 0
            if not tw.native:
                tw.native_w = None


def _reference(w: torch.Tensor, scheme: Any, partitions: list[int] | None, tuning: GemmTuning) -> list[Any]:
    """The reference path: ``prepare(nvfp4_quantize_ref(shard))`` per shard (NVFP4Linear.weight's shards)."""
    from .tc_linear import prepare

    return [prepare(q, tuning) for q in quantize_weight_ref(w, _scheme(scheme), partitions)]


def sync_weight(w: torch.Tensor, scheme: Any = "nvfp4-per-token", partitions: list[int] | None = None,
                tuning: GemmTuning = DEFAULT) -> list[Any]:
    """The TCWeights of ``w [N, K]`` under ``scheme`` (a name or :class:`linear.Scheme`), one per shard
    of ``partitions``: bitwise those of ``NVFP4Linear(scheme, partitions, tuning).prepared(w)`` (with
    the native layout made). Weights the kernels do not take (not bf16, K % 32 != 0, 16x16 tiles):
    the reference path. One host synchronization (the native flag)."""
    if not supported(w, scheme, partitions):
        return _reference(w, scheme, partitions, tuning)
    buf = torch.zeros(2 * MAX_SHARDS, dtype=torch.float32, device=w.device)
    tws, flags = _sync_async(w, scheme, partitions, tuning, buf[:MAX_SHARDS], buf[MAX_SHARDS:].view(torch.int32))
    _decide_native(tws, flags.tolist())
    return tws


def sync_model(named_weights: dict[str, torch.Tensor], scheme: Any = "nvfp4-per-token",
               partitions: dict[str, list[int]] | None = None, tuning: GemmTuning = DEFAULT) -> dict[str, list[Any]]:
    """:func:`sync_weight` for every weight of a model (``partitions``: per name, the fused shards'
    sizes), all launches queued first and one host synchronization at the end."""
    partitions = partitions or {}
    names = list(named_weights)
    fast = [nm for nm in names if supported(named_weights[nm], scheme, partitions.get(nm))]
    out: dict[str, list[Any]] = {}
    pending: list[tuple[list[Any], torch.Tensor]] = []
    bufs: dict[torch.device, torch.Tensor] = {}
    for i, nm in enumerate(fast):
        w = named_weights[nm]
        if w.device not in bufs:
            bufs[w.device] = torch.zeros(len(fast), 2 * MAX_SHARDS, dtype=torch.float32, device=w.device)
        row = bufs[w.device][i]
        tws, flags = _sync_async(w, scheme, partitions.get(nm), tuning, row[:MAX_SHARDS], row[MAX_SHARDS:].view(torch.int32))
        out[nm] = tws
        pending.append((tws, flags))
    for nm in names:
        if nm not in out:
            out[nm] = _reference(named_weights[nm], scheme, partitions.get(nm), tuning)
    if pending:
        allf = torch.cat([f for _, f in pending]).tolist()
        j = 0
        for tws, f in pending:
            _decide_native(tws, allf[j:j + f.numel()])
            j += f.numel()
    return {nm: out[nm] for nm in names}
