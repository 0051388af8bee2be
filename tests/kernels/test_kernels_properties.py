"""Property tests (hypothesis): round-trip error bound, monotonicity, Triton == reference.

Examples are drawn by the hypothesis profile of tests/conftest.py: "ci" (default, the same examples
every run) or "dev" (``HYPOTHESIS_PROFILE=dev``: a fresh random search each run).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mismatch_probe.kernels.nvfp4 import ref as R

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw, max_rows: int = 4, max_blocks: int = 3):
    rows = draw(st.integers(1, max_rows))
    k = 16 * draw(st.integers(1, max_blocks))
    vals = draw(st.lists(finite, min_size=rows * k, max_size=rows * k))
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30]))
    x = torch.tensor(np.array(vals, dtype=np.float32).reshape(rows, k)) * scale
    return x.clamp(-3e38, 3e38)


FLT_MAX = float(torch.finfo(torch.float32).max)
AMAX_MIN = 2688 / FLT_MAX  # about 7.9e-36: below it S_enc = 2688 / amax would exceed FLT_MAX


@settings(max_examples=200, deadline=None)
@given(x=matrices(), per_token=st.booleans())
# found by hypothesis on main (2026-12-01): one fp32 subnormal in an otherwise zero row, per-tensor
@example(x=torch.tensor([[2.2421e-44] + [0.0] * 15]), per_token=False).via("regression: fp32 subnormal amax")
@example(x=torch.tensor([[1e-37] * 16, [3e-36] * 16]), per_token=True).via("regression: rows below AMAX_MIN")
def test_round_trip_error_bound(x, per_token):
    """Round trip |x - dequant(quant(x))| within the format's precision, where NVFP4 can hold x.

    In range (the scaling domain's amax >= AMAX_MIN = 2688 / FLT_MAX, about 7.9e-36): at most
    0.2 * vmax of the block (E2M1 rounding, scale rounding) + 6 * 2^-9 * amax / 2688 (blocks whose
    E4M3 scale is subnormal or 0).

    Below AMAX_MIN (e.g. fp32 subnormals such as 2.2421e-44 alone in a zero tensor) NVFP4 cannot
    represent the data: the encode scale S_enc = 2688 / amax is capped at FLT_MAX, but the decode
    scale (amax / 2688, in dequantize and in the GEMM's alpha) is not, so the values come back
    smaller by r = amax * FLT_MAX / 2688 < 1 (to 0 for subnormals). There the spec promises only
    the sign (never flipped) and |x - x_hat| <= vmax + 2 * (the in-range bound), plus fp32
    subnormal rounding of the decode products (at most 2^-149 per value)."""
    q = R.nvfp4_quantize_ref(x, per_token=per_token)
    d = R.nvfp4_dequantize_ref(q).double()
    xd = x.double()
    vmax = xd.abs().reshape(x.shape[0], -1, 16).amax(2).repeat_interleave(16, dim=1)
    amax = xd.abs().amax(dim=1, keepdim=True) if per_token else xd.abs().max()
    in_range = 0.2 * vmax + 6 * 2.0**-9 * amax / 2688 + 1e-300
    bound = torch.where(amax >= AMAX_MIN, in_range, vmax + 2 * in_range + 2.0**-149)
    assert torch.all((d - xd).abs() <= bound * (1 + 1e-6))
    assert torch.all(d * xd >= 0)  # the sign is kept (or the value becomes 0)


@settings(max_examples=200, deadline=None)
@given(vals=st.lists(finite, min_size=16, max_size=16), amax_extra=st.floats(0, 1e5))
def test_monotone_within_a_block(vals, amax_extra):
    """Inside one block (one scale) quantize-dequantize is monotone non-decreasing."""
    x = torch.tensor(sorted(vals), dtype=torch.float32)
    row = torch.cat([x, torch.tensor([amax_extra] + [0.0] * 15)]).reshape(1, 32)
    d = R.nvfp4_dequantize_ref(R.nvfp4_quantize_ref(row))[0, :16]
    assert torch.all(d[1:] >= d[:-1])


@settings(max_examples=100, deadline=None)
@given(x=st.floats(0, 448, allow_nan=False, width=32))
def test_scale_rounding_is_torch_e4m3_rne(x):
    """The spec's scale rounding (torch float8_e4m3fn cast, RNE) is monotone and within half an ulp."""
    v = torch.tensor([x], dtype=torch.float32)
    r = v.to(torch.float8_e4m3fn).float().item()
    up = torch.nextafter(v, torch.tensor([1e9])).to(torch.float8_e4m3fn).float().item()
    assert up >= r
    assert abs(r - x) <= max(abs(x) / 16, 2.0**-10) + 1e-12


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=matrices(max_rows=3, max_blocks=2), per_token=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_triton_quantize_equals_reference_bitwise(x, per_token, dtype):
    """Triton kernel (interpreter on CPU, CUDA on GPU) == reference, bit for bit."""
    from mismatch_probe.kernels import nvfp4_quantize
    from mismatch_probe.kernels.nvfp4.common import INTERPRET

    dev = "cpu" if INTERPRET else "cuda"
    xd = x.to(dtype).to(dev)
    a, b = nvfp4_quantize(xd, per_token=per_token), R.nvfp4_quantize_ref(xd, per_token=per_token)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.amax, b.amax)
