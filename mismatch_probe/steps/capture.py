"""``capture``: one engine only, on the sequences of an earlier run, written as a capture folder
(``OUT/ENGINE/tokens.parquet`` and ops, ``OUT/sequences.parquet``, the manifest) to compare later
with ``diff``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.errors import UsageError
from mismatch_probe.probes.factory import ENGINES
from mismatch_probe.run import reader as layout
from mismatch_probe.steps import options as opts
from mismatch_probe.steps.compare_types import capture_plan
from mismatch_probe.steps.options import Flag


@dataclass
class CaptureConfig:
    """The resolved configuration of one ``capture`` (the manifest records it under ``config``). Each
    field is also its command-line option (``Flag.field``, see steps/options.py)."""

    engine: str = Flag(("--engine", "-e"), "hf | fsdp | vllm").field()
    source: Path = Flag(("--from",), "A run directory whose sequences (sequences.parquet) are scored.").field()
    out: Path = opts.OUT.field()
    model: str | None = opts.MODEL.field(None)  # default: the run's learner model
    capture: str = opts.CAPTURE.field("stats")
    capture_rules: list[str] = opts.CAPTURE_RULE.field(factory=list)
    capture_full_rows: int | None = opts.CAPTURE_FULL_ROWS.field(None)
    capture_topk: int = opts.CAPTURE_TOPK.field(8)
    full_logits: bool = opts.FULL_LOGITS.field(False)
    micro_batch_size: int = opts.MICRO_BATCH_SIZE.field(8)
    nproc: int = opts.NPROC.field(2)
    fsdp_timeout_s: float = opts.FSDP_TIMEOUT.field(300.0)
    recipe: str | None = opts.RECIPE.field(None)  # hf, vllm (the FSDP capture runs the engine's ops)
    dtype: str = opts.DTYPE.field("bfloat16")
    overwrite: bool = opts.OVERWRITE.field(False)
    sampler_args: list[str] = opts.SAMPLER_ARG.field(factory=list)
    learner_args: list[str] = opts.LEARNER_ARG.field(factory=list)

    @property
    def side(self) -> str:
        return "sampler" if self.engine == "vllm" else "learner"

    def engine_args(self, model_dir: Path, plan: Any) -> tuple[dict[str, Any], dict[str, dict]]:
        """The engine's typed --sampler-arg (vllm) or --learner-arg (hf, fsdp); the other side's is an error."""
        from mismatch_probe.probes import engine_args

        mine, other = ("--sampler-arg", "--learner-arg") if self.engine == "vllm" else ("--learner-arg", "--sampler-arg")
        if self.learner_args if self.engine == "vllm" else self.sampler_args:
            raise UsageError(f"{other} does not apply to --engine {self.engine} (use {mine})")
        if self.engine == "vllm":
            raw = engine_args.split_pairs(self.sampler_args, mine)
            return engine_args.sampler_kwargs(raw, capture_on=plan is not None, recipe=self.recipe or "engine")
        return engine_args.learner_kwargs(engine_args.split_pairs(self.learner_args, mine), model_dir,
                                          capture_on=plan is not None, learner=self.engine), {}

    def manifest_config(self) -> dict[str, Any]:
        return {"engine": self.engine, "from": str(self.source), "capture": self.capture,
                "capture_rules": list(self.capture_rules), "capture_full_rows": self.capture_full_rows,
                "capture_topk": self.capture_topk, "full_logits": self.full_logits,
                "micro_batch_size": self.micro_batch_size, "dtype": self.dtype, "nproc": self.nproc,
                "timeout": self.fsdp_timeout_s, "recipe": self.recipe, "sampler_args": list(self.sampler_args),
                "learner_args": list(self.learner_args)}


def run_capture(cfg: CaptureConfig, console: Console) -> tuple[Path, int]:
    """Everything ``mismatch-probe capture`` does; returns the capture folder and the number of sequences."""
    from mismatch_probe.analysis.token_gaps import tokens_table
    from mismatch_probe.probes.base import Rollout
    from mismatch_probe.probes.factory import EngineSpec, build_runner
    from mismatch_probe.probes.models import resolve_model
    from mismatch_probe.run.reader import RunDir
    from mismatch_probe.run.rundir import RunWriter
    from mismatch_probe.run.schema import write_table
    from mismatch_probe.steps.ops_stage import describe_capture

    engine = cfg.engine
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    from mismatch_probe.steps.validate import capture_values

    capture_values(cfg)  # --out, numbers, --dtype, --recipe: before anything loads
    src = RunDir(cfg.source).require_complete()
    if not src.has(layout.SEQUENCES):
        raise UsageError(f"{cfg.source} has no {layout.SEQUENCES}; run compare first")
    seqs = src.sequences()
    model_dir = src.config.get("model_dir")
    if cfg.model is None and not isinstance(model_dir, str):
        raise layout.corrupt(src.file(layout.MANIFEST), "config.model_dir is not a path; pass --model")
    mi = resolve_model(cfg.model or model_dir)
    plan = capture_plan(cfg.capture, cfg.capture_rules, cfg.capture_full_rows, cfg.capture_topk, cfg.full_logits)
    d = seqs.to_pydict()
    kwargs, auto = cfg.engine_args(mi.path, plan)
    with RunWriter(cfg.out, overwrite=cfg.overwrite) as run:
        conf = cfg.manifest_config()
        run.set_config({**{k: conf[k] for k in ("engine", "from")}, "model_dir": str(mi.path),
                        "model_type": mi.model_type, "num_layers": mi.num_layers,
                        **{k: v for k, v in conf.items() if k not in ("engine", "from")}}, kind="capture")
        run.set_section("capture", describe_capture(plan))
        fsdp = engine == "fsdp"
        spec = EngineSpec(
            engine, mi, max(len(t) for t in d["token_ids"]), dtype=cfg.dtype, engine_kwargs=kwargs, engine_auto=auto,
            recipe=None if fsdp else cfg.recipe, capture=plan,
            # FSDP: the rank datasets; HF, vLLM: streamed while the engine runs
            ops_dest=run.path(layout.ops_by_rank(engine) if fsdp else layout.ops_file(engine)),
            tokens_dest=run.path(layout.tokens_by_rank(engine)) if fsdp else None,
            seq_meta=tuple(zip(d["seq_id"], d["prompt_id"], d["n_prompt"], strict=True)) if fsdp else None,
            micro_batch_size=cfg.micro_batch_size, nproc=cfg.nproc, timeout_s=cfg.fsdp_timeout_s,
        )
        with console.status(f"{engine}: loading and scoring {len(d['seq_id'])} sequences"), build_runner(spec) as runner:
            scores = runner.score(d["token_ids"], d["seq_id"])
            info = runner.info
            run.record_engine(cfg.side, info.engine, info.settings, info.auto, info.notes, auto_prefix=engine)
        rollouts = [Rollout(seq_id=s, prompt_id=p, prompt_ids=t[:n], response_ids=t[n:])
                    for s, p, n, t in zip(d["seq_id"], d["prompt_id"], d["n_prompt"], d["token_ids"], strict=True)]
        source_name = "prefill" if cfg.side == "sampler" else "learner"
        write_table(run.path(layout.tokens_file(engine)), tokens_table(rollouts, scores, source_name), "tokens")
        if runner.ops is not None:
            write_table(run.path(layout.ops_file(engine)), runner.ops, "ops")
        write_table(run.path(layout.SEQUENCES), seqs, "sequences")
        path = run.finish()
    return path, len(d["seq_id"])
