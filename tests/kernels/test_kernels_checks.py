"""The named kernel checks (Triton kernel vs reference): exact ones compare bits (atol = rtol = 0).

Without CUDA they run in this process through Triton's interpreter on CPU tensors. The kernels
module never sets TRITON_INTERPRET: it wraps its kernels in the interpreter directly, so other test
modules that import Triton in the same pytest process are not affected (checked below). The GEMM
checks use fp32 dot operands in interpreter mode (exact here; the interpreter's bf16 ``tl.dot`` is
wrong), so the bf16 tensor-core path is covered only by the GPU run (test_kernels_gpu.py)."""

from __future__ import annotations

import os

import pytest

from mismatch_probe.kernels.checks import CHECKS, Check, Exact, Tolerance, kind_label, run_checks

N_CHECKS = 51  # pinned: adding or removing a named check changes this number (and the README's)


def test_named_checks_pinned_and_labelled():
    names = [c.name for c in CHECKS]
    assert len(set(names)) == len(names) == N_CHECKS
    for c in CHECKS:
        assert kind_label(c.exact, c.bound) == ("bitwise (atol=rtol=0)" if c.exact else f"tolerance ({c.bound})")
        assert c.exact != bool(c.bound), c.name


def test_check_kind_is_never_implicit():
    def fn(dev, big):
        return ""

    with pytest.raises(TypeError):
        Check("x", "no kind given", fn)  # no default for `exact`
    with pytest.raises(ValueError, match="must state"):
        Check("x", "tolerance without a bound", fn, exact=False)
    assert Exact("x", "", fn).exact and not Tolerance("x", "", fn, "max |diff| <= 1 ulp").exact
    assert kind_label(False, "max |diff| <= 1 ulp") == "tolerance (max |diff| <= 1 ulp)"
    assert "bitwise" not in kind_label(False, "max |diff| <= 1 ulp")


@pytest.mark.parametrize("name", [c.name for c in CHECKS])
def test_check_bitwise(name):
    (res,) = run_checks([name])
    if res.status == "skip":
        assert next(c for c in CHECKS if c.name == name).gpu_only  # only GPU-only checks skip
        pytest.skip(res.detail)
    assert res.status == "pass", res.detail


def test_interpreter_mode_does_not_leak():
    import triton

    from mismatch_probe.kernels.nvfp4 import common as _triton_common

    assert os.environ.get("TRITON_INTERPRET", "0") != "1" or _triton_common.INTERPRET
    if _triton_common.INTERPRET and os.environ.get("TRITON_INTERPRET", "0") != "1":
        # ordinary (non-kernel) Triton JIT functions stay compiled-mode objects for everyone else
        assert type(triton.language.standard.zeros).__name__ == "JITFunction"


def test_unknown_check_name():
    with pytest.raises(ValueError, match="unknown check"):
        run_checks(["no_such_check"])


QUANT_CHECKS = [c.name for c in CHECKS if c.name.startswith(("quant_", "rmsnorm")) and "tile16" not in c.name]


@pytest.mark.parametrize("name", QUANT_CHECKS)
def test_quantize_v2_kernel_bitwise(name, monkeypatch):
    """The alternative block-major quantize kernel (v2) passes the same checks."""
    from mismatch_probe.kernels.nvfp4 import triton_quant as triton_nvfp4

    monkeypatch.setattr(triton_nvfp4, "QUANT_IMPL", "v2")
    (res,) = run_checks([name])
    assert res.status == "pass", res.detail


@pytest.mark.parametrize("path", ["fp4w", "fp4w-swap"])
def test_grouped_other_paths_bitwise(path):
    """Grouped GEMM through the paths that are not in the named checks (CPU interpreter)."""
    import torch

    from mismatch_probe.kernels import quantize_expert_weights
    from mismatch_probe.kernels.nvfp4.reference.grouped import moe_grouped_linear

    g = torch.Generator().manual_seed(1)
    w = quantize_expert_weights(torch.randn(4, 32, 64, generator=g), use_ref=True)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    tw = torch.rand(7, 2, generator=g)
    got = moe_grouped_linear(x, ids, tw, w, path=path)
    assert torch.equal(got.view(torch.int16), moe_grouped_linear(x, ids, tw, w, use_ref=True).view(torch.int16))


def test_backend_record():
    from mismatch_probe.kernels import select_backend

    rec = select_backend("aligned_linear", "cpu", 16)
    assert rec["backend"] == "triton-interpreter" and rec["path"] == "fp4w-swap"
    assert select_backend("grouped_gemm", "cpu", 4)["path"] == "fp4"
    with pytest.raises(ValueError, match="unknown kernel"):
        select_backend("nope", "cpu")
