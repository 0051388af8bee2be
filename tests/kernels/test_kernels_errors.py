"""Bad input to the kernels: clear errors naming the violated constraint."""

from __future__ import annotations

import pytest
import torch

from mismatch_probe.kernels import (
    NVFP4Tensor,
    moe_route,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_ref,
    quantize_expert_weights,
    rmsnorm_nvfp4_quantize,
)
from mismatch_probe.kernels.nvfp4.common import INTERPRET
from mismatch_probe.kernels.nvfp4.reference.aligned_linear import aligned_linear, w4a4_matmul
from mismatch_probe.kernels.nvfp4.reference.grouped import grouped_w4a4

DEV = "cpu" if INTERPRET else "cuda"


def _w(n: int = 32, k: int = 64) -> NVFP4Tensor:
    q = nvfp4_quantize_ref(torch.randn(n, k))
    return NVFP4Tensor(q.codes.to(DEV), q.scales.to(DEV), q.amax.to(DEV))


def test_k_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(2, 24, device=DEV))


def test_wrong_dtype():
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        nvfp4_quantize(torch.ones(2, 32, dtype=torch.int32, device=DEV))


def test_non_contiguous():
    x = torch.randn(64, 32, device=DEV).t()
    with pytest.raises(ValueError, match="contiguous"):
        nvfp4_quantize(x)


def test_tile16_needs_per_tensor():
    with pytest.raises(ValueError, match="per-tensor"):
        nvfp4_quantize(torch.randn(16, 32, device=DEV), per_token=True, tile16=True)


def test_mismatched_scale_shape():
    w = _w()
    bad = NVFP4Tensor(w.codes, w.scales[:, :2].contiguous(), w.amax)
    with pytest.raises(ValueError, match=r"scales shape"):
        nvfp4_dequantize(bad)


def test_k_mismatch_in_gemm():
    with pytest.raises(ValueError, match="K mismatch"):
        aligned_linear(torch.randn(2, 32, device=DEV), _w(16, 64))


def test_per_tensor_activations_rejected():
    xq = nvfp4_quantize_ref(torch.randn(2, 64, device=DEV))
    with pytest.raises(ValueError, match="per-token"):
        aligned_linear(xq, _w())


def test_bad_path_name():
    xq = nvfp4_quantize_ref(torch.randn(2, 64, device=DEV), per_token=True)
    with pytest.raises(ValueError, match="path must be one of"):
        w4a4_matmul(xq, _w(), path="cutlass")


def test_grouped_offsets_length():
    wq = quantize_expert_weights(torch.randn(4, 16, 32), use_ref=True)
    a = nvfp4_quantize_ref(torch.randn(6, 32), per_token=True)
    _, offsets = moe_route(torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="E\\+1"):
        grouped_w4a4(a, offsets[:3], wq) if INTERPRET else pytest.skip("CPU-only case")


def test_rmsnorm_weight_shape():
    with pytest.raises(ValueError, match="weight must have shape"):
        rmsnorm_nvfp4_quantize(torch.randn(2, 32, device=DEV), torch.ones(16, device=DEV))


def test_wrong_device_for_this_mode():
    other = "cuda" if INTERPRET else "cpu"
    if other == "cuda":
        pytest.skip("no CUDA device to misplace a tensor on")
    with pytest.raises(ValueError, match="CUDA tensors"):
        nvfp4_quantize(torch.randn(2, 32, device=other))
