"""The strict CUDA RMSNorm reads vLLM's per-head q/k views of the fused qkv output in place (no copy)
and gives the bits of the same rows made contiguous: checked in Triton's interpreter (fp32 on the CPU;
the GPU run is tests/gpu's strict compare)."""

from __future__ import annotations

import textwrap

import pytest
from mp_testlib import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from mismatch_probe.kernels.strict import triton_ops as T

    torch.manual_seed(0)
    t, hq, hk, d = 5, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    w = torch.randn(d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    for view in (q.view(t, hq, d), k.view(t, hk, d), qkv[:, : hq * d], torch.randn(3, t, hq, d)[:, :, 1:]):
        wv = torch.randn(view.shape[-1])
        y, _ = T._norm(view, None, wv, 1e-6, 0.0, True)
        ref, _ = T._norm(view.contiguous(), None, wv, 1e-6, 0.0, True)
        assert y.shape == view.shape and y.is_contiguous() and torch.equal(y, ref), view.shape
        # the reference math: fp32 mean of squares, 1/sqrt, scaled
        r = view.contiguous()
        expect = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * wv
        assert (y - expect).abs().max() < 1e-4
    x = torch.randn(t, hq * d); res = torch.randn(t, hq * d)
    y, r2 = T._norm(x, res, w.repeat(hq), 1e-6, 0.0, True)
    assert torch.equal(r2, x + res)
    print("ok")
    """
)


def test_norm_reads_head_views_in_place_with_the_same_bits() -> None:
    assert interpreted(SCRIPT, timeout=600).strip().endswith("ok")
