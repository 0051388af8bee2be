"""The CUDA digest/stats kernel (``probes/digest_triton.py``) against the numpy reference of ``probes/digest.py``,
as the recorder launches it: several tensors of one dtype in one launch, the stats written as the file's parts
(``split_arena``), vector loads where every row is 16-byte aligned and scalar loads where one is not, a column
offset (a tensor-parallel slice), NaN / Inf / -Inf planted in float rows. Digests and counts exactly equal;
sums to float64 rounding (their order differs from numpy's).

Marked ``gpu``; skipped without a CUDA GPU (CI has none; there the same kernel runs through Triton's interpreter in
``tests/probes/test_capture_recorder.py``). Run on the GPU machine with ``bash bench/gpu_tests.sh``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mp_testlib import has_cuda

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int8", "uint8", "bool")


def _tensor(dtype: str, rows: int, cols: int, seed: int):  # noqa: ANN202
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, cols, device="cuda", generator=g) * 100
    dt = getattr(torch, dtype)
    x = (x > 0) if dt == torch.bool else x.to(dt)
    if dt.is_floating_point:
        x[0, 1], x[1, 2], x[2, 3] = float("nan"), float("inf"), float("-inf")
    return x


def _refs(x, col_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    import torch

    from mismatch_probe.probes import digest as D

    xc = x.cpu().contiguous()
    raw = D.word_view(xc).numpy().view(np.uint8).reshape(xc.shape[0], -1)
    vals = xc.numpy().astype(float) if xc.dtype == torch.bool else xc.double().numpy()
    return D.digest_bytes_ref(raw, xc.element_size(), col_offset), D.stats_ref(vals)


@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aligned", [True, False], ids=["vector", "scalar"])
def test_one_launch_of_several_tensors_equals_the_reference(dtype: str, aligned: bool) -> None:
    import torch

    from mismatch_probe.probes import digest_triton

    cols = 1024 if aligned else 1001  # 1001 elements: rows not 16-byte aligned for any dtype
    big = _tensor(dtype, 300, cols * 2, 1)
    parts = [
        (_tensor(dtype, 257, cols, 2), 0, 0),
        (big[:, cols:], 257, cols),  # a column slice: row stride 2 * cols, column offset cols
        (_tensor(dtype, 33, cols + (0 if aligned else 6), 3), 557, 0),
    ]
    rows = 590
    dig = torch.zeros(rows, dtype=torch.int64, device="cuda")
    st = digest_triton.split_arena(rows, "cuda")
    digest_triton.launch(parts, dig, st)
    dig_only = torch.zeros(rows, dtype=torch.int64, device="cuda")
    digest_triton.launch(parts, dig_only, digest_triton.split_arena(rows, "cuda"), stats=False)
    got_d = dig.cpu().numpy().view(np.uint64)
    got_s = digest_triton.stats_rows(st).cpu().numpy()
    amb = st[3].cpu().numpy()
    for t, out, coff in parts:
        n = t.shape[0]
        dref, sref = _refs(t, coff)
        assert np.array_equal(got_d[out : out + n], dref)
        assert np.array_equal(dig_only.cpu().numpy().view(np.uint64)[out : out + n], dref)
        s = got_s[out : out + n]
        assert np.array_equal(s[:, 2:], sref[:, 2:])  # abs_max, NaN and Inf counts: exact
        assert np.allclose(s[:, :2], sref[:, :2], rtol=1e-12, atol=0)
        if dtype == "bfloat16":  # abs_max's bf16 bits: exact for a bf16 row
            bits = torch.from_numpy(amb[out : out + n].astype(np.int16)).view(torch.bfloat16).double().numpy()
            assert np.array_equal(bits, sref[:, 2])
