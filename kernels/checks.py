"""Named checks of the NVFP4 kernels against the pure-torch reference.

Used by ``mismatch-probe kernels check`` and by the tests. Every check says what kind it is, with
no default: ``Exact(...)`` checks compare raw bits with ``torch.equal`` (codes, scale bytes, amax,
outputs viewed as integers; atol = rtol = 0); ``Tolerance(...)`` checks compare within a bound that
the check states (``bound``), and are labelled "tolerance" with that bound wherever they are shown.
On a machine without CUDA they run through the Triton interpreter on CPU with small shapes; there
the GEMM's ``tl.dot`` takes fp32 operands (exact for E2M1 x E4M3 values; the interpreter's bf16 dot
is wrong), so checks named ``gemm_*`` cover the bf16 tensor-core path only on the GPU. Checks
marked GPU-only are skipped on CPU (too large for the interpreter).

The ``gemm_*`` and ``grouped_*`` checks run the exact per-16-block Triton GEMMs of
:mod:`.nvfp4.reference` (cross-checks, bitwise against :func:`.nvfp4.ref.w4a4_gemm_ref`); the
``tc_*`` checks run the recipes' GEMM, :mod:`.nvfp4.tc_linear` (tolerance against the reference,
bitwise properties among its paths).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .nvfp4 import ref as R
from .nvfp4.common import INTERPRET
from .nvfp4.tuning import DEFAULT, GemmTuning


@dataclass
class Check:
    """One named check. ``exact`` has no default: build checks with ``Exact`` or ``Tolerance``."""

    name: str
    what: str
    fn: Callable[..., str]  # fn(device, big) -> detail; the tc_* checks also take tuning=GemmTuning
    exact: bool
    bound: str = ""  # the tolerance, in words ("max |diff| <= 1 bf16 ulp"); empty for exact checks
    gpu_only: bool = False

    @property
    def tuned(self) -> bool:
        """A check of the recipes' GEMM (tc_linear): it runs under a given :class:`GemmTuning`."""
        return self.name.startswith("tc_")

    def __post_init__(self) -> None:
        if self.exact == bool(self.bound):
            raise ValueError(f"check {self.name}: an exact check has no bound, a tolerance check must state one")


def Exact(name: str, what: str, fn: Callable[[torch.device, bool], str], gpu_only: bool = False) -> Check:  # noqa: N802
    """A bitwise check: raw bits compared with torch.equal (atol = rtol = 0)."""
    return Check(name, what, fn, exact=True, gpu_only=gpu_only)


def Tolerance(name: str, what: str, fn: Callable[[torch.device, bool], str], bound: str,  # noqa: N802
              gpu_only: bool = False) -> Check:
    """A check within a stated tolerance ``bound``; never labelled bitwise."""
    return Check(name, what, fn, exact=False, bound=bound, gpu_only=gpu_only)


def kind_label(exact: bool, bound: str = "") -> str:
    """How a check's comparison is shown: "bitwise (atol=rtol=0)" only for exact checks."""
    return "bitwise (atol=rtol=0)" if exact else f"tolerance ({bound})"


@dataclass
class CheckResult:
    name: str
    what: str
    status: str  # "pass" | "fail" | "skip"
    detail: str
    seconds: float
    exact: bool
    bound: str = ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_equal_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    ba, bb = _bits(a.contiguous()), _bits(b.contiguous())
    if not torch.equal(ba, bb):
        n = int((ba != bb).sum())
        extra = ""
        if a.is_floating_point():
            af, bf = a.float(), b.float()
            d = (af - bf).abs()
            d = torch.where(torch.isnan(d), torch.zeros_like(d), d)
            extra = f"; max |diff| {d.max().item():.3g}, rel L2 {(d.norm() / bf.norm().clamp_min(1e-30)).item():.3g}"
        raise AssertionError(f"{what}: {n} of {a.numel()} elements differ bitwise{extra}")


