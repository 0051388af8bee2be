"""The tiny-model builder's per-family options (cheap, no engine): the byte-level BPE tokenizer and
random values for parameters that HF initializes to a constant."""

from __future__ import annotations

import torch

from mismatch_probe.probes import tiny_models as tm


def test_byte_bpe_tokenizer_is_deterministic_and_round_trips_the_prompt_words() -> None:
    a, b = tm._tokenizer("byte-bpe"), tm._tokenizer("byte-bpe")
    assert a.get_vocab() == b.get_vocab() and len(a.get_vocab()) == tm.VOCAB_SIZE
    text = "the quick brown fox jumps over the lazy dog."
    ids = a(text).input_ids
    assert 0 < len(ids) < len(text) and max(ids) < tm.VOCAB_SIZE
    assert a.decode(ids) == text
    assert a.convert_tokens_to_ids(tm.SPECIALS) == list(range(len(tm.SPECIALS)))


def test_random_init_touches_only_the_named_parameters_and_is_seeded() -> None:
    def model() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        torch.nn.init.zeros_(m[0].bias)
        return m

    m1, m2 = model(), model()
    w = m1[0].weight.detach().clone()
    tm._random_init(m1, ("0.bias",), seed=0)
    tm._random_init(m2, ("0.bias",), seed=0)
    assert torch.equal(m1[0].bias, m2[0].bias) and m1[0].bias.abs().sum() > 0
    assert torch.equal(m1[0].weight, w) and torch.equal(m1[1].bias, torch.zeros(4))
