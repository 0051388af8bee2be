"""The fused weight sync (kernels/nvfp4/sync.py) gives the reference path's prepared weights bit for bit:
every TCWeight field (codes, scales, amax, decode-layout tiles, the native layout and its flag) equals
``prepare(nvfp4_quantize_ref(shard))`` (+ ``native.decode_ok``), for both 1x16-block schemes, on shapes
with K % 32 / % 64 / % 128, N not a multiple of 64, fused shards, zeros, a zero block, huge and tiny
values, NaN / Inf. Run in Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` before import);
on the GPU ``bench/gpu_nvfp4_check.py`` checks the same equality for Qwen3-8B layers."""

from __future__ import annotations

import textwrap

import pytest
from mp_testlib import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from mismatch_probe.kernels.nvfp4 import native as NA
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.sync import sync_model, sync_weight
    from mismatch_probe.kernels.nvfp4.tc_linear import chunk_for, prepare

    FIELDS = ("codes", "scales", "amax", "dec", "dsc")

    def same(a, b):
        if a.dtype == torch.float32:  # NaN amax: compare the bits
            a, b = a.view(torch.int32), b.view(torch.int32)
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    def check(got, w, scheme, parts):
        ref = [prepare(q) for q in NVFP4Linear(scheme, parts).weight(w)]
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            NA.decode_ok(r)  # the native layout the CUDA decode GEMM makes at first use
            for f in FIELDS:
                assert same(getattr(g, f), getattr(r, f)), (tuple(w.shape), scheme, parts, f)
            assert (g.bkc, g.nseg, g.per_row, g.grouped, g.native) == (r.bkc, r.nseg, r.per_row, r.grouped, r.native)
            assert (g.native_w is None) == (r.native_w is None)
            if r.native:
                assert all(same(a, b) for a, b in zip(g.native_w, r.native_w)), (tuple(w.shape), scheme, parts)
        return ref

    def special(n, k, seed):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * 0.02
        w[0, :16] = 0  # a whole zero block
        w[1, 5] = 0
        w[2, 17] = 3e4; w[3, 40] = -2e-30; w[4, :] = 1e-35  # huge, tiny (bf16 subnormals)
        w[5, 32:48] = torch.tensor([1e-6] * 15 + [-5e3])  # a block whose small values round to 0
        w[n - 1, 100 % k] = -7e3
        return w.bfloat16()

    cases = [
        ((70, 96, 1), None),  # K % 32 only: 32-wide decode chunks, no native layout
        ((130, 192, 2), None),  # 64-wide chunks
        ((100, 384, 3), [60, 20, 20]),  # qkv-like shards, 128-wide chunks + native layout
        ((96, 256, 4), [48, 48]),  # gate_up-like
        ((40, 1024, 7), None),  # several K segments
        ((64, 128, 8), [32, 31]),  # partitions that do not add up: one shard (as NVFP4Linear)
    ]
    for scheme in ("nvfp4-per-token", "nvfp4-static"):
        for (n, k, seed), parts in cases:
            w = special(n, k, seed)
            check(sync_weight(w, scheme, parts), w, scheme, parts)
        z = torch.zeros(70, 128, dtype=torch.bfloat16)
        check(sync_weight(z, scheme), z, scheme, None)
        for bad in (float("nan"), float("inf"), float("-inf"), "payload"):  # flagged blocks, native off
            w = special(80, 256, 5)
            if bad == "payload":  # a negative NaN with a payload: the shared amax keeps the reference's bits
                w.view(torch.int16)[50, 3] = -63  # 0xffc1
            else:
                w[50, 3] = bad
            check(sync_weight(w, scheme, [40, 40]), w, scheme, [40, 40])
    # a contiguous view 2 bytes past an aligned address (the kernels' offsets are hinted 16-byte aligned)
    flat = special(66, 128, 16).reshape(-1)
    w = flat[1 : 1 + 64 * 128].view(64, 128)
    assert w.is_contiguous() and w.data_ptr() % 16 != 0
    check(sync_weight(w, "nvfp4-per-token"), w, "nvfp4-per-token", None)
    # a model at once (and a weight the kernel does not take: fp32 -> the reference path)
    # (weights of one K share a launch: "o", "up" and "gate_up" read through offsets from the lowest-addressed)
    ws = {"qkv": special(100, 384, 11), "o": special(64, 128, 12), "f32": special(64, 64, 13).float(),
          "up": special(130, 128, 14), "gate_up": special(96, 128, 15)}
    parts = {"qkv": [60, 20, 20], "gate_up": [48, 48]}
    got = sync_model(ws, "nvfp4-per-token", parts)
    assert list(got) == list(ws)
    for nm, w in ws.items():
        check(got[nm], w, "nvfp4-per-token", parts.get(nm))
    print("ok")
    """
)


def test_sync_equals_the_reference_path_in_the_interpreter() -> None:
    assert interpreted(SCRIPT, timeout=300).strip().endswith("ok")


def test_sync_supported_routes_tile16_and_odd_k_to_the_reference() -> None:
    import torch

    from mismatch_probe.kernels.nvfp4.sync import supported

    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert supported(w, "nvfp4-per-token") and supported(w, "nvfp4-static", [32, 32])
    assert not supported(w, "nvfp4-dynamic-tensor")  # 16x16 tiles
    assert not supported(w.float(), "nvfp4-per-token")
    assert not supported(torch.zeros(64, 48, dtype=torch.bfloat16), "nvfp4-per-token")  # K % 32 != 0
    assert not supported(w, "nvfp4-per-token", [16, 16, 16, 16])  # more than MAX_SHARDS shards
