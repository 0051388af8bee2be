"""The named bitwise equivalence checks (Triton kernel vs reference, atol = rtol = 0).

Without CUDA they run in this process through Triton's interpreter on CPU tensors. The kernels
module never sets TRITON_INTERPRET: it wraps its kernels in the interpreter directly, so other test
modules that import Triton in the same pytest process are not affected (checked below). The GEMM
checks use fp32 dot operands in interpreter mode (exact here; the interpreter's bf16 ``tl.dot`` is
wrong), so the bf16 tensor-core path is covered only by the GPU run (test_kernels_gpu.py)."""

from __future__ import annotations

import os

import pytest

from mismatch_probe.kernels.checks import CHECKS, run_checks


def test_at_least_28_named_checks():
    names = [c.name for c in CHECKS]
    assert len(set(names)) == len(names) >= 28
    assert all(c.exact for c in CHECKS)


@pytest.mark.parametrize("name", [c.name for c in CHECKS])
def test_check_bitwise(name):
    (res,) = run_checks([name])
    if res.status == "skip":
        pytest.skip(res.detail)
    assert res.status == "pass", res.detail


def test_interpreter_mode_does_not_leak():
    import triton

    from mismatch_probe.kernels import _triton_common

    assert os.environ.get("TRITON_INTERPRET", "0") != "1" or _triton_common.INTERPRET
    if _triton_common.INTERPRET and os.environ.get("TRITON_INTERPRET", "0") != "1":
        # ordinary (non-kernel) Triton JIT functions stay compiled-mode objects for everyone else
        assert type(triton.language.standard.zeros).__name__ == "JITFunction"


def test_unknown_check_name():
    with pytest.raises(ValueError, match="unknown check"):
        run_checks(["no_such_check"])