def assert_same_q(a: R.NVFP4Tensor, b: R.NVFP4Tensor) -> str:
    assert_equal_bits(a.codes, b.codes, "codes")
    assert_equal_bits(a.scales, b.scales, "scales")
    assert_equal_bits(a.amax.reshape(-1), b.amax.reshape(-1), "amax")
    return f"codes {tuple(a.codes.shape)}, scales {tuple(a.scales.shape)} equal"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _q_check(make: Callable[[], torch.Tensor], **kw) -> Callable[[torch.device, bool], str]:
    def run(dev: torch.device, big: bool) -> str:
        from .nvfp4.triton_quant import nvfp4_quantize

        x = make().to(dev)
        kwd = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        return assert_same_q(nvfp4_quantize(x, **kwd), R.nvfp4_quantize_ref(x, **kwd))

    return run


def _randn(rows: int, k: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> Callable[[], torch.Tensor]:
    return lambda: (torch.randn(rows, k, generator=_gen(seed)) * scale).to(dtype)


def _ties() -> torch.Tensor:
    # amax = 2688 -> S_enc = 1; a block holding 6 gets sf = 1 and enc = 1: y == x exactly.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = [6.0] + ties + [-t for t in ties] + [0.0]
    x = torch.tensor(row * 4, dtype=torch.float32).reshape(1, 64).repeat(3, 1)
    x[2, 48] = 2688.0
    return x.to(torch.bfloat16)


def _extremes() -> torch.Tensor:
    x = torch.randn(4, 64, generator=_gen(3))
    x[0] = x[0] * 6 * 448 * 1e-3
    x[0, 0] = 6 * 448 * 1e-3
    x[1] = x[1] * 3.0e38 / 4
    x[1, 5] = 3.4e38
    x[2] = x[2] * 1e-38
    x[3, :16] = 2688.0
    x[3, 16:32] = -2688.0
    return x


def _subnormal_scales() -> torch.Tensor:
    x = torch.randn(4, 256, generator=_gen(4)) * 1e-3
    x[:, 0] = 100.0  # amax 100: blocks of ~1e-3 get E4M3 scales in the subnormal range
    return x.to(torch.bfloat16)


def _zero_scale() -> torch.Tensor:
    x = torch.randn(2, 64, generator=_gen(5)) * 1e-6
    x[:, 0] = 1e4  # blocks 1..3 round to sf == 0 while holding non-zero values
    return x


def _neg_zero() -> torch.Tensor:
    x = torch.zeros(2, 32)
    x[0, :16] = -0.0
    x[0, 16] = 1.0
    x[0, 17:32] = -1e-6  # rounds to zero: code 8 (-0)
    x[1] = -0.0
    return x.to(torch.bfloat16)


def _nonfinite() -> torch.Tensor:
    x = torch.randn(3, 64, generator=_gen(6))
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[2, 40] = float("-inf")
    return x.to(torch.bfloat16)


def _bf16_subnormal() -> torch.Tensor:
    x = torch.zeros(2, 32)
    x[0, 0] = 3.6734e-40  # amax itself a bf16 subnormal: S_enc overflows to FLT_MAX
    x[1, :16] = torch.linspace(-1e-38, 1e-38, 16)
    x[1, 16] = 1.0
    return x.to(torch.bfloat16)


def _equal_blocks() -> torch.Tensor:
    vals = torch.tensor([0.1, -3.0, 7.5, 1e-3], dtype=torch.float32)
    return vals.repeat_interleave(16).reshape(1, 64).repeat(5, 1).to(torch.float16)


def _heavy() -> torch.Tensor:
    g = _gen(7)
    return (torch.randn(16, 512, generator=g) * torch.exp(torch.randn(16, 512, generator=g) * 2)).to(torch.bfloat16)


def _dequant_check(per_token: bool, dtype: torch.dtype, apply_global: bool = True):
    def run(dev: torch.device, big: bool) -> str:
        from .nvfp4.triton_quant import nvfp4_dequantize

        x = torch.randn(9, 128, generator=_gen(8)).to(dev)
        q = R.nvfp4_quantize_ref(x, per_token=per_token)
        got = nvfp4_dequantize(q, dtype, apply_global=apply_global)
        if apply_global:
            want = R.nvfp4_dequantize_ref(q, dtype)
        else:
            want = R.block_dequant_operand(q).to(dtype)
        assert_equal_bits(got, want, "dequantized")
        return f"{dtype} {tuple(got.shape)} equal"

    return run


def _rmsnorm_check(dev: torch.device, big: bool) -> str:
    from .nvfp4.triton_quant import rmsnorm_nvfp4_quantize

    k = 4096 if big else 1024
    x = torch.randn(5, k, generator=_gen(9)).to(torch.bfloat16).to(dev)
    w = (1 + 0.1 * torch.randn(k, generator=_gen(10))).to(torch.bfloat16).to(dev)
    y, q = rmsnorm_nvfp4_quantize(x, w)
    y_ref = R.rmsnorm_ref(x, w, 1e-6)  # torch's RMSNorm, independent of the kernel's output
    assert_equal_bits(y, y_ref, "RMSNorm output vs torch RMSNorm")
    return assert_same_q(q, R.nvfp4_quantize_ref(y_ref, per_token=True)) + "; y equal to torch RMSNorm"


def _weights(n: int, k: int, seed: int, **kw) -> R.NVFP4Tensor:
    return R.nvfp4_quantize_ref(torch.randn(n, k, generator=_gen(seed)), **kw)


def _gemm_check(m: int, path: str, tile16: bool = False, k: int = 256, n: int = 48):
    def run(dev: torch.device, big: bool) -> str:
        from .nvfp4.reference.aligned_linear import aligned_linear

        kk, nn = (k * 8, n * 32) if big and k <= 256 else (k, n)
        w = _weights(nn, kk, 11, tile16=tile16)
        w = R.NVFP4Tensor(w.codes.to(dev), w.scales.to(dev), w.amax.to(dev))
        x = torch.randn(m, kk, generator=_gen(12)).to(torch.bfloat16).to(dev)
        got = aligned_linear(x, w, path=path)
        assert_equal_bits(got, R.w4a4_gemm_ref(R.nvfp4_quantize_ref(x, per_token=True), w), "output")
        return f"M={m} N={nn} K={kk} path={path} equal"

    return run


def _invariance_check(dev: torch.device, big: bool) -> str:
    from .nvfp4.reference.aligned_linear import aligned_linear

    ms = (1, 3, 16, 128, 1000, 4096) if big else (1, 3, 16, 20)
    k, n = (2048, 512) if big else (64, 32)
    w = _weights(n, k, 13)
    w = R.NVFP4Tensor(w.codes.to(dev), w.scales.to(dev), w.amax.to(dev))
    x = torch.randn(max(ms), k, generator=_gen(14)).to(torch.bfloat16).to(dev)
    full = aligned_linear(x, w)
    qx = R.nvfp4_quantize_ref(x, per_token=True)
    for m in ms:
        got = aligned_linear(x[:m], w)
        assert_equal_bits(got, full[:m], f"rows of M={m} vs M={max(ms)}")
        rows = min(m, 64)
        sub = R.NVFP4Tensor(qx.codes[:rows], qx.scales[:rows], qx.amax[:rows], True)
        assert_equal_bits(got[:rows], R.w4a4_gemm_ref(sub, w), f"M={m}: first rows vs reference")
    return f"M in {ms} (auto paths): identical rows, equal to the reference"


def _grouped_setup(dev: torch.device, big: bool, t: int):
    from .nvfp4.moe import GroupedNVFP4Weights, quantize_expert_weights

    e, n, k, top = (16, 256, 512, 4) if big else (4, 32, 64, 2)
    wq = quantize_expert_weights(torch.randn(e, n, k, generator=_gen(15)), use_ref=True)
    wq = GroupedNVFP4Weights(wq.codes.to(dev), wq.scales.to(dev), wq.amax.to(dev))
    g = _gen(16)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(t)]).to(dev)
    tw = torch.rand(t, top, generator=g).to(dev)
    return x, ids, tw, wq


