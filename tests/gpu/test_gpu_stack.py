"""The GPU stack users run: CUDA vLLM (FLASH_ATTN) and the HF learner on one GPU.

Marked ``gpu``; skipped without a CUDA GPU and a CUDA build of vLLM (CI has neither). Run on the
GPU machine after the CUDA vLLM bundle is installed, from a copy of ``tests/`` outside the
checkout so the installed package is imported (docs/gpu.md: ``bash bench/gpu_tests.sh``).

* The strict attention kernel reads vLLM's paged KV cache (NHD pages through a shuffled block
  table, unused slots NaN) and gives the learner's bits: prefill, chunked prefill, decode.
* ``compare --align strict`` on tiny-qwen3: every pair exactly 0, every captured op bitwise equal,
  the FLASH_ATTN override in the sampler's manifest; ``bisect`` on it reports no divergent op.
* ``--learner-recipe nvfp4-dynamic-tensor --sampler-recipe nvfp4-static`` completes (the static
  calibration inside CUDA vLLM) and shows a gap.
* An engine run (vLLM's in-place CUDA kernels) captures what each hook saw: embed bitwise.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from mp_testlib import cli

pytestmark = pytest.mark.gpu


def _cuda_vllm() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


needs_cuda_vllm = pytest.mark.skipif(not _cuda_vllm(), reason="needs a CUDA GPU and CUDA vLLM")


@needs_cuda_vllm
@pytest.mark.parametrize(("window", "hq", "hkv"), [(None, 16, 8), (100, 16, 8), (None, 32, 8)])
def test_paged_strict_attention_bitwise_equals_learner(window: int | None, hq: int, hkv: int) -> None:
    # GQA groups of 2 (0.6B) and 4 (8B): the paged kernel packs a group into one program
    import torch

    from mismatch_probe.kernels.strict import triton_ops as T

    g = torch.Generator(device="cuda").manual_seed(3)
    b, t, d, page = 3, 300, 128, 16
    q = torch.randn(b, t, hq, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, t, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, t, hkv, d, device="cuda", generator=g).bfloat16()
    full = T.attention(q, k, v, torch.arange(t, device="cuda").expand(b, t), d**-0.5, window)
    nblk = -(-t // page)
    table = torch.randperm(b * nblk + 5, device="cuda")[: b * nblk].reshape(b, nblk).to(torch.int32)
    phys = torch.full((b * nblk + 5, page, hkv, 2 * d), float("nan"), device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda")
    for bi in range(b):
        phys[table[bi, pos // page].long(), pos % page, :, :d] = k[bi]
        phys[table[bi, pos // page].long(), pos % page, :, d:] = v[bi]
    kc, vc = phys.permute(0, 2, 1, 3).transpose(1, 2).split(d, dim=-1)  # as vLLM's FLASH_ATTN splits its cache
    qs = torch.cat([q[0], q[1, 200:], q[2, 299:]])
    out = torch.zeros_like(qs)
    qsl = torch.tensor([0, t, t + 100, t + 101], dtype=torch.int32, device="cuda")
    T.paged_attention(qs, kc, vc, out, qsl, torch.full((3,), t, dtype=torch.int32, device="cuda"), table, t, d**-0.5, window)
    assert torch.equal(out[:t], full[0])
    assert torch.equal(out[t : t + 100], full[1, 200:])
    assert torch.equal(out[-1], full[2, 299])
    for j in (0, 15, 16, 63, 64, 255, 299):
        od = torch.zeros_like(q[:, j])
        T.paged_attention(q[:, j].contiguous(), kc, vc, od, torch.arange(b + 1, dtype=torch.int32, device="cuda"),
                          torch.full((b,), j + 1, dtype=torch.int32, device="cuda"), table, 1, d**-0.5, window)
        assert torch.equal(od, full[:, j]), j


@pytest.fixture(scope="module")
def strict_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "strict"
    cli("compare", "--model", "tiny-qwen3", "--align", "strict", "--out", str(out), check=True)
    return out


@needs_cuda_vllm
def test_strict_compare_on_cuda_vllm_is_exactly_zero(strict_run: Path) -> None:
    import pandas as pd

    s = json.loads((strict_run / "compare/summary.json").read_text())
    for pair in ("learner_vs_prefill", "learner_vs_decode", "prefill_vs_decode"):
        assert s["pairs"][pair]["max_abs_dlogp"] == 0.0, (pair, s["pairs"][pair])
    errs = pd.read_parquet(strict_run / "compare/op_errors.parquet")
    bad = errs[errs.bitwise_equal_frac != 1.0]
    assert len(errs) > 10 and bad.empty, bad[["op", "bitwise_equal_frac"]].to_string()
    m = json.loads((strict_run / "manifest.json").read_text())
    sampler = m["engines"]["sampler"]
    assert sampler["device"] == "cuda" and sampler.get("attention_backend") == "FLASH_ATTN"
    assert any("FlashAttentionImpl.forward" in o for o in sampler["recipe"]["plugin_overrides"])
    # the recipes read vLLM's own linear weights on CUDA (aliases, no bf16 copy: docs/gpu.md "Memory")
    w = sampler["recipe"]["weights"]
    assert w["aliased"] > 10 and w["own"] == 0 and w["own_bytes"] == 0, w


@needs_cuda_vllm
def test_bisect_on_strict_cuda_run_finds_no_divergent_op(strict_run: Path) -> None:
    proc = cli("bisect", str(strict_run), "--no-ablation")
    assert proc.returncode == 0, proc.stderr[-2000:]
    b = json.loads((strict_run / "bisect.json").read_text())
    assert b["first_divergent"]["bitwise"] is None
    assert "Traceback" not in proc.stderr


@needs_cuda_vllm
def test_static_nvfp4_sampler_calibrates_inside_cuda_vllm(tmp_path: Path) -> None:
    out = tmp_path / "mismatched"
    proc = cli("compare", "--model", "tiny-qwen3", "--capture", "off", "--learner-recipe", "nvfp4-dynamic-tensor",
               "--sampler-recipe", "nvfp4-static", "--out", str(out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    s = json.loads((out / "compare/summary.json").read_text())
    assert s["pairs"]["learner_vs_prefill"]["max_abs_dlogp"] > 0.0  # two schemes: a gap, shown, not a crash


@needs_cuda_vllm
@pytest.mark.parametrize("recipe", [("--align", "strict"), ("--recipe", "nvfp4-per-token")])
def test_recipe_in_cuda_graphs_is_exactly_zero(tmp_path: Path, recipe: tuple[str, str]) -> None:
    """With --capture off, enforce_eager=false runs the recipe's decode steps as whole CUDA graphs
    (no torch.compile): still exactly the learner's bits, and the manifest says how vLLM ran."""
    out = tmp_path / "graphs"
    proc = cli("compare", "--model", "tiny-qwen3", *recipe, "--capture", "off", "--sampler-arg", "enforce_eager=false",
               "--out", str(out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    s = json.loads((out / "compare/summary.json").read_text())
    for pair in ("learner_vs_prefill", "learner_vs_decode", "prefill_vs_decode"):
        assert s["pairs"][pair]["max_abs_dlogp"] == 0.0, (pair, s["pairs"][pair])
    sampler = json.loads((out / "manifest.json").read_text())["engines"]["sampler"]
    assert sampler["enforce_eager"] is False
    assert sampler["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


@needs_cuda_vllm
def test_engine_capture_reads_what_the_hook_saw(tmp_path: Path) -> None:
    """With vLLM's own CUDA kernels (no recipe), the fused add + RMSNorm overwrites the residual (at
    layer 0 the embedding output) and rotary overwrites q / k in place after the hooks: the
    captured rows must still be the hook's values. The embedding, a row gather in both engines,
    is the op whose rows are equal by construction."""
    import pandas as pd

    out = tmp_path / "engine"
    proc = cli("compare", "--model", "tiny-qwen3", "--out", str(out))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    df = pd.read_parquet(out / "compare/op_errors.parquet")
    assert df[df.op == "embed"].bitwise_equal_frac.tolist() == [1.0]
