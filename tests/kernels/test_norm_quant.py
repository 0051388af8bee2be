"""The fused strict RMSNorm + per-token NVFP4 quantize (kernels/nvfp4/norm_quant.py) gives the bits of the
two kernels it replaces: the normalized rows (and the fused add's residual) of the strict norm, the codes,
scales and amax of the reference quantizer, the GEMM operand ``E2M1 * sf`` row-major or in the native
decode GEMM's core-matrix layout (zero rows past the last). Checked in Triton's interpreter (fp32 rows on
the CPU); in bf16 on the GPU: ``tests/kernels/test_kernels_gpu.py`` (gpu-marked) and
``bench/gpu_nvfp4_check.py`` section n."""

from __future__ import annotations

import textwrap

import pytest
from mp_testlib import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from mismatch_probe.kernels.nvfp4 import norm_quant as NQ
    from mismatch_probe.kernels.nvfp4.native import core_operand
    from mismatch_probe.kernels.nvfp4.ref import nvfp4_quantize_ref, e2m1_decode, e4m3_decode, unpack_codes
    from mismatch_probe.kernels.strict import triton_ops as T

    torch.manual_seed(0)
    cases = 0
    for rows, h in ((1, 128), (5, 256), (16, 384), (3, 512)):
        # blocks each program quantizes: one program per row (h 128), two whole chunks (256), a whole one and a
        # partial one (384), four (512); every program of a row computes the whole norm and the row's amax
        NQ.CHUNK_BLOCKS = {128: 64, 256: 8, 384: 16, 512: 8}[h]
        for res in (False, True):
            for unit, (offset, first) in ((False, (0.0, True)), (True, (1.0, False))):
                for layout in (0, 2):
                    x = torch.randn(rows, h) * 3
                    x[0, :16] = 0.0  # an all-zero block
                    r = torch.randn(rows, h) if res else None
                    w = torch.randn(h)
                    y, rout, (q, op) = NQ.norm_quantize(x, r, w, 1e-6, offset, first, layout)
                    ey, er = T._norm(x, r, w, 1e-6, offset, first)
                    assert torch.equal(y, ey), (rows, h, res, unit)
                    assert (rout is None) == (r is None) and (r is None or torch.equal(rout, er))
                    eq = nvfp4_quantize_ref(ey, per_token=True)
                    for name in ("codes", "scales", "amax"):
                        assert torch.equal(getattr(q, name), getattr(eq, name)), (name, rows, h)
                    vals = e2m1_decode(unpack_codes(eq.codes)).reshape(rows, h // 16, 16)
                    eop = (vals * e4m3_decode(eq.scales)[:, :, None]).reshape(rows, h)
                    want = eop if layout == 0 else core_operand(eop)
                    assert op.shape == want.shape and torch.equal(op, want), (layout, rows, h)
                    cases += 1
    # the protocol: the norm learns its consumer's layout from the linear's first call, then hands the
    # linear its fused quantization (the linear's own quantizer's result) from the next call on
    from mp_fused_protocol import check_protocol

    NQ.CHUNK_BLOCKS = 64
    x, g = torch.randn(4, 256), torch.randn(256)
    check_protocol(lambda mod: NQ.rmsnorm(mod, x, None, g, 1e-6)[0])
    print("ok", cases)
    """
)


def test_fused_norm_quantize_gives_the_bits_of_the_norm_and_the_quantizer() -> None:
    out = interpreted(SCRIPT).split()
    assert out[-2:] == ["ok", "32"], out[-3:]


def test_the_producers_quantize_only_under_a_per_token_linear() -> None:
    from mismatch_probe.kernels.nvfp4.schemes import quantize_upstream
    from mismatch_probe.kernels.recipes import parse

    for name, want in (("engine", False), ("strict", False), ("nvfp4-static", False), ("nvfp4-dynamic-tensor", False),
                       ("nvfp4-per-token", True), ("strict+nvfp4-per-token", True)):
        r = parse(name)
        assert quantize_upstream(r, r.ops()) is want, name
    r = parse("nvfp4-per-token")
    assert not quantize_upstream(r, r.ops() - {"linear"})