def _grouped_check(path: str):
    def run(dev: torch.device, big: bool) -> str:
        from .nvfp4.reference.grouped import moe_grouped_linear

        x, ids, tw, wq = _grouped_setup(dev, big, 300 if big else 9)
        got = moe_grouped_linear(x, ids, tw, wq, path=path)
        assert_equal_bits(got, moe_grouped_linear(x, ids, tw, wq, use_ref=True), "MoE output")
        return f"{x.shape[0]} tokens, {wq.codes.shape[0]} experts, path={path}: equal"

    return run


def _grouped_invariance(dev: torch.device, big: bool) -> str:
    from .nvfp4.reference.grouped import moe_grouped_linear

    x, ids, tw, wq = _grouped_setup(dev, big, 300 if big else 9)
    full = moe_grouped_linear(x, ids, tw, wq)
    assert_equal_bits(full, moe_grouped_linear(x, ids, tw, wq, use_ref=True), "full batch vs reference")
    sizes = (1, 3, 16, 128, 300) if big else (1, 3, 9)
    for t in sizes:
        assert_equal_bits(moe_grouped_linear(x[:t], ids[:t], tw[:t], wq), full[:t], f"tokens={t}")
    return f"token counts {sizes}: identical rows (expert loads vary), equal to the reference"


