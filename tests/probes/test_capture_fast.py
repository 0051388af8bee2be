"""The HF learner's capture through the batched (CUDA) recorder path, run on CPU tensors through
Triton's interpreter: one wrapped forward per module (input and output sites merged), and record_rows' fast
path (an op seen before in the same layout costs one queue append) write the same rows as the
CPU path, and the fast path is taken for every op after the first micro-batch's."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from mismatch_probe.probes import recorder as recmod
from mismatch_probe.probes.capture import build_plan


def _learner(plan):
    import transformers

    from mismatch_probe.probes.hf.runner import HfLearner

    cfg = transformers.Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, intermediate_size=48, vocab_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    r = HfLearner(Path("."), 64, micro_batch_size=2, device="cpu")
    r.model = model
    r._apply_recipe()
    r._loaded = True
    r.capture = plan
    return r


def test_hf_capture_batched_fast_path_equals_the_cpu_path(monkeypatch):
    plan = build_plan("stats", ["*.mlp.*=digest"], full_rows=3, topk=2)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 64, n).tolist() for n in (5, 3, 5, 4, 5, 5)]  # 3 micro-batches, padded rows
    r = _learner(plan)
    hooks = []
    r.capture = None
    lp_cpu = r.score(seqs, list(range(6)))  # no capture
    r.capture = plan
    tables = []

    class Spy(recmod.OpRecorder):
        slow = 0

        def record(self, *a, **k):
            Spy.slow += 1
            return super().record(*a, **k)

        def table(self):
            t = super().table()
            tables.append(t.to_pandas())
            return t

    for batched in (False, True, True):
        Spy.slow = 0
        monkeypatch.setattr(recmod, "OpRecorder", functools.partial(Spy, batched=batched))
        monkeypatch.setattr(r, "_finish_capture", lambda rec: (rec.table(), hooks.append(Spy.slow)))
        lp = r.score(seqs, list(range(6)))
        assert all(np.array_equal(a, b) for a, b in zip(lp, lp_cpu, strict=True))
    pd.testing.assert_frame_equal(tables[0], tables[1])
    pd.testing.assert_frame_equal(tables[0], tables[2])
    n_ops = tables[1].op.nunique()
    assert n_ops == 2 * 17 + 3
    # CPU: every op of every micro-batch takes the slow path; batched: the first micro-batch's ops,
    # then per later batch one call per plan rule set (mlp.* digest, the rest) plus the rows of the
    # full window (first micro-batch only here) and the logits (top-k): the rest are appends
    assert hooks[0] == 3 * n_ops
    assert hooks[1] <= n_ops + 2 * 3
    # a new recorder reuses the layouts of the first (process-wide): its first micro-batch is appends too
    assert hooks[2] < hooks[1]


def test_hf_capture_wraps_forwards_without_hooks_and_restores_them():
    """Sites get a wrapped ``forward`` (no module hooks: those put every call of the module on
    Module.__call__'s slow path); exit restores every module, one patched before the capture too
    (as the recipes' patches do), also when the forward raised; the sites are resolved once per model."""
    import pytest

    from mismatch_probe.probes.capture import CapturePlan
    from mismatch_probe.probes.hf.capture import HfCapture, model_sites

    model = _learner(None).model
    down = model.model.layers[0].mlp.down_proj
    down.forward = down.forward  # an instance forward set before the capture
    before = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    rec = recmod.OpRecorder(CapturePlan("digest"))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.inference_mode(), HfCapture(model, rec) as cap:
        wrapped = {n for n, m in model.named_modules() if m.__dict__.get("forward") is not before[n]}
        assert {"model.layers.0", "model.layers.0.mlp.down_proj", "model.norm", "lm_head"} <= wrapped
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        cap.set_batch([0], [3], 3)
        model(input_ids=ids)
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == before
    assert rec.table().column("op").to_pylist().count("0.mlp.down") == 3
    with pytest.raises(RuntimeError, match="boom"), HfCapture(model, recmod.OpRecorder(CapturePlan("digest"))):
        raise RuntimeError("boom")
    assert all(m.__dict__.get("forward") is before[n] for n, m in model.named_modules())
    assert model_sites(model) is model_sites(model)


def test_hf_capture_reuses_its_wrappers_and_makes_new_ones_over_a_changed_forward():
    """A model's second capture installs the wrappers its first one made (no closure per site per
    ``score()``), recording into its own recorder; a forward patched between the captures (a recipe's
    instance attribute) gets a new wrapper over it; a capture inside a capture of the same model makes
    wrappers of its own and both recorders get the rows."""
    from mismatch_probe.probes.capture import CapturePlan
    from mismatch_probe.probes.hf.capture import HfCapture

    model = _learner(None).model
    layer0, down = model.model.layers[0], model.model.layers[0].mlp.down_proj
    ids = torch.zeros(1, 3, dtype=torch.long)

    def run(*recs: recmod.OpRecorder) -> dict[str, object]:
        caps = [HfCapture(model, r) for r in recs]
        with torch.inference_mode():
            for c in caps:
                c.__enter__()
            got = {"layer0": layer0.__dict__["forward"], "down": down.__dict__["forward"]}
            for c in caps:
                c.set_batch([0], [3], 3)
            model(input_ids=ids)
            for c in reversed(caps):
                c.__exit__(None, None, None)
        return got

    def downs(r: recmod.OpRecorder) -> int:
        return r.table().column("op").to_pylist().count("0.mlp.down")

    r1, r2 = recmod.OpRecorder(CapturePlan("digest")), recmod.OpRecorder(CapturePlan("digest"))
    first, second = run(r1), run(r2)
    assert first == second  # the same wrapper objects
    assert downs(r1) == downs(r2) == 3
    calls = []
    plain = down.forward

    def patched(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return plain(x)

    down.forward = patched
    r3 = recmod.OpRecorder(CapturePlan("digest"))
    third = run(r3)
    assert third["layer0"] is first["layer0"] and third["down"] is not first["down"]
    assert downs(r3) == 3 and calls == [1]
    assert down.__dict__["forward"] is patched
    outer, inner = recmod.OpRecorder(CapturePlan("digest")), recmod.OpRecorder(CapturePlan("digest"))
    run(outer, inner)
    assert downs(outer) == downs(inner) == 3
    assert "forward" not in layer0.__dict__ and down.__dict__["forward"] is patched
