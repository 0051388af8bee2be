"""The strict paged attention's per-step metadata (vLLM plugin): computed once per forward, shared by
the layers, recomputed for a new forward or changed inputs (CPU tensors; the kernel's GPU run is in
tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from mismatch_probe.kernels.strict.triton_ops import paged_meta  # noqa: E402
from mismatch_probe.probes.vllm import plugin  # noqa: E402


def _md() -> SimpleNamespace:
    # a prefill of 3 new tokens over 2 cached ones and a decode step over 6 cached ones
    return SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                           seq_lens=torch.tensor([5, 7], dtype=torch.int32),
                           block_table=torch.tensor([[3, 1], [0, 2]], dtype=torch.int64))


def test_paged_meta_values() -> None:
    m = paged_meta(*vars(_md()).values(), 4)
    assert m.pos.tolist() == [2, 3, 4, 6]
    assert m.qstart.tolist() == [0, 3] and m.qlen.tolist() == [3, 1] and m.kvlen.tolist() == [5, 7]
    assert m.table.dtype == torch.int32 and m.table.tolist() == [[3, 1], [0, 2]]


def test_step_meta_is_shared_by_the_layers_of_a_forward_and_recomputed_after() -> None:
    plugin._STEP_META.clear()
    a, b, md = object(), object(), _md()
    first = plugin.step_meta(a, md, 4)
    assert plugin.step_meta(b, md, 4) is first  # the next layer of the same forward
    again = plugin.step_meta(a, md, 4)  # layer a again: a new forward (or a graph capture)
    assert again is not first and torch.equal(again.pos, first.pos)
    md.seq_lens.add_(1)  # vLLM's buffers written in place between steps: the version moves
    moved = plugin.step_meta(b, md, 4)
    assert moved is not again and moved.pos.tolist() == [3, 4, 5, 7]
    other = _md()  # another metadata object (another KV-cache group)
    assert plugin.step_meta(a, other, 4).pos.tolist() == [2, 3, 4, 6]
    assert plugin.step_meta(b, other, 3) is not plugin.step_meta(a, other, 4)  # token count differs
    plugin.uninstall()
    assert plugin._STEP_META == {}


def test_step_meta_takes_inference_mode_tensors() -> None:
    # tensors made under torch.inference_mode (as vLLM's runner may) have no version counter
    plugin._STEP_META.clear()
    with torch.inference_mode():
        md = _md()
    a, b = object(), object()
    first = plugin.step_meta(a, md, 4)
    assert plugin.step_meta(b, md, 4) is first and first.pos.tolist() == [2, 3, 4, 6]
    assert plugin.step_meta(a, md, 4) is not first
    plugin._STEP_META.clear()
