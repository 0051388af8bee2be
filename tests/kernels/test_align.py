"""Alignment recipes without vLLM: strict ops, batch invariance, undoable HF patches, NVFP4 schemes.

Bitwise tests assert exact equality (``torch.equal``) and say so in their names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mismatch_probe.kernels.nvfp4.linear import NVFP4Linear, qdq
from mismatch_probe.kernels.recipes import OP_KINDS, Recipe, parse, resolve
from mismatch_probe.kernels.strict import ops as so
from mismatch_probe.probes.hf.patch import patch, token_logprobs_fn
from mismatch_probe.probes.tiny_models import resolve_tiny_model

LENGTHS = (5, 9, 17, 23, 31, 12, 40, 7)


def _load(name: str) -> torch.nn.Module:
    import transformers

    path = resolve_tiny_model(name)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def _seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(8, 512, (n,), generator=g).tolist() for n in LENGTHS]


def _score(model: torch.nn.Module, batch: list[list[int]], recipe: str | None) -> list[torch.Tensor]:
    """Right-padded micro-batch forward, as HfLearner does."""
    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        lp = token_logprobs_fn(recipe)(model(input_ids=ids, attention_mask=mask).logits, ids)
    return [lp[i, : len(s) - 1].clone() for i, s in enumerate(batch)]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return _load(request.param)


# --- strict ops ---------------------------------------------------------------------------


def test_torch_cpu_fp32_matmul_is_not_batch_invariant_here() -> None:
    """Why strict never calls a library GEMM: a row's bits change with the batch it sits in."""
    torch.manual_seed(0)
    w, x = torch.randn(512, 128), torch.randn(300, 128)
    full = x @ w.T
    differ = sum(not torch.equal(x[i : i + 1] @ w.T, full[i : i + 1]) for i in range(0, 300, 10))
    assert differ > 0, "torch's fp32 CPU matmul happened to be batch invariant on this machine"


def test_tree_sum_bitwise_independent_of_zero_padding() -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 37)
    ref = so.tree_sum(x)
    for pad in (1, 27, 91, 300):
        assert torch.equal(so.tree_sum(torch.nn.functional.pad(x, (0, pad))), ref)


def test_strict_linear_bitwise_rows_independent_of_batch() -> None:
    torch.manual_seed(2)
    w = torch.randn(96, 128).bfloat16()
    x = torch.randn(50, 128).bfloat16()
    full = so.linear(x, w)
    for i in (0, 17, 49):
        assert torch.equal(so.linear(x[i : i + 1], w), full[i : i + 1])
    assert torch.equal(so.linear(x[:3], torch.cat([w[:40], w[40:]])), full[:3])  # fused == split columns


def test_strict_attention_bitwise_prefill_equals_decode() -> None:
    """A query sees the same bits in a full prefill and as the last token of a decode step."""
    torch.manual_seed(3)
    t, hq, hkv, d = 19, 4, 2, 32
    q, k, v = (torch.randn(t, h, d).bfloat16() for h in (hq, hkv, hkv))
    pre = so.attention(q, k, v, torch.arange(t), 0.17)
    for j in (0, 5, 18):
        dec = so.attention(q[j : j + 1], k[: j + 1], v[: j + 1], torch.tensor([j]), 0.17)
        assert torch.equal(dec, pre[j : j + 1])


def test_strict_log_softmax_close_to_torch() -> None:
    x = torch.randn(4, 512) * 3
    assert torch.allclose(so.log_softmax_fp32(x), torch.log_softmax(x, -1), atol=1e-5)


def test_strict_moe_bitwise_token_alone_equals_in_batch() -> None:
    torch.manual_seed(4)
    e, h, i = 8, 32, 16
    w13, w2 = torch.randn(e, 2 * i, h).bfloat16(), torch.randn(e, h, i).bfloat16()
    x = torch.randn(12, h).bfloat16()
    wts, ids = so.moe_route(so.linear(x, torch.randn(e, h).bfloat16()), 2, True)
    full = so.moe_experts(x, wts, ids, w13, w2)
    for r in (0, 7, 11):
        assert torch.equal(so.moe_experts(x[r : r + 1], wts[r : r + 1], ids[r : r + 1], w13, w2), full[r : r + 1])


# --- recipes ------------------------------------------------------------------------------


