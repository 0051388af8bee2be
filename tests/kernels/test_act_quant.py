"""The fused strict act-and-mul + per-token NVFP4 quantize (kernels/nvfp4/act_quant.py) gives the bits of the
two kernels it replaces: the strict act-and-mul's product (SiLU, GELU-tanh, GELU-erf; gate and up strided
views of one fused gate_up output, as vLLM hands them), the reference quantizer's codes, scales and amax,
the GEMM operand ``E2M1 * sf`` row-major or in the native decode GEMM's core-matrix layout. Checked in
Triton's interpreter (fp32 rows on the CPU); in bf16 on the GPU: ``tests/kernels/test_kernels_gpu.py``
(gpu-marked) and ``bench/gpu_nvfp4_check.py`` section n. Then the protocol with the down projection."""

from __future__ import annotations

import textwrap

import pytest
from mp_testlib import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from types import SimpleNamespace
    from mismatch_probe.kernels.nvfp4 import act_quant as AQ
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.native import core_operand
    from mismatch_probe.kernels.nvfp4.ref import nvfp4_quantize_ref, e2m1_decode, e4m3_decode, unpack_codes
    from mismatch_probe.kernels.strict import triton_ops as T

    torch.manual_seed(0)
    cases = 0
    for rows, d in ((1, 128), (5, 256), (16, 384)):
        # blocks per program: one program per row (d 128), two whole chunks (256), a whole one and a partial one
        # (384): each program takes the row's amax over every chunk and quantizes its own
        AQ.CHUNK_BLOCKS = {128: 128, 256: 8, 384: 16}[d]
        for kind in ("silu", "gelu_tanh", "gelu"):
            for layout in (0, 2):
                x = torch.randn(rows, 2 * d) * 3
                x[0, :16] = 0.0  # an all-zero block
                x[-1, d + 16:d + 32] = 0.0  # a zero block of up
                g, u = x[:, :d], x[:, d:]
                y, (q, op) = AQ.act_quantize(g, u, kind, layout)
                ey = T.act_and_mul(g, u, kind)
                assert torch.equal(y, ey), (rows, d, kind)
                eq = nvfp4_quantize_ref(ey, per_token=True)
                for name in ("codes", "scales", "amax"):
                    assert torch.equal(getattr(q, name), getattr(eq, name)), (name, rows, d, kind)
                vals = e2m1_decode(unpack_codes(eq.codes)).reshape(rows, d // 16, 16)
                eop = (vals * e4m3_decode(eq.scales)[:, :, None]).reshape(rows, d)
                want = eop if layout == 0 else core_operand(eop)
                assert op.shape == want.shape and torch.equal(op, want), (layout, rows, d)
                cases += 1
    # the protocol: the act learns the down projection's layout from its first call, then hands it the
    # fused quantization (the linear's own quantizer's result) from the next call on
    from mp_fused_protocol import check_protocol

    AQ.CHUNK_BLOCKS = 128

    x = torch.randn(4, 512)
    g, u = x[:, :256], x[:, 256:]
    y1 = check_protocol(lambda mod: AQ.act_and_mul(mod, g, u))
    assert torch.equal(y1, T.act_and_mul(g, u, "silu"))
    # vLLM's SiluAndMul override takes this path under the per-token recipe (its CUDA check forced here: the
    # interpreter runs the kernels on the CPU) and hands the down projection the fused quantization
    from mismatch_probe.kernels.recipes import parse
    from mismatch_probe.probes.vllm import plugin

    r = parse("nvfp4-per-token")
    plugin._STATE.update(recipe=r, ops=r.ops(), layers=None)
    plugin._fuse_quant = lambda x: plugin.quantize_upstream(plugin._STATE["recipe"], plugin._STATE["ops"])
    act, lin2 = SimpleNamespace(), NVFP4Linear("nvfp4-per-token")
    tw = lin2.prepared(torch.randn(64, 256) * 0.05)[0]
    fwd = plugin._silu_and_mul(None)
    x2 = torch.randn(4, 512)
    a1 = fwd(act, x2)
    lin2._quantized_input(a1, a1, None, tw)
    a2 = fwd(act, x2)
    assert torch.equal(a1, a2) and torch.equal(a2, T.act_and_mul(x2[:, :256], x2[:, 256:], "silu"))
    lin2._quantized_input(a2, a2, None, tw)
    assert lin2.fused_inputs == 1
    print("ok", cases)
    """
)


def test_fused_act_quantize_gives_the_bits_of_the_act_and_the_quantizer() -> None:
    out = interpreted(SCRIPT).split()
    assert out[-2:] == ["ok", "18"], out[-3:]


def test_an_unknown_activation_is_one_clear_error() -> None:
    import torch

    from mismatch_probe.kernels.nvfp4 import act_quant

    with pytest.raises(ValueError, match="not supported"):
        act_quant.act_quantize(torch.zeros(1, 128), torch.zeros(1, 128), "relu", 0)


def test_the_producers_split_a_row_into_chunks_and_the_bench_switch_restores_one_program_per_row() -> None:
    """``fused_input.chunks``: (blocks per program, programs per row); a partial last chunk counts; the
    A/B switch ``CHUNKED`` (bench/gpu_stack.py ``RECIPE@chunks-ab``) gives the whole row to one program."""
    from mismatch_probe.kernels.nvfp4 import fused_input as F

    assert F.chunks(12288, 128) == (128, 6)  # Qwen3-8B's act-and-mul width: six programs of 2,048 values
    assert F.chunks(4096, 64) == (64, 4)  # its norm: four of 1,024
    assert F.chunks(1024, 128) == (64, 1)  # a row shorter than a chunk: one program of the row's blocks
    assert F.chunks(3072 + 16 * 3, 128) == (128, 2)  # 195 blocks: a whole chunk and a partial one
    was = F.CHUNKED
    F.CHUNKED = False
    try:
        assert F.chunks(12288, 128) == (1024, 1)
    finally:
        F.CHUNKED = was
