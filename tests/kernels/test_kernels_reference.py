"""Reference (spec) unit tests: hand-worked examples from docs/nvfp4.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_probe.kernels.conformance import quantize_variant
from mismatch_probe.kernels.nvfp4 import ref as R


def _codes(q: R.NVFP4Tensor) -> list[int]:
    return R.unpack_codes(q.codes).reshape(-1).tolist()


def test_constants_are_the_spec_bits():
    assert np.float32(R.RCP6).view(np.uint32) == 0x3E2AAAAB
    assert float(np.float32(R.RCP2688)) == R.RCP2688
    assert float(np.float32(R.FLT_MAX)) == R.FLT_MAX


@pytest.mark.parametrize(
    ("y", "code"),
    [
        (0.25, 0), (0.2500001, 1), (0.75, 2), (0.7499999, 1), (1.25, 2), (1.2500001, 3), (1.75, 4),
        (2.5, 4), (2.5000002, 5), (3.5, 6), (3.4999998, 5), (5.0, 6), (5.0000005, 7), (6.0, 7),
        (-0.25, 8), (-0.75, 10), (-5.0, 14), (-6.0, 15), (0.0, 0), (-0.0, 0), (-1e-6, 8),
    ],
)
def test_e2m1_round_to_nearest_even_thresholds(y, code):
    assert R.e2m1_round(torch.tensor([y], dtype=torch.float32)).item() == code


def test_tie_values_quantize_exactly_when_scale_is_one():
    # amax = 6 * 448 -> S_enc = 1; the block holding 6.0 gets sf = e4m3(6 * RN(1/6)) = 1, enc = 1
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
    x = torch.tensor([ties + [2688.0] + [0.0] * 15], dtype=torch.float32)
    q = R.nvfp4_quantize_ref(x)
    assert q.amax.item() == 2688.0
    assert q.scales[0, 0].item() == 0x38  # E4M3 1.0
    assert _codes(q)[:16] == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]


def test_packing_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = R.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(R.unpack_codes(packed), codes)


def test_zero_scale_block_te_saturates_vllm_writes_zero():
    x = torch.zeros(1, 32)
    x[0, 0] = 1e4
    x[0, 16:] = 1e-6  # block 1: vmax * mult far below the smallest E4M3 subnormal -> sf = 0
    q = R.nvfp4_quantize_ref(x)
    assert q.scales[0, 1].item() == 0
    assert set(_codes(q)[16:]) == {7}  # enc = FLT_MAX: codes saturate to +6 ...
    assert torch.all(R.nvfp4_dequantize_ref(q)[0, 16:] == 0)  # ... and dequantize to 0 anyway
    v = quantize_variant(x, "vllm_cuda")
    assert set(R.unpack_codes(v.codes).reshape(-1)[16:].tolist()) == {0}


def test_negative_zero_and_tiny_negatives():
    x = torch.tensor([[-0.0] * 8 + [1.0] + [-1e-6] * 7], dtype=torch.float32)
    assert _codes(R.nvfp4_quantize_ref(x)) == [0] * 8 + [7] + [8] * 7  # 1.0 is the block max -> 6


def test_all_zero_tensor():
    q = R.nvfp4_quantize_ref(torch.zeros(2, 32, dtype=torch.bfloat16), per_token=True)
    assert q.amax.tolist() == [0.0, 0.0]
    assert int(q.codes.sum()) == 0 and int(q.scales.sum()) == 0
    assert torch.equal(R.nvfp4_dequantize_ref(q), torch.zeros(2, 32))


def test_dequant_formula_by_hand():
    x = torch.tensor([[3.0] + [0.0] * 15], dtype=torch.float32)
    q = R.nvfp4_quantize_ref(x)
    # amax 3: S_enc = 896, mult = 896 * RN(1/6), sf = e4m3(3 * mult) = 448, enc = 1/(448/896) = 2
    assert q.scales[0, 0].item() == 0x7E  # 448
    assert _codes(q)[0] == 7  # y = 6
    sf, amax = np.float32(448.0), np.float32(3.0)
    want = np.float32(6.0) * ((sf * amax) * np.float32(R.RCP2688))
    assert R.nvfp4_dequantize_ref(q)[0, 0].item() == float(want)


def test_per_token_rows_are_independent():
    x = torch.randn(5, 64)
    q = R.nvfp4_quantize_ref(x, per_token=True)
    q2 = R.nvfp4_quantize_ref(x[2:3], per_token=True)
    assert torch.equal(q.codes[2:3], q2.codes) and torch.equal(q.scales[2:3], q2.scales)


def test_tile16_shares_scale_over_16_rows():
    x = torch.randn(32, 64)
    q = R.nvfp4_quantize_ref(x, tile16=True)
    assert torch.equal(q.scales[0], q.scales[15]) and torch.equal(q.scales[16], q.scales[31])


def test_nan_inf_policy_flags_block():
    x = torch.randn(2, 48)
    x[0, 20] = float("nan")
    x[1, 40] = float("inf")
    q = R.nvfp4_quantize_ref(x, per_token=True)
    assert q.scales[0, 1].item() == R.SCALE_NAN_BYTE and q.scales[1, 2].item() == R.SCALE_NAN_BYTE
    assert torch.isfinite(q.amax).all()
    d = R.nvfp4_dequantize_ref(q)
    assert torch.isnan(d[0, 16:32]).all() and torch.isfinite(d[0, :16]).all() and torch.isfinite(d[0, 32:]).all()
    with pytest.raises(ValueError, match="NaN/Inf"):
        R.nvfp4_quantize_ref(x, nonfinite="error")


def test_swizzle_offsets_by_hand():
    s = torch.zeros(256, 8, dtype=torch.uint8)
    for m, k, v in ((0, 0, 1), (1, 0, 2), (32, 0, 3), (0, 1, 4), (0, 4, 5), (128, 0, 6)):
        s[m, k] = v
    swz = R.swizzle_scales_ref(s)
    # ((m/128)*(Kp/4) + k/4)*512 + (m%32)*16 + ((m/32)%4)*4 + k%4 with Kp = 8
    for off, v in ((0, 1), (16, 2), (4, 3), (1, 4), (512, 5), (1024, 6)):
        assert swz[off].item() == v
    assert torch.equal(R.unswizzle_scales_ref(swz, 256, 8), s)


def test_gemm_ref_close_to_float_matmul():
    x, w = torch.randn(8, 256), torch.randn(32, 256)
    qx, qw = R.nvfp4_quantize_ref(x, per_token=True), R.nvfp4_quantize_ref(w)
    got = R.w4a4_gemm_ref(qx, qw, torch.float32)
    want = R.nvfp4_dequantize_ref(qx).double() @ R.nvfp4_dequantize_ref(qw).double().t()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize(
    ("bad", "exc", "msg"),
    [
        (torch.randn(2, 20), ValueError, "multiple of 16"),
        (torch.randn(32), ValueError, "2-D"),
        (torch.randint(0, 5, (2, 32)), TypeError, "bfloat16, float16 or float32"),
    ],
)
def test_reference_bad_input(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        R.nvfp4_quantize_ref(bad)


def test_reference_bad_amax_shape():
    with pytest.raises(ValueError, match="expected 3"):
        R.nvfp4_quantize_ref(torch.randn(3, 32), per_token=True, amax=torch.ones(2))


def test_conformance_loader_npy(tmp_path):
    from mismatch_probe.kernels.conformance import disagreement, load_tensor

    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((2, 3, 32)).astype(np.float32))
    x = load_tensor(str(tmp_path / "x.npy"))
    assert x.shape == (6, 32)
    rows = disagreement(x)
    assert rows[0]["codes_differ"] == 0.0 and len(rows) == 6
