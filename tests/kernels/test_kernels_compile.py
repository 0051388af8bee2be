"""The NVFP4 Triton kernels compiled for real GPUs on this CPU machine (Triton's ahead-of-time compile to
PTX and a cubin, ``MISMATCH_PROBE_TRITON_MODE=jit``): the per-token quantizer and the fused norm + quantize and
act-and-mul + quantize compile for sm_89 and sm_90 (the latter with the dependent-launch trigger), and the quantizer's
hardware E4M3 conversion does not compile for sm_80 / sm_86: why ``common.MIN_CC`` is 8.9 and Ampere runs
the reference path (``linear.use_kernels``, ``backends.select_backend``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import os, re, subprocess, tempfile
    import triton
    import triton.backends.nvidia as nvidia_backend
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mismatch_probe.kernels.nvfp4 import act_quant as AQ, norm_quant as NQ, quant_fast as Q

    def build(k, types, cst, cc, warps=4):
        sig = {n: types.get(n, "constexpr") for n in k.arg_names}
        try:
            c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=cst), target=GPUTarget("cuda", cc, 32),
                               options={"num_warps": warps})
        except Exception:
            return "fails"
        return "pdl" if "griddepcontrol.launch_dependents" in c.asm["ptx"] else "ok"

    qt = {"x_ptr": "*i16", "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", "op_ptr": "*fp16",
          "rows_total": "i32", "K": "i32"}
    q = {"R": 1, "NB": 256, "AMAX_MODE": 0, "XBITS": True, "EMIT_OP": True}
    nt = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "rout_ptr": "*bf16",
          "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8", "op_ptr": "*fp16", "rows": "i32", "H": "i32",
          "eps": "fp32", "offset": "fp32", "groups": "i32"}
    n = {"HAS_W": True, "HAS_RES": True, "ROUND_FIRST": True, "BLOCK": 4096, "CB": 64, "LAYOUT": 2, "HW": True}
    at = {"g_ptr": "*bf16", "u_ptr": "*bf16", "y_ptr": "*bf16", "amax_ptr": "*fp32", "codes_ptr": "*u8",
          "scales_ptr": "*u8", "op_ptr": "*fp16", "rows": "i32", "D": "i32", "sg": "i32", "su": "i32", "groups": "i32"}
    a = {"ACT": 0, "CB": 128, "LAYOUT": 2, "HW": True}
    out = [
        build(Q._quant_fast_kernel, qt, {**q, "HW": True}, 90),
        build(Q._quant_fast_kernel, qt, {**q, "HW": True}, 89),
        build(Q._quant_fast_kernel, qt, {**q, "HW": True}, 86),
        build(Q._quant_fast_kernel, qt, {**q, "HW": True}, 80),
        build(NQ._norm_quant_kernel, nt, {**n, "PDL": True}, 90),
        build(NQ._norm_quant_kernel, nt, {**n, "PDL": False}, 89),
        build(AQ._act_quant_kernel, at, {**a, "PDL": True}, 90),
        build(AQ._act_quant_kernel, at, {**a, "ACT": 1, "LAYOUT": 0, "PDL": False}, 89),
    ]
    # the act-and-mul's programs hold one chunk of a row in registers: no spill to the stack (a whole row of
    # 12,288 values per program spilled 440 bytes at 255 registers)
    sig = {n: at.get(n, "constexpr") for n in AQ._act_quant_kernel.arg_names}
    c = triton.compile(ASTSource(fn=AQ._act_quant_kernel, signature=sig, constexprs={**a, "PDL": True}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    out.append(re.search(r"STACK:[0-9]+", res).group(0))
    print("RESULT", " ".join(out))
    """
)


def test_kernels_compile_for_sm89_and_sm90_and_not_for_ampere() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MISMATCH_PROBE_TRITON_MODE"] = "jit"
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, r.stderr[-3000:]
    assert line.split()[1:] == ["ok", "ok", "fails", "fails", "pdl", "ok", "pdl", "ok", "STACK:0"], line


def test_the_kernel_gate_is_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mismatch_probe.kernels.nvfp4 import common

    for cc, want in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(common, "_cc", lambda _i, cc=cc: cc)
        assert common.gpu_capable(torch.device("cuda", 0)) is want, cc
    assert common.gpu_capable(torch.device("cpu")) is False
