"""The recipes' NVFP4 GEMM (the one production path): weights prepared once, two paths, one result.

:class:`linear.NVFP4Linear` (the recipes' linear, made from the scheme) quantizes the activations and
calls :func:`tc_matmul` here; the kernels are the Triton ones of :mod:`gemm_tc` and, where it is
built, the CUDA C++ decode GEMM of :mod:`native`. The numerics contract is docs/nvfp4.md; the tuning
is data (:class:`tuning.GemmTuning`, carried by the prepared weight).

* :func:`prepare` turns NVFP4 weights (one matrix or ``E`` experts) into a :class:`TCWeight`:
  the decode-layout bytes for the register-decode path (made once per weight version), the
  linear scales and amax, and, at first large-M use, the fp16 operand ``E2M1 * sf * 2^-7``.
  Its ``nseg`` (K segments) depends only on (N, K): dense weights split K when N alone gives too
  few programs for a decode-shaped GEMM; expert weights never split (the experts give the
  parallelism), so grouped and per-expert calls share it.
* :func:`tc_matmul` / :func:`tc_linear` / :func:`tc_grouped`: path ``decode`` (M <= 64: FP4
  weights streamed and decoded in registers) or ``prefill`` (fp16 operands, wgmma mainloop).
  Both compute the contract of :mod:`gemm_tc`, so every row is identical whatever M, the row's
  position, the path or the expert grouping (tested with ``torch.equal`` on the GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
import triton

from mismatch_probe.kernels.launch_math import cdiv

from .common import INTERPRET, kernel_device_ok, launch
from .gemm_tc import decode_kernel, decode_ns_kernel, prefill_kernel, reduce_kernel, reduce_shards_kernel
from .ref import NVFP4Tensor, e2m1_decode, e4m3_decode, unpack_codes
from .tuning import DEFAULT, DecodeTuning, GemmTuning, PrefillTuning, SegmentRule

DECODE_MAX_M = 64
PATHS = ("auto", "decode", "prefill")
OP_DTYPE = torch.float32 if INTERPRET else torch.float16


def chunk_for(k: int) -> int:
    """Decode-layout chunk (K elements per arranged chunk): 128, 64 or 32; 0 = no decode path."""
    for c in (128, 64, 32):
        if k % c == 0:
            return c
    return 0


def nseg_for(n: int, k: int, grouped: bool = False, rule: SegmentRule = DEFAULT.segments) -> int:
    """K segments of dense weights, a function of (N, K) only (:class:`tuning.SegmentRule`: they
    decide the accumulation segments, hence the bits, of every path for a shape); expert weights: 1."""
    bkc = chunk_for(k)
    if grouped or bkc == 0:
        return 1
    tiles, s = cdiv(n, 64), 1
    while tiles * s < rule.target and s < rule.max_segments and (k // bkc) % (2 * s) == 0:
        s *= 2
    if s == 1 and rule.long_k and k >= rule.long_k and (k // bkc) % 2 == 0:
        s = 2
    return s


@dataclass
class TCWeight:
    """Prepared NVFP4 weight: ``codes`` [(E,) N, K/2], ``scales`` [(E,) N, K/16], ``amax`` [1] /
    [N] (per row) / [E] (experts); ``dec``: decode-layout bytes (None without a decode path);
    ``tuning``: how every GEMM on it runs (its ``segments`` made ``nseg``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    per_row: bool
    dec: torch.Tensor | None
    dsc: torch.Tensor | None
    bkc: int
    nseg: int
    grouped: bool
    _op: torch.Tensor | None = field(default=None, repr=False)
    native: bool | None = field(default=None, repr=False)  # native decode usable (None: not decided yet)
    native_w: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    tuning: GemmTuning = field(default=DEFAULT, repr=False)

    @property
    def n(self) -> int:
        return self.codes.shape[-2]

    @property
    def k(self) -> int:
        return self.codes.shape[-1] * 2

    def op(self) -> torch.Tensor:
        """fp16 ``E2M1 * sf * 2^-7`` [(E,) N, K] (fp32 in the interpreter), built once."""
        if self._op is None:
            c = self.codes.reshape(-1, self.n, self.k // 2)
            s = self.scales.reshape(-1, self.n, self.k // 16)
            ops = [weight_operand(c[e], s[e]) for e in range(c.shape[0])]
            self._op = torch.stack(ops) if self.grouped else ops[0]
        return self._op

    def expert(self, e: int) -> TCWeight:
        """Expert e as a dense weight with the same numerics (same nseg)."""
        if not self.grouped:
            raise ValueError("not an expert weight")
        return TCWeight(self.codes[e], self.scales[e], self.amax[e : e + 1], False,
                        None if self.dec is None else self.dec[e : e + 1], None if self.dsc is None else self.dsc[e : e + 1],
                        self.bkc, self.nseg, False, None if self._op is None else self._op[e], tuning=self.tuning)

    def tuned(self, tuning: GemmTuning) -> TCWeight:
        """The same weight (its prepared tensors shared) under another tuning (bench/probe: compare
        configs on one weight); ``nseg`` follows a changed :class:`tuning.SegmentRule`, else stays."""
        same = tuning.segments == self.tuning.segments
        return replace(self, tuning=tuning, nseg=self.nseg if same else nseg_for(self.n, self.k, self.grouped, tuning.segments))


def weight_operand(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[N, K] ``E2M1 * sf * 2^-7`` in OP_DTYPE (exact)."""
    vals = e2m1_decode(unpack_codes(codes))
    sf = e4m3_decode(scales).repeat_interleave(16, dim=1)
    return (vals * sf * (1.0 / 128.0)).to(OP_DTYPE)


TILE_ROWS = 64  # rows per tile of the decode layout (the kernels' BN divides it)


def _tile(t: torch.Tensor, e: int, n: int, chunks: int) -> torch.Tensor:
    """[E*N, chunks*w] -> [E, ceil(N/64), chunks, 64, w] (zero rows pad the last tile)."""
    w = t.shape[1] // chunks
    nt = -(-n // TILE_ROWS)
    out = torch.zeros(e, nt * TILE_ROWS, chunks, w, dtype=t.dtype, device=t.device)
    out[:, :n] = t.reshape(e, n, chunks, w)
    return out.reshape(e, nt, TILE_ROWS, chunks, w).transpose(2, 3).contiguous()


def decode_layout(codes: torch.Tensor, scales: torch.Tensor, bkc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard packing (byte j = codes 2j, 2j+1) -> the decode layout: per bkc-wide K chunk, byte
    j = code[j] | code[j + bkc/2] << 4, stored tile by tile ([(E,) N/64, K/bkc, 64, bkc/2]: one
    contiguous block per 64 rows x chunk); scales likewise [(E,) N/64, K/bkc, 64, bkc/16]."""
    n = codes.shape[-2]
    k = codes.shape[-1] * 2
    e = codes.numel() // (n * k // 2)
    flat = unpack_codes(codes.reshape(-1, k // 2)).reshape(-1, k // bkc, 2, bkc // 2)
    arranged = (flat[:, :, 0, :] | (flat[:, :, 1, :] << 4)).reshape(-1, k // 2)
    return _tile(arranged, e, n, k // bkc), _tile(scales.reshape(-1, k // 16), e, n, k // bkc)


def prepare(w: Any, tuning: GemmTuning = DEFAULT) -> TCWeight:
    """TCWeight from an ``NVFP4Tensor`` [N, K] (per-tensor or per-row amax) or
    ``GroupedNVFP4Weights`` [E, N, K] (one amax per expert), for GEMMs under ``tuning``."""
    grouped = not isinstance(w, NVFP4Tensor)
    per_row = (not grouped) and bool(w.per_token)
    k = w.codes.shape[-1] * 2
    n = w.codes.shape[-2]
    bkc = chunk_for(k)
    dec, dsc = decode_layout(w.codes, w.scales, bkc) if bkc else (None, None)
    return TCWeight(w.codes.contiguous(), w.scales.contiguous(), w.amax.reshape(-1).float().contiguous(), per_row,
                    dec, dsc, bkc, nseg_for(n, k, grouped, tuning.segments), grouped, tuning=tuning)


def choose(m: int, w: TCWeight, path: str = "auto") -> str:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "decode" and not w.bkc:
        raise ValueError(f"no decode path for K = {w.k} (needs K % 32 == 0)")
    if path != "auto":
        return path
    return "decode" if m <= DECODE_MAX_M and w.bkc else "prefill"


@functools.lru_cache(maxsize=1024)
def decode_config(m: int, grouped: bool = False, tuning: DecodeTuning = DEFAULT.decode) -> Mapping[str, Any]:
    """Tokens on the MMA's M side (16 rows: mma.sync) and 64 weight rows per program by default;
    for dense M <= 16 four decode chunks per loop step and 3 stages (more bytes in flight per SM);
    ``SWAP`` puts the weight rows on the M side instead (wgmma m64, tokens on N). Chosen from the
    H200 runs in BENCHMARKS.md (every variant gave the same bits; only the speed differs).
    ``tuning``: overrides (:class:`tuning.DecodeTuning`; in the interpreter only SWAP, CPI and NSEG)."""
    over = tuning.overrides()
    if INTERPRET:
        keep = {key: v for key, v in over.items() if key in ("SWAP", "CPI", "NSEG")}
        return MappingProxyType({"BN": 16, "BM": 16, "num_warps": 4, "num_stages": 1, "USE_ASM": False, **keep})
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    small = bm == 16 and not grouped
    return MappingProxyType({"SWAP": False, "BN": 64 if bm < 64 else 32, "BM": bm, "num_warps": 4,
                             "num_stages": 3 if small else 4, "USE_ASM": True, "CPI": 4 if small else 1, **over})


@functools.lru_cache(maxsize=1024)
def prefill_config(nseg: int, kseg: int, tuning: PrefillTuning = DEFAULT.prefill) -> Mapping[str, Any]:
    """Prefill tile config; ``FLAT``: one K loop across the segments (see ``prefill_kernel``; same
    bits either way, ``FLAT=False`` is the old loop per segment, kept for the side-by-side probe).
    ``tuning``: :class:`tuning.PrefillTuning` (its tile overrides are ignored in the interpreter)."""
    bk = 64 if kseg % 64 == 0 else (32 if kseg % 32 == 0 else 16)
    flat = {"FLAT": tuning.flat, "WDEC": tuning.decode_weights, "SPLIT": tuning.split_epilogue}
    if INTERPRET:
        return MappingProxyType({"BM": 16, "BN": 16, "BK": 16, "num_warps": 4, "num_stages": 1, "GROUP_M": 1, **flat})
    if nseg == 1:
        cfg = {"BM": 128, "BN": 256, "BK": bk, "num_warps": 8, "num_stages": 3, "GROUP_M": 16}
    else:
        cfg = {"BM": 128, "BN": 128, "BK": bk, "num_warps": 8, "num_stages": 4, "GROUP_M": 16}
    return MappingProxyType({**cfg, **flat, **tuning.overrides()})


def act_operand(a: NVFP4Tensor) -> torch.Tensor:
    """[M, K] ``E2M1 * sf`` of per-token activations in OP_DTYPE (exact)."""
    from .triton_quant import nvfp4_dequantize

    return nvfp4_dequantize(a, OP_DTYPE, apply_global=False)


def _run(a_amax: torch.Tensor, a_op: torch.Tensor, w: TCWeight, m: int, p: str,
         tiles: tuple[torch.Tensor, ...] | None, row_e: torch.Tensor | None, bm: int | None = None,
         pdl: bool = False) -> torch.Tensor:
    dev = a_op.device
    n, k = w.n, w.k
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    if m == 0:
        return out
    grouped = tiles is not None
    tun = w.tuning
    nseg = (w.nseg if tun.decode.nseg is None else int(tun.decode.nseg)) if p == "decode" else w.nseg
    if a_op.dim() > 2 and not (p == "decode" and use_native(w, a_op, nseg)):  # a native decode layout
        from . import native

        a_op = native.rows_operand(a_op, m)
    te, tr0, tr1 = tiles if grouped else (a_amax, a_amax, a_amax)
    wes = (n * k) if grouped else 0
    if p == "decode":
        cfg = decode_config(m, tuning=tun.decode) if bm is None else {**decode_config(m, True, tun.decode), "BM": bm}
        part = torch.empty(nseg, m, n, dtype=torch.float32, device=dev) if nseg > 1 else a_amax
        if use_native(w, a_op, nseg):
            from . import native

            native.decode_gemm(a_amax, a_op, w, m, nseg, out.view(torch.int16), part, pdl)
            if not native.reduces_in_kernel(m, w, nseg):
                reduce_segments(part, a_amax, w, out, nseg)
            return out
        n_m = te.numel() if grouped else cdiv(m, cfg["BM"])
        args = (w.dec, w.dsc, w.amax, a_op, a_amax, out.view(torch.int16), part, te, tr0, tr1,
                m, n, k, cfg["BN"], cfg["BM"], w.bkc, nseg)
        grid = (cdiv(n, cfg["BN"]), n_m, nseg)
        if cfg.get("SWAP", False):
            launch(decode_kernel, grid, *args, grouped, w.per_row, cfg["USE_ASM"], INTERPRET,
                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        else:
            launch(decode_ns_kernel, grid, *args, _cpi(cfg, k // w.bkc // nseg), grouped, w.per_row, cfg["USE_ASM"], INTERPRET,
                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if nseg > 1:
            blk = 1024
            launch(reduce_kernel, (cdiv(m * n, blk),), part, a_amax, w.amax,
                   row_e if row_e is not None else a_amax, out.view(torch.int16), m, n, nseg, blk, w.per_row, grouped,
                   num_warps=4)
        return out
    if two_launch(w):
        _prefill_two_launch(a_amax, a_op, w, m, out)
        return out
    cfg = prefill_config(w.nseg, k // w.nseg, tun.prefill)
    n_m = te.numel() if grouped else cdiv(m, cfg["BM"])
    wop, wdec = _weight_args(w, cfg["WDEC"] and not grouped)
    launch(prefill_kernel, (n_m * cdiv(n, cfg["BN"]),),
           a_op, wop, a_amax, w.amax, out.view(torch.int16), te, tr0, tr1,
           m, n, k, wes,
           cfg["BM"], cfg["BN"], cfg["BK"], w.nseg, cfg["GROUP_M"], grouped, w.per_row, INTERPRET, cfg["FLAT"],
           **wdec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def reduce_segments(part: torch.Tensor, a_amax: torch.Tensor, w: TCWeight, out: torch.Tensor, nseg: int) -> None:
    """The bf16 rows of a dense weight from its K segments' fp32 partials ``part`` [nseg, M, N]
    (``reduce_kernel``: in segment order, then the epilogue) into ``out`` [M, N] bf16, which may be a column
    block of a wider output (a fused layer's shard: its row stride is passed on)."""
    m, n = out.shape
    launch(reduce_kernel, (cdiv(m * n, 1024),), part, a_amax, w.amax, a_amax, out.view(torch.int16), m, n, nseg, 1024,
           w.per_row, False, out.stride(0), num_warps=4)


SHARD_REDUCE = True  # False: one reduce_segments launch per shard (the bench's A/B switch; the same bits)


def reduce_shards(items: list[tuple[torch.Tensor, TCWeight, int]], a_amax: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`reduce_segments` of a fused layer's shards (``items``: each its partials, weight and first column
    in ``out`` [M, sum of N] bf16; up to four, dense) in one launch (``reduce_shards_kernel``): every column
    block the bits of its shard's own reduce."""
    if len(items) == 1 or not SHARD_REDUCE:
        for part, w, c0 in items:
            reduce_segments(part, a_amax, w, out[:, c0:c0 + w.n], w.nseg)
        return
    if not 1 < len(items) <= 4:
        raise ValueError(f"reduce_shards: 1 to 4 shards, got {len(items)}")
    m, blk = out.shape[0], 1024
    first = items[0][2]
    starts, args, segs, rows = [0], [], [], []
    for part, w, c0 in items:
        args.append((part, w.amax, w.n, c0 - first))
        segs.append(w.nseg)
        rows.append(w.per_row)
        starts.append(starts[-1] + cdiv(m * w.n, blk))
    total = starts[-1]
    while len(args) < 4:  # absent shards: never reached (their first program is the grid's size)
        args.append((a_amax, a_amax, 1, 0))
        segs.append(1)
        rows.append(False)
        starts.append(total)
    flat: list[Any] = list(args[0][:3])  # shard 0: partials, amax, N (its first program 0, its column 0)
    for i in range(1, 4):  # shard i: its first program, partials, amax, N, first column
        flat += [starts[i], *args[i]]
    launch(reduce_shards_kernel, (total,), a_amax, out.view(torch.int16)[:, first:], m, out.stride(0), *flat,
           *segs, *rows, blk, num_warps=4)


def _weight_args(w: TCWeight, decode: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """The prefill kernel's weight operand and keyword arguments: the fp16 operand ``w.op()``, or with
    ``decode`` (``PrefillTuning.decode_weights``) the codes and scale bytes decoded in registers (the
    operand pointer is then unused: the codes stand in, so no operand is made)."""
    if decode:
        return w.codes, {"wc_ptr": w.codes, "ws_ptr": w.scales, "WDEC": True}
    return w.op(), {}


def two_launch(w: TCWeight) -> bool:
    """The prefill of a dense weight with two K segments runs as two launches of the one-segment tile
    (``prefill_kernel`` PHASE 1, 2: segment 0's fp32 sums through a buffer), where the weight's
    tuning asks for it (:attr:`tuning.PrefillTuning.two_launch`; same bits as the one-loop kernel)."""
    return w.tuning.prefill.two_launch and w.nseg == 2 and not w.grouped


def _prefill_two_launch(a_amax: torch.Tensor, a_op: torch.Tensor, w: TCWeight, m: int, out: torch.Tensor) -> None:
    """PHASE 1 then 2 over row blocks whose fp32 buffer stays within the tuning's ``partial_bytes``."""
    n, k = w.n, w.k
    cfg = prefill_config(1, k // 2, w.tuning.prefill)  # the one-accumulator tile
    rows = max(cfg["BM"], w.tuning.prefill.partial_bytes // (4 * n) // cfg["BM"] * cfg["BM"])
    part = torch.empty(min(m, rows), n, dtype=torch.float32, device=a_op.device)
    wop, wdec = _weight_args(w, bool(cfg["WDEC"]))
    for r0 in range(0, m, rows):
        mm = min(rows, m - r0)
        am, ao, o = a_amax[r0:r0 + mm], a_op[r0:r0 + mm], out[r0:r0 + mm]
        grid = (cdiv(mm, cfg["BM"]) * cdiv(n, cfg["BN"]),)
        for phase in (1, 2):
            launch(prefill_kernel, grid, ao, wop, am, w.amax, o.view(torch.int16), am, am, am, mm, n, k, 0,
                   cfg["BM"], cfg["BN"], cfg["BK"], 2, cfg["GROUP_M"], False, w.per_row, INTERPRET, True, part, phase,
                   **wdec, SPLIT=cfg["SPLIT"] and phase == 2, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def use_native(w: TCWeight, a_op: torch.Tensor, nseg: int) -> bool:
    """The native (CUDA C++) decode GEMM runs this call: built and usable here, dense weight with
    K % 128 == 0, no NaN-flagged weight scale, fp16 operand, the weight's own K segments."""
    if INTERPRET or not w.tuning.decode.native or w.grouped or nseg != w.nseg or a_op.dtype != torch.float16:
        return False
    from . import native

    return native.available() and native.decode_ok(w)


def operand_layout(m: int, w: TCWeight, path: str = "decode") -> int:
    """The token-operand layout the GEMM of M rows on ``path`` (``auto``: the dispatcher's choice)
    takes, so that the quantizer writes it directly: 0 row-major, or, on the native decode kernels,
    ``native.token_layout`` (1 chunk-major, 2 core-matrix)."""
    if (m == 0 or m > DECODE_MAX_M or not w.bkc or choose(m, w, path) != "decode"
            or not use_native(w, w.codes.new_empty(0, dtype=torch.float16), w.nseg)):
        return 0
    from . import native

    return native.token_layout(m, w)


def decode_operand(a_op: torch.Tensor, w: TCWeight, m: int) -> torch.Tensor:
    """``a_op`` (row-major) in the layout the decode GEMM of M rows takes (bench / callers holding a
    row-major operand: convert once, outside the timed GEMM)."""
    layout = operand_layout(m, w) if a_op.dim() == 2 else 0
    if layout:
        from . import native

        return native.layout_operand(a_op, layout)
    return a_op


def _cpi(cfg: dict[str, Any], chunks: int) -> int:
    """Chunks per loop step: the largest power of two <= cfg's CPI dividing the segment's chunks."""
    cpi = int(cfg.get("CPI", 1))
    while chunks % cpi:
        cpi //= 2
    return cpi


def _check(a: NVFP4Tensor, w: TCWeight) -> None:
    kernel_device_ok(a.codes, w.codes)
    if a.shape[1] != w.k:
        raise ValueError(f"K mismatch: activations have K={a.shape[1]}, weights have K={w.k}")


def tc_matmul(a: NVFP4Tensor, w: TCWeight, *, path: str = "auto", a_op: torch.Tensor | None = None,
              after_own_kernel: bool = False) -> torch.Tensor:
    """``a @ w.T`` -> bf16 [M, N] (``a``: per-token NVFP4 activations; ``a_op``: their fp16 operand
    if already made, e.g. by the quantizer). ``after_own_kernel``: the kernel launched last on the stream
    writes none of ``w``'s fields (the quantizer of ``a``, or another GEMM): the native decode GEMM may then
    start streaming ``w`` before that kernel ends (``native.decode_gemm``'s ``pdl``; the same bits)."""
    _check(a, w)
    if w.grouped:
        raise ValueError("expert weights: use tc_grouped")
    m = a.shape[0]
    p = choose(m, w, path)
    amax = a.amax if a.per_token else a.row_amax().contiguous()  # per-tensor amax: one alpha per row
    if a_op is None:  # the operand made here: the last kernel is this conversion
        a_op, after_own_kernel = act_operand(a), True
    return _run(amax, a_op, w, m, p, None, None, pdl=after_own_kernel)


def tc_matmul_shards(a: NVFP4Tensor, tws: list[TCWeight], *, a_op: torch.Tensor | None = None,
                     after_own_kernel: bool = False) -> torch.Tensor:
    """``a`` times each weight of ``tws`` (shards reading the same tokens: a fused layer's q, k, v or gate,
    up), side by side -> bf16 [M, sum of N]: every column block the bits of :func:`tc_matmul` of its shard.
    On the native wgmma decode path (:func:`native.shards_ok`) one launch computes every shard into one
    output (no ``torch.cat``; the shards with K segments across CTAs then get one reduce launch,
    :func:`reduce_shards`, each writing its columns); else one :func:`tc_matmul` per shard, joined. ``after_own_kernel``: as
    :func:`tc_matmul` (each shard after the first follows its own kernel)."""
    if not _one_launch(a, tws, a_op):
        ys = [tc_matmul(a, tw, a_op=a_op, after_own_kernel=i > 0 or after_own_kernel) for i, tw in enumerate(tws)]
        return torch.cat(ys, dim=-1) if len(ys) > 1 else ys[0]
    from . import native

    m = a.shape[0]
    for w in tws:
        _check(a, w)
    out = torch.empty(m, sum(w.n for w in tws), dtype=torch.bfloat16, device=a_op.device)
    parts = [torch.empty(w.nseg, m, w.n, dtype=torch.float32, device=a_op.device)
             if w.nseg > 1 and not native.fused_segments(m, w, w.nseg) else a.amax for w in tws]
    native.decode_shards(a.amax, a_op, tws, m, out.view(torch.int16), parts, after_own_kernel)
    c0, left = 0, []
    for w, part in zip(tws, parts, strict=True):  # the K segments the kernel left to a reduce launch
        if not native.reduces_in_kernel(m, w, w.nseg):
            left.append((part, w, c0))
        c0 += w.n
    if left:
        reduce_shards(left, a.amax, out)
    return out


def _one_launch(a: NVFP4Tensor, tws: list[TCWeight], a_op: torch.Tensor | None) -> bool:
    """The shards run as one native wgmma decode launch: per-token activations with their fp16 operand, every
    shard on the native decode path, and :func:`native.shards_ok`."""
    if len(tws) < 2 or a_op is None or a_op.dtype != torch.float16 or not a.per_token or not a.shape[0]:
        return False
    m = a.shape[0]
    if not all(choose(m, w) == "decode" and use_native(w, a_op, w.nseg) for w in tws):
        return False
    from . import native

    return native.shards_ok(m, tws)


def tc_linear(x: torch.Tensor, w: TCWeight, *, path: str = "auto") -> torch.Tensor:
    """Per-token quantize (one pass, also emitting the fp16 operand) + :func:`tc_matmul`."""
    from .quant_fast import MAX_K, quantize_rows
    from .triton_quant import nvfp4_quantize

    x = x.contiguous()
    if x.shape[1] <= MAX_K:
        layout = operand_layout(x.shape[0], w, path)
        codes, scales, amax, op = quantize_rows(x, None, True, emit_op=OP_DTYPE, op_layout=layout)
        return tc_matmul(NVFP4Tensor(codes, scales, amax, True), w, path=path, a_op=op, after_own_kernel=True)
    return tc_matmul(nvfp4_quantize(x, per_token=True), w, path=path)


def tc_grouped(a: NVFP4Tensor, offsets: torch.Tensor, w: TCWeight, *, path: str = "auto",
               a_op: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped GEMM: rows ``offsets[e]:offsets[e+1]`` of ``a`` times expert e, one launch. Each row
    equals a :func:`tc_matmul` call of that expert alone (same kernel numerics)."""
    from .moe import tile_schedule

    _check(a, w)
    if not w.grouped:
        raise ValueError("tc_grouped needs expert weights (prepare(GroupedNVFP4Weights))")
    e_count = w.codes.shape[0]
    if offsets.numel() != e_count + 1:
        raise ValueError(f"offsets must have E+1 = {e_count + 1} entries, got {offsets.numel()}")
    m = a.shape[0]
    p = choose(max(1, m // e_count), w, path)
    bm = (decode_config(16, True, w.tuning.decode)["BM"] if p == "decode"
          else prefill_config(w.nseg, w.k // w.nseg, w.tuning.prefill)["BM"])
    offsets = offsets.to(a.codes.device)
    tiles = tile_schedule(offsets, bm, m)
    row_e = None
    if p == "decode" and w.nseg > 1:
        row_e = torch.searchsorted(offsets[1:], torch.arange(m, device=offsets.device), right=True).to(torch.int32)
    amax = a.amax if a.per_token else a.row_amax().contiguous()
    return _run(amax, a_op if a_op is not None else act_operand(a), w, m, p, tiles, row_e, bm)


def kernel_record(m: int, w: TCWeight, path: str = "auto") -> dict[str, Any]:
    """Manifest record of what :func:`tc_matmul` runs for M rows: path, config, versions."""
    p = choose(m, w, path)
    cfg = decode_config(m, tuning=w.tuning.decode) if p == "decode" else prefill_config(w.nseg, w.k // w.nseg, w.tuning.prefill)
    if p == "decode":
        cfg = {**cfg, "CPI": _cpi(cfg, w.k // w.bkc // w.nseg)}
        if not INTERPRET and use_native(w, w.codes.new_empty(0, dtype=torch.float16), w.nseg):
            from . import native

            st = native.status()
            return {"backend": "cuda-native", "kernel": "nvfp4_native.decode_gemm", "path": p,
                    "config": {**native.decode_variant(m, w), "NSEG": w.nseg, "KC": 128, "operands": "float16"},
                    "arch": st.get("arch"), "torch": torch.__version__, "cuda": getattr(torch.version, "cuda", None)}
    return {"backend": "triton-interpreter" if INTERPRET else "triton", "kernel": "gemm_tc", "path": p,
            "config": {**cfg, "NSEG": w.nseg, "BKC": w.bkc, "operands": str(OP_DTYPE).replace("torch.", "")},
            "triton": triton.__version__, "torch": torch.__version__,
            "cuda": getattr(torch.version, "cuda", None)}


