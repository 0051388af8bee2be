"""FSDP learner (2 ranks, gloo on the CPU) with nvfp4-per-token: one score() wall time (launch, load,
fully_shard, 4 micro-batches per rank), a random-weight Llama-shaped model of 25 M linear parameters
(8 layers, hidden 512) written to ``--model-dir`` at first use. What it shows: how much of a score()
the per-forward re-quantization of the weights cost before the NVFP4 weight cache was keyed by shape.

    python bench/bench_fsdp_nvfp4_cache.py [--seqs 16] [--model-dir /tmp/mp-m50]

Prints one JSON line: sequences, score() seconds, and a logprob checksum (equal across code versions).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _model(d: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (d / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)


def main() -> None:
    from mismatch_probe.probes.fsdp.runner import FsdpLearner

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--model-dir", default="/tmp/mp-m50")
    a = ap.parse_args()
    d = Path(a.model_dir)
    _model(d)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 8000, 48).tolist() for _ in range(a.seqs)]
    with FsdpLearner(d, 8000, nproc=2, micro_batch_size=2, recipe="nvfp4-per-token", timeout_s=900) as f:
        t = time.perf_counter()
        lp = f.score(seqs, list(range(len(seqs))))
        dt = time.perf_counter() - t
    print(json.dumps({"seqs": len(seqs), "score_s": round(dt, 2), "lp0": float(lp[0][:4].sum())}))


if __name__ == "__main__":
    main()
