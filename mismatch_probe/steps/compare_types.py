"""``compare``'s data types: the resolved configuration and what ``prepare`` hands the stages.

Below the orchestrator (:mod:`.compare`) and its stages (:mod:`.compare_stages`, :mod:`.ops_stage`):
they import this module, it imports none of them (no cycle, type-only imports included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.errors import UsageError
from mismatch_probe.probes.models import ModelInfo
from mismatch_probe.steps import options as opts
from mismatch_probe.steps.options import Flag
from mismatch_probe.steps.prompts import PromptSpec


def capture_plan(mode: str, rules: list[str], full_rows: int | None, topk: int, full_logits: bool) -> Any:
    """The CapturePlan of ``--capture`` / ``--capture-rule`` / ``--capture-full-rows`` /
    ``--capture-topk`` / ``--full-logits`` (None when capture is off)."""
    from mismatch_probe.probes.capture import build_plan

    if (full_rows or 0) < 0 or topk < 0:
        raise UsageError("--capture-full-rows and --capture-topk must be >= 0")
    return build_plan(mode, list(rules), full_rows, topk, full_logits)


LEARNERS = ("hf", "fsdp")
SAMPLERS = ("vllm",)


@dataclass
class CompareConfig:
    """The resolved configuration of one ``compare`` run (recorded whole in the manifest). Each field
    is also its command-line option (``Flag.field``: flags and help, see steps/options.py)."""

    out: Path = opts.OUT.field(Path("runs/latest"))
    model: str = opts.MODEL.field("tiny-qwen3")
    sampler_model: str | None = Flag(("--sampler-model",), "Checkpoint the sampler serves (default: --model).").field(None)
    learner: str = Flag(("--learner",), "hf | fsdp").field("hf")
    sampler: str = Flag(("--sampler",), "vllm").field("vllm")
    prompts: Path | None = Flag(("--prompts", "-p"), "JSONL prompts file (see README).").field(None)
    rollouts: Path | None = Flag(
        ("--rollouts",),
        "A training run's rollouts (Parquet or JSONL; ours, verl or slime column names): their recorded sampler "
        "logprobs are the decode view; learner and sampler prefill rescore them (see README).",
    ).field(None)
    n: int = Flag(("--n",), "Samples per prompt.").field(2)
    max_tokens: int = Flag(("--max-tokens",), "Response length limit.").field(16)
    temperature: float = Flag(("--temperature",), "Sampling temperature (logprobs: raw T=1 distribution).").field(1.0)
    seed: int = Flag(("--seed",), "Sampling seed (prompt i uses seed + i).").field(0)
    micro_batch_size: int = opts.MICRO_BATCH_SIZE.field(8)
    dtype: str = opts.DTYPE.field("bfloat16")
    overwrite: bool = opts.OVERWRITE.field(False)
    nproc: int = opts.NPROC.field(2)
    fsdp_timeout_s: float = opts.FSDP_TIMEOUT.field(300.0)
    fsdp_param_dtype: str | None = Flag(
        ("--fsdp-param-dtype",), "--learner fsdp: MixedPrecisionPolicy param dtype (default: --dtype)."
    ).field(None)
    fsdp_reduce_dtype: str = Flag(
        ("--fsdp-reduce-dtype",), "--learner fsdp: MixedPrecisionPolicy reduce dtype (recorded)."
    ).field("float32")
    capture: str = opts.CAPTURE.field("stats")
    capture_rules: list[str] = opts.CAPTURE_RULE.field(factory=list)
    capture_full_rows: int | None = opts.CAPTURE_FULL_ROWS.field(None)  # None: 256 under stats
    capture_topk: int = opts.CAPTURE_TOPK.field(8)
    full_logits: bool = opts.FULL_LOGITS.field(False)
    align: str = Flag(
        ("--align",), "engine | strict: strict makes every op batch-invariant and identical in both engines."
    ).field("engine")
    recipe: str | None = opts.RECIPE.field(None)
    learner_recipe: str | None = Flag(("--learner-recipe",), "The learner's recipe (overrides --recipe).").field(None)
    sampler_recipe: str | None = Flag(("--sampler-recipe",), "The sampler's recipe (overrides --recipe).").field(None)
    sampler_args: list[str] = opts.SAMPLER_ARG.field(factory=list)
    learner_args: list[str] = opts.LEARNER_ARG.field(factory=list)
    topk: int | None = Flag(
        ("--topk",),
        "Keep the top-K logprobs of every position on both sides (0: off) \\[default: 20 when capture is on].",
    ).field(None)

    def side_recipe(self, side: str) -> str:
        """The resolved recipe name of ``side`` ('learner' | 'sampler'): --align combined with
        --learner-recipe / --sampler-recipe, else --recipe (see mismatch_probe.kernels.recipes)."""
        from mismatch_probe.kernels.recipes import resolve

        own = self.learner_recipe if side == "learner" else self.sampler_recipe
        try:
            return resolve(self.align, own or self.recipe).name
        except ValueError as e:
            raise UsageError(str(e)) from None

    def resolved_topk(self) -> int:
        """--topk, or its default: 20 when op capture is on and the learner is HF, else 0 (off)."""
        if self.topk is not None:
            return self.topk
        return 20 if self.capture != "off" and self.learner == "hf" else 0

    def capture_plan(self) -> Any:
        """The CapturePlan of this run's capture options (None when capture is off)."""
        return capture_plan(self.capture, self.capture_rules, self.capture_full_rows, self.capture_topk, self.full_logits)

    def validate(self) -> None:
        from mismatch_probe.steps.validate import compare_values

        compare_values(self)  # numbers: ranges, NaN, infinities
        if self.rollouts is not None and self.prompts is not None:
            raise UsageError("give either --prompts or --rollouts, not both")
        if self.learner not in LEARNERS:
            raise UsageError(f"--learner must be one of {', '.join(LEARNERS)}, got {self.learner!r}")
        if self.topk is not None and self.topk < 0:
            raise UsageError("--topk must be >= 0 (0: off)")
        if self.topk and self.learner == "fsdp":
            raise UsageError("--topk needs --learner hf (the FSDP learner does not record top-K yet)")
        if self.nproc < 1:
            raise UsageError("--nproc must be >= 1")
        if self.fsdp_timeout_s <= 0:
            raise UsageError("--fsdp-timeout must be > 0 seconds")
        fsdp_dtypes = (("--fsdp-param-dtype", self.fsdp_param_dtype), ("--fsdp-reduce-dtype", self.fsdp_reduce_dtype))
        for flag, v in fsdp_dtypes:
            if v is not None and v not in ("bfloat16", "float16", "float32"):
                raise UsageError(f"{flag} must be bfloat16, float16 or float32")
        self.capture_plan()  # validates --capture and --capture-rule
        if self.sampler not in SAMPLERS:
            raise UsageError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.n < 1:
            raise UsageError("--n must be >= 1")
        if self.max_tokens < 1:
            raise UsageError("--max-tokens must be >= 1")
        if self.temperature < 0:
            raise UsageError("--temperature must be >= 0")
        if self.micro_batch_size < 1:
            raise UsageError("--micro-batch-size must be >= 1")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise UsageError("--dtype must be bfloat16, float16 or float32")
        recipes = {side: self.side_recipe(side) for side in ("learner", "sampler")}
        if recipes["learner"] != "engine" and self.dtype != "bfloat16":
            raise UsageError("recipes other than 'engine' are defined for --dtype bfloat16")
        from mismatch_probe.probes.engine_args import split_pairs

        split_pairs(self.sampler_args, "--sampler-arg")
        split_pairs(self.learner_args, "--learner-arg")


@dataclass
class Prepared:
    model: ModelInfo
    sampler_model: ModelInfo
    specs: list[PromptSpec]
    prompt_ids: list[list[int]]
    recorded: list[Any] | None = None  # RecordedRollout of --rollouts
    rollouts_naming: str | None = None
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)  # typed --sampler-arg
    sampler_auto: dict[str, dict] = field(default_factory=dict)  # settings the tool needs, with reasons
    learner_kwargs: dict[str, Any] = field(default_factory=dict)  # typed --learner-arg
