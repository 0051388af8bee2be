"""The one place runners are made: an :class:`EngineSpec` in, a configured runner out.

Every command and step describes the engine it needs as data (model, dtype, device, engine
arguments, recipe with its op/layer subset, capture plan and destination, top-K, the sequences'
metadata) and calls :func:`build_runner`; the runner is configured through its constructor only and
entered by the caller (``with build_runner(spec) as runner:``). vLLM's context length follows one
rule, :func:`max_model_len`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.errors import UsageError
from mismatch_probe.probes.base import Runner
from mismatch_probe.probes.models import ModelInfo

ENGINES = ("hf", "fsdp", "vllm")
LEARNERS = ("hf", "fsdp")
MIN_MODEL_LEN = 64  # vLLM's context is never made smaller than this (tiny sequences, warm-up)


@dataclass(frozen=True)
class EngineSpec:
    """What one runner is: built by :func:`build_runner`, never changed after."""

    engine: str  # hf | fsdp | vllm
    model: ModelInfo
    longest_seq: int  # tokens of the longest sequence the runner will see (prompt + response)
    dtype: str = "bfloat16"
    device: str | None = None  # hf / fsdp: None picks CUDA when available (recorded with the reason)
    seed: int = 0  # vllm: sampling seed
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # typed --sampler-arg (vllm) / --learner-arg
    engine_auto: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # settings chosen for it, with reasons
    recipe: str | None = None  # kernels.recipes name (None / 'engine': the engine's own ops)
    recipe_ops: frozenset[str] | None = None  # subset of op classes the recipe patches (empty: idle, ablation)
    recipe_layers: frozenset[int] | None = None  # subset of decoder layers
    capture: Any = None  # a CapturePlan (None: no op capture)
    ops_dest: Path | None = None  # hf / vllm: the ops.parquet captured ops stream to; fsdp: the ops_by_rank folder
    tokens_dest: Path | None = None  # fsdp: where the per-rank tokens dataset goes (tokens_by_rank)
    topk: int = 0  # hf / vllm: keep the top-K logprobs of every position
    topk_support: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # hf: the sampler's top-K ids
    seq_meta: tuple[tuple[int, int, int], ...] | None = None  # fsdp: (seq_id, prompt_id, n_prompt) per sequence
    micro_batch_size: int = 8  # hf / fsdp
    nproc: int = 2  # fsdp: ranks
    timeout_s: float = 300.0  # fsdp: a rank that dies or hangs ends the run within this
    mp_param_dtype: str | None = None  # fsdp: MixedPrecisionPolicy param dtype (None: dtype)
    mp_reduce_dtype: str = "float32"  # fsdp: MixedPrecisionPolicy reduce dtype
    row_parallel_slices: int = 1  # hf: reduce the row-parallel linears' K in N slices (strict, TP = N sampler)

    @property
    def side(self) -> str:
        return "learner" if self.engine in LEARNERS else "sampler"


def max_model_len(model: ModelInfo, longest_seq: int) -> int:
    """vLLM's context for sequences of up to ``longest_seq`` tokens: one more position (the prefill
    rescoring generates one token), at least :data:`MIN_MODEL_LEN`, at most the model's own."""
    return min(model.max_positions, max(longest_seq + 1, MIN_MODEL_LEN))


def build_runner(spec: EngineSpec) -> Runner:
    """The runner of ``spec``, configured, not loaded (enter it to load)."""
    if spec.engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {spec.engine!r}")
    if spec.topk and spec.engine == "fsdp":
        raise UsageError("--topk needs --learner hf (the FSDP learner does not record top-K yet)")
    if spec.seq_meta is not None and spec.engine != "fsdp":
        raise ValueError("seq_meta is the FSDP learner's (its ranks write the token tables)")
    m = spec.model
    if spec.engine == "vllm":
        from mismatch_probe.probes.vllm.runner import VllmSampler

        return VllmSampler(m.path, m.vocab_size, max_model_len=max_model_len(m, spec.longest_seq), seed=spec.seed,
                           dtype=spec.dtype, recipe=spec.recipe, recipe_ops=spec.recipe_ops,
                           recipe_layers=spec.recipe_layers, llm_kwargs=dict(spec.engine_kwargs), topk=spec.topk,
                           capture=spec.capture, ops_dest=spec.ops_dest, auto=spec.engine_auto)
    kw = dict(spec.engine_kwargs)
    graphs = bool(kw.pop("cuda_graphs", False))  # the HF learner's (engine_args.learner_kwargs refuses it elsewhere)
    common: dict[str, Any] = {
        "micro_batch_size": spec.micro_batch_size,
        "dtype": spec.dtype,
        "device": spec.device,
        "attn_implementation": kw.pop("attn_implementation", "sdpa"),
        "model_kwargs": kw,
        "recipe": spec.recipe,
        "capture": spec.capture,
        "auto": spec.engine_auto,
    }
    if spec.engine == "fsdp":
        from mismatch_probe.probes.fsdp.runner import FsdpLearner

        if spec.recipe_ops is not None or spec.recipe_layers is not None or spec.row_parallel_slices > 1 or graphs:
            raise ValueError("the FSDP learner runs whole recipes only (no op/layer subset, no K slices), eagerly")
        return FsdpLearner(m.path, m.vocab_size, nproc=spec.nproc, timeout_s=spec.timeout_s,
                           mp_param_dtype=spec.mp_param_dtype, mp_reduce_dtype=spec.mp_reduce_dtype,
                           seq_meta=spec.seq_meta, dataset_dest=spec.tokens_dest, ops_dataset_dest=spec.ops_dest,
                           **common)
    from mismatch_probe.probes.hf.runner import HfLearner

    return HfLearner(m.path, m.vocab_size, cuda_graphs=graphs, recipe_ops=spec.recipe_ops,
                     recipe_layers=spec.recipe_layers, topk=spec.topk,
                     topk_support=spec.topk_support, row_parallel_slices=spec.row_parallel_slices,
                     ops_dest=spec.ops_dest, **common)
