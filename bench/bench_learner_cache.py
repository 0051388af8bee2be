"""Host time of the HF learner's forward with and without a KV cache (``padded_forward`` passes
``use_cache=False``): a Qwen3 model with the 0.6B shape's 28 layers and tiny widths, 4 x 16 tokens, one
CPU thread, so the forward is host-bound as the 0.6B forward is on the H200's host. Median of 200 calls
after 5 warm-ups, ``--rounds`` rounds alternating the two.

    python bench/bench_learner_cache.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(8, 1000, (4, 16))
    mask = torch.ones_like(ids)

    def median_ms(use_cache: bool) -> float:
        for _ in range(5):
            model(input_ids=ids, attention_mask=mask, use_cache=use_cache)
        ts = []
        for _ in range(200):
            t = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, use_cache=use_cache)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    print("| round | use_cache=True ms | use_cache=False ms |\n|---|---:|---:|")
    with torch.inference_mode():
        for r in range(a.rounds):
            print(f"| {r} | {median_ms(True):.3f} | {median_ms(False):.3f} |")


if __name__ == "__main__":
    main()
