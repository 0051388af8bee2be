"""Weight sync: bf16 weights -> the prepared NVFP4 weights of the GEMM, at memory speed.

What :meth:`linear.NVFP4Linear.prepared` computes for a 1x16-block scheme (``nvfp4-per-token``:
one amax per logical weight; ``nvfp4-static``: one amax over the fused shards), i.e.
``tc_linear.prepare(nvfp4_quantize_ref(shard, amax=...))`` per shard plus the native decode
layout :func:`native.decode_ok` would make at first use, in two passes over the weights of a
whole model instead of dozens of torch passes per weight: an amax pass (per shard the finite max
|x| and a non-finite flag, 2 NaN, 1 Inf, max-ed into the shard's slots: float max is order free,
so exact) and a fused pass that reads each bf16 value once and writes the codes (standard packing),
the E4M3 scale bytes, the decode-layout scale tiles (``dsc`` of :func:`tc_linear.decode_layout`) and
either the native layout (``native.native_layout``: code bytes, scale bytes = ``dsc``, fp16 ``sf * 2^7``;
where K % 128 == 0 and the K segments allow it) or, for the other shards, the decode-layout code tiles
(``dec``). A shard with the native layout gets ``dec`` only if a Triton decode kernel reads it (the native
decode GEMM cannot run on it: a NaN-flagged block, no extension), made from the codes at first use
(:class:`SyncedWeight`): the sync writes 1.19 bytes per weight instead of 1.75. Two implementations (:data:`BACKEND`):

* native (CUDA C++, ``csrc/sync.cuh``; the default where the extension of :func:`native.load` builds,
  sm_89+ with nvcc: ``BACKEND = "auto"``): one launch of
  each kernel for all the weights, over one int64 table
  with a row per shard (offsets of its bf16 and of its outputs in one buffer, its amax slot, its
  programs' first number: a program finds its shard by binary search, so the host table is per shard,
  not per program). ``sync_amax_kernel``: 128 KB of a shard per program, 16-byte loads.
  ``sync_quant_kernel``: a 64-row tile x 8 chunks of 128 K per program; thread (row, wp) holds blocks
  {2wp, 2wp+1, 4+2wp, 5+2wp} of a chunk (the pairs that ``dec`` and the native words combine), writes
  codes and ``dec`` alone (16-byte stores) and scales, ``dsc``, the native words and fp16 scales after
  one shuffle per word with its neighbour lane (4- to 16-byte stores). Shards of a 32- or 64-wide
  decode chunk (K % 128 != 0) take the Triton fused kernel after the native amax pass;
* Triton (``BACKEND = "triton"``; without the extension, and in the CPU interpreter): ``_amax_kernel``
  per row and ``_sync_kernel`` per 64-row tile and ``bkc``-wide K chunk, one launch each per K (and
  decode layout), reading int64 tables (per weight or shard its offset from the group's
  lowest-addressed weight and the offsets of its outputs; per program its weight or shard and rows).

The quantizer arithmetic is the spec's (:func:`ref.nvfp4_quantize_ref`): in Triton with the exact
helpers of :mod:`common` (``tl.div_rn``, integer E4M3 rounding), in CUDA with ``quantize.cuh``'s
(correctly rounded ``__fdiv_rn``, hardware E4M3 RNE conversion, the magic-constant E2M1 rounding),
so every field is bitwise equal to the reference path (``tests/kernels/test_nvfp4_sync.py`` runs the
Triton kernels in the interpreter, ``tests/kernels/test_nvfp4_sync_native.py`` emulates the native
kernel's stores; ``bench/gpu_nvfp4_check.py --only b`` checks both paths on the GPU). Padding rows
of the last tile come out zero, as the reference's. ``native`` (no NaN-flagged block) is known from
the flags; the host reads all flags of :func:`sync_model` with one synchronization at the end.
The returned TCWeights (:class:`SyncedWeight`) are views of one output buffer made at first access:
the host work of a call is the shard table and a few launches (the Qwen3-8B shape: 252 shards).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
import triton.language as tl

from mismatch_probe.kernels.launch_math import next_pow2

from .common import INTERPRET, e2m1_encode, e4m3_round, gpu_capable, kjit, launch, rmax, rsum
from .schemes import SCHEMES, Scheme, quantize_weight_ref, shard_sizes
from .tc_linear import TCWeight, chunk_for, nseg_for
from .tuning import DEFAULT, GemmTuning

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
TILE = 64  # rows per program = tc_linear.TILE_ROWS (one decode-layout tile)
# launch configurations (H200, bench/gpu_nvfp4_check.py --only b: BENCHMARKS.md, "Issue 28"); they change
# no bit (max-reductions and disjoint-bit sums), only the speed
AMAX_CFG = (32, 128, 4)  # amax pass: rows per program, K block, warps (best of 24 on the 8B shape: 5.24 vs 5.97 ms)
SYNC_WARPS = 8  # the fused kernel, per 64-row tile
ROWS = tl.constexpr(TILE)
MAX_SHARDS = 3
# which kernels run the sync on a CUDA device: "auto" (the default) the CUDA C++ ones of csrc/sync.cuh where
# native.load() builds them (sm_89+, nvcc; the extension the native decode GEMM loads too), else Triton;
# "native" those alone (an error where the extension is absent); "triton" the Triton kernels. Both are
# bitwise the reference path on the H200 (2026-12-05: bench/gpu_nvfp4_check.py --only b, tests/kernels/
# test_nvfp4_sync_gpu.py), the native ones 1.8x a D2D copy of the 8B shape's weights against Triton's 3.7x;
# shards whose decode chunk is not 128 wide (K % 128 != 0) always take the Triton fused kernel
BACKEND = "auto"
BACKENDS = ("auto", "native", "triton")


@kjit
def _program(x_base, tab_ptr, prog_ptr, W: tl.constexpr):
    """This program's item (``prog_ptr[2p]``: a weight or shard) and first row or tile (``[2p + 1]``):
    (its row of the ``W``-wide int64 ``tab_ptr``, that first, its bf16 bits ``x_base`` + offset (field 0,
    16-byte aligned: the host copies a weight that is not), its rows n (field 1))."""
    p = tl.program_id(0)
    tab = tab_ptr + tl.load(prog_ptr + 2 * p) * W
    first = tl.load(prog_ptr + 2 * p + 1)
    return tab, first, x_base + tl.multiple_of(tl.load(tab), 8), tl.load(tab + 1)


@kjit
def _amax_kernel(x_base, tab_ptr, prog_ptr, amax_ptr, flag_ptr, K, R: tl.constexpr, BK: tl.constexpr):
    """Program p: rows [r0, r0 + R) of one weight (:func:`_program`); its row of ``tab_ptr``:
    x offset (elements from ``x_base``), n, b1, b2, first slot. Finite max |x| and non-finite flag per
    row, max-ed into slot first + (row >= b1) + (row >= b2) of ``amax_ptr`` / ``flag_ptr`` (zeroed)."""
    tab, r0, x_ptr, n = _program(x_base, tab_ptr, prog_ptr, 5)
    b1 = tl.load(tab + 2)
    b2 = tl.load(tab + 3)
    slot0 = tl.load(tab + 4)
    rows = r0 + tl.arange(0, R).to(tl.int64)
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
        tl.atomic_max(amax_ptr + slot0 + s, rmax(tl.where(sel, ram, 0.0), 0))
        tl.atomic_max(flag_ptr + slot0 + s, rmax(tl.where(sel, rnf, 0), 0))


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
def _sync_kernel(x_base, tab_ptr, prog_ptr, amax_base, out8, out32, out16, K, BKC: tl.constexpr, H: tl.constexpr,
                 NATIVE: tl.constexpr):
    """Program (p, c): tile t of one shard (:func:`_program`: rows [64t, 64t+64)) x K chunk c; bf16
    bits in, every prepared layout out. The shard's row of ``tab_ptr``: x offset (elements from ``x_base``),
    n, its amax's index in ``amax_base``, the byte offsets in ``out8`` of codes, scales, dec, dsc, and the
    offsets of wq in ``out32`` (int32 words) and of ws16 in ``out16`` (halves): one buffer, three views."""
    c = tl.program_id(1)
    tab, t, x_ptr, n = _program(x_base, tab_ptr, prog_ptr, 9)
    amax_ptr = amax_base + tl.load(tab + 2)
    codes_ptr = out8 + tl.multiple_of(tl.load(tab + 3), 256)
    scales_ptr = out8 + tl.multiple_of(tl.load(tab + 4), 256)
    dec_ptr = out8 + tl.multiple_of(tl.load(tab + 5), 256)
    dsc_ptr = out8 + tl.multiple_of(tl.load(tab + 6), 256)
    wq_ptr = out32 + tl.multiple_of(tl.load(tab + 7), 64)
    ws16_ptr = out16 + tl.multiple_of(tl.load(tab + 8), 128)
    chunks = K // BKC
    tile = t * chunks + c
    rl = tl.arange(0, ROWS)
    rows = t * ROWS + rl
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
    if not NATIVE:  # with the native layout, no decode-layout tiles (see _plan)
        dec = tl.reshape(c0, (ROWS, H)) | (tl.reshape(c1, (ROWS, H)) << 4)
        tl.store(dec_ptr + tile * (ROWS * H) + rl[:, None] * H + jh[None, :], dec.to(tl.uint8))
    _store_half(c0, s0, rows, rmask, rl, c, 0, K, codes_ptr, scales_ptr, dsc_ptr, tile, H, BKC)
    _store_half(c1, s1, rows, rmask, rl, c, 1, K, codes_ptr, scales_ptr, dsc_ptr, tile, H, BKC)
    if NATIVE:  # BKC == 128, H == 64
        _store_native(c0, c1, f0, f1, rl, tile, wq_ptr, ws16_ptr)


def supported(w: torch.Tensor, scheme: Any, partitions: list[int] | None = None) -> bool:
    """The fused path computes this weight: a plain bf16 [N, K] tensor (no subclass such as DTensor),
    K % 32 == 0, a 1x16-block scheme, at most MAX_SHARDS shards, on a GPU the kernels run on (sm_89+)."""
    return (type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == torch.bfloat16 and w.dim() == 2
            and (w.device.type != "cuda" or gpu_capable(w.device))
            and chunk_for(w.shape[1]) > 0 and w.shape[0] > 0
            and not _scheme(scheme).weight_tile16 and len(shard_sizes(w.shape[0], partitions)) <= MAX_SHARDS)


def _scheme(scheme: Any) -> Any:
    return scheme if isinstance(scheme, Scheme) else SCHEMES[scheme]


def _table(rows: list[list[int]]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)


def _to(dev: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Host int64 tables to ``dev`` (pinned, asynchronous: no host synchronization)."""
    out = []
    for a in arrays:
        t = torch.from_numpy(np.ascontiguousarray(a))
        out.append(t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t)
    return out


