"""``compare``: run the sampler and the learner on the same tokens and write the run directory."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from mismatch_probe.errors import UsageError
from mismatch_probe.probes.models import ModelInfo, resolve_model
from mismatch_probe.run.rundir import RunWriter
from mismatch_probe.steps.compare_types import LEARNERS, SAMPLERS, CompareConfig, Prepared
from mismatch_probe.steps.progress import progress_bars, stage_seconds
from mismatch_probe.steps.prompts import PromptSpec, load_prompts

__all__ = ["LEARNERS", "SAMPLERS", "CompareConfig", "Prepared", "prepare", "run_compare", "tokenize_prompts"]

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

    skw, sauto = engine_args.sampler_kwargs(
        engine_args.split_pairs(cfg.sampler_args, "--sampler-arg"),
        capture_on=cfg.capture_plan() is not None,
        recipe=cfg.side_recipe("sampler"),
    )
    lkw = engine_args.learner_kwargs(engine_args.split_pairs(cfg.learner_args, "--learner-arg"), model.path,
                                     capture_on=cfg.capture_plan() is not None, learner=cfg.learner)
    from mismatch_probe.steps.validate import engine_values, sequence_lengths

    engine_values(model, sequence_lengths(specs, ids, cfg.max_tokens), cfg.resolved_topk(), skw, lkw)
    return Prepared(model=model, sampler_model=smodel, specs=specs, prompt_ids=ids, recorded=recorded, rollouts_naming=naming,
                    sampler_kwargs=skw, sampler_auto=sauto, learner_kwargs=lkw)


def run_compare(cfg: CompareConfig, console: Console) -> tuple[Path, dict[str, Any]]:
    """Everything ``mismatch-probe compare`` does; returns the run path and the summary."""
    from mismatch_probe.steps import compare_stages as stages

    t0 = time.perf_counter()
    prep = prepare(cfg)
    with RunWriter(cfg.out, overwrite=cfg.overwrite) as run, progress_bars(console) as progress:
        run.set_config({
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
            "model_dir": str(prep.model.path),
            "sampler_model_dir": str(prep.sampler_model.path),
            "model_type": prep.model.model_type,
            "num_layers": prep.model.num_layers,
            "n_prompts": len(prep.specs),
            "recipes": {side: cfg.side_recipe(side) for side in ("learner", "sampler")},  # resolved, per side
            "topk_resolved": cfg.resolved_topk(),
        })
        if prep.recorded is not None:
            run.set_section("rollouts", {
                "file": str(cfg.rollouts),
                "naming": prep.rollouts_naming,
                "n_rollouts": len(prep.recorded),
                "trainer_logprobs": prep.recorded[0].old_logprobs is not None,
            })
        run.write_manifest()
        rollouts = stages.sample(cfg, prep, run, progress)
        stages.learn(cfg, prep, run, rollouts, progress)
        summary = stages.compare_tokens(run, progress)
        # where the user's wait went (the engines' start-up included in their stages; not the final rename)
        run.set_section("timings", {"stages_s": stage_seconds(progress), "total_s": round(time.perf_counter() - t0, 3)})
        path = run.finish()
    return path, summary
