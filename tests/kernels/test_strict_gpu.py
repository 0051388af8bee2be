"""GPU-only: the strict CUDA kernels (kernels/strict/triton_ops.py) are batch invariant, bitwise.

Skipped on CPU machines (CI); run on the H200 with the final bench call (BENCHMARKS.md).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU-only machine)")


@needs_cuda
def test_strict_cuda_linear_norm_act_logsoftmax_rows_invariant() -> None:
    from mismatch_probe.kernels.strict import ops as so

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(1000, 512, device="cuda", generator=g) * 0.05).bfloat16()
    b = torch.randn(1000, device="cuda", generator=g).bfloat16()
    x = torch.randn(3000, 512, device="cuda", generator=g).bfloat16()
    full = so.linear(x, w, b)
    for m in (1, 2, 3, 127, 128, 129, 3000):
        assert torch.equal(so.linear(x[:m], w, b), full[:m]), m
    assert torch.equal(so.linear(x[1500:1501], w, b), full[1500:1501])
    r = torch.randn_like(x)
    wn = torch.rand(512, device="cuda", generator=g).bfloat16()
    for unit in (False, True):
        y, s = so.add_rmsnorm(x, r, wn, 1e-6, unit_offset=unit)
        y1, s1 = so.add_rmsnorm(x[7:8], r[7:8], wn, 1e-6, unit_offset=unit)
        assert torch.equal(y1, y[7:8]) and torch.equal(s1, s[7:8])
    for act in ("silu", "gelu_tanh", "gelu"):
        assert torch.equal(so.act_and_mul(x[5:6], r[5:6], act), so.act_and_mul(x, r, act)[5:6])
    lg = torch.randn(40, 50_000, device="cuda", generator=g) * 4
    assert torch.equal(so.log_softmax_fp32(lg[3:4]), so.log_softmax_fp32(lg)[3:4])
    assert torch.allclose(so.log_softmax_fp32(lg), torch.log_softmax(lg, -1), atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("window", [None, 100])
def test_strict_cuda_attention_padding_and_decode_bitwise(window: int | None) -> None:
    from mismatch_probe.kernels.strict import ops as so

    g = torch.Generator(device="cuda").manual_seed(1)
    b, t, hq, hkv, d = 3, 300, 8, 2, 128
    q = torch.randn(b, t, hq, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, t, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, t, hkv, d, device="cuda", generator=g).bfloat16()
    pos = torch.arange(t, device="cuda").expand(b, t)
    full = so.attention_batch(q, k, v, pos, d**-0.5, window)
    alone = so.attention_batch(q[1:2, :77], k[1:2, :77], v[1:2, :77], pos[1:2, :77], d**-0.5, window)
    assert torch.equal(alone, full[1:2, :77])
    for j in (0, 63, 64, 200, 299):
        dec = so.attention_batch(q[:, j : j + 1], k[:, : j + 1], v[:, : j + 1], pos[:, j : j + 1], d**-0.5, window)
        assert torch.equal(dec, full[:, j : j + 1]), j
        tail = so.attention_batch(q[:, j : j + 1], k[:, : j + 1], v[:, : j + 1], None, d**-0.5, window)
        assert torch.equal(tail, dec), j  # q_pos None: the last positions, the batch description cached
    assert torch.equal(so.attention_batch(q, k, v, None, d**-0.5, window), full)
