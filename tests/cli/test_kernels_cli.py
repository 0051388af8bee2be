"""``mismatch-probe kernels check|conformance|bench`` through the real CLI (subprocess)."""

from __future__ import annotations

import numpy as np
import torch
from mp_testlib import cli


def test_check_subset_passes_and_unknown_name_is_usage_error():
    p = cli("kernels", "check", "--only", "quant_e2m1_ties", "--only", "gemm_k16")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "2/2 passed" in p.stdout and p.stdout.count("bitwise (atol=rtol=0)") == 2 and "tolerance" not in p.stdout
    p = cli("kernels", "check", "--only", "nope")
    assert p.returncode == 2 and "unknown check" in p.stderr and "Traceback" not in p.stderr


def test_conformance_pt_and_npy(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 128, generator=g) * torch.exp(torch.randn(32, 128, generator=g) * 2)
    torch.save({"h": x.to(torch.bfloat16)}, tmp_path / "x.pt")
    p = cli("kernels", "conformance", str(tmp_path / "x.pt"), "--json", str(tmp_path / "x.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    for v in ("vllm_cuda", "modelopt", "torchao"):
        assert v in p.stdout
    assert (tmp_path / "x.json").exists()


def test_conformance_bad_file(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((4, 20), dtype=np.float32))
    p = cli("kernels", "conformance", str(tmp_path / "bad.npy"))
    assert p.returncode == 2 and "multiple of 16" in p.stderr and "Traceback" not in p.stderr


def test_bench_without_cuda_is_clear():
    p = cli("kernels", "bench", env={"CUDA_VISIBLE_DEVICES": ""})  # hides the GPU on a CUDA machine too
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0]
