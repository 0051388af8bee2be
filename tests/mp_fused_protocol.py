"""The protocol between a fused producer (kernels/nvfp4/fused_input.py: the norm, the act-and-mul) and the
per-token NVFP4 linear that reads its output, checked the same way for each producer (imported by the
interpreter scripts of tests/kernels/test_norm_quant.py and test_act_quant.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def check_protocol(produce: Callable[[Any], Any]) -> Any:
    """``produce(module)`` makes 4 rows of 256 with the producer ``module``. The first call is quantized by the
    linear, which teaches the module its operand layout; from the second on the linear takes the producer's
    quantization (its own quantizer's result, only in the layout it asked for); ``fused_input.ENABLED``
    off: the producer alone, the same output. Returns the first output."""
    import torch

    from mismatch_probe.kernels.nvfp4 import fused_input as FI
    from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear
    from mismatch_probe.kernels.nvfp4.tc_linear import operand_layout

    mod, lin = SimpleNamespace(), NVFP4Linear("nvfp4-per-token")
    tw = lin.prepared(torch.randn(64, 256) * 0.05)[0]
    lay = operand_layout(4, tw, "auto")
    y1 = produce(mod)
    assert lin._quantized_input(y1, y1, None, tw) is not None and lin.fused_inputs == 0  # quantized by the linear
    y2 = produce(mod)
    assert torch.equal(y1, y2) and FI.take(y2, tw, FI.tag(2 - lay)) is None  # another layout: not this one
    qa, op = lin._quantized_input(y2, y2, None, tw)
    assert lin.fused_inputs == 1
    ea, eop = lin.quantize_input(y2, None, tw)
    assert all(torch.equal(getattr(qa, n), getattr(ea, n)) for n in ("codes", "scales", "amax")) and torch.equal(op, eop)
    FI.ENABLED = False
    try:
        y3 = produce(mod)
        assert torch.equal(y3, y1) and FI.take(y3, tw, FI.tag(lay)) is None
    finally:
        FI.ENABLED = True
    return y1
