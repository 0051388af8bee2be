"""GPU-only: the weight sync's kernels on CUDA, Triton and native (``csrc/sync.cuh``), give the reference
path's prepared weights bit for bit (every TCWeight field, the native layout and its flag), for both
1x16-block schemes, on the shapes of the interpreter test (tests/kernels/test_nvfp4_sync.py: K % 32 /
% 64 / % 128, N not a multiple of 64, fused shards, zeros, huge and tiny values, NaN / Inf) and a model
at once; and the prefill GEMM with the weights decoded in registers (``PrefillTuning.decode_weights``)
gives the operand path's bits. Run on the GPU machine by ``bash bench/gpu_tests.sh`` (the kernels stage)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU-only machine)")

FIELDS = ("codes", "scales", "amax", "dec", "dsc")
CASES = [((70, 96, 1), None), ((130, 192, 2), None), ((100, 384, 3), [60, 20, 20]), ((96, 256, 4), [48, 48]),
         ((40, 1024, 7), None), ((64, 128, 8), [32, 31]), ((300, 4096, 9), [128, 100, 72])]


def _special(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, :16] = 0  # a whole zero block
    w[2, 17] = 3e4
    w[3, 40] = -2e-30
    w[4, :] = 1e-35  # bf16 subnormals
    w[5, 32:48] = torch.tensor([1e-6] * 15 + [-5e3])
    w[n - 1, 100 % k] = -7e3
    return w.bfloat16().cuda()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:  # NaN amax: the bits
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _check(got: list, w: torch.Tensor, scheme: str, parts: list[int] | None) -> None:
    from mismatch_probe.kernels.nvfp4 import native
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.tc_linear import prepare

    ref = [prepare(q) for q in NVFP4Linear(scheme, parts).weight(w)]
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        native.decode_ok(r)
        for f in FIELDS:
            assert _same(getattr(g, f), getattr(r, f)), (tuple(w.shape), scheme, parts, f)
        assert (g.bkc, g.nseg, g.native) == (r.bkc, r.nseg, r.native), (tuple(w.shape), scheme, parts)
        if r.native:
            assert all(_same(a, b) for a, b in zip(g.native_w, r.native_w, strict=True)), (tuple(w.shape), scheme)


@needs_cuda
@pytest.mark.parametrize("scheme", ["nvfp4-per-token", "nvfp4-static"])
@pytest.mark.parametrize("backend", ["triton", "native"])
def test_sync_on_cuda_equals_the_reference_path(backend: str, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mismatch_probe.kernels.nvfp4 import native, sync

    if backend == "native" and not native.available():
        pytest.skip(f"native extension absent: {native.status()['reason']}")
    monkeypatch.setattr(sync, "BACKEND", backend)
    for (n, k, seed), parts in CASES:
        w = _special(n, k, seed)
        _check(sync.sync_weight(w, scheme, parts), w, scheme, parts)
    for bad in (float("nan"), float("inf"), float("-inf"), "payload"):  # flagged blocks: native off, dec from codes
        w = _special(80, 256, 5)
        if bad == "payload":  # a negative NaN with a payload (bf16 0xffc1)
            w.view(torch.int16)[50, 3] = -63
        else:
            w[50, 3] = bad
        _check(sync.sync_weight(w, scheme, [40, 40]), w, scheme, [40, 40])
    ws = {"qkv": _special(100, 384, 11), "o": _special(64, 128, 12), "up": _special(130, 128, 14),
          "gate_up": _special(96, 128, 15), "down": _special(128, 4096, 16)}
    parts = {"qkv": [60, 20, 20], "gate_up": [48, 48]}
    got = sync.sync_model(ws, scheme, parts)
    for nm, w in ws.items():
        _check(got[nm], w, scheme, parts.get(nm))


@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(1536, 1024), (512, 8192), (4096, 4096)])
def test_prefill_weights_decoded_in_registers_same_bits_on_cuda(n: int, k: int) -> None:
    from mismatch_probe.kernels.nvfp4 import tc_linear as T
    from mismatch_probe.kernels.nvfp4.ref import nvfp4_quantize_ref
    from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

    g = torch.Generator(device="cuda").manual_seed(n + k)
    tw = T.prepare(nvfp4_quantize_ref(torch.randn(n, k, device="cuda", generator=g)))
    twd = tw.tuned(DEFAULT.with_(prefill={"decode_weights": True}))
    x = torch.randn(2048, k, device="cuda", generator=g).to(torch.bfloat16)
    for m in (65, 300, 2048):
        am = nvfp4_quantize_ref(x[:m], per_token=True)
        assert torch.equal(T.tc_matmul(am, twd, path="prefill").view(torch.int16),
                           T.tc_matmul(am, tw, path="prefill").view(torch.int16)), (n, k, m)
    assert twd._op is None  # no fp16 operand made for the weights decoded in registers
