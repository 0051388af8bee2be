"""Option values checked before any engine starts: each bad value is a one-line :class:`UsageError`
that names the flag (NaN, infinities and out-of-range numbers included)."""

from __future__ import annotations

import math
from pathlib import Path

from mismatch_probe.errors import UsageError

DTYPES = ("bfloat16", "float16", "float32")
_SHOWN = 12  # digits of an integer shown in a message (no 309-digit echoes)


def shown(v: object) -> str:
    """``v`` for a message, huge integers shortened (``1e+308`` rather than 309 digits)."""
    if isinstance(v, int) and not isinstance(v, bool) and len(str(abs(v))) > _SHOWN:
        return f"{float(v):.3g}" if abs(v) < 10**308 else f"an integer of {len(str(abs(v)))} digits"
    return repr(v) if isinstance(v, str) else str(v)


def at_least(v: int, flag: str, minimum: int) -> int:
    if v < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {shown(v)}")
    return v


def finite(v: float, flag: str, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None) -> float:
    """A finite number (not NaN or infinite), >= ``minimum``, > ``above``, <= ``maximum``."""
    if not math.isfinite(v):
        raise UsageError(f"{flag} must be a finite number, got {v}")
    if minimum is not None and v < minimum:
        raise UsageError(f"{flag} must be >= {minimum:g}, got {v:g}")
    if above is not None and v <= above:
        raise UsageError(f"{flag} must be > {above:g}, got {v:g}")
    if maximum is not None and v > maximum:
        raise UsageError(f"{flag} must be <= {maximum:g}, got {v:g}")
    return v


def fraction(v: float, flag: str) -> float:
    return finite(v, flag, minimum=0.0, maximum=1.0)


def dtype(v: str, flag: str = "--dtype") -> str:
    if v not in DTYPES:
        raise UsageError(f"{flag} must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {v!r}")
    return v


def recipe(name: str | None, flag: str = "--recipe") -> str:
    """A recipe name as both engines know it (``mismatch_probe.kernels.recipes``)."""
    from mismatch_probe.kernels.recipes import resolve

    try:
        return resolve("engine", name).name
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


INT_MAX = 2**31 - 1  # counts and sizes beyond this are mistakes (and overflow the engines' int32)


def compare_values(cfg: object) -> None:
    """The numeric options of ``compare`` (a ``CompareConfig``), before anything is loaded."""
    g = cfg.__dict__
    if g.get("model") in _tiny_names():
        check_cache()
    if "out" in g:  # the --out policy first: a refused folder costs no engine start
        from mismatch_probe.run.outpath import check_out_dir

        check_out_dir(g["out"], overwrite=bool(g.get("overwrite")))
    for flag, key, lo in (("--n", "n", 1), ("--max-tokens", "max_tokens", 1), ("--micro-batch-size", "micro_batch_size", 1),
                          ("--nproc", "nproc", 1), ("--capture-topk", "capture_topk", 0)):
        if key in g:
            at_least(g[key], flag, lo)
            at_most(g[key], flag, INT_MAX)
    for flag, key in (("--topk", "topk"), ("--capture-full-rows", "capture_full_rows")):
        if g.get(key) is not None:
            at_least(g[key], flag, 0)
            at_most(g[key], flag, INT_MAX)
    if "seed" in g:
        at_least(g["seed"], "--seed", 0)
        at_most(g["seed"], "--seed", 2**63 - 1 - 2**31)  # prompt i samples with seed + i (an int64 in the engines)
    if "temperature" in g:
        finite(g["temperature"], "--temperature", minimum=0.0)
    if "fsdp_timeout_s" in g:
        finite(g["fsdp_timeout_s"], "--fsdp-timeout", above=0.0)


def at_most(v: int, flag: str, maximum: int) -> int:
    if v > maximum:
        raise UsageError(f"{flag} must be <= {maximum}, got {shown(v)}")
    return v


# config attributes that give the checkpoint's tensors their shapes: changing one, weights cannot load
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts", "tie_word_embeddings")


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return " ".join(lines[:3]) if lines else type(e).__name__


def engine_values(model: object, lengths: list[int], topk: int, sampler_kwargs: dict, learner_kwargs: dict) -> None:
    """Values the engines would refuse after loading, checked now with their own validators where
    they exist (vLLM's config dataclasses, HF's ``PretrainedConfig.validate``). ``lengths``: the
    positions each sequence needs (prompt + response + the rescoring's one)."""
    vocab, ctx, path = model.vocab_size, model.max_positions, model.path  # type: ignore[attr-defined]
    if topk > vocab:
        raise UsageError(f"--topk {shown(topk)} is larger than the model's vocabulary ({vocab})")
    check_weights(path)
    _sampler_values(sampler_kwargs, max(lengths, default=1), ctx, topk)
    _learner_values(learner_kwargs, path)


