"""The optional native (CUDA C++) backend: ``csrc/`` (``nvfp4_native.cu`` and the headers it includes,
one per role: ``common.cuh``, the three decode pipelines ``decode_cpasync.cuh`` / ``decode_bulk.cuh`` /
``decode_wg.cuh``, ``quantize.cuh``, ``launch.cuh``, ``dispatch.cuh``), built at first use.

Built with ``torch.utils.cpp_extension.load`` (nvcc + ninja on the GPU machine) into a cache
folder (``$MISMATCH_PROBE_NATIVE_CACHE``, default ``<cache>/native`` under ``$MISMATCH_PROBE_CACHE``,
:mod:`mismatch_probe.settings`), once per
source / torch / GPU-architecture combination. Optional: without CUDA, without nvcc, on a GPU
older than sm_89 (no hardware E4M3 conversion), with ``MISMATCH_PROBE_NATIVE=0``, or when the
build fails, :func:`status` says why and the callers keep the Triton kernels.

Kernels (same bits as the Triton paths; the GPU checks compare them with ``torch.equal``):

* ``decode_gemm``: the decode-path GEMM of :mod:`gemm_tc` (M <= 64), weights in the layout of
  :func:`native_layout` (made once per weight version); mma.sync m16n8k16 with one fp32 chain per
  output along K. Variants (:attr:`tuning.NativeTuning.variant`, all the same bits, see :data:`VARIANTS`):
  the cp.async pipeline (0, 3) and the bulk-copy pipeline (6-9: weights by the copy engine, a
  producer warp, no CTA-wide barrier; with E4M3 scale bytes or fp16 scales, byte-permute or
  mask/shift fragment decode; 12-14 (14 the default off sm_90): the token operand chunk-major, one
  bulk copy per stage) and, on sm_90 (the default there), variant 15: wgmma.mma_async m64nNk16 with
  the weights on the MMA's M side, their fragments decoded into registers, and the tokens on its N
  side from a core-matrix ordered operand (TOKEN_CORE) that the quantizer writes;
* ``quantize_rows``: the per-token / given-amax quantizer of :mod:`quant_fast` for bf16 rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from mismatch_probe import settings

from .common import quant_outputs
from .ref import e4m3_decode, unpack_codes
from .tuning import NativeTuning

SRC = Path(__file__).parent / "csrc" / "nvfp4_native.cu"  # the translation unit; it includes the csrc/*.cuh
MIN_CC = (8, 9)
# Decode variants: (pipeline, scales, fragment decode, NT). "cp.async": every thread copies weights
# and tokens into a ring of 6 stages x 2 chunks of 128 K (variant 3: 8 x 1; M <= 16; 2 or 4 token
# tiles above), a CTA barrier per stage. "bulk": a producer warp, weights by cp.async.bulk (copy
# engine), tokens by cp.async, mbarriers per stage (6 stages x 2 chunks, 4 for M > 32). "e4m3": scale
# bytes; "fp16": scales as fp16 sf * 2^7 (native_layout's third tensor). "prmt" / "shift": the fp16
# pairs made by byte permutes or by masks and shifts. NT 2: 4 consumer warps of two 8-row weight
# tiles, 1: 8 warps of one. The bulk ones need an even chunk count per K segment and M <= 64 (else
# variant 0 runs). "bulk-chunked" (12-14): 7 with the token operand chunk-major (TOKEN_ROW, made by
# the quantizer or :func:`chunk_operand`), one bulk copy per 16-row token block and stage on the
# weights' mbarrier, 4 stages x 4 chunks at M <= 16 when the segment's chunk count allows; 13 with
# the software-pipelined consumer loop; 14: 8 consumer warps of one weight tile there. All give the
# same bits (H200 runs of BENCHMARKS.md, 2026-12-01: 7 the fastest of 0-11 at 15:46; 12 at 18:13:
# M = 16 21.0 -> 15.5 us; 14 at 18:21: 15.4 us, the default since). Earlier: 1 (2 tiles, 4 stages
# x 2), 2 (1 tile, 6 x 2): no better than 0; 4, 5 (wgmma with register weights): 35 us at M = 16,
# removed; a register ring for the weights (no shared memory): 0.9-1.0 TB/s, dropped; the token
# tile multicast over clusters of 2-4 CTAs (lab, 18:00): 40-70 us, dropped.
VARIANTS: dict[int, tuple[str, str, str, int]] = {
    0: ("cp.async", "e4m3", "prmt", 2), 3: ("cp.async", "e4m3", "prmt", 2), 6: ("bulk", "e4m3", "prmt", 2),
    7: ("bulk", "fp16", "prmt", 2), 8: ("bulk", "fp16", "shift", 2), 9: ("bulk", "e4m3", "shift", 2),
    10: ("bulk", "fp16", "prmt", 1), 11: ("bulk", "fp16", "shift", 1),
    12: ("bulk-chunked", "fp16", "prmt", 2), 13: ("bulk-chunked-pipelined", "fp16", "prmt", 2),
    14: ("bulk-chunked", "fp16", "prmt", 1),  # 14: NT 1 at M <= 16 with 4 chunks per stage, else as 12
    15: ("wgmma-core", "fp16", "shift", 2)}  # sm_90a: wgmma, weights on M, tokens on N (TOKEN_CORE)
CHUNKED = (12, 13, 14)  # the variants that take the chunk-major token operand
CORE = (15,)  # the variants that take the core-matrix token operand
# Default: 15 on sm_90 (H200, 2026-12-01 20:42 bench_kernels: M = 1 / 16 / 64 14.2 / 15.0 / 20.2 us against
# 14's 15.5 / 15.4 / 31.2; lab 20:47 with 4 register sets: 13.9 / 14.9), else 14 (wgmma is sm_90a only)
DEFAULT_VARIANT = 14
HOPPER_VARIANT = 15
# the chunk-major token operand: [ceil(M/16) blocks][K/128 chunks][16 rows][128 + 8 halves] (fp16; the
# 8 padding halves of a row keep ldmatrix conflict-free and are never read; rows >= M are zero)
TOKEN_ROW = 136
# the core-matrix token operand of variant 15: [K/128 chunks][16 k-groups of 8][NTOK/8 row groups][8 rows]
# [8 halves] fp16, NTOK = token_cols(M) (rows >= M zero): a stage's tokens are one contiguous copy, a k16
# step's wgmma B operand is 2 x NTOK/8 core matrices of 128 contiguous bytes
TOKEN_CORE = (16, 8, 8)
# programmatic dependent launch of the wgmma decode GEMM after its tokens' quantizer (decode_gemm's ``pdl``):
# the weight stream starts while the quantizer runs; False: every launch plain (the bench's A/B switch). The
# quantizer stays on the path all the same (M = 16, N = K = 8192: the linear 3.6-4.1 us over its GEMM alone); tried
# and taken out (H100, BENCHMARKS.md "Issue 28, round 16"): the quantizer with 4 rows per CTA (so no GEMM CTA waits
# for an SM: slower on every shape) and the first stages after the ring prefetched into the L2 before the wait
# (nothing gained)
PDL = True
_STATE: dict[str, Any] = {"mod": None, "reason": None, "tried": False, "build_s": None}


def _cache_dir(tag: str) -> Path:
    return settings.get("MISMATCH_PROBE_NATIVE_CACHE") / tag


def _why_not() -> str | None:
    if not settings.get("MISMATCH_PROBE_NATIVE"):
        return "disabled (MISMATCH_PROBE_NATIVE=0)"
    from .common import INTERPRET

    if INTERPRET or not torch.cuda.is_available():
        return "no CUDA device (Triton interpreter mode)"
    cc = torch.cuda.get_device_capability()
    if cc < MIN_CC:
        return f"sm_{cc[0]}{cc[1]} < sm_89 (no hardware E4M3 conversion)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) found: set CUDA_HOME to build the native kernels"
    return None


def load() -> Any | None:
    """The compiled module, building it at the first call; None (see :func:`status`) when absent."""
    if _STATE["tried"]:
        return _STATE["mod"]
    _STATE["tried"] = True
    why = _why_not()
    if why is not None:
        _STATE["reason"] = why
        return None
    import time

    from torch.utils.cpp_extension import load as cpp_load

    cc = torch.cuda.get_device_capability()
    arch = f"{cc[0]}{cc[1]}" + ("a" if cc == (9, 0) else "")  # sm_90a: the Hopper target
    src = b"".join(f.read_bytes() for f in sorted(SRC.parent.glob("*.cu*")))  # the .cu and its headers
    tag = hashlib.sha256(src + torch.__version__.encode() + arch.encode()).hexdigest()[:16]
    build = _cache_dir(tag)
    build.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        mod = cpp_load(
            name=f"mp_nvfp4_native_{tag}",
            sources=[str(SRC)],
            build_directory=str(build),
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo"],
            verbose=settings.get("MISMATCH_PROBE_NATIVE_VERBOSE"),
        )
    except Exception as e:  # a failed build leaves the Triton kernels in charge, with the reason
        _STATE["reason"] = f"build failed: {type(e).__name__}: {str(e)[-600:]}"
        return None
    _STATE.update(mod=mod, build_s=round(time.time() - t0, 1), arch=f"sm_{arch}", tag=tag)
    return mod


def status() -> dict[str, Any]:
    """``{"available", "reason", "arch", "build_s"}`` without building (``reason`` of an earlier try)."""
    if not _STATE["tried"]:
        why = _why_not()
        return {"available": None if why is None else False, "reason": why or "not built yet (built at first use)"}
    return {"available": _STATE["mod"] is not None, "reason": _STATE["reason"], "arch": _STATE.get("arch"),
            "build_s": _STATE["build_s"]}


def available() -> bool:
    return load() is not None


# ---------------------------------------------------------------------------------------------
# decode GEMM

# fragment k per lane % 4 and byte: bytes 0, 2 hold the pair {2q, 2q+1}, bytes 1, 3 {2q+8, 2q+9}, so
# (W << 8) & 0xFF00FF00 and W & 0xFF00FF00 (or one byte permute each) give the two fp16 pairs
_KK = ((0, 8, 1, 9), (2, 10, 3, 11), (4, 12, 5, 13), (6, 14, 7, 15))


def native_layout(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 weight [N, K] (standard packing, linear scales) -> (codes, scales, scales16) in the
    layout of ``decode_gemm``: per 64 rows (zero-padded) and 128-wide K chunk, 4096 code bytes
    ordered [tile t (8 rows), lane = 4 g + q, word w, byte i] and 512 scale bytes [tile, row g,
    step]; byte i of word w holds the value of row 8t+g at k = 16(2w) + KK[q][i] in bits {1,2,3,7}
    (as s|e1e0m: sign bit 7) and the one at k = 16(2w+1) + KK[q][i] in bits {4,5,6,0} (sign bit 0).
    ``scales16``: the same scales as fp16 ``sf * 2^7`` (exact), 2 bytes each, same order."""
    n, k = codes.shape[0], codes.shape[1] * 2
    if k % 128:
        raise ValueError(f"native layout needs K % 128 == 0, got K = {k}")
    npad = -(-n // 64) * 64
    chunks = k // 128
    c = unpack_codes(codes)
    s = scales
    if npad != n:
        c = torch.cat([c, c.new_zeros(npad - n, k)])
        s = torch.cat([s, s.new_zeros(npad - n, k // 16)])
    kk = torch.tensor(_KK, dtype=torch.long, device=c.device)
    v = c.view(npad // 64, 8, 8, chunks, 4, 2, 16)[..., kk]  # nb t g c w h q i
    lo, hi = v[:, :, :, :, :, 0], v[:, :, :, :, :, 1]  # nb t g c w q i
    byte = ((lo & 7) << 1) | ((lo & 8) << 4) | ((hi & 7) << 4) | (hi >> 3)
    wq = byte.permute(0, 3, 1, 2, 5, 4, 6).contiguous().view(-1)  # nb c t g q w i
    ws = s.reshape(npad // 64, 8, 8, chunks, 8).permute(0, 3, 1, 2, 4).contiguous().view(-1)  # nb c t g step
    ws16 = (e4m3_decode(ws) * 128).to(torch.float16).view(torch.uint8)
    return wq, ws, ws16


def decode_ok(w: Any) -> bool:
    """Whether ``decode_gemm`` computes this TCWeight (dense, K % 128 == 0, no NaN-flagged scale:
    its fp16 scale decode has no NaN)."""
    if w.grouped or w.k % 128 or (w.k // 128) % w.nseg:
        return False
    if w.native is None:
        w.native = (int(w.scales.max()) < 0x7F) if w.scales.numel() else False  # one check per weight version
        if w.native:
            w.native_w = native_layout(w.codes, w.scales)
            if w.codes.is_cuda:
                counters(w.codes.device)  # made here, outside any graph capture
    return bool(w.native)


def decode_variant(m: int, w: Any) -> dict[str, Any]:
    """The kernel instance for M rows (as nvfp4_native.cu's decode_gemm picks it): the variant, its
    pipeline / scales / fragment decode, MT (16-row token tiles), NT (8-row weight tiles per warp),
    STAGES, CPS (128-wide chunks per stage), HALF (cp.async, M <= 8: token rows 0-7 only)."""
    chunks = w.k // 128 // w.nseg
    two = chunks % 2 == 0
    v = _variant(w.tuning.native)
    mt = 1 if m <= 16 else 2 if m <= 32 else 4
    if v in CORE and _bulk_ok(m, w):  # as nvfp4_native.cu's decode_gemm picks the instance
        ntok = token_cols(m)
        rec = {"variant": v, "pipeline": "wgmma-core", "scales": "fp16", "decode": "shift", "NTOK": ntok,
               "MMA": f"wgmma.mma_async m64n{ntok}k16 (A: registers)",
               "tokens": f"core-matrix [K/128][16][{ntok // 8}][8][8] fp16"}
        if w.nseg > 1:
            rec["segments"] = "added by the tile's last CTA (no reduce launch)" if REDUCE_IN_KERNEL else "a reduce launch"
        if fused_segments(m, w, w.nseg):
            return {**rec, "pipeline": "wgmma-core, both K segments in the CTA, a ring per segment", "STAGES": 4,
                    "CPS": 2, "R": 2, "MMA": rec["MMA"] + ", 2 warpgroups"}
        if ntok == 64 and crowded(w, w.nseg):
            return {**rec, "pipeline": "wgmma-core, 2 CTAs per SM", "STAGES": 2, "CPS": 2, "R": 2}
        cps = 4 if chunks % 4 == 0 and ntok < 64 else 2
        return {**rec, "STAGES": 4 if cps == 4 or ntok == 64 else 6, "CPS": cps, "R": 4 if cps == 4 and ntok <= 16 else 2}
    if v >= 6 and _bulk_ok(m, w):
        pipe, sc, dec, nt = VARIANTS[v]
        cps = 4 if v in CHUNKED and mt == 1 and chunks % 4 == 0 else 2
        if v == 14 and cps == 2:
            nt = 2
        stages = 4 if mt == 4 or cps == 4 else 6
        rec = {"variant": v, "pipeline": pipe, "scales": sc, "decode": dec, "MT": mt, "NT": nt,
               "STAGES": stages, "CPS": cps, "MMA": "mma.sync m16n8k16"}
        if v in CHUNKED:
            rec["tokens"] = f"chunk-major [M/16][K/128][16][{TOKEN_ROW}] fp16"
        return rec
    if m > 16:
        return {"variant": 0, "pipeline": "cp.async", "MT": mt, "NT": 2, "STAGES": 6 if m <= 32 else 4,
                "CPS": 2 if two else 1, "HALF": 0, "MMA": "mma.sync m16n8k16"}
    v = 0 if v != 3 and two else 3
    return {"variant": v, "pipeline": "cp.async", "MT": 1, "NT": 2, "STAGES": 6 if v == 0 else 8, "CPS": 2 if v == 0 else 1,
            "HALF": int(m <= 8), "MMA": "mma.sync m16n8k16"}


def _bulk_ok(m: int, w: Any) -> bool:
    """The bulk-copy kernels (variants 6-14) run: an even chunk count per K segment and M <= 64
    (else the cp.async kernel, as nvfp4_native.cu's decode_gemm decides)."""
    return (w.k // 128 // w.nseg) % 2 == 0 and m <= 64


def token_layout(m: int, w: Any) -> int:
    """The token operand the native decode GEMM of M rows of this weight takes: 0 row-major [M, K], 1
    chunk-major (TOKEN_ROW), 2 core-matrix (TOKEN_CORE)."""
    if not _bulk_ok(m, w):
        return 0
    v = _variant(w.tuning.native)
    return 2 if v in CORE else 1 if v in CHUNKED else 0


def token_cols(m: int) -> int:
    """NTOK of variant 15 for M rows: the wgmma's N, the least of 8, 16, 32, 64 >= M."""
    return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64


def chunk_operand(op: torch.Tensor) -> torch.Tensor:
    """Row-major fp16 operand [M, K] (K % 128 == 0) -> the chunk-major one (see TOKEN_ROW)."""
    m, k = op.shape
    mb = -(-m // 16)
    out = op.new_zeros(mb * 16, k // 128, TOKEN_ROW)
    out[:m, :, :128] = op.reshape(m, k // 128, 128)
    return out.view(mb, 16, k // 128, TOKEN_ROW).permute(0, 2, 1, 3).contiguous()


def core_operand(op: torch.Tensor) -> torch.Tensor:
    """Row-major fp16 operand [M, K] (M <= 64, K % 128 == 0) -> the core-matrix one (see TOKEN_CORE)."""
    m, k = op.shape
    ntok = token_cols(m)
    full = op.new_zeros(ntok, k)
    full[:m] = op
    # [G, 8 rows, K/128, 16 k-groups, 8 halves] -> [K/128, 16, G, 8, 8]
    return full.view(ntok // 8, 8, k // 128, 16, 8).permute(2, 3, 0, 1, 4).contiguous()


def layout_operand(op: torch.Tensor, layout: int) -> torch.Tensor:
    """Row-major operand [M, K] -> ``layout`` (token_layout's numbering)."""
    return chunk_operand(op) if layout == 1 else core_operand(op) if layout == 2 else op


def rows_operand(op: torch.Tensor, m: int) -> torch.Tensor:
    """The chunk-major or core-matrix operand -> row-major [M, K] (a copy)."""
    if op.dim() == 5:
        chunks, g = op.shape[0], op.shape[2]
        return op.permute(2, 3, 0, 1, 4).reshape(g * 8, chunks * 128)[:m].contiguous()
    mb, chunks = op.shape[0], op.shape[1]
    return op[..., :128].permute(0, 2, 1, 3).reshape(mb * 16, chunks * 128)[:m].contiguous()


def default_variant() -> int:
    """15 (wgmma) on sm_90, else 14."""
    if "hopper" not in _STATE:
        _STATE["hopper"] = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return HOPPER_VARIANT if _STATE["hopper"] else DEFAULT_VARIANT


def _variant(cfg: NativeTuning) -> int:
    """The variant to run: the tuning's or the default."""
    v = default_variant() if cfg.variant is None else int(cfg.variant)
    if v not in VARIANTS:
        raise ValueError(f"native decode variant {v} unknown (one of {sorted(VARIANTS)})")
    if v in CORE and default_variant() != HOPPER_VARIANT:
        raise ValueError(f"native decode variant {v} (wgmma) needs an sm_90 GPU")
    return v


def decode_gemm(a_amax: torch.Tensor, a_op: torch.Tensor, w: Any, m: int, nseg: int, out: torch.Tensor,
                part: torch.Tensor, pdl: bool = False) -> None:
    """``a_op``: the fp16 token operand, row-major [M, K] or chunk-major (either is converted to what
    the chosen kernel takes: :func:`token_layout`). ``pdl``: the wgmma kernel (variant 15) launched as a
    programmatic dependent launch, its weight stream started while the kernel before it on the stream
    still runs (the quantizer of its tokens); the caller's promise: that kernel writes none of ``w``'s
    fields (the tokens, their amax and every output are read and written after it has finished).
    Where the kernel does not add the K segments itself (:func:`reduces_in_kernel`) it leaves the partials in
    ``part`` for ``gemm_tc.reduce_kernel``."""
    if wgmma_path(m, w, nseg):
        decode_shards(a_amax, a_op, [w], m, out, [part], pdl)
        return
    mod = load()
    wq, ws, ws16 = w.native_w
    a = _token_operand(a_op, m, token_layout(m, w))
    mod.decode_gemm(wq, ws, ws16, w.amax, bool(w.per_row), a, a_amax, out, part, m, w.n, w.k, nseg, _variant(w.tuning.native),
                    fused_segments(m, w, nseg), crowded(w, nseg), bool(pdl) and PDL)


def _token_operand(a_op: torch.Tensor, m: int, layout: int) -> torch.Tensor:
    """The token operand in ``layout`` (:func:`token_layout`'s numbering), contiguous and 16-byte aligned,
    as the kernels read it (converted or copied only where it is not)."""
    if a_op.dim() != (2, 4, 5)[layout]:
        a_op = layout_operand(a_op if a_op.dim() == 2 else rows_operand(a_op, m), layout)
    if a_op.data_ptr() % 16 or not a_op.is_contiguous():
        a_op = a_op.clone(memory_format=torch.contiguous_format)
    return a_op


def wgmma_path(m: int, w: Any, nseg: int) -> bool:
    """The decode GEMM of M rows runs the wgmma kernel (variant 15, sm_90: :func:`decode_shards`)."""
    return nseg == w.nseg and token_layout(m, w) == 2


def reduces_in_kernel(m: int, w: Any, nseg: int) -> bool:
    """The decode GEMM of M rows writes the bf16 rows itself, with no reduce launch after it: one K segment,
    both halves in the CTA (:func:`fused_segments`), or, with :data:`REDUCE_IN_KERNEL`, the wgmma kernel's
    last CTA of each 64-row tile adding the tile's partials in segment order (the arithmetic of
    ``gemm_tc.reduce_kernel``, without its launch)."""
    if nseg == 1 or fused_segments(m, w, nseg):
        return True
    return REDUCE_IN_KERNEL and wgmma_path(m, w, nseg)


# the wgmma kernel's per-tile arrival counters (K segments across CTAs): int32, zero between launches (the last
# CTA of a tile resets its counter), one buffer per device made once with the first weight's native layout (so
# never inside a CUDA graph capture: the weights are prepared in the engines' warm-up); launches on one stream
# share it, as they run one after another (a programmatic dependent launch touches it only after the grid
# before it has finished)
COUNTERS = 1 << 16
MAX_SHARDS = 4  # decode_wg.cuh's WG_SHARDS
GROUP_SHARDS = True  # False: a fused layer's shards one launch each (the bench's A/B switch; the same bits)
# the wgmma kernel's K segments across CTAs added by each tile's last CTA (True) or by a reduce launch after it
# (False, the default): the same bits; the in-kernel sum was slower on the H100 (BENCHMARKS.md, issue 28 round
# 20: the 8B decode in CUDA vLLM -9% at 16 sequences, -20% at 64: each CTA's fence and arrival before it exits)
REDUCE_IN_KERNEL = False


def counters(device: torch.device) -> torch.Tensor:
    key = ("cnt", device.type, device.index)
    if key not in _STATE:
        _STATE[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _STATE[key]


def _instance(m: int, w: Any) -> tuple[Any, ...]:
    """What decides the wgmma kernel's instance for this weight (the shards of one launch must agree)."""
    chunks = w.k // 128 // w.nseg
    ks2 = fused_segments(m, w, w.nseg)
    return (w.k, chunks % 4 == 0, ks2, token_cols(m) == 64 and crowded(w, w.nseg), w.tuning.native)


def shards_ok(m: int, tws: list[Any]) -> bool:
    """The shards (weights reading the same tokens: a fused layer's q, k, v or gate, up) run as one launch of
    the wgmma decode kernel into one output: each would run that kernel alone (:func:`wgmma_path`, after
    :func:`tc_linear.use_native`), with the same instance, at most :data:`MAX_SHARDS`, and the counters fit."""
    if not GROUP_SHARDS or not 1 < len(tws) <= MAX_SHARDS or m > 64:
        return False
    if not all(decode_ok(w) and wgmma_path(m, w, w.nseg) for w in tws):
        return False
    first = _instance(m, tws[0])
    return all(_instance(m, w) == first for w in tws[1:]) and sum(tiles(w) for w in tws) <= COUNTERS


def decode_shards(a_amax: torch.Tensor, a_op: torch.Tensor, tws: list[Any], m: int, out: torch.Tensor,
                  parts: list[torch.Tensor], pdl: bool = False) -> None:
    """One launch of the wgmma decode kernel (variant 15) for the weights ``tws`` (1 to :data:`MAX_SHARDS`,
    the same K and kernel instance: :func:`shards_ok`) reading the tokens ``a_op``: ``out`` [M, sum of N]
    (2-byte) gets shard i at its columns, each the bf16 rows a launch of that weight alone writes, except
    where the kernel leaves its K segments to a reduce launch (:func:`reduces_in_kernel` false): then
    ``parts[i]`` (fp32 [nseg_i, M, N_i]) holds them for ``gemm_tc.reduce_kernel`` (the caller's)."""
    mod = load()
    w0 = tws[0]
    a = _token_operand(a_op, m, 2)
    cnt = counters(a.device)
    cols, offs, c, o = [], [], 0, 0  # the output's columns and the counters of each shard (-1: none)
    for w in tws:
        cols.append(c)
        offs.append(o if REDUCE_IN_KERNEL else -1)
        c += w.n
        o += tiles(w)
    mod.decode_wg([w.native_w[0] for w in tws], [w.native_w[2] for w in tws], [w.amax for w in tws],
                  [int(bool(w.per_row)) for w in tws], parts, cnt, offs, [w.n for w in tws], [w.nseg for w in tws], cols,
                  c, a, a_amax, out, m, w0.k, fused_segments(m, w0, w0.nseg), crowded(w0, w0.nseg),
                  bool(pdl) and PDL)


def sm_count() -> int:
    """Multiprocessors of the current CUDA device (cached; 132 without one, for the records)."""
    if "sms" not in _STATE:
        _STATE["sms"] = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                         if torch.cuda.is_available() else 132)
    return int(_STATE["sms"])


def crowded(w: Any, nseg: int) -> bool:
    """K segments across CTAs would not fit one wave at one CTA per SM (ceil(N/64) * nseg > SMs): at
    M > 32 the across-CTA kernel then runs a ring of 2 stages x 2 chunks, two CTAs per SM (H200 lab
    2026-12-01 23:20, N = K = 8192, NSEG 2, M = 64: 21.5 us before the reduce vs 23.4 in two waves).
    Decided here only: decode_gemm passes it to the extension, decode_variant records it."""
    return nseg > 1 and tiles(w) * nseg > sm_count()


def tiles(w: Any) -> int:
    """The weight's 64-row tiles (the decode kernels' CTAs per K segment)."""
    return -(-w.n // 64)


def fills_gpu(w: Any) -> bool:
    """The weight's 64-row tiles alone occupy at least 7/8 of the SMs."""
    return tiles(w) * 8 >= 7 * sm_count()


def fused_segments(m: int, w: Any, nseg: int) -> bool:
    """Variant 15 adds two K segments inside the CTA (two warpgroups, one K half each, p0 + p1 in fp32
    before the epilogue: the bits of reduce_kernel), so no partials and no reduce launch: nseg == 2,
    M <= 32, the core-matrix operand, and the weight's 64-row tiles alone fill the GPU (fills_gpu;
    only :attr:`tuning.SegmentRule.long_k` gives such a weight two segments). The tuning's ``ks2``
    forces it on or off. H200 2026-12-01: at N = K = 8192 (128 tiles) M = 16 13.2-13.4 us in the CTA (lab 23:20,
    bench 23:22; bench/results/h200_2026-12-01_s6_*) vs 15.6 across CTAs in two waves' worth (2026-12-02,
    a ring per segment and the masks-and-shifts decode: 12.4-12.6 us); at
    (4096, 4096) and (4096, 12288) (64 tiles: half the CTAs) in the CTA loses, 8.2 vs 7.8 and 19.8
    vs 14.9 us (21:11); between 64 and 116 tiles not measured (across CTAs, as before)."""
    if token_layout(m, w) != 2 or nseg != 2 or m > 32:
        return False
    ks2 = w.tuning.native.ks2
    return fills_gpu(w) if ks2 is None else bool(ks2)


# ---------------------------------------------------------------------------------------------
# quantizer


def quant_ok(x: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 16 == 0
            and x.shape[1] <= 16384 and x.data_ptr() % 16 == 0 and x.is_cuda and available())


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None, per_token: bool,
                  emit_op: torch.dtype | None = None, op_layout: int = 0) -> tuple[torch.Tensor, ...]:
    """As :func:`quant_fast.quantize_rows` (bf16 x; ``emit_op`` None or fp16; ``op_layout``: the operand's
    layout, :func:`token_layout`'s numbering (1: chunk-major, 2: core-matrix, rows <= 64); K % 128 == 0)."""
    amax = None if amax is None else amax.float().contiguous()
    layout = int(op_layout)
    codes, scales, mode, amax_t, op = quant_outputs(x, amax, per_token, None if (emit_op is None or layout)
                                                    else torch.float16)
    if layout:
        rows, k = x.shape
        if emit_op is None or k % 128 or (layout == 2 and rows > 64):
            raise ValueError("op_layout needs emit_op and K % 128 == 0 (core-matrix: at most 64 rows)")
        shape = (-(-rows // 16), k // 128, 16, TOKEN_ROW) if layout == 1 else (k // 128, 16, token_cols(rows) // 8, 8, 8)
        op = torch.empty(shape, dtype=torch.float16, device=x.device)
    load().quantize_rows(x, amax_t, codes, scales, codes if op is None else op, op is not None, mode, layout)
    return codes, scales, amax_t, op
