"""Model resolution and validation (no engine import until a tiny model is built): tiny-model names
or local HF folders; the family comes from the spec registry."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import UsageError
from mismatch_probe.families import registry

# {model_type: label} and the embedded tiny models, from the family specs (families/registry.py)
SUPPORTED_FAMILIES = {t: s.label for t, s in registry.families().items()}
TINY_NAMES = tuple(registry.tiny_models())


@dataclass(frozen=True)
class ModelInfo:
    """What the tool needs to know about a model folder before loading any engine."""

    path: Path
    name: str  # tiny-model name or the folder path as given
    model_type: str
    vocab_size: int
    max_positions: int
    num_layers: int
    is_moe: bool
    kv_width: int = 0  # key (= value) values per token per layer: KV heads x head dim (0: not known)


def resolve_model(arg: str) -> ModelInfo:
    """Resolve ``--model``: a tiny-model name (built on first use) or a local HF folder."""
    if arg in TINY_NAMES:
        from mismatch_probe.probes.tiny_models import resolve_tiny_model

        path = resolve_tiny_model(arg)
    else:
        path = Path(arg).expanduser()
        if not path.exists():
            raise UsageError(
                f"model not found: {arg} (give a local HF folder or one of {', '.join(TINY_NAMES)})"
            )
        if not path.is_dir():
            raise UsageError(f"model must be a folder (an HF checkpoint), got a file: {arg}")
    return inspect_model_dir(path, name=arg)


def inspect_model_dir(path: Path, name: str | None = None) -> ModelInfo:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"{path} is not an HF model folder (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_FAMILIES:
        raise UsageError(
            f"{path}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UsageError(f"{path} has a config but no weights (*.safetensors)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise UsageError(f"{path} has no tokenizer (tokenizer.json)")
    try:
        return ModelInfo(
            path=path.resolve(),
            name=name or str(path),
            model_type=mt,
            vocab_size=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            num_layers=int(cfg["num_hidden_layers"]),
            is_moe=registry.get(mt).moe,
            kv_width=kv_width_of(cfg),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{cfg_path}: missing or invalid field {e}") from None


def kv_width_of(cfg: dict) -> int:
    """KV heads x head dim of the config (GQA ``num_key_value_heads``, else every head; ``head_dim``, else
    hidden / heads); 0 where the fields are missing."""
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        return max(0, kv * int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0
