"""``compare``: run the sampler and the learner on the same tokens and write the run directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.errors import UsageError
from mismatch_probe.probes.models import ModelInfo, resolve_model
from mismatch_probe.run.rundir import RunWriter
from mismatch_probe.steps.progress import progress_bars
from mismatch_probe.steps.prompts import PromptSpec, load_prompts

LEARNERS = ("hf", "fsdp")
SAMPLERS = ("vllm",)


@dataclass
class CompareConfig:
    """The resolved configuration of one ``compare`` run (recorded whole in the manifest)."""

    out: Path
    model: str = "tiny-qwen3"
    sampler_model: str | None = None
    learner: str = "hf"
    sampler: str = "vllm"
    prompts: Path | None = None
    rollouts: Path | None = None  # --rollouts: a training run's recorded rollouts (decode view from the file)
    n: int = 2
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    micro_batch_size: int = 8
    dtype: str = "bfloat16"
    overwrite: bool = False
    nproc: int = 2  # --learner fsdp: ranks
    fsdp_timeout_s: float = 300.0  # --learner fsdp: a rank that dies or hangs ends the run within this
    fsdp_param_dtype: str | None = None  # FSDP MixedPrecisionPolicy param dtype (None: --dtype)
    fsdp_reduce_dtype: str = "float32"  # FSDP MixedPrecisionPolicy reduce dtype
    capture: str = "stats"  # off | digest | stats | full: default op-capture mode
    capture_rules: list[str] = field(default_factory=list)  # GLOB=MODE[@START:END], last match wins
    capture_full_rows: int | None = None  # raw values for the first N tokens (seq_id, pos order); None: 256 under stats
    capture_topk: int = 8  # logits rows: keep the top-k values and ids
    full_logits: bool = False  # keep the vocabulary-wide logits rows where the plan says full
    align: str = "engine"  # --align: engine | strict (every op batch-invariant, identical in both engines)
    recipe: str | None = None  # --recipe (both sides): engine | strict | nvfp4-dynamic-tensor | nvfp4-static | nvfp4-per-token
    learner_recipe: str | None = None  # --learner-recipe: overrides --recipe for the learner
    sampler_recipe: str | None = None  # --sampler-recipe: overrides --recipe for the sampler
    sampler_args: list[str] = field(default_factory=list)  # --sampler-arg KEY=VALUE: vLLM engine arguments
    learner_args: list[str] = field(default_factory=list)  # --learner-arg KEY=VALUE: HF from_pretrained kwargs
    topk: int | None = None  # --topk K: top-K logprobs of every position (None: 20 when capture is on, HF learner)

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

    def validate(self) -> None:
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
        from mismatch_probe.steps import ops_stage

        ops_stage.capture_plan(self)  # validates --capture and --capture-rule
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


def tokenize_prompts(specs: list[PromptSpec], model: ModelInfo, max_tokens: int, what: str = "prompts line") -> list[list[int]]:
    """Token ids of each prompt, checked against the model's vocabulary and context."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model.path)
    except Exception as e:
        raise UsageError(f"cannot load the tokenizer of {model.path}: {str(e).splitlines()[0]}") from None
    if len(tok) > model.vocab_size:
        raise UsageError(
            f"the tokenizer of {model.path} has {len(tok)} tokens but the model's vocabulary has "
            f"{model.vocab_size}: they do not belong together"
        )
    out: list[list[int]] = []
    for i, s in enumerate(specs):
        where = f"prompt {i + 1}" if s.line == 0 else f"{what} {s.line}"
        ids = tok(s.text)["input_ids"] if s.text is not None else list(s.token_ids or [])
        if not ids:
            raise UsageError(f"{where}: tokenizes to no tokens")
        bad = [t for t in ids + list(s.response_token_ids or []) if t >= model.vocab_size]
        if bad:
            raise UsageError(f"{where}: token id {bad[0]} is outside the model's vocabulary ({model.vocab_size})")
        n_resp = len(s.response_token_ids) if s.response_token_ids is not None else max_tokens
        if len(ids) + n_resp >= model.max_positions:  # the prefill rescoring adds one sampled token
            raise UsageError(
                f"{where}: {len(ids)} prompt tokens + {n_resp} response tokens do not fit the model's "
                f"context of {model.max_positions} (one position is needed for the rescoring)"
            )
        if s.response_token_ids is not None and len(ids) + len(s.response_token_ids) < 2:
            raise UsageError(f"{where}: needs at least 2 tokens in all to score")
        out.append(ids)
    return out


