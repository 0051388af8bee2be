"""vLLM's KV cache on the CPU sized from the run (probes/vllm/cpu_kv.py), not from the machine's RAM."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from mismatch_probe.probes.models import ModelInfo, kv_width_of
from mismatch_probe.probes.vllm import cpu_kv


def _model(layers: int, kv_width: int) -> ModelInfo:
    return ModelInfo(path=Path("."), name="t", model_type="qwen3", vocab_size=512, max_positions=4096,
                     num_layers=layers, is_moe=False, kv_width=kv_width)


def test_kv_width_from_the_config() -> None:
    dense = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    assert kv_width_of(dense) == 2 * 64  # GQA: KV heads x hidden / heads
    assert kv_width_of({**dense, "head_dim": 256}) == 2 * 256  # its own head_dim (Gemma, Qwen3)
    assert kv_width_of({k: v for k, v in dense.items() if k != "num_key_value_heads"}) == 8 * 64  # MHA
    assert kv_width_of({"model_type": "x"}) == 0 and kv_width_of({**dense, "num_attention_heads": 0}) == 0


def test_kv_cache_bytes_holds_every_sequence_at_the_full_context_and_keeps_the_cap() -> None:
    m = _model(2, 128)
    per = cpu_kv.bytes_per_token(m, "bfloat16")
    assert per == 2 * 2 * 128 * 2 and cpu_kv.bytes_per_token(m, "float32") == 2 * per
    # 300 tokens: two whole 256-token blocks per sequence
    assert cpu_kv.kv_cache_bytes(m, "bfloat16", 300, None, 0.3) == int(
        per * cpu_kv.CPU_MAX_NUM_SEQS * 512 * cpu_kv.MARGIN + cpu_kv.FLOOR)
    assert cpu_kv.kv_cache_bytes(m, "bfloat16", 300, 8, 0.3) == int(per * 8 * 512 * cpu_kv.MARGIN + cpu_kv.FLOOR)
    tiny = 1e-9  # never more than the RAM share
    assert cpu_kv.kv_cache_bytes(m, "bfloat16", 300, None, tiny) == int(tiny * psutil.virtual_memory().total)
    assert cpu_kv.kv_cache_bytes(_model(2, 0), "bfloat16", 300, None, 0.3) is None  # not known: the share


@pytest.mark.vllm
def test_the_cpu_sampler_ran_with_the_run_sized_cache(real_run_qwen3: Path) -> None:
    """The shared tiny-qwen3 run (real vLLM on the CPU, no memory setting given): vLLM ran with the
    run-sized KV cache, far below the RAM share that bounds it, recorded with its reason."""
    from mismatch_probe.probes.models import resolve_model

    m = json.loads((real_run_qwen3 / "manifest.json").read_text())
    s = m["engines"]["sampler"]
    auto = m["auto"]["sampler.kv_cache_memory_bytes"]
    assert s["kv_cache_memory_bytes"] == auto["value"] and "max_num_seqs" in auto["reason"]
    per = cpu_kv.bytes_per_token(resolve_model(m["config"]["model"]), "bfloat16")
    assert per is not None
    blocks = -(-s["max_model_len"] // cpu_kv.BLOCK)
    assert s["kv_cache_memory_bytes"] == int(per * cpu_kv.CPU_MAX_NUM_SEQS * blocks * cpu_kv.BLOCK * cpu_kv.MARGIN
                                             + cpu_kv.FLOOR)
    assert s["kv_cache_memory_bytes"] < s["gpu_memory_utilization"] * psutil.virtual_memory().total
