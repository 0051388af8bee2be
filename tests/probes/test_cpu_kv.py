"""vLLM's KV cache on the CPU sized from the run (probes/vllm/cpu_kv.py), not from the machine's RAM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch_probe.probes.vllm import cpu_kv


def _cfg(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_bytes_per_token_from_the_config(tmp_path: Path) -> None:
    dense = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}
    assert cpu_kv.bytes_per_token(_cfg(tmp_path, dense), "bfloat16") == 2 * 4 * 2 * 64 * 2
    assert cpu_kv.bytes_per_token(tmp_path, "float32") == 2 * 4 * 2 * 64 * 4
    gemma = {"text_config": {**dense, "head_dim": 256}}  # a multimodal config: the text model's, its own head_dim
    assert cpu_kv.bytes_per_token(_cfg(tmp_path, gemma), "bfloat16") == 2 * 4 * 2 * 256 * 2
    no_kv = {k: v for k, v in dense.items() if k != "num_key_value_heads"}  # MHA: every head has its K/V
    assert cpu_kv.bytes_per_token(_cfg(tmp_path, no_kv), "bfloat16") == 2 * 4 * 8 * 64 * 2
    assert cpu_kv.bytes_per_token(_cfg(tmp_path, {"model_type": "x"}), "bfloat16") is None
    assert cpu_kv.bytes_per_token(tmp_path / "missing", "bfloat16") is None


def test_kv_cache_bytes_holds_every_sequence_at_the_full_context_and_keeps_the_cap(tmp_path: Path) -> None:
    d = _cfg(tmp_path, {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 128})
    per = cpu_kv.bytes_per_token(d, "bfloat16")
    assert per is not None
    got = cpu_kv.kv_cache_bytes(d, "bfloat16", 300, None, 1 << 40)  # 300 tokens: two whole 256-token blocks
    assert got == int(per * cpu_kv.CPU_MAX_NUM_SEQS * 512 * cpu_kv.MARGIN + cpu_kv.FLOOR)
    assert cpu_kv.kv_cache_bytes(d, "bfloat16", 300, 8, 1 << 40) == int(per * 8 * 512 * cpu_kv.MARGIN + cpu_kv.FLOOR)
    assert cpu_kv.kv_cache_bytes(d, "bfloat16", 300, None, 1000) == 1000  # never more than the RAM share
    assert cpu_kv.kv_cache_bytes(tmp_path / "missing", "bfloat16", 300, None, 1000) is None


@pytest.mark.vllm
def test_the_cpu_sampler_ran_with_the_run_sized_cache(real_run_qwen3: Path) -> None:
    """The shared tiny-qwen3 run (real vLLM on the CPU, no memory setting given): vLLM ran with the
    run-sized KV cache, far below the RAM share that bounds it, recorded with its reason."""
    import psutil

    from mismatch_probe.probes.models import resolve_model

    m = json.loads((real_run_qwen3 / "manifest.json").read_text())
    s = m["engines"]["sampler"]
    auto = m["auto"]["sampler.kv_cache_memory_bytes"]
    assert s["kv_cache_memory_bytes"] == auto["value"] and "max_num_seqs" in auto["reason"]
    per = cpu_kv.bytes_per_token(resolve_model(m["config"]["model"]).path, "bfloat16")
    assert per is not None
    blocks = -(-s["max_model_len"] // cpu_kv.BLOCK)
    assert s["kv_cache_memory_bytes"] == int(per * cpu_kv.CPU_MAX_NUM_SEQS * blocks * cpu_kv.BLOCK * cpu_kv.MARGIN
                                             + cpu_kv.FLOOR)
    assert s["kv_cache_memory_bytes"] < s["gpu_memory_utilization"] * psutil.virtual_memory().total