def _sampler_values(kw: dict, needed: int, ctx: int, topk: int) -> None:
    mml = kw.get("max_model_len")
    if mml is not None:
        if not isinstance(mml, int) or mml < needed:
            raise UsageError(f"--sampler-arg max_model_len={shown(mml)}: the longest sequence needs {needed} positions "
                             "(prompt + response + one for the rescoring)")
        if mml > ctx:
            raise UsageError(f"--sampler-arg max_model_len={shown(mml)} is beyond the model's context ({ctx})")
    mlp = kw.get("max_logprobs")
    if mlp is not None and mlp != -1 and (not isinstance(mlp, int) or mlp < max(topk, 1)):
        raise UsageError(f"--sampler-arg max_logprobs={shown(mlp)}: the run asks for {max(topk, 1)} logprobs per "
                         "position (--topk, or the sampled token's); give at least that, or -1")
    try:
        import dataclasses

        from vllm.config import CacheConfig
    except Exception:  # noqa: BLE001 (vLLM missing or broken: the engine check reports it later)
        return
    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    sub = {k: v for k, v in kw.items() if k in fields}
    if sub:
        try:
            CacheConfig(**sub)
        except Exception as e:  # noqa: BLE001 (pydantic's ValidationError, ValueError, TypeError)
            raise UsageError(f"--sampler-arg {', '.join(f'{k}={v}' for k, v in sub.items())}: vLLM refuses it: "
                             f"{_first_line(e)}") from None


def _learner_values(kw: dict, path: object) -> None:
    if kw.get("cuda_graphs"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--learner-arg cuda_graphs=true needs a CUDA GPU")
    attn = kw.get("attn_implementation")
    if isinstance(attn, str) and attn.startswith("flash_attention"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--learner-arg attn_implementation={attn} needs a CUDA GPU (flash-attn); use sdpa or eager")
        from transformers.utils import is_flash_attn_2_available

        if attn == "flash_attention_2" and not is_flash_attn_2_available():
            raise UsageError(f"--learner-arg attn_implementation={attn}: the flash-attn package is not installed")
    overrides = {k: v for k, v in kw.items() if k not in ("attn_implementation", "cuda_graphs")}
    if not overrides:
        return
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(path)
    for k in SHAPE_KEYS:
        if k in overrides and overrides[k] != getattr(base, k, None):
            raise UsageError(f"--learner-arg {k}={shown(overrides[k])}: the checkpoint's weights are shaped for "
                             f"{k}={getattr(base, k, None)}; they cannot load with another")
    try:
        cfg = AutoConfig.from_pretrained(path, **overrides)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except Exception as e:  # noqa: BLE001 (HF raises ValueError and its strict-dataclass errors)
        raise UsageError(f"--learner-arg {', '.join(f'{k}={v}' for k, v in overrides.items())}: transformers refuses it: "
                         f"{_first_line(e)}") from None


def sequence_lengths(specs: list, prompt_ids: list[list[int]], max_tokens: int) -> list[int]:
    """Positions each sequence needs in the sampler: prompt + response (given, or up to
    ``max_tokens``) + one for the prefill rescoring's sampled token."""
    return [len(ids) + (len(s.response_token_ids) if s.response_token_ids is not None else max_tokens) + 1
            for s, ids in zip(specs, prompt_ids, strict=True)]


def check_weights(path: Path) -> None:
    """Each ``*.safetensors`` file of a model folder is whole: its header parses and its tensors'
    byte ranges fit the file (a truncated download or copy is named before an engine loads it)."""
    import json
    import struct

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            size = f.stat().st_size
            with f.open("rb") as fh:
                head = fh.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if n < 2 or 8 + n > size:
                    raise ValueError("the header is cut off")
                header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + n + end > size:
                raise ValueError(f"the tensors need {8 + n + end} bytes, the file has {size} (truncated?)")
        except OSError as e:
            raise UsageError(f"{f}: cannot read the weights: {e.strerror}") from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise UsageError(f"{f}: not a whole safetensors file: {e}") from None


def capture_values(cfg: object) -> None:
    """``capture``'s options (a ``CaptureConfig``), as ``compare`` checks the same ones."""
    compare_values(cfg)
    dtype(cfg.dtype)  # type: ignore[attr-defined]
    if cfg.recipe is not None:  # type: ignore[attr-defined]
        recipe(cfg.recipe)  # type: ignore[attr-defined]


def _tiny_names() -> tuple[str, ...]:
    from mismatch_probe.probes.models import TINY_NAMES

    return TINY_NAMES


def check_cache() -> Path:
    """``MISMATCH_PROBE_CACHE`` (where tiny models are built) is a folder that can be written, or can be made."""
    import os

    from mismatch_probe import settings

    cache = Path(settings.get("MISMATCH_PROBE_CACHE")).expanduser()
    where = f"MISMATCH_PROBE_CACHE={cache}"
    if cache.exists():
        if not cache.is_dir():
            raise UsageError(f"{where} is not a folder (tiny models are built there); point it at a folder")
        if not os.access(cache, os.W_OK | os.X_OK):
            raise UsageError(f"{where}: cannot write there (tiny models are built there)")
        return cache
    try:
        cache.mkdir(parents=True, exist_ok=True)  # made now (it would be at the model's build anyway)
    except OSError as e:
        raise UsageError(f"{where}: cannot create it ({e.strerror})") from None
    return cache
