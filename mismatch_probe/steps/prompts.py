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


TOKEN_ID_MAX = 2**31 - 1  # token ids are int32 in every table


def _int_list(v: object, key: str, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise UsageError(f"{where}: {key!r} must be a list of integers")
    if any(t < 0 for t in v):
        raise UsageError(f"{where}: {key!r} holds a negative token id")
    if any(t > TOKEN_ID_MAX for t in v):
        raise UsageError(f"{where}: {key!r} holds a token id above {TOKEN_ID_MAX} (no vocabulary is that large)")
    return list(v)


def check_readable(path: Path, what: str) -> Path:
    """A file to read: a regular file, or a pipe or terminal (``/dev/stdin``, ``<(...)``), read once."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{what} not found: {path}")
    if path.is_dir():
        raise UsageError(f"{what} {path} is a folder, expected a file")
    return path


def _text(s: str, where: str) -> str:
    """A prompt text that can be encoded (JSON allows lone surrogates such as \\ud800; tokenizers do not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where}: the text holds {s[e.start:e.end].encode('unicode_escape').decode()}, "
                         "a lone surrogate, which is not a character") from None
    return s


def jsonl_objects(path: Path, where: Callable[[int], str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) of each non-blank line of a JSONL file; a line that is not
    a JSON object is a :class:`UsageError` located by ``where(line number)``."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for n, raw_bytes in enumerate(f, start=1):
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = f"byte 0x{raw_bytes[e.start]:02x} at column {e.start + 1}"
                raise UsageError(f"{where(n)}: not UTF-8 text ({bad})") from None
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise UsageError(f"{where(n)}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise UsageError(f"{where(n)}: JSON nested too deeply") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{where(n)}: each line must be a JSON object")
            yield n, obj


def load_prompts(path: Path | None) -> list[PromptSpec]:
    """Parse a JSONL prompts file (or return the built-in prompts when ``path`` is None)."""
    if path is None:
        return [PromptSpec(line=0, text=t) for t in BUILTIN_PROMPTS]
    path = check_readable(path, "prompts file")
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
            spec.text = _text(obj["prompt"], where)
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
