"""Property tests (hypothesis): round-trip error bound, monotonicity, Triton == reference."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mismatch_probe.kernels import nvfp4_ref as R

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw, max_rows: int = 4, max_blocks: int = 3):
    rows = draw(st.integers(1, max_rows))
    k = 16 * draw(st.integers(1, max_blocks))
    vals = draw(st.lists(finite, min_size=rows * k, max_size=rows * k))
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30]))
    x = torch.tensor(np.array(vals, dtype=np.float32).reshape(rows, k)) * scale
    return x.clamp(-3e38, 3e38)


@settings(max_examples=200, deadline=None)
@given(x=matrices(), per_token=st.booleans())
def test_round_trip_error_bound(x, per_token):
    """|x - dequant(quant(x))| <= 0.2 * vmax_block + 6 * 2^-9 * amax / 2688 (subnormal / zero scales)."""
    q = R.nvfp4_quantize_ref(x, per_token=per_token)
    d = R.nvfp4_dequantize_ref(q).double()
    xd = x.double()
    vmax = xd.abs().reshape(x.shape[0], -1, 16).amax(2).repeat_interleave(16, dim=1)
    amax = xd.abs().amax(dim=1, keepdim=True) if per_token else xd.abs().max()
    bound = 0.2 * vmax + 6 * 2.0**-9 * amax / 2688 + 1e-300
    assert torch.all((d - xd).abs() <= bound * (1 + 1e-6))


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
    from mismatch_probe.kernels._triton_common import INTERPRET

    dev = "cpu" if INTERPRET else "cuda"
    xd = x.to(dtype).to(dev)
    a, b = nvfp4_quantize(xd, per_token=per_token), R.nvfp4_quantize_ref(xd, per_token=per_token)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.amax, b.amax)
