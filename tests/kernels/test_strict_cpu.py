"""The fast CPU strict definition: row results independent of the batch, the padding, the block
position and the thread count (bitwise, ``torch.equal``), and bisect's dominant divergence.

Cheap (no engine, no model): a few seconds in all.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from mismatch_probe.kernels.strict import ops as so


@pytest.fixture()
def threads():
    """Run a block under several torch thread counts, restoring the original."""
    n0 = torch.get_num_threads()
    yield (1, 2, 3)
    torch.set_num_threads(n0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strict_linear_rows_bitwise_across_batch_sizes_and_threads(dtype: torch.dtype, threads: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    w = (torch.randn(200, 96) * 0.1).bfloat16().to(dtype)
    b = torch.randn(200).bfloat16().to(dtype)
    x = torch.randn(300, 96).bfloat16().to(dtype)
    ref = so.linear(x, w, b)
    assert ref.dtype == dtype
    for n in threads:
        torch.set_num_threads(n)
        for m in (1, 2, 5, 16, 17, 33, 300):
            assert torch.equal(so.linear(x[:m], w, b), ref[:m]), (n, m)
        assert torch.equal(so.linear(x[123:124], w, b), ref[123:124])  # a row alone == at row 123 of 300
        assert torch.equal(so.linear(x[40:45], w[:64], b[:64]), ref[40:45, :64])  # split columns == fused
    err = (ref.float() - (x.float() @ w.float().T + b.float())).norm() / ref.float().norm()
    assert err < 1e-2


def test_strict_attention_bitwise_padding_windows_decode_threads(threads: tuple[int, ...]) -> None:
    """A sequence alone == inside a right-padded batch == each query as a decode step, with key
    counts across several key blocks (KB) and with a sliding window, for any thread count."""
    torch.manual_seed(1)
    hq, hkv, d, lens = 4, 2, 32, (130, 7, 65)
    width = max(lens)
    q = torch.randn(len(lens), width, hq, d).bfloat16()
    k = torch.randn(len(lens), width, hkv, d).bfloat16()
    v = torch.randn(len(lens), width, hkv, d).bfloat16()
    pos = torch.arange(width).expand(len(lens), width)
    for window in (None, 20):
        batch = so.attention_batch(q, k, v, pos, 0.2, window)
        assert torch.equal(so.attention_batch(q, k, v, None, 0.2, window), batch)  # None: the last positions
        assert torch.equal(so.attention_batch(q[:, 90:], k, v, None, 0.2, window), batch[:, 90:])
        for n in threads:
            torch.set_num_threads(n)
            for i, t in enumerate(lens):
                alone = so.attention(q[i, :t], k[i, :t], v[i, :t], torch.arange(t), 0.2, window)
                assert torch.equal(alone, batch[i, :t]), (window, n, i)
                for j in (0, t // 2, t - 1):
                    dec = so.attention(q[i, j : j + 1], k[i, : j + 1], v[i, : j + 1], torch.tensor([j]), 0.2, window)
                    assert torch.equal(dec, batch[i, j : j + 1]), (window, n, i, j)
    # close to the textbook definition
    batch = so.attention_batch(q, k, v, pos, 0.2)
    rk, rv = (z[:1, :130].transpose(1, 2).float().repeat_interleave(2, 1) for z in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1, :130].transpose(1, 2).float(), rk, rv, is_causal=True,
                                                           scale=0.2).transpose(1, 2)
    assert (batch[:1, :130].float() - ref).abs().max() < 2e-2


def test_ew_position_independent() -> None:
    """An element's transcendental never depends on where it sits in the tensor."""
    x = torch.randn(50_000)
    full = so.ew(torch.exp, x)
    for a, b in ((0, 1), (30_000, 30_011), (16_383, 16_390), (49_990, 50_000)):
        assert torch.equal(so.ew(torch.exp, x[a:b]), full[a:b])


def test_dominant_divergence_is_first_op_where_most_rows_differ() -> None:
    from mismatch_probe.steps.bisect import _whole_sequences, first_divergent

    errs = pd.DataFrame({
        "op": ["embed", "0.attn.v", "0.attn.rope_q", "0.attn.core"], "layer": [-1, 0, 0, 0], "exec_order": [0, 1, 2, 3],
        "bitwise_equal_frac": [1.0, 0.995, 0.04, 0.0], "rel_l2": [0.0, 1e-5, 3e-3, 4e-3], "dtype": ["bfloat16"] * 4,
    })
    fd = first_divergent(errs)
    assert fd["bitwise"]["op"] == "0.attn.v"
    assert fd["dominant"]["op"] == "0.attn.rope_q" and fd["dominant"]["bitwise_equal_frac"] == 0.04
    assert first_divergent(errs.assign(bitwise_equal_frac=1.0))["dominant"] is None
    # attention replay takes whole prefill sequences only, within the row budget
    keys = {(0, p) for p in range(5)} | {(1, p) for p in (0, 1, 3)} | {(2, p) for p in range(4)}
    assert _whole_sequences(keys, 9) == [(0, p) for p in range(5)] + [(2, p) for p in range(4)]
    assert _whole_sequences(keys, 3) == [(0, p) for p in range(5)]  # at least one sequence
