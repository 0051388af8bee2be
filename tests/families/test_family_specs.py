"""Every family spec is consistent with the canonical vocabulary (cheap, no engine)."""

from __future__ import annotations

import pytest

from mismatch_probe.errors import UsageError
from mismatch_probe.families import registry
from mismatch_probe.families.base import parse_site
from mismatch_probe.families.opnames import LAYER_OPS
from mismatch_probe.probes.models import SUPPORTED_FAMILIES, TINY_NAMES

SPECS = list(registry.families().values())


def test_registry_finds_the_families_and_their_tiny_models() -> None:
    assert {"llama", "qwen3", "qwen3_moe"} <= set(registry.families())
    assert {"tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"} <= set(TINY_NAMES)
    assert SUPPORTED_FAMILIES["qwen3_moe"] == "Qwen3-MoE"
    with pytest.raises(UsageError, match="not supported"):
        registry.get("gpt2")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_type)
def test_layer_ops_are_canonical_and_in_execution_order(spec) -> None:
    assert set(spec.layer_ops) <= set(LAYER_OPS), set(spec.layer_ops) - set(LAYER_OPS)
    idx = [LAYER_OPS.index(k) for k in spec.layer_ops]
    assert idx == sorted(idx) and len(set(idx)) == len(idx)
    assert spec.layer_ops[-1] == "out"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_type)
def test_every_op_has_a_site_in_each_engine_or_is_declared_unobservable(spec) -> None:
    rope = {"attn.rope_q", "attn.rope_k"}
    for engine, sites, fused, extra, unobs in (
        ("hf", spec.hf_layer, {}, rope if spec.hf_rope_fn else set(), spec.hf_unobservable),
        ("vllm", spec.vllm_layer, spec.vllm_fused, (rope if spec.vllm_rope else set()) | {
            k for pair in spec.vllm_add_norms.values() for k in pair if not k.startswith("-")}, spec.vllm_unobservable),
    ):
        covered = set(sites) | {k for parts in fused.values() for k in parts} | extra | set(unobs)
        if engine == "vllm":
            covered.add("out")  # the residual output of the next add-norm
        assert set(spec.layer_ops) <= covered, (engine, set(spec.layer_ops) - covered)
        for site in sites.values():
            parse_site(site)
    assert set(spec.hf_heads_first) <= set(spec.hf_layer)  # a layout note needs an HF site


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.model_type)
def test_replay_references_name_ops_of_the_family(spec) -> None:
    for kind, refs in spec.replay_inputs.items():
        assert kind in spec.layer_ops
        for ref in refs:
            assert ref.removeprefix("-1.") in spec.layer_ops, (kind, ref)
    assert all(r in spec.layer_ops for r in spec.final_norm_inputs)
