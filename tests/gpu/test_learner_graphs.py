"""``--learner-arg cuda_graphs=true``: the HF learner's forward replayed from CUDA graphs gives the eager bits.

Marked ``gpu``; skipped without a CUDA GPU (CI has none). Run on the GPU machine with ``bash bench/gpu_tests.sh``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mp_testlib import has_cuda

from mismatch_probe.probes.hf.runner import HfLearner
from mismatch_probe.probes.models import resolve_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["engine", "strict", "nvfp4-per-token"])
def test_graphed_learner_logprobs_equal_the_eager_learner_bitwise(recipe: str) -> None:
    m = resolve_model("tiny-qwen3")
    rng = np.random.default_rng(0)
    # micro-batches of 4: two of one width without padding, two of one width with padding (other lengths each)
    lens = [40, 40, 40, 40, 40, 40, 40, 40, 33, 21, 33, 12, 33, 30, 9, 33]
    seqs = [rng.integers(4, m.vocab_size, n).tolist() for n in lens]
    with HfLearner(m.path, m.vocab_size, micro_batch_size=4, recipe=recipe, device="cuda") as eager:
        ref = eager.score(seqs)
    with HfLearner(m.path, m.vocab_size, micro_batch_size=4, recipe=recipe, device="cuda", cuda_graphs=True) as lr:
        first = lr.score(seqs)  # each shape: eager, then captured and checked
        again = lr.score(seqs)  # replays where the graph was kept
        stats = lr.info.settings["cuda_graphs"]
    for a, b, c in zip(ref, first, again, strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert stats["captured"] + len(stats["eager_shapes"]) == 2, stats  # 4x40 and 4x33+pad
    assert stats["replays"] + stats["eager_calls"] == 8
    if recipe == "nvfp4-per-token":  # its kernels replay bitwise (H100, 0.6B shape): the graphs are kept
        assert stats["captured"] == 2 and stats["replays"] == 6, stats
