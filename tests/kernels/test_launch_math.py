"""The host-side launch arithmetic equals Triton's (the grids and block sizes the kernels were checked with)."""

from __future__ import annotations

import pytest

from mismatch_probe.kernels.launch_math import cdiv, next_pow2

triton = pytest.importorskip("triton")


def test_cdiv_and_next_pow2_equal_tritons() -> None:
    for n in [*range(-3, 300), 1023, 1024, 1025, 4095, 4096, 151_936, (1 << 31) + 5]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
