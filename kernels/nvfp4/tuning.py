"""The NVFP4 GEMM's tuning as data: frozen dataclasses, passed to :func:`tc_linear.prepare` (and so
to every call on the prepared weight), never module state.

Only :class:`SegmentRule` and :attr:`DecodeTuning.nseg` decide bits (the K segments of the fp32
accumulation, a function of (N, K)); every other field chooses among kernels and tile shapes that
give the same bits (tested with ``torch.equal`` on the GPU), so it only changes the speed. The
defaults are the H200 choices of BENCHMARKS.md; benches and probes build other instances with
:func:`dataclasses.replace` and pass them in. Learner and sampler must use the same
:class:`SegmentRule` (the recipes both use :data:`DEFAULT`). Importing this module imports nothing
heavy (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# field -> the config key of the kernels' config dicts (what kernel_record writes to the manifest)
_DECODE_KEYS = {"swap": "SWAP", "bn": "BN", "bm": "BM", "num_warps": "num_warps", "num_stages": "num_stages",
                "use_asm": "USE_ASM", "cpi": "CPI", "nseg": "NSEG"}
_PREFILL_KEYS = {"bm": "BM", "bn": "BN", "bk": "BK", "num_warps": "num_warps", "num_stages": "num_stages",
                 "group_m": "GROUP_M"}


def _fields(cfg: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    by_key = {key: f for f, key in keys.items()}
    bad = sorted(set(cfg) - set(by_key))
    if bad:
        raise ValueError(f"unknown config key(s) {bad}; known: {sorted(by_key)}")
    return {by_key[key]: v for key, v in cfg.items()}


@dataclass(frozen=True)
class SegmentRule:
    """K segments of dense weights (decides the bits; see :func:`tc_linear.nseg_for`): split K until
    ``ceil(N/64) * nseg >= target`` decode programs (64 weight rows each), at most ``max_segments``
    segments, whole decode chunks per segment. ``long_k``: a weight whose tiles alone fill the GPU
    still splits a K of at least ``long_k`` in two (None: off); the native decode then runs the
    halves on two warpgroups of one CTA (:func:`native.fused_segments`). H200, N = K = 8192
    (BENCHMARKS.md, 2026-12-02): decode M = 16 ~2.7x cuBLAS bf16 (one segment: ~2.3x), at the cost of
    M = 33-64 (two segments across CTAs + reduce, ~20% slower than one segment, still ~1.5x faster
    than bf16) and of the M = 8192 prefill (two launches, ~1.2x cuBLAS instead of ~1.07x). It changes
    only shapes with at least ``target`` tiles (N > 8128) and K >= 8192 (70B-class projections; in
    Qwen3 up to 32B and Llama-3-8B every weight with K >= 8192 has N <= 5120, hence two segments by
    ``target`` already); a sampler that decodes more than 32 rows per step at such shapes can set it
    to None (both engines alike: it decides the bits). ``target`` 128 and ``max_segments`` 8 were
    chosen from the H200 runs of BENCHMARKS.md (``bench/probe_nvfp4.py --only nseg``)."""

    target: int = 128
    max_segments: int = 8
    long_k: int | None = 8192


@dataclass(frozen=True)
class DecodeTuning:
    """Overrides of the Triton decode config (:func:`tc_linear.decode_config`; None: the shape's
    default) and the native switch. ``nseg`` (bench/probe only) forces the decode's K segments
    (changes the bits; the native kernel then does not run). ``native`` False: the Triton decode
    kernels even where the CUDA C++ one could run (same bits)."""

    swap: bool | None = None
    bn: int | None = None
    bm: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    use_asm: bool | None = None
    cpi: int | None = None
    nseg: int | None = None
    native: bool = True

    def overrides(self) -> dict[str, Any]:
        """The set fields as the config keys of :func:`tc_linear.decode_config`."""
        return {key: getattr(self, f) for f, key in _DECODE_KEYS.items() if getattr(self, f) is not None}

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> DecodeTuning:
        """From config keys as :func:`tc_linear.decode_config` spells them (``{"SWAP": False, "BN": 32}``;
        ``"NATIVE"`` for :attr:`native`), as the benches write their candidates."""
        return cls(**_fields(cfg, {**_DECODE_KEYS, "native": "NATIVE"}))


@dataclass(frozen=True)
class PrefillTuning:
    """The prefill path: tile overrides of :func:`tc_linear.prefill_config` (None: the default);
    ``flat``: one K loop across the segments (False: the old loop per segment, for the side-by-side
    probe); ``two_launch``: the prefill of two-segment dense weights as two launches of the
    one-segment tile (H200 2026-12-01 21:11, M = 4096: Qwen3-8B (4096, 4096) 1.45x -> 1.26x cuBLAS,
    (4096, 12288) 1.44x -> 1.06x, same bits); ``partial_bytes``: the bound of its fp32 buffer of
    segment 0's sums (M x N x 4 bytes, in row blocks above it); ``decode_weights``: dense weights
    decoded in registers from their codes and scale bytes (``gemm_tc._w_dec``) instead of read from the
    fp16 operand ``TCWeight.op()`` (2 bytes per weight kept in memory from the first prefill on): the
    same operand values, so the same bits (interpreter tests); off until a GPU run has timed it.
    ``split_epilogue``: the two-launch prefill's second launch runs its epilogue (segment 0's sums
    read back, added, scaled, stored) on the tile's column halves one after the other, so fewer
    registers are live at once: 254 registers and no spill instead of 255 and 94 bytes spilled; the same
    bits (interpreter test; ``torch.equal`` on the H100). On by default since round 17 (H100, CUDA
    graphs, weights resident, GEMM alone at M = 8192): faster in seven of eight paired comparisons, 2-12%
    at the Qwen3-8B shapes; at N = K = 8192 -10.5%, -3.0%, +4.4% (BENCHMARKS.md, issue 28 round 17)."""

    bm: int | None = None
    bn: int | None = None
    bk: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    group_m: int | None = None
    flat: bool = True
    two_launch: bool = True
    partial_bytes: int = 256 << 20
    decode_weights: bool = False
    split_epilogue: bool = True

    def overrides(self) -> dict[str, Any]:
        """The set tile fields as the config keys of :func:`tc_linear.prefill_config`."""
        return {key: getattr(self, f) for f, key in _PREFILL_KEYS.items() if getattr(self, f) is not None}

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> PrefillTuning:
        """From config keys as :func:`tc_linear.prefill_config` spells them (``{"BN": 128}``; ``"FLAT"``,
        ``"TWO_LAUNCH"``, ``"PARTIAL_BYTES"``, ``"DECODE_WEIGHTS"``, ``"SPLIT_EPILOGUE"`` for the other fields)."""
        return cls(**_fields(cfg, {**_PREFILL_KEYS, "flat": "FLAT", "two_launch": "TWO_LAUNCH",
                                   "partial_bytes": "PARTIAL_BYTES", "decode_weights": "DECODE_WEIGHTS",
                                   "split_epilogue": "SPLIT_EPILOGUE"}))


@dataclass(frozen=True)
class NativeTuning:
    """The CUDA C++ decode GEMM (:mod:`native`): ``variant`` (None: :func:`native.default_variant`, 15 on
    sm_90, else 14; see :data:`native.VARIANTS`, all the same bits); ``ks2`` forces the in-CTA K
    segments on or off (None: :func:`native.fills_gpu` decides)."""

    variant: int | None = None
    ks2: bool | None = None


@dataclass(frozen=True)
class GemmTuning:
    """Everything that tunes the recipes' NVFP4 GEMM, in one value."""

    segments: SegmentRule = field(default_factory=SegmentRule)
    decode: DecodeTuning = field(default_factory=DecodeTuning)
    prefill: PrefillTuning = field(default_factory=PrefillTuning)
    native: NativeTuning = field(default_factory=NativeTuning)

    def with_(self, **parts: Any) -> GemmTuning:
        """A copy with some parts replaced, each given as a dataclass or as a dict of its fields
        (``DEFAULT.with_(decode={"native": False})``)."""
        out: dict[str, Any] = {}
        for name, v in parts.items():
            cur = getattr(self, name)
            out[name] = replace(cur, **v) if isinstance(v, dict) else v
        return replace(self, **out)


DEFAULT = GemmTuning()