def _amax_reuse_check(dev: torch.device, big: bool) -> str:
    """The kernel given the rows' amax (as a fused producer hands it over) == the kernel computing it
    == the reference computing it."""
    from .nvfp4.triton_quant import nvfp4_quantize

    x = _randn(6, 64, torch.bfloat16, 10)().to(dev)
    given = nvfp4_quantize(x, per_token=True, amax=R.nonfinite_amax(x, True))
    assert_same_q(given, nvfp4_quantize(x, per_token=True))
    return assert_same_q(given, R.nvfp4_quantize_ref(x, per_token=True)) + " (amax given == computed == reference)"


def _swizzle_check(dev: torch.device, big: bool) -> str:
    s = torch.randint(0, 255, (200, 24), generator=_gen(17), dtype=torch.uint8)
    swz = R.swizzle_scales_ref(s)
    # independent formulation (as in vLLM/FlashInfer): pad, view [rp/128, 4, 32, kp/4, 4], permute
    rp, kp = 256, 24
    pad = torch.zeros(rp, kp, dtype=torch.uint8)
    pad[:200] = s
    alt = pad.view(rp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    assert_equal_bits(swz, alt, "swizzled layout")
    assert_equal_bits(R.unswizzle_scales_ref(swz, 200, 24), s, "round trip")
    return "formula == blocked permute; round trip exact"



TC_BOUND = "bf16 out: |got - ref| <= alpha * 2(K/16) 2^-23 sum|a*b| + 1 ulp, >= 99% of elements bit-equal"
TC_MS = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4096, 8192)


def _to(q: R.NVFP4Tensor, dev: torch.device) -> R.NVFP4Tensor:
    return R.NVFP4Tensor(q.codes.to(dev), q.scales.to(dev), q.amax.to(dev), q.per_token, q.tile16)