def _progs(counts: list[int], step: int) -> np.ndarray:
    """[(item, first row or tile), ...] of ``counts[i]`` programs per item, ``step`` rows (tiles) apart."""
    c = np.asarray(counts, np.int64)
    item = np.repeat(np.arange(c.size), c)
    first = (np.arange(item.size) - np.repeat(np.cumsum(c) - c, c)) * step
    return np.stack([item, first], axis=1)


def _base(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensor of ``ts`` at the lowest address: the others are addressed as offsets from it (>= 0)."""
    return min(ts, key=lambda t: t.data_ptr())


def _offset(w: torch.Tensor, base: torch.Tensor) -> int:
    """``w``'s first element as an offset in bf16 elements from ``base``'s (the kernels' ``x`` table field)."""
    return (w.data_ptr() - base.data_ptr()) // 2


def _amax_pass(ws: list[torch.Tensor], sizes: list[list[int]], ab: torch.Tensor) -> None:
    """Launch the amax pass of every weight (one launch per K): weight i's shard amaxes into ``ab[i, 0:3]``,
    its non-finite flags (2 NaN, 1 Inf) into ``ab[i, 3:6]`` as int32 bits (``ab`` zeroed)."""
    r, bk0, warps = (4, 64, 4) if INTERPRET else AMAX_CFG
    by_k: dict[int, list[int]] = {}
    for i, w in enumerate(ws):
        by_k.setdefault(w.shape[1], []).append(i)
    flat = ab.view(-1)
    for k, idx in by_k.items():
        base = _base([ws[i] for i in idx])
        rows = []
        for i in idx:
            n = ws[i].shape[0]
            b = [sum(sizes[i][:j]) for j in range(1, len(sizes[i]))] + [n] * MAX_SHARDS
            rows.append([_offset(ws[i], base), n, b[0], b[1], i * _COLS])
        prog = _progs([-(-ws[i].shape[0] // r) for i in idx], r)
        tab, prog = _to(ab.device, _table(rows), prog)
        bk = min(next_pow2(k), bk0)
        launch(_amax_kernel, (prog.shape[0],), base.view(torch.int16), tab, prog, flat, flat[3:].view(torch.int32), k, r, bk,
               num_warps=warps)


@functools.lru_cache(maxsize=256)
def _plan(n: int, k: int, tuning: GemmTuning) -> tuple[int, int, int, bool, tuple[int, ...]]:
    """(bkc, chunks, nseg, native, byte sizes of codes, scales, dec, dsc, wq, ws16) of one shard; a shard
    that gets the native layout gets no ``dec`` (the native decode GEMM reads the native layout; the Triton
    decode kernels that read ``dec`` run on such a weight only where the native one cannot, and then
    :class:`SyncedWeight` makes ``dec`` from the codes at first use)."""
    bkc = chunk_for(k)
    nt, chunks = -(-n // TILE), k // bkc
    nseg = nseg_for(n, k, False, tuning.segments)
    native = bkc == 128 and (k // 128) % nseg == 0  # decode_ok's shape conditions
    pad = nt * TILE * k
    sizes = (n * k // 2, n * k // 16, 0 if native else pad // 2, pad // 16, pad // 2 if native else 0,
             pad // 8 if native else 0)
    return bkc, chunks, nseg, native, sizes


_COLS = 8  # per weight in the amax buffer: 3 shard amaxes, 3 flags (int32 bits), the fused (shared) amax, padding


class _Shard(NamedTuple):
    w: int  # weight index
    j: int  # shard index in the weight
    r0: int  # first row in the weight
    n: int
    k: int
    plan: tuple[int, int, int, bool, tuple[int, ...]]  # _plan(n, k)
    offs: list[int]  # byte offsets of codes, scales, dec, dsc, wq, ws16 in the output buffer


def _layout(ws: list[torch.Tensor], sizes: list[list[int]], tuning: GemmTuning) -> tuple[list[_Shard], int]:
    """Every shard of ``ws`` and where its outputs go in one buffer (256-byte aligned parts); its size."""
    shards, off = [], 0
    plans: dict[tuple[int, int], tuple[int, int, int, bool, tuple[int, ...]]] = {}  # (hashing tuning: ~us)
    for i, w in enumerate(ws):
        r0 = 0
        for j, n in enumerate(sizes[i]):
            plan = plans.get((n, w.shape[1]))
            if plan is None:
                plan = plans[(n, w.shape[1])] = _plan(n, w.shape[1], tuning)
            offs = []
            for nbytes in plan[4]:
                offs.append(off)
                off += (nbytes + 255) // 256 * 256
            shards.append(_Shard(i, j, r0, n, w.shape[1], plan, offs))
            r0 += n
    return shards, max(off, 256)


def _launch_sync(ws: list[torch.Tensor], shards: list[_Shard], amax_col: Any, ab: torch.Tensor, buf: torch.Tensor) -> None:
    """The fused kernel over every shard, one launch per (K, decode chunk, native layout); shard
    ``sh`` reads its amax at ``ab[sh.w, amax_col(sh)]``."""
    groups: dict[tuple[int, int, bool], list[_Shard]] = {}
    for sh in shards:
        groups.setdefault((sh.k, sh.plan[0], sh.plan[3]), []).append(sh)
    for (k, bkc, native), group in groups.items():
        base = _base([ws[sh.w] for sh in group])
        rows = [[_offset(ws[sh.w], base) + sh.r0 * k, sh.n, sh.w * _COLS + amax_col(sh), *sh.offs[:4],
                 sh.offs[4] // 4, sh.offs[5] // 2] for sh in group]
        tab, prog = _to(buf.device, _table(rows), _progs([-(-sh.n // TILE) for sh in group], 1))
        launch(_sync_kernel, (prog.shape[0], k // bkc), base.view(torch.int16), tab, prog, ab.view(-1), buf,
               buf.view(torch.int32), buf.view(torch.float16), k, bkc, bkc // 2, native, num_warps=SYNC_WARPS)


_LAZY = frozenset(("codes", "scales", "amax", "dec", "dsc"))


class SyncedWeight(TCWeight):
    """A :class:`tc_linear.TCWeight` made by the sync, the same in every field and behaviour: its tensors
    are views of the sync's output buffer and amax buffer, made at first access (the sync of a model
    returns hundreds of weights: building ~8 tensor views each was most of its host time). ``native_w``
    (the native layout's views) exists once ``native`` is decided and True; ``dec`` of a shard with the
    native layout is made from the codes at first access. :meth:`tuned` keeps it lazy; a weight rebuilt
    with ``dataclasses.replace`` is an ordinary one holding the same tensors."""

    def __getattr__(self, name: str) -> Any:  # only for attributes not set yet: the lazy views
        d = self.__dict__
        lz = d.get("_lz")
        if lz is None or name not in _LAZY:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if "codes" not in d:
            d.update(_views(lz))
        if name == "dec" and "dec" not in d:  # not written (a native-layout shard): made once, from the codes
            from .tc_linear import decode_layout

            d["dec"] = decode_layout(self.codes, self.scales, self.bkc)[0]
        return d[name]

    def tuned(self, tuning: GemmTuning) -> TCWeight:
        """:meth:`TCWeight.tuned` without making the views or ``dec`` (the same lazy weight, another tuning);
        a tuning that changes the K segments gives an ordinary TCWeight."""
        if tuning.segments != self.tuning.segments:
            return super().tuned(tuning)
        tw = SyncedWeight.__new__(SyncedWeight)
        tw.__dict__.update(self.__dict__)
        tw.__dict__["tuning"] = tuning
        return tw

    @property
    def native_w(self) -> tuple[torch.Tensor, ...] | None:  # type: ignore[override]
        d = self.__dict__
        if "_nw" not in d:
            lz = d.get("_lz")
            if lz is None or not self.native or not lz[0].plan[3]:
                return None
            d["_nw"] = _native_views(lz)
        return d["_nw"]

    @native_w.setter
    def native_w(self, v: tuple[torch.Tensor, ...] | None) -> None:
        self.__dict__["_nw"] = v


def _views(lz: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    """The TCWeight tensors of shard ``sh`` (``lz``: shard, output buffer, amax buffer, amax index)."""
    sh, buf, ab, idx = lz
    bkc, chunks, _, _, nb = sh.plan
    n, k, o = sh.n, sh.k, sh.offs
    nt = -(-n // TILE)
    tiles = (1, nt, chunks, TILE)
    tstride = (nt * chunks * TILE, chunks * TILE, TILE, 1)
    views = {"codes": buf.as_strided((n, k // 2), (k // 2, 1), o[0]),
             "scales": buf.as_strided((n, k // 16), (k // 16, 1), o[1]),
             "amax": ab.as_strided((1,), (1,), idx),
             "dsc": buf.as_strided((*tiles, bkc // 16), tuple(t * (bkc // 16) for t in tstride) + (1,), o[3])}
    if nb[2]:  # written by the kernels (no native layout); else made from the codes at first use
        views["dec"] = buf.as_strided((*tiles, bkc // 2), tuple(t * (bkc // 2) for t in tstride) + (1,), o[2])
    return views


def _native_views(lz: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """``native.native_layout``'s (codes, scales, scales16) of the shard: views of the buffer."""
    sh, buf = lz[0], lz[1]
    nb, o = sh.plan[4], sh.offs
    return (buf.as_strided((nb[4],), (1,), o[4]), buf.as_strided((nb[3],), (1,), o[3]),
            buf.as_strided((nb[5],), (1,), o[5]))


def _tcweight(sh: _Shard, buf: torch.Tensor, ab: torch.Tensor, idx: int, tuning: GemmTuning) -> SyncedWeight:
    """Shard ``sh``'s TCWeight (``native`` undecided; its amax ``ab.view(-1)[idx]``): no tensor made yet."""
    tw = SyncedWeight.__new__(SyncedWeight)
    tw.__dict__.update(per_row=False, bkc=sh.plan[0], nseg=sh.plan[2], grouped=False, tuning=tuning,
                       _lz=(sh, buf, ab, idx))
    return tw


def _native_table(ws: list[torch.Tensor], shards: list[_Shard], base: torch.Tensor, fused: bool, mod: Any
                  ) -> tuple[np.ndarray, int, int]:
    """The native kernels' shard table (``csrc/sync.cuh``: one int64 row of ``mod.sync_cols`` per shard of
    ``shards``, the fused kernel's only of 128-wide decode chunks) and the amax and fused kernels' program
    counts (each column of first programs numbers its kernel's programs shard after shard)."""
    cols, per_amax, per_q = int(mod.sync_cols), int(mod.sync_amax_elems), int(mod.sync_chunks)
    tab = np.zeros((len(shards), cols), np.int64)
    a0 = q0 = 0
    b0 = base.data_ptr()
    for r, sh in enumerate(shards):
        n, k, o = sh.n, sh.k, sh.offs
        chunks = sh.plan[1]
        cg = -(-chunks // per_q)
        na, nq = -(-(n * k) // per_amax), -(-n // TILE) * cg
        slot = sh.w * _COLS + sh.j
        tab[r, :14] = ((ws[sh.w].data_ptr() - b0) // 2 + sh.r0 * k, n, k, slot, sh.w * _COLS + 6 if fused else slot,
                       o[0], o[1], -1 if sh.plan[3] else o[2], o[3], o[4] if sh.plan[3] else -1, o[5], a0, q0, cg)
        a0 += na
        q0 += nq
    return tab, a0, q0


def _native_module(dev: torch.device) -> Any:
    """The native extension where the sync runs on it (:data:`BACKEND`, a CUDA device, built), else None."""
    if BACKEND not in BACKENDS:
        raise ValueError(f"sync.BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
    if BACKEND == "triton" or INTERPRET or dev.type != "cuda":
        if BACKEND == "native":
            raise RuntimeError("sync.BACKEND 'native' needs a CUDA device (not the Triton interpreter)")
        return None
    from . import native

    with torch.cuda.device(dev):
        mod = native.load()
    if mod is None and BACKEND == "native":
        raise RuntimeError(f"sync.BACKEND 'native': the native extension is absent ({native.status()['reason']})")
    return mod


def _native_amax(ws: list[torch.Tensor], shards: list[_Shard], fused: bool, mod: Any, ab: torch.Tensor,
                 buf: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The native amax kernel over every shard; returns the shard table on the device and the fused
    kernel's program count over it (for :func:`_native_quant`)."""
    base = _base(ws)
    tab, na, nq = _native_table(ws, shards, base, fused, mod)
    (t_dev,) = _to(ws[0].device, tab)
    mod.sync_weights(base, t_dev, ab, buf, na, 0)
    return t_dev, nq


def _native_quant(ws: list[torch.Tensor], shards: list[_Shard], fused: bool, mod: Any, ab: torch.Tensor,
                  buf: torch.Tensor, table: tuple[torch.Tensor, int]) -> list[_Shard]:
    """The native fused kernel over the shards of 128-wide decode chunks (``table``: :func:`_native_amax`'s,
    reused where every shard is one); returns the other shards (the Triton fused kernel's)."""
    nat = [sh for sh in shards if sh.plan[0] == 128]
    t_dev, nq = table
    if nat and len(nat) < len(shards):  # a table of these alone
        tab, _, nq = _native_table(ws, nat, _base(ws), fused, mod)
        (t_dev,) = _to(ws[0].device, tab)
    if nat:
        mod.sync_weights(_base(ws), t_dev, ab, buf, 0, nq)
    return [sh for sh in shards if sh.plan[0] != 128]


def _fuse_amax(ab: torch.Tensor) -> torch.Tensor:
    """The shared amax of a ``fused_weight_amax`` scheme into ``ab[:, 6]`` (NVFP4Linear.weight:
    w.float().abs().amax(), non-finite included: NaN wins, then Inf); the flags with a NaN weight's
    shards all flagged 2."""
    flags = ab.view(torch.int32)[:, 3:6]
    f = flags.amax(1)
    ab[:, 6] = torch.where(f == 2, float("nan"), torch.where(f == 1, float("inf"), ab[:, 0:3].amax(1)))
    return torch.maximum(flags, torch.where(f[:, None] == 2, 2, 0))


def _sync_async(ws: list[torch.Tensor], parts: list[list[int] | None], scheme: Any, tuning: GemmTuning
                ) -> tuple[list[list[Any]], torch.Tensor]:
    """Launch the sync of the weights ``ws`` (bf16 [N, K] on one device; ``parts``: each one's shards):
    native kernels: one amax launch and one fused launch for all; Triton: one amax launch and one
    fused launch per K (and decode layout); no host synchronization. Returns the TCWeights of each
    weight (``native`` undecided) and the flags [weights, 3] (int32; 2: a NaN, 1: an Inf in the shard,
    or a NaN in the weight under a shared amax)."""
    fused = _scheme(scheme).fused_weight_amax
    # the kernels read a weight at its offset from the group's first, hinted 16-byte aligned: a view that
    # is not (a slice at an odd element) is copied first
    ws = [w.detach() if w.is_contiguous() and w.data_ptr() % 16 == 0 else w.detach().clone(memory_format=torch.contiguous_format)
          for w in ws]
    sizes = [shard_sizes(w.shape[0], p) for w, p in zip(ws, parts)]
    dev = ws[0].device
    mod = _native_module(dev)
    shards, nbytes = _layout(ws, sizes, tuning)
    ab = torch.zeros(len(ws), _COLS, dtype=torch.float32, device=dev)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def amax_col(sh: _Shard) -> int:  # the shared amax (column 6) or the shard's own
        return 6 if fused else sh.j

    if mod is not None:
        table = _native_amax(ws, shards, fused, mod, ab, buf)
    else:
        _amax_pass(ws, sizes, ab)
    flags = _fuse_amax(ab) if fused else ab.view(torch.int32)[:, 3:6]
    # the fused pass: the native kernel takes the shards of 128-wide decode chunks, Triton the rest
    rest = shards if mod is None else _native_quant(ws, shards, fused, mod, ab, buf, table)
    if rest:
        _launch_sync(ws, rest, amax_col, ab, buf)
    out: list[list[Any]] = [[] for _ in ws]
    for sh in shards:
        out[sh.w].append(_tcweight(sh, buf, ab, sh.w * _COLS + amax_col(sh), tuning))
    return out, flags


def _decide_native(tws: list[Any], flags: list[int]) -> None:
    """``native`` of each shard with the native layout written: no flagged block (``native_w`` follows)."""
    for tw, f in zip(tws, flags):
        if tw._lz[0].plan[3]:
            tw.native = f == 0


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
    return sync_model({"w": w}, scheme, {"w": partitions} if partitions else None, tuning)["w"]


def sync_model(named_weights: dict[str, torch.Tensor], scheme: Any = "nvfp4-per-token",
               partitions: dict[str, list[int]] | None = None, tuning: GemmTuning = DEFAULT) -> dict[str, list[Any]]:
    """:func:`sync_weight` for every weight of a model (``partitions``: per name, the fused shards'
    sizes): per device, one amax launch and one fused launch per K (and decode layout) for all weights,
    and one host synchronization at the end (the native flags)."""
    partitions = partitions or {}
    out: dict[str, list[Any]] = {}
    by_dev: dict[torch.device, list[str]] = {}
    for nm, w in named_weights.items():
        if supported(w, scheme, partitions.get(nm)):
            by_dev.setdefault(w.device, []).append(nm)
        else:
            out[nm] = _reference(w, scheme, partitions.get(nm), tuning)
    pending = []
    for names in by_dev.values():
        tws, flags = _sync_async([named_weights[nm] for nm in names], [partitions.get(nm) for nm in names], scheme, tuning)
        out.update(zip(names, tws))
        pending.append((tws, flags))
    fused = _scheme(scheme).fused_weight_amax
    for names, (tws, flags) in zip(by_dev.values(), pending, strict=True):
        for nm, t, f in zip(names, tws, flags.tolist(), strict=True):
            _decide_native(t, f)
            if fused and 2 in f:
                _reference_nan(t, named_weights[nm])
    return {nm: out[nm] for nm in named_weights}


def _reference_nan(tws: list[Any], w: torch.Tensor) -> None:
    """The shared amax of a weight holding a NaN, as the reference computes it (``w.float().abs().amax()``):
    its NaN's bits are the device's (CUDA's reduction does not keep the constant NaN the kernels wrote),
    and only the bits of the amax differ (codes and scales of a NaN amax do not depend on them). Rare: a
    weight with a NaN, after the host has read the flags."""
    _, _, ab, idx = tws[0]._lz
    ab.view(-1)[idx] = w.detach().float().abs().amax()
