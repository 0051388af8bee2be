"""The strict attention kernel reads vLLM's paged KV cache through the block table and gives the
learner's bits: checked here on the CPU in Triton's interpreter (fp32; the interpreter's bf16 dot is
broken), on the GPU in bf16 by ``tests/gpu/test_gpu_stack.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from mismatch_probe.kernels.strict import triton_ops as T

    torch.manual_seed(0)
    b, t, d, page = 2, 70, 16, 16
    # GQA groups of 2 and 4 query heads packed into one program of the paged kernel; 3: not packed
    for (hq, hkv), window in [((4, 2), None), ((4, 2), 20), ((8, 2), None), ((6, 2), 20)]:
        assert T.gqa_pack(hq, hkv) == {2: 2, 4: 4, 3: 1}[hq // hkv]
        q = torch.randn(b, t, hq, d); k = torch.randn(b, t, hkv, d); v = torch.randn(b, t, hkv, d)
        full = T.attention(q, k, v, torch.arange(t).expand(b, t), d**-0.5, window)
        mask = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        if window:
            mask &= torch.arange(t)[None, :] > torch.arange(t)[:, None] - window
        for bi in range(b):
            s = torch.einsum("thd,khd->htk", q[bi], k[bi].repeat_interleave(hq // hkv, 1)) * d**-0.5
            vr = v[bi].repeat_interleave(hq // hkv, 1)
            ref = torch.einsum("htk,khd->thd", s.masked_fill(~mask, float("-inf")).softmax(-1), vr)
            assert (full[bi] - ref).abs().max() < 1e-5
        nblk = -(-t // page)
        table = torch.randperm(b * nblk + 3)[: b * nblk].reshape(b, nblk).to(torch.int32)
        kc = torch.full((b * nblk + 3, page, hkv, d), float("nan")); vc = kc.clone()  # unused slots: NaN
        for bi in range(b):
            for j in range(t):
                kc[table[bi, j // page], j % page] = k[bi, j]; vc[table[bi, j // page], j % page] = v[bi, j]
        # one prefill of 70 new tokens and one chunk of 30 new tokens over 40 cached ones
        qs = torch.cat([q[0], q[1, t - 30:]]); out = torch.zeros_like(qs)
        T.paged_attention(qs, kc, vc, out, torch.tensor([0, t, t + 30], dtype=torch.int32),
                          torch.tensor([t, t], dtype=torch.int32), table, t, d**-0.5, window)
        assert torch.equal(out[:t], full[0]) and torch.equal(out[t:], full[1, t - 30:])
        for j in (0, 15, 16, 63, 64, 69):  # decode steps
            qs = torch.stack([q[0, j], q[1, j]]); out = torch.zeros_like(qs)
            T.paged_attention(qs, kc, vc, out, torch.tensor([0, 1, 2], dtype=torch.int32),
                              torch.tensor([j + 1, j + 1], dtype=torch.int32), table, 1, d**-0.5, window)
            assert torch.equal(out[0], full[0, j]) and torch.equal(out[1], full[1, j]), j
    print("ok")
    """
)


def test_paged_attention_equals_the_learners_kernel_in_the_interpreter() -> None:
    # the interpreter's tl.dot is numpy's matmul; OpenBLAS's SIMD kernels (chosen per CPU: Zen, Haswell, ...)
    # sum in an order that depends on the matrix shapes, so the two kernels' equal tiles could differ in the
    # last bit on some machines (seen on an AMD EPYC host); its plain x86-64 kernel sums the same way for
    # every shape, which is what the GPU's tensor-core tiles do (the bf16 check in tests/gpu)
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_CORETYPE="Prescott")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
