"""The one-pass comparison kernel (analysis/pair_stats.py) against the numpy definitions it replaces
in op_errors: maxima and ULP distances exactly, float64 sums to 1e-12 relative (summation order)."""

from __future__ import annotations

import math

import pytest
import torch

from mismatch_probe.analysis.op_errors import decode_buffer, error_stats, ulp_distance_buffers
from mismatch_probe.analysis.pair_stats import pair_stats

BITS = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32, "float64": torch.int64}


@pytest.mark.parametrize("dtype", list(BITS))
def test_pair_stats_equal_the_numpy_path(dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    t = getattr(torch, dtype)
    ref = (torch.randn(64, 333, generator=g) * 10).to(t)
    got = ref + (torch.randn(64, 333, generator=g) * 0.01).to(t)
    ref[0, 0], got[1, 1], got[3, 3] = float("inf"), float("nan"), -0.0  # non-finite: 0 in both; a signed zero
    ref[2, :5] = 0
    ref[4, 4] = 1e-7 if dtype == "float16" else 1e-40  # subnormal
    rb, gb = (x.reshape(-1).view(BITS[dtype]).numpy().tobytes() for x in (ref, got))
    want = error_stats(decode_buffer(gb, 64, dtype), decode_buffer(rb, 64, dtype))
    want["max_ulp"] = ulp_distance_buffers(gb, rb, dtype)
    out = pair_stats(rb, gb, dtype)
    assert out["max_abs_diff"] == want["max_abs_diff"] and out["max_ulp"] == want["max_ulp"]
    for k in ("mean_abs_diff", "rel_l2", "cosine", "sqnr_db"):
        assert math.isclose(out[k], want[k], rel_tol=1e-12), (k, out[k], want[k])


def test_pair_stats_of_equal_rows() -> None:
    x = torch.randn(8, 16).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    out = pair_stats(x, x, "bfloat16")
    assert out["max_abs_diff"] == 0.0 and out["max_ulp"] == 0.0 and out["rel_l2"] == 0.0 and out["cosine"] == 1.0
    assert math.isinf(out["sqnr_db"])
