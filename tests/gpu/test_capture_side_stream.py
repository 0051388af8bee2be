"""Op capture on CUDA: the recorders of a process share one side stream per device, so a recorder per
``score()`` reuses the device memory the previous one freed (no ``cudaMalloc`` of its arena each time),
and its rows are the same bits whichever recorder computed them.

Marked ``gpu``; skipped without a CUDA GPU (CI has none). Run on the GPU machine with ``bash bench/gpu_tests.sh``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mp_testlib import has_cuda

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
def test_recorders_share_the_side_stream_and_reuse_its_memory() -> None:
    import torch

    from mismatch_probe.probes.capture import CapturePlan
    from mismatch_probe.probes.recorder import OpRecorder

    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(8)]
    seq = np.repeat(np.arange(4), 128)
    pos = np.tile(np.arange(128), 4)

    def one() -> tuple[OpRecorder, object]:
        rec = OpRecorder(CapturePlan("digest"), None)
        for i, x in enumerate(xs):
            rec.record_rows(f"{i}.mlp.down", x, seq, pos)
        table = rec.table()
        return rec, table

    first, t1 = one()
    torch.cuda.synchronize()
    mallocs = torch.cuda.memory_stats()["num_device_alloc"]
    second, t2 = one()
    torch.cuda.synchronize()
    assert first._stream is not None and first._stream is second._stream
    assert torch.cuda.memory_stats()["num_device_alloc"] == mallocs  # the arena came from the stream's cached blocks
    assert t1.to_pandas().equals(t2.to_pandas())  # the same rows (digest mode: its stats columns NaN in both)