def prepare(cfg: CompareConfig) -> Prepared:
    """Validate everything a run needs before any engine starts or any file is written."""
    cfg.validate()
    model = resolve_model(cfg.model)
    recorded, naming = None, None
    if cfg.rollouts is not None:
        from mismatch_probe.steps.rollouts import load_rollouts

        recorded, naming = load_rollouts(cfg.rollouts, model.vocab_size)
        specs = [PromptSpec(line=r.row, token_ids=r.prompt_ids, response_token_ids=r.response_ids) for r in recorded]
    else:
        specs = load_prompts(cfg.prompts)
    smodel = model if cfg.sampler_model in (None, cfg.model) else resolve_model(cfg.sampler_model)
    if smodel.vocab_size != model.vocab_size:
        raise UsageError(
            f"--sampler-model has vocabulary {smodel.vocab_size}, --model {model.vocab_size}: not the same policy"
        )
    if smodel.model_type != model.model_type:
        raise UsageError(f"--sampler-model is a {smodel.model_type} model, --model a {model.model_type} model")
    ids = tokenize_prompts(specs, model, cfg.max_tokens, what=f"{cfg.rollouts} row" if recorded else "prompts line")
    from mismatch_probe.probes import engine_args
    from mismatch_probe.steps import ops_stage

    skw, sauto = engine_args.sampler_kwargs(
        engine_args.split_pairs(cfg.sampler_args, "--sampler-arg"),
        capture_on=ops_stage.capture_plan(cfg) is not None,
        recipe=cfg.side_recipe("sampler"),
    )
    lkw = engine_args.learner_kwargs(engine_args.split_pairs(cfg.learner_args, "--learner-arg"), model.path)
    return Prepared(model=model, sampler_model=smodel, specs=specs, prompt_ids=ids, recorded=recorded, rollouts_naming=naming,
                    sampler_kwargs=skw, sampler_auto=sauto, learner_kwargs=lkw)


def run_compare(cfg: CompareConfig, console: Console) -> tuple[Path, dict[str, Any]]:
    """Everything ``mismatch-probe compare`` does; returns the run path and the summary."""
    from mismatch_probe.steps import compare_stages as stages

    prep = prepare(cfg)
    with RunWriter(cfg.out, overwrite=cfg.overwrite) as run, progress_bars(console) as progress:
        run.manifest["config"] = {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "model_dir": str(prep.model.path),
            "sampler_model_dir": str(prep.sampler_model.path),
            "model_type": prep.model.model_type,
            "num_layers": prep.model.num_layers,
            "n_prompts": len(prep.specs),
            "recipes": {side: cfg.side_recipe(side) for side in ("learner", "sampler")},  # resolved, per side
            "topk_resolved": cfg.resolved_topk(),
        }
        if prep.recorded is not None:
            run.manifest["rollouts"] = {
                "file": str(cfg.rollouts),
                "naming": prep.rollouts_naming,
                "n_rollouts": len(prep.recorded),
                "trainer_logprobs": prep.recorded[0].old_logprobs is not None,
            }
        run.write_manifest()
        rollouts = stages.sample(cfg, prep, run, progress)
        stages.learn(cfg, prep, run, rollouts, progress)
        summary = stages.compare_tokens(run, progress)
        path = run.finish()
    return path, summary