def test_recipe_resolution_and_names() -> None:
    assert resolve(None, None).is_engine
    assert resolve("strict", None).name == "strict"
    assert resolve("strict", "nvfp4-per-token").name == "strict+nvfp4-per-token"
    assert parse("strict+nvfp4-static") == Recipe("strict", "nvfp4-static")
    assert parse("nvfp4-static").ops() == {"linear", "norm", "act", "moe", "rope", "attention", "logits", "logsoftmax"}
    assert parse("strict").ops() == set(OP_KINDS)
    assert parse("engine").describe()["ops"]["linear"] == "engine"
    with pytest.raises(ValueError):
        parse("fp8")


# --- the HF patch -------------------------------------------------------------------------


def test_strict_learner_bitwise_alone_equals_micro_batch_of_8(model: torch.nn.Module) -> None:
    """Acceptance 3 (learner): a sequence's logprobs alone == inside a padded micro-batch of 8."""
    seqs = _seqs()
    with patch(model, "strict"):
        batch = _score(model, seqs, "strict")
        for i in (0, 4, 6):  # the shortest, a middle one, the longest (no padding in the batch)
            assert torch.equal(_score(model, [seqs[i]], "strict")[0], batch[i])


def test_patch_off_restores_engine_bitwise(model: torch.nn.Module) -> None:
    """Acceptance 5 (learner): undo gives the engine's original outputs bit for bit."""
    seqs = _seqs()
    before = _score(model, seqs, None)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    with patch(model, "strict") as h:
        assert len(h.patched) > 10
        patched = _score(model, seqs, "strict")
    after = _score(model, seqs, None)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards
    assert any(not torch.equal(a, b) for a, b in zip(before, patched, strict=True)), "strict changed nothing"


def test_patch_subsets_by_op_and_layer() -> None:
    """bisect's ablation: ops= and layers= choose what is patched."""
    m = _load("tiny-qwen3")
    with patch(m, "strict", ops={"norm"}, layers=range(2)) as h:
        assert h.patched and all(n.endswith("norm") for n in h.patched)
        assert not any(".layers.2." in n or ".layers.3." in n for n in h.patched)
        assert "model.norm" in h.patched  # outside the decoder layers: follows ops only
    with patch(m, "strict", ops={"rope", "attention"}) as h:
        assert sum(n.endswith("self_attn") for n in h.patched) == 4 and "model.rotary_emb" in h.patched
    with pytest.raises(ValueError):
        patch(m, "strict", ops={"softmax"})


# --- NVFP4 schemes ------------------------------------------------------------------------


def test_nvfp4_per_token_bitwise_batch_invariant_dynamic_tensor_not() -> None:
    torch.manual_seed(5)
    w = torch.randn(64, 128).bfloat16()
    x = torch.randn(16, 128).bfloat16()
    x[3] *= 40  # one loud token: a per-tensor amax moves every other row's scale
    pt, dyn = NVFP4Linear("nvfp4-per-token"), NVFP4Linear("nvfp4-dynamic-tensor")
    assert torch.equal(pt(x[:1], w), pt(x, w)[:1])
    assert not torch.equal(dyn(x[:1], w), dyn(x, w)[:1])


def test_nvfp4_static_needs_calibration_and_qdq_modes() -> None:
    from mismatch_probe.kernels.nvfp4.linear import CALIBRATION

    st = NVFP4Linear("nvfp4-static")
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    with pytest.raises(RuntimeError):
        st(x, w)
    CALIBRATION["on"] = True
    try:
        st(x, w)
    finally:
        CALIBRATION["on"] = False
    assert st.static_amax is not None and float(st.static_amax) == float(x.float().abs().max())
    assert st(x, w).shape == (4, 32)
    for mode in ("per-token", "per-tensor"):
        err = (qdq(x, mode).float() - x.float()).abs().max()
        assert 0 < float(err) < 1.0


