"""Embedded tiny models: built in-process from a config with seeded random weights, no download.

Each model is built once into a cache folder (``$MISMATCH_PROBE_CACHE`` or
``~/.cache/mismatch-probe``) as a regular HF folder (config, safetensors, tokenizer) that both
vLLM and transformers load. The folder name carries a build version: change ``BUILD_VERSION``
whenever the recipe below changes, so stale caches are never reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mismatch_probe import settings
from mismatch_probe.families.registry import tiny_models

BUILD_VERSION = 1
TINY_MODELS = tuple(tiny_models())  # one per family spec that names a tiny model (its ``tiny_config``)
DEFAULT_MODEL = "tiny-qwen3"
VOCAB_SIZE = 512
MAX_POSITIONS = 512

# A small English word list, so built-in prompts tokenize to real words (and decode readably).
_WORDS = """the of and to a in is it you that he was for on are with as his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very through
just form sentence great think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head stand own
page should country found answer school grow study still learn plant cover food sun four between
state keep eye never last let thought city tree cross farm hard start might story saw far sea draw
left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river
car feet care second book carry took science eat room friend began idea fish mountain stop once base
hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red
list though feel talk bird soon body dog family direct pose leave song measure door product black
short numeral class wind question happen complete ship area half rock order fire south problem piece
told knew pass since top whole king space heard best hour better true during hundred five remember
step early hold west ground interest reach fast verb sing listen six table travel less morning ten
simple several vowel toward war lay against pattern slow center love person money serve appear road
map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green oh quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane""".split()

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", ".", ",", "?", "!"]


def cache_root() -> Path:
    return settings.get("MISMATCH_PROBE_CACHE")


def _vocab() -> dict[str, int]:
    words: list[str] = list(SPECIALS)
    for w in _WORDS:
        if w not in words:
            words.append(w)
    i = 0
    while len(words) < VOCAB_SIZE:
        words.append(f"w{i}")
        i += 1
    return {w: idx for idx, w in enumerate(words[:VOCAB_SIZE])}


def _config(name: str):  # -> transformers.PretrainedConfig
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.06,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    spec = tiny_models().get(name)
    if spec is None:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY_MODELS)}")
    return transformers.AutoConfig.for_model(spec.model_type, **{**common, **spec.tiny_config})


def _tokenizer(kind: str = "word"):  # -> transformers.PreTrainedTokenizerFast
    """``word``: the word list as a word-level vocabulary. ``byte-bpe``: a byte-level BPE trained on
    the word list (256 byte symbols, the specials, then merges up to ``VOCAB_SIZE``; deterministic),
    for model types that transformers loads with a BPE tokenizer class whatever the folder says."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "byte-bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([" ".join(_WORDS)] * 3 + [" " + w for w in _WORDS], trainer)
    elif kind == "word":
        tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()]
        )
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    else:
        raise ValueError(f"unknown tiny tokenizer kind {kind!r}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )


def build_tiny_model(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Build tiny model ``name`` with seeded weights into ``out_dir`` (a regular HF folder)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = _config(name)
    torch.manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        spec = tiny_models()[name]
        _random_init(model, spec.tiny_random_init, seed)
    model = model.to(torch.bfloat16)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _tokenizer(spec.tiny_tokenizer).save_pretrained(out_dir)
    return out_dir


def _random_init(model, suffixes: tuple[str, ...], seed: int) -> None:  # model: a transformers model
    """Seeded N(0, 0.1) values for the parameters whose names end with one of ``suffixes``."""
    import torch

    if not suffixes:
        return
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(tuple(suffixes)):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def resolve_tiny_model(name: str) -> Path:
    """Path of the cached tiny model ``name``, building it on first use (atomic: temp + rename)."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}")
    root = cache_root() / "models"
    final = root / f"{name}-v{BUILD_VERSION}"
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    tmp.chmod(0o755)
    try:
        build_tiny_model(name, tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race; use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
