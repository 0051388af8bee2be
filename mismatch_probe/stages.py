"""The stages of ``compare``: sampler, learner, token comparison. Engines are imported here, lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
from rich.progress import Progress

from mismatch_probe import ops_stage
from mismatch_probe.compare import decode_table, summarize, token_gaps, tokens_table
from mismatch_probe.probes.base import GenerateParams, Rollout
from mismatch_probe.schema import atomic_write_json, read_table, write_table

if TYPE_CHECKING:
    from mismatch_probe.pipeline import CompareConfig, Prepared
    from mismatch_probe.rundir import RunWriter


def _record(run: RunWriter, side: str, runner: Any) -> None:
    info = runner.info
    run.manifest["engines"][side] = {"engine": info.engine, **info.settings}
    run.manifest["auto"].update({f"{side}.{k}": v for k, v in info.auto.items()})
    run.manifest["notes"].extend(info.notes)
    run.write_manifest()


def sample(cfg: CompareConfig, prep: Prepared, run: RunWriter, progress: Progress) -> list[Rollout]:
    """Generate (or take the given responses), then rescore every full sequence as a prefill."""
    from mismatch_probe.pipeline import step
    from mismatch_probe.probes.vllm_probe import VllmSampler

    max_len = max(len(p) for p in prep.prompt_ids) + max(
        [cfg.max_tokens] + [len(s.response_token_ids or []) for s in prep.specs]
    )
    sampler = VllmSampler(
        prep.sampler_model.path,
        prep.sampler_model.vocab_size,
        max_model_len=min(prep.sampler_model.max_positions, max(max_len + 1, 64)),  # rescoring generates 1 token
        seed=cfg.seed,
        dtype=cfg.dtype,
        recipe=cfg.side_recipe("sampler"),
    )
    with step(progress, "loading vLLM sampler"):
        sampler.__enter__()
    try:
        with step(progress, "pre-flight: tokenizer and weight parity"):
            ops_stage.sampler_preflight(prep, run, sampler)
        given = prep.specs[0].response_token_ids is not None
        if given:
            rollouts = [
                Rollout(seq_id=i, prompt_id=i, prompt_ids=ids, response_ids=list(s.response_token_ids or []))
                for i, (s, ids) in enumerate(zip(prep.specs, prep.prompt_ids, strict=True))
            ]
            run.manifest["notes"].append("responses were given (--prompts response_token_ids): no decode view")
        else:
            params = GenerateParams(n=cfg.n, max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed)
            with step(progress, f"sampling {len(prep.prompt_ids)} prompts x {cfg.n}"):
                rollouts = sampler.generate(prep.prompt_ids, params)
        short = [r for r in rollouts if len(r.token_ids) < 2]
        if short:
            run.manifest["notes"].append(f"{len(short)} sequences of a single token were left out (nothing to score)")
            rollouts = [r for r in rollouts if len(r.token_ids) >= 2]
        sampler.capture = ops_stage.capture_plan(cfg)
        with step(progress, f"rescoring {len(rollouts)} sequences as a prefill"):
            prefill = sampler.score([r.token_ids for r in rollouts], [r.seq_id for r in rollouts])
        ops_stage.write_ops(run, "sampler", sampler)
    finally:
        _record(run, "sampler", sampler)
        sampler.__exit__(None, None, None)
    table = pa.concat_tables([decode_table(rollouts), tokens_table(rollouts, prefill, "prefill")])
    write_table(run.path("sampler/tokens.parquet"), table, "tokens")
    seqs = {
        "seq_id": [r.seq_id for r in rollouts],
        "prompt_id": [r.prompt_id for r in rollouts],
        "n_prompt": [len(r.prompt_ids) for r in rollouts],
        "token_ids": [r.token_ids for r in rollouts],
    }
    write_table(run.path("sequences.parquet"), pa.table(seqs), "sequences")
    run.manifest["config"]["n_sequences"] = len(rollouts)
    return rollouts


def learn(cfg: CompareConfig, prep: Prepared, run: RunWriter, rollouts: list[Rollout], progress: Progress) -> None:
    """Teacher-forced learner forward on exactly the sampler's token ids."""
    from mismatch_probe.pipeline import step
    from mismatch_probe.probes.hf_probe import HfLearner

    learner: Any
    if cfg.learner == "fsdp":
        from mismatch_probe.probes.fsdp_probe import FsdpLearner

        learner = FsdpLearner(
            prep.model.path,
            prep.model.vocab_size,
            micro_batch_size=cfg.micro_batch_size,
            dtype=cfg.dtype,
            nproc=cfg.nproc,
            timeout_s=cfg.fsdp_timeout_s,
            mp_param_dtype=cfg.fsdp_param_dtype,
            mp_reduce_dtype=cfg.fsdp_reduce_dtype,
            _fault=cfg.extra.get("_fsdp_fault"),  # test-only fault injection (never set by the CLI)
        )
        learner.seq_meta = [(r.seq_id, r.prompt_id, len(r.prompt_ids)) for r in rollouts]
        learner.dataset_dest = run.path("learner/tokens_by_rank")  # moved in only after all ranks finished
        learner.ops_dataset_dest = run.path("learner/ops_by_rank")  # where op capture is on
    else:
        learner = HfLearner(
            prep.model.path,
            prep.model.vocab_size,
            micro_batch_size=cfg.micro_batch_size,
            dtype=cfg.dtype,
            recipe=cfg.side_recipe("learner"),
        )
    with step(progress, f"loading {learner.name.upper()} learner"):
        learner.__enter__()
    try:
        ops_stage.learner_preflight(prep, run, learner)
        learner.capture = ops_stage.capture_plan(cfg)
        with step(progress, "learner forward (teacher-forced)", total=len(rollouts)) as advance:
            learner.progress = advance
            scores = learner.score([r.token_ids for r in rollouts], [r.seq_id for r in rollouts])
        ops_stage.write_ops(run, "learner", learner)
    finally:
        _record(run, "learner", learner)
        learner.__exit__(None, None, None)
    write_table(run.path("learner/tokens.parquet"), tokens_table(rollouts, scores, "learner"), "tokens")


def compare_tokens(run: RunWriter, progress: Progress) -> dict[str, Any]:
    """Join the token tables and compute the summary metrics of the three pairs."""
    from mismatch_probe.pipeline import step

    with step(progress, "comparing token logprobs"):
        s = read_table(run.path("sampler/tokens.parquet"), "tokens").to_pandas()
        learner_df = read_table(run.path("learner/tokens.parquet"), "tokens").to_pandas()
        gaps = token_gaps(s, learner_df)
        write_table(run.path("compare/token_gaps.parquet"), pa.Table.from_pandas(gaps, preserve_index=False), "token_gaps")
        summary = {"schema_version": run.manifest["schema_version"], **summarize(gaps)}
        atomic_write_json(run.path("compare/summary.json"), summary)
    with step(progress, "comparing captured ops"):
        ops_stage.compare_ops(run.dir, int(run.manifest["config"].get("num_layers", 10_000)))
    return summary
