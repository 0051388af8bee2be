"""The small runner interface every engine adapter implements (Polygraphy style).

Public methods validate their input, then call ``_impl`` methods; runners are context managers
that load on enter and release everything they created on exit. A runner is configured through its
constructor only (:func:`mismatch_probe.probes.factory.build_runner` makes every runner from an
``EngineSpec``); callers outside ``probes/`` use the methods below and never reach into the engine
(``llm``, ``model``): scoring, a recipe subset switched on for a while (ablation), replay of one op,
weight digests and parity, the sampler's tokenizer.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Rollout:
    """One sampled (or given) sequence."""

    seq_id: int
    prompt_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    decode_logprobs: list[float] | None = None  # sampler's logprob of each response token at decode
    decode_topk: tuple[Any, Any] | None = None  # --topk: the sampler's top-K ids, logprobs per response token [n, K]
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class GenerateParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0


@dataclass
class RunnerInfo:
    """What a runner reports for the manifest: versions, auto-chosen settings and why, notes."""

    engine: str
    settings: dict[str, Any] = field(default_factory=dict)
    auto: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _check_seqs(seqs: list[list[int]], vocab_size: int) -> None:
    for i, s in enumerate(seqs):
        if len(s) < 2:
            raise ValueError(f"sequence {i} has {len(s)} tokens; scoring needs at least 2")
        bad = [t for t in s if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sequence {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


class Runner(ABC):
    """Base of all engine runners."""

    name = "runner"

    def __init__(
        self,
        vocab_size: int,
        *,
        capture: Any = None,
        ops_dest: Path | None = None,
        auto: Mapping[str, Mapping[str, Any]] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``capture``: a CapturePlan (record canonical ops while scoring; None: off); ``ops_dest``:
        captured ops stream to this ops.parquet (bounded memory) instead of ``self.ops``; ``auto``:
        settings chosen for this runner by its caller, with their reasons (recorded in ``info``);
        ``progress``: callable(n_done) called as sequences are scored (``score(progress=)`` wins)."""
        self.vocab_size = vocab_size
        self.info = RunnerInfo(engine=self.name)
        self.info.auto.update({k: dict(v) for k, v in (auto or {}).items()})
        self._loaded = False
        self.capture: Any = capture
        self.ops: Any = None  # the ops table (pyarrow) of the last captured score(), when kept in memory
        self.ops_dest: Path | None = None if ops_dest is None else Path(ops_dest)
        self.progress = progress

    def __enter__(self) -> Runner:
        self._load_impl()
        self._loaded = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loaded:
            self._unload_impl()
            self._loaded = False

    def score(self, seqs: list[list[int]], seq_ids: list[int] | None = None, *,
              progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Teacher-forced logprob of each token given its prefix: array of len(seq) - 1 per seq
        (entry j is the logprob of ``seq[j + 1]``). ``seq_ids`` name the sequences in captures;
        ``progress``: callable(n_done) for this call (else the constructor's)."""
        self._check_loaded()
        _check_seqs(seqs, self.vocab_size)
        seq_ids = list(range(len(seqs))) if seq_ids is None else list(seq_ids)
        if len(seq_ids) != len(seqs) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids must name each sequence once")
        saved = self.progress
        if progress is not None:
            self.progress = progress
        try:
            out = self._score_impl(seqs, seq_ids)
        finally:
            self.progress = saved
        for s, lp in zip(seqs, out, strict=True):
            assert lp.shape == (len(s) - 1,), (lp.shape, len(s))
        return out

    def _check_loaded(self) -> None:
        if not self._loaded:
            raise RuntimeError(f"{self.name} runner used outside its `with` block")

    @contextlib.contextmanager
    def recipe_applied(self, recipe: str, ops: Iterable[str] | None = None,
                       layers: Iterable[int] | None = None) -> Iterator[None]:
        """Score under ``recipe`` restricted to op classes ``ops`` and decoder ``layers`` (bisect's
        ablation), on top of the recipe the runner was built with; restored on exit."""
        self._check_loaded()
        with self._recipe_impl(recipe, None if ops is None else sorted(ops), None if layers is None else sorted(layers)):
            yield

    def _recipe_impl(self, recipe: str, ops: list[str] | None,
                     layers: list[int] | None) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError(f"the {self.name} runner cannot switch recipes in place")

    def replay(self, op: str, inputs: list[Any], pos: Any) -> Any:
        """This engine's implementation of canonical ``op`` on the captured ``inputs`` (tensors
        [rows, numel]) at positions ``pos``: its output rows (bisect's input substitution)."""
        self._check_loaded()
        return self._replay_impl(op, inputs, pos)

    def _replay_impl(self, op: str, inputs: list[Any], pos: Any) -> Any:
        raise NotImplementedError(f"the {self.name} runner cannot replay ops")

    def _finish_capture(self, rec: Any) -> None:
        """Close the op recorder: ``self.ops`` holds the table, or None where it streamed to
        ``self.ops_dest``; the manifest learns what was kept."""
        if self.ops_dest is not None:
            rec.close()
            self.ops = None
        else:
            self.ops = rec.table()
        self.info.settings["capture"] = rec.summary()

    @abstractmethod
    def _load_impl(self) -> None: ...

    @abstractmethod
    def _unload_impl(self) -> None: ...

    @abstractmethod
    def _score_impl(self, seqs: list[list[int]], seq_ids: list[int]) -> list[np.ndarray]: ...


class SamplerRunner(Runner):
    """A runner that also generates (the RL sampler)."""

    def generate(self, prompts: list[list[int]], params: GenerateParams) -> list[Rollout]:
        """Sample ``params.n`` responses per prompt; keep each sampled token's decode logprob."""
        if not self._loaded:
            raise RuntimeError(f"{self.name} runner used outside its `with` block")
        if params.n < 1 or params.max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        return self._generate_impl(prompts, params)

    @abstractmethod
    def _generate_impl(self, prompts: list[list[int]], params: GenerateParams) -> list[Rollout]: ...