def tc_within_bound(got: torch.Tensor, a: R.NVFP4Tensor, w: R.NVFP4Tensor) -> str:
    """The GEMM tolerance of docs/nvfp4.md against the exact per-block reference (raises AssertionError)."""
    a_op, b_op = R.block_dequant_operand(a), R.block_dequant_operand(w)
    alpha = R.gemm_alpha(a.row_amax()[:, None], w.row_amax()[None, :])
    ref = R.w4a4_gemm_ref(a, w)
    k = a_op.shape[1]
    bound = alpha * (2 * (k // 16) * 2.0**-23) * (a_op.abs() @ b_op.abs().t())
    rf = ref.float()
    ulp = torch.where(rf == 0, torch.full_like(rf, 2.0**-133), 2.0 ** (torch.floor(torch.log2(rf.abs())) - 7))
    d = (got.float() - rf).abs()
    worst = float((d - bound - ulp).max())
    same = float((got.view(torch.int16) == ref.view(torch.int16)).float().mean())
    if worst > 0 or same < 0.99:
        raise AssertionError(f"outside the GEMM tolerance: worst excess {worst:.3g}, {same * 100:.2f}% bit-equal")
    return f"within the bound, {same * 100:.2f}% bit-equal to the per-block reference"


def _tc_gemm_check(path: str, m: int, n: int, k: int):
    def run(dev: torch.device, big: bool, tuning: GemmTuning = DEFAULT) -> str:
        from .nvfp4.tc_linear import prepare, tc_matmul

        nn_, kk_ = (n * 16, k * 8) if big else (n, k)
        w = _to(_weights(nn_, kk_, 31), dev)
        a = R.nvfp4_quantize_ref(torch.randn(m, kk_, generator=_gen(32)).to(torch.bfloat16).to(dev), per_token=True)
        tw = prepare(w, tuning)
        return f"M={m} N={nn_} K={kk_} path={path} nseg={tw.nseg}: " + tc_within_bound(tc_matmul(a, tw, path=path), a, w)

    return run


def _tc_grouped_check(dev: torch.device, big: bool, tuning: GemmTuning = DEFAULT) -> str:
    from .nvfp4.moe import GroupedNVFP4Weights, gather_rows, moe_route, quantize_expert_weights
    from .nvfp4.tc_linear import prepare, tc_grouped

    e, n, k, top, t = (16, 256, 512, 4, 300) if big else (4, 32, 64, 2, 9)
    wq = quantize_expert_weights(torch.randn(e, n, k, generator=_gen(33)), use_ref=True)
    wq = GroupedNVFP4Weights(wq.codes.to(dev), wq.scales.to(dev), wq.amax.to(dev))
    g = _gen(34)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(t)]).to(dev)
    perm, off = moe_route(ids, e)
    a = gather_rows(R.nvfp4_quantize_ref(x, per_token=True), perm // top)
    tw = prepare(wq, tuning)
    msgs = []
    for path in ("decode", "prefill"):
        y = tc_grouped(a, off, tw, path=path)
        ol = off.tolist()
        for ex in range(e):
            if ol[ex + 1] > ol[ex]:
                sub = R.NVFP4Tensor(a.codes[ol[ex]:ol[ex + 1]], a.scales[ol[ex]:ol[ex + 1]], a.amax[ol[ex]:ol[ex + 1]], True)
                tc_within_bound(y[ol[ex]:ol[ex + 1]], sub, wq.expert(ex))
        msgs.append(path)
    return f"{t} tokens, {e} experts, paths {msgs}: every expert's rows within the bound"


def _tc_rows_identical(dev: torch.device, big: bool, tuning: GemmTuning = DEFAULT) -> str:
    """Rows identical for every M in TC_MS at two row offsets, decode and prefill paths, vs the
    full-M prefill output (and repeated runs identical)."""
    from .nvfp4.tc_linear import prepare, tc_matmul

    n, k = 1024, 1024
    w = _to(_weights(n, k, 35), dev)
    tw = prepare(w, tuning)
    x = torch.randn(max(TC_MS) + 64, k, generator=_gen(36)).to(torch.bfloat16).to(dev)
    a = R.nvfp4_quantize_ref(x, per_token=True)
    full = tc_matmul(a, tw, path="prefill")
    assert_equal_bits(tc_matmul(a, tw, path="prefill"), full, "repeated run")
    for m in TC_MS:
        for off in (0, 37):
            sub = R.NVFP4Tensor(a.codes[off:off + m], a.scales[off:off + m], a.amax[off:off + m], True)
            for path in ("decode", "prefill") if m <= 64 else ("prefill",):
                assert_equal_bits(tc_matmul(sub, tw, path=path), full[off:off + m], f"M={m} at row {off}, {path}")
    return f"N=K={n} (nseg {tw.nseg}): {len(TC_MS)} values of M x 2 offsets, decode and prefill: identical rows"


def _tc_grouped_eq_per_expert(dev: torch.device, big: bool, tuning: GemmTuning = DEFAULT) -> str:
    from .nvfp4.moe import GroupedNVFP4Weights, gather_rows, moe_route, quantize_expert_weights
    from .nvfp4.tc_linear import prepare, tc_grouped, tc_matmul

    e, n, k, top, t = 16, 256, 512, 4, 300
    wq = quantize_expert_weights(torch.randn(e, n, k, generator=_gen(37)), use_ref=True)
    wq = GroupedNVFP4Weights(wq.codes.to(dev), wq.scales.to(dev), wq.amax.to(dev))
    g = _gen(38)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(t)]).to(dev)
    perm, off = moe_route(ids, e)
    a = gather_rows(R.nvfp4_quantize_ref(x, per_token=True), perm // top)
    tw = prepare(wq, tuning)
    ol = off.tolist()
    y0 = tc_grouped(a, off, tw, path="prefill")
    for path in ("decode", "prefill"):
        y = tc_grouped(a, off, tw, path=path)
        assert_equal_bits(y, y0, f"grouped {path} vs grouped prefill")
        for ex in range(e):
            if ol[ex + 1] > ol[ex]:
                sub = R.NVFP4Tensor(a.codes[ol[ex]:ol[ex + 1]], a.scales[ol[ex]:ol[ex + 1]], a.amax[ol[ex]:ol[ex + 1]], True)
                assert_equal_bits(tc_matmul(sub, tw.expert(ex), path=path), y[ol[ex]:ol[ex + 1]], f"expert {ex} {path}")
    return f"{t} tokens x top-{top}, {e} experts: grouped == per-expert calls, decode == prefill"


CHECKS: list[Check] = [
    Exact("quant_bf16_per_tensor_1x16", "bf16 randn 33x256, per-tensor", _q_check(_randn(33, 256, torch.bfloat16))),
    Exact("quant_fp16_per_tensor_1x16", "fp16 randn 17x128, per-tensor", _q_check(_randn(17, 128, torch.float16, 1))),
    Exact("quant_fp32_per_tensor_1x16", "fp32 randn 9x512, per-tensor", _q_check(_randn(9, 512, torch.float32, 2))),
    Exact("quant_bf16_per_token_1x16", "bf16 33x256, per-token", _q_check(_randn(33, 256, torch.bfloat16), per_token=True)),
    Exact("quant_fp16_per_token_1x16", "fp16 17x128, per-token", _q_check(_randn(17, 128, torch.float16, 1), per_token=True)),
    Exact("quant_fp32_per_token_1x16", "fp32 9x512, per-token", _q_check(_randn(9, 512, torch.float32, 2), per_token=True)),
    Exact("quant_one_row", "1 row, K=4096, per-token", _q_check(_randn(1, 4096, torch.bfloat16, 3), per_token=True)),
    Exact("quant_odd_rows", "7 rows x K=48 (odd rows, K not a power of 2)", _q_check(_randn(7, 48, torch.bfloat16, 4))),
    Exact("quant_k16", "K = 16, 65 rows, per-token", _q_check(_randn(65, 16, torch.bfloat16, 5), per_token=True)),
    Exact("quant_large_k_multi_tile", "K = 16400 (> one tile: two-pass row loop), per-token",
          _q_check(_randn(2, 16400, torch.bfloat16, 6), per_token=True)),
    Exact("quant_large_k_per_tensor", "K = 16400, per-tensor", _q_check(_randn(3, 16400, torch.float32, 6))),
    Exact("quant_tile16x16", "16x16 weight tiles, 48x256", _q_check(_randn(48, 256, torch.bfloat16, 7), tile16=True)),
    Exact("quant_tile16x16_partial", "16x16 tiles, 40 rows (partial last tile)",
          _q_check(_randn(40, 96, torch.float32, 8), tile16=True)),
    Exact("quant_zeros", "all-zero tensor, per-tensor", _q_check(lambda: torch.zeros(4, 64, dtype=torch.bfloat16))),
    Exact("quant_zero_rows_per_token", "some all-zero rows, per-token",
          _q_check(lambda: torch.cat([torch.zeros(2, 64), torch.randn(2, 64, generator=_gen(9))]), per_token=True)),
    Exact("quant_all_equal_blocks", "blocks of one repeated value (fp16)", _q_check(_equal_blocks)),
    Exact("quant_e2m1_ties", "values exactly on every E2M1 rounding tie (y == x)", _q_check(_ties)),
    Exact("quant_extremes", "near 6*448*scale, near FLT_MAX, tiny 1e-38 (fp32)", _q_check(_extremes, per_token=True)),
    Exact("quant_subnormal_e4m3_scales", "block scales in the E4M3 subnormal range", _q_check(_subnormal_scales)),
    Exact("quant_scale_rounds_to_zero", "non-zero blocks whose scale rounds to 0 (TE: codes saturate)",
          _q_check(_zero_scale)),
    Exact("quant_bf16_subnormal_inputs", "bf16 subnormal inputs (amax subnormal -> S_enc capped at FLT_MAX)",
          _q_check(_bf16_subnormal, per_token=True)),
    Exact("quant_negative_zero", "-0.0 -> code 0; tiny negatives -> code 8", _q_check(_neg_zero, per_token=True)),
    Exact("quant_nan_inf_flagged", "NaN/Inf policy: flagged blocks (scale 0x7F, codes 0)", _q_check(_nonfinite)),
    Exact("quant_nan_inf_flagged_per_token", "NaN/Inf policy, per-token amax excludes them",
          _q_check(_nonfinite, per_token=True)),
    Exact("quant_heavy_tailed", "heavy-tailed (lognormal-scaled) data", _q_check(_heavy, per_token=True)),
    Exact("quant_amax_reuse", "amax given (reuse) == amax computed", _amax_reuse_check),
    Exact("dequant_fp32_per_tensor", "dequantize to fp32", _dequant_check(False, torch.float32)),
    Exact("dequant_bf16_per_token", "dequantize to bf16 (RNE)", _dequant_check(True, torch.bfloat16)),
    Exact("dequant_fp16", "dequantize to fp16", _dequant_check(True, torch.float16)),
    Exact("dequant_gemm_operand", "E2M1*sf operand in bf16 (no global scale)", _dequant_check(True, torch.bfloat16, False)),
    Exact("rmsnorm_quant_amax_reuse", "fused RMSNorm + per-token quantize: y == torch RMSNorm, q == quantize_ref(it)",
          _rmsnorm_check),
    Exact("gemm_decode_fma_m1", "aligned_linear M=1, packed FP4 operands, CUDA-core FMA", _gemm_check(1, "fma")),
    Exact("gemm_decode_fma_m16", "aligned_linear M=16, CUDA-core FMA path", _gemm_check(16, "fma")),
    Exact("gemm_decode_fp4_m16", "aligned_linear M=16, packed FP4 operands, tensor cores", _gemm_check(16, "fp4")),
    Exact("gemm_decode_fp4w_m16", "aligned_linear M=16, FP4 weights + bf16 activations", _gemm_check(16, "fp4w")),
    Exact("gemm_decode_fp4w_swap_m16", "aligned_linear M=16, swap-AB (weights on MMA M side)",
          _gemm_check(16, "fp4w-swap")),
    Exact("gemm_bf16_operands_m33", "aligned_linear M=33, pre-dequantized bf16 operands", _gemm_check(33, "bf16")),
    Exact("gemm_tile16_weights", "aligned_linear with 16x16-tile weights", _gemm_check(5, "auto", True)),
    Exact("gemm_k16", "aligned_linear K=16", _gemm_check(3, "auto", k=16)),
    Exact("gemm_batch_invariance", "rows identical for every M", _invariance_check),
    Exact("grouped_moe_fp4", "MoE route+grouped GEMM+combine, FP4 operands", _grouped_check("fp4")),
    Exact("grouped_moe_bf16_operands", "MoE grouped GEMM, bf16 operands", _grouped_check("bf16")),
    Exact("grouped_moe_fma", "MoE grouped GEMM, CUDA-core FMA path", _grouped_check("fma")),
    Exact("grouped_batch_invariance", "MoE rows identical for any token count", _grouped_invariance),
    Exact("swizzle_layout", "swizzled scale layout == blocked-permute form; round trip", _swizzle_check),
    Exact("gemm_large_m4096", "aligned_linear M=4096 K=2048 (bf16 tensor cores)", _gemm_check(4096, "auto", k=2048, n=256),
          gpu_only=True),
    # the default (tensor-core) GEMM of tc_linear: tolerance vs the per-block reference, bitwise properties
    Tolerance("tc_gemm_decode_vs_reference", "tensor-core GEMM, decode path, M=16 (K split in segments)",
              _tc_gemm_check("decode", 16, 48, 256), TC_BOUND),
    Tolerance("tc_gemm_prefill_vs_reference", "tensor-core GEMM, prefill path, M=70",
              _tc_gemm_check("prefill", 70, 40, 96), TC_BOUND),
    Tolerance("tc_grouped_vs_reference", "tensor-core grouped MoE GEMM, decode and prefill paths, per expert",
              _tc_grouped_check, TC_BOUND),
    Exact("tc_rows_identical_every_m_and_path", "tensor-core GEMM: rows identical for M in 1..8192 at two offsets, "
          "decode vs prefill, repeated runs", _tc_rows_identical, gpu_only=True),
    Exact("tc_grouped_eq_per_expert", "tensor-core grouped GEMM == per-expert calls, decode == prefill",
          _tc_grouped_eq_per_expert, gpu_only=True),
]


def run_checks(names: list[str] | None = None, device: str | None = None,
               tuning: GemmTuning | None = None) -> list[CheckResult]:
    """Run the checks (all, or those named). GPU-only checks are skipped without CUDA; with CUDA,
    shapes are the larger 'big' variants. ``tuning``: the GEMM tuning the ``tc_*`` checks run under
    (default: the recipes' :data:`tuning.DEFAULT`; the benches pass others, e.g. a native variant)."""
    dev = torch.device(device or ("cpu" if INTERPRET else "cuda"))
    big = dev.type == "cuda"
    known = {c.name for c in CHECKS}
    if names:
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"unknown check(s): {', '.join(bad)}")
    out = []
    for c in CHECKS:
        if names and c.name not in names:
            continue
        if c.gpu_only and dev.type != "cuda":
            out.append(CheckResult(c.name, c.what, "skip", "GPU only (no CUDA here)", 0.0, c.exact, c.bound))
            continue
        t0 = time.perf_counter()
        try:
            kw: dict[str, Any] = {"tuning": tuning} if tuning is not None and c.tuned else {}
            detail, status = c.fn(dev, big, **kw), "pass"
        except AssertionError as e:
            detail, status = str(e), "fail"
        except Exception as e:  # a crash is a failure too, with its reason
            detail, status = f"{type(e).__name__}: {e}", "fail"
        out.append(CheckResult(c.name, c.what, status, detail, time.perf_counter() - t0, c.exact, c.bound))
    return out