def test_nvfp4_weights_quantized_once_and_again_when_the_parameters_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched model's NVFP4 linears quantize their weights once, not at every forward, and again
    (all of them) after an in-place update of any parameter: the next forward equals a freshly patched
    model's bit for bit. A write through ``.data`` is not seen until ``weights_changed()``."""
    from mismatch_probe.kernels.nvfp4 import linear as lin

    calls = []
    orig = lin.quantize_weight_ref
    monkeypatch.setattr(lin, "quantize_weight_ref", lambda *a, **k: calls.append(1) or orig(*a, **k))
    seqs = _seqs()[:3]
    model, fresh = _load("tiny-qwen3"), _load("tiny-qwen3")
    h = patch(model, "nvfp4-per-token")
    n = len(h.nvfp4)
    a = _score(model, seqs, "nvfp4-per-token")
    assert len(calls) == n and all(st.weights_by_shape for st in h.nvfp4.values())
    assert all(torch.equal(x, y) for x, y in zip(a, _score(model, seqs, "nvfp4-per-token"), strict=True))
    assert len(calls) == n  # the second forward quantized nothing
    with torch.no_grad():
        for m in (model, fresh):
            m.model.layers[1].mlp.up_proj.weight.mul_(1.25)  # an optimizer-style in-place update
    b = _score(model, seqs, "nvfp4-per-token")
    assert len(calls) == 2 * n
    with patch(fresh, "nvfp4-per-token"):
        ref = _score(fresh, seqs, "nvfp4-per-token")
    assert all(torch.equal(x, y) for x, y in zip(b, ref, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for m in (model, fresh):
        m.model.layers[0].self_attn.o_proj.weight.data.mul_(0.5)  # no version bump
    before = len(calls)  # (the fresh model's patch quantized its own weights meanwhile)
    _score(model, seqs, "nvfp4-per-token")
    assert len(calls) == before  # not seen: the caller says so
    h.weights_changed()
    c = _score(model, seqs, "nvfp4-per-token")
    assert len(calls) == before + n
    with patch(fresh, "nvfp4-per-token"):
        assert all(torch.equal(x, y) for x, y in zip(c, _score(fresh, seqs, "nvfp4-per-token"), strict=True))
    h.undo()
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_nvfp4_activation_quantized_once_per_block_input(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v read one tensor, gate/up another: the patched model quantizes each once (4 activation
    quantizations per layer, not 7), and the logprobs equal those of the same model quantizing in every
    linear, bit for bit; the scope hooks go with undo()."""
    from mismatch_probe.kernels.nvfp4 import linear as lin

    calls = []
    orig = lin.nvfp4_quantize_ref
    monkeypatch.setattr(lin, "nvfp4_quantize_ref", lambda *a, **k: calls.append(1) or orig(*a, **k))
    seqs = _seqs()[:3]
    model = _load(name)
    layers = model.config.num_hidden_layers
    h = patch(model, "nvfp4-per-token")
    shared = _score(model, seqs, "nvfp4-per-token")
    assert len(calls) == 4 * layers and h.shared.hits == 3 * layers
    assert h.shared.src is None and h.shared.entry is None  # nothing kept past the blocks
    for st in h.nvfp4.values():
        st.shared = None
    calls.clear()
    alone = _score(model, seqs, "nvfp4-per-token")
    assert len(calls) == 7 * layers
    assert all(torch.equal(x, y) for x, y in zip(shared, alone, strict=True))
    h.undo()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())



FSDP_SCRIPT = r"""
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")  # started by torch's launcher: 2 ranks
rank, world = dist.get_rank(), dist.get_world_size()
import test_align as t
t.torch.inference_mode = torch.no_grad  # FSDP2's unshard needs version counters (no inference tensors)
seqs = t._seqs()[rank::world]  # data parallel: each rank scores its own sequences
plain, sharded = t._load("tiny-qwen3"), t._load("tiny-qwen3")
for layer in sharded.model.layers:
    fully_shard(layer)
fully_shard(sharded)
w = sharded.model.layers[0].mlp.down_proj.weight
assert w.to_local().numel() * world == w.numel(), "parameters are sharded across the ranks"
base = t._score(sharded, seqs, None)
with t.patch(plain, "strict"), t.patch(sharded, "strict") as h:
    assert len(h.patched) > 10
    a, b = t._score(plain, seqs, "strict"), t._score(sharded, seqs, "strict")
assert all(torch.equal(x, y) for x, y in zip(a, b))
assert all(torch.equal(x, y) for x, y in zip(base, t._score(sharded, seqs, None)))
# NVFP4: weights quantized once although FSDP2 gathers them into a new buffer at every forward, and
# again after an optimizer-style update of the shards (the same update on the plain model)
from mismatch_probe.kernels.nvfp4 import linear as lin
calls = []
orig = lin.quantize_weight_ref
lin.quantize_weight_ref = lambda *a, **k: calls.append(1) or orig(*a, **k)
with t.patch(plain, "nvfp4-per-token") as hp, t.patch(sharded, "nvfp4-per-token") as hs:
    n = len(hs.nvfp4)
    for _ in range(2):
        a, b = t._score(plain, seqs, "nvfp4-per-token"), t._score(sharded, seqs, "nvfp4-per-token")
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(calls) == 2 * n, (len(calls), n)  # plain and sharded, once each
    with torch.no_grad():
        for m in (plain, sharded):
            for name, p in m.named_parameters():
                if "layers.1." in name:
                    p.mul_(1.25)
    a, b = t._score(plain, seqs, "nvfp4-per-token"), t._score(sharded, seqs, "nvfp4-per-token")
    assert len(calls) == 4 * n, (len(calls), n)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
dist.destroy_process_group()
print(f"ok rank {rank} of {world}")
"""


def test_patch_under_fsdp2_bitwise_equals_plain_model_and_undoes(tmp_path: Path) -> None:
    """FSDP2 (fully_shard per layer and root, gloo, 2 ranks started by torch's launcher, each
    rank holding half of every parameter): the patched sharded model gives the patched plain
    model's logprobs bit for bit on every rank, and undo restores the sharded model's own. Under
    NVFP4 the sharded model quantizes its weights once (not at every forward's gather) and again after
    an in-place update of the shards, still bit for bit the plain model's."""
    import os
    import subprocess
    import sys

    here = Path(__file__).parent
    script = tmp_path / "fsdp_patch.py"
    script.write_text(FSDP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    env = {**os.environ, "PYTHONPATH": str(here), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=here, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok rank 0 of 2" in proc.stdout and "ok rank 1 of 2" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "fp8"], "unknown recipe 'fp8'"),
        (["--sampler-recipe", "nvfp4"], "unknown recipe 'nvfp4'"),
        (["--align", "loose"], "--align must be one of"),
        # --learner fsdp takes recipes now (tests/cli/test_fsdp_recipes_cli.py); what it refuses is --topk
        (["--learner", "fsdp", "--align", "strict", "--topk", "5"], "--topk needs --learner hf"),
    ],
)
def test_bad_recipe_flags_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    from mp_testlib import cli

    proc = cli("compare", "--out", str(tmp_path / "run"), *args, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert message in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


def test_explain_pair_names_activation_scaling() -> None:
    from mismatch_probe.kernels.nvfp4.linear import explain_pair

    torch.manual_seed(6)
    x, w = torch.randn(8, 128).bfloat16(), torch.randn(32, 128).bfloat16()
    x[0] *= 30
    same = explain_pair(x, w, NVFP4Linear("nvfp4-per-token"), NVFP4Linear("nvfp4-per-token"))
    assert same["reason"].startswith("none") and same["output_max_abs_diff"] == 0.0
    diff = explain_pair(x, w, NVFP4Linear("nvfp4-dynamic-tensor"), NVFP4Linear("nvfp4-per-token"))
    assert "activation scaling" in diff["reason"] and diff["activation_codes_differ_frac"] > 0
    assert "weight quantization" in diff["reason"]  # 16x16 tiles vs 1x16 blocks


def test_hf_learner_static_recipe_calibrates_and_records() -> None:
    from mismatch_probe.probes.hf.runner import HfLearner

    seqs = _seqs()[:3]
    with HfLearner(resolve_tiny_model("tiny-qwen3"), 512, recipe="nvfp4-static", device="cpu") as lr:
        out = lr.score(seqs, list(range(len(seqs))))
        rec = lr.info.settings["recipe"]
    assert rec["name"] == "nvfp4-static" and rec["calibrated_linears"] == 28  # 4 layers x 7 linears
    assert rec["nvfp4"]["activation_amax"] == "static" and rec["nvfp4"]["weight_blocks"] == "1x16"
    assert all(len(o) == len(s) - 1 for o, s in zip(out, seqs, strict=True))
    assert lr.model is None  # unloaded (and unpatched)
