"""Prompt input: JSONL files or built-in prompts, validated with line-precise errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.errors import UsageError

BUILTIN_PROMPTS = (
    "the quick brown fox",
    "once upon a time there was a king who",
    "water is made of",
    "write a short story about a dog and a boy who live near the sea",
    "what is the best way to learn music ?",
    "the city at night",
    "list four animal names",
    "my father said that the ocean is deep and",
)


@dataclass
class PromptSpec:
    """One prompt: text or token ids, and optionally given response ids to score."""

    line: int  # 1-based line in the prompts file (0 for built-in)
    text: str | None = None
    token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    extra: dict = field(default_factory=dict)


def _int_list(v: object, key: str, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise UsageError(f"{where}: {key!r} must be a list of integers")
    if any(t < 0 for t in v):
        raise UsageError(f"{where}: {key!r} holds a negative token id")
    return list(v)


def jsonl_objects(path: Path, where: Callable[[int], str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) of each non-blank line of a JSONL file; a line that is not
    a JSON object is a :class:`UsageError` located by ``where(line number)``."""
    with path.open(encoding="utf-8") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise UsageError(f"{where(n)}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{where(n)}: each line must be a JSON object")
            yield n, obj


def load_prompts(path: Path | None) -> list[PromptSpec]:
    """Parse a JSONL prompts file (or return the built-in prompts when ``path`` is None)."""
    if path is None:
        return [PromptSpec(line=0, text=t) for t in BUILTIN_PROMPTS]
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompts file not found: {path}")
    specs: list[PromptSpec] = []
    for n, obj in jsonl_objects(path, lambda n: f"{path}:{n}"):
        where = f"{path}:{n}"
        has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
        if has_text == has_ids:
            raise UsageError(f"{where}: give exactly one of 'prompt' or 'prompt_token_ids'")
        spec = PromptSpec(line=n)
        if has_text:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise UsageError(f"{where}: 'prompt' must be a non-empty string")
            spec.text = obj["prompt"]
        else:
            spec.token_ids = _int_list(obj["prompt_token_ids"], "prompt_token_ids", where)
            if not spec.token_ids:
                raise UsageError(f"{where}: 'prompt_token_ids' is empty")
        if "response_token_ids" in obj:
            spec.response_token_ids = _int_list(obj["response_token_ids"], "response_token_ids", where)
            if not spec.response_token_ids:
                raise UsageError(f"{where}: 'response_token_ids' is empty")
        spec.extra = {k: v for k, v in obj.items() if k not in ("prompt", "prompt_token_ids", "response_token_ids")}
        specs.append(spec)
    if not specs:
        raise UsageError(f"prompts file is empty: {path}")
    scored = {s.response_token_ids is not None for s in specs}
    if len(scored) > 1:
        raise UsageError(f"{path}: either every line gives 'response_token_ids' or none does")
    return specs
