"""``mismatch-probe compare``: the learner-vs-sampler logprob gap on the same tokens."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from mismatch_probe.cli.app import app, console

SHOWN = (
    ("n_tokens", "response tokens"),
    ("mean_abs_dlogp", "mean |dlogp|"),
    ("max_abs_dlogp", "max |dlogp|"),
    ("p99_abs_dlogp", "p99 |dlogp|"),
    ("mean_abs_dprob", "mean |dprob|"),
    ("k3", "k3 (KL est.)"),
    ("chi2", "chi2"),
    ("clip_frac", "clip frac (eps 0.2)"),
    ("seq_max_abs_logratio", "max |seq log-ratio|"),
    ("pearson_prob", "pearson(prob)"),
)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, float) and v == int(v) and abs(v) >= 1:
        return str(int(v))
    return f"{v:.3e}" if v != 0 else "0"


def summary_table(summary: dict[str, Any], title: str) -> Table:
    t = Table(title=title)
    t.add_column("metric")
    pairs = summary["pairs"]
    for p in pairs:
        t.add_column(p.replace("_", " "), justify="right")
    for key, label in SHOWN:
        t.add_row(label, *[_fmt(pairs[p][key]) if pairs[p] else "-" for p in pairs])
    return t


@app.command("compare")
def compare(
    out: Path = typer.Option(Path("runs/latest"), "--out", "-o", help="Run directory to write."),
    model: str = typer.Option("tiny-qwen3", "--model", "-m", help="tiny-llama | tiny-qwen3 | tiny-qwen3-moe | local HF folder."),
    sampler_model: str | None = typer.Option(None, "--sampler-model", help="Checkpoint the sampler serves (default: --model)."),
    learner: str = typer.Option("hf", "--learner", help="hf | fsdp"),
    sampler: str = typer.Option("vllm", "--sampler", help="vllm"),
    prompts: Path | None = typer.Option(None, "--prompts", "-p", help="JSONL prompts file (see README)."),
    rollouts: Path | None = typer.Option(
        None,
        "--rollouts",
        help="A training run's rollouts (Parquet or JSONL; ours, verl or slime column names): their recorded "
        "sampler logprobs are the decode view; learner and sampler prefill rescore them (see README).",
    ),
    n: int = typer.Option(2, "--n", help="Samples per prompt."),
    max_tokens: int = typer.Option(16, "--max-tokens", help="Response length limit."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (logprobs: raw T=1 distribution)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (prompt i uses seed + i)."),
    micro_batch_size: int = typer.Option(8, "--micro-batch-size", help="Learner micro-batch size (right padding)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float16 | float32 (both engines)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing run directory."),
    align: str = typer.Option(
        "engine", "--align", help="engine | strict: strict makes every op batch-invariant and identical in both engines."
    ),
    recipe: str | None = typer.Option(
        None, "--recipe", help="Both sides: engine | strict | nvfp4-dynamic-tensor | nvfp4-static | nvfp4-per-token."
    ),
    learner_recipe: str | None = typer.Option(None, "--learner-recipe", help="The learner's recipe (overrides --recipe)."),
    sampler_recipe: str | None = typer.Option(None, "--sampler-recipe", help="The sampler's recipe (overrides --recipe)."),
    capture: str = typer.Option("stats", "--capture", help="Op capture: off | digest | stats | full."),
    topk: int | None = typer.Option(
        None,
        "--topk",
        help="Keep the top-K logprobs of every position on both sides (0: off) \\[default: 20 when capture is on].",
    ),
    capture_rule: list[str] = typer.Option([], "--capture-rule", help="GLOB=MODE[@START:END] (repeatable; last match wins)."),
    capture_full_rows: int | None = typer.Option(
        None, "--capture-full-rows",
        help="Keep raw values for the first N tokens (by seq_id, pos), the rows bisect replays "
        "\\[default: 256 under --capture stats].",
    ),
    capture_topk: int = typer.Option(8, "--capture-topk", help="logits rows: keep the top-k values and ids."),
    full_logits: bool = typer.Option(False, "--full-logits", help="Keep vocabulary-wide logits rows where capture is full."),
    nproc: int = typer.Option(2, "--nproc", help="--learner fsdp: number of ranks (gloo on CPU, NCCL on CUDA)."),
    fsdp_timeout: float = typer.Option(
        300.0,
        "--fsdp-timeout",
        help="--learner fsdp: seconds; a rank that dies or hangs stops the run within this (exit code 3).",
    ),
    fsdp_param_dtype: str | None = typer.Option(
        None, "--fsdp-param-dtype", help="--learner fsdp: MixedPrecisionPolicy param dtype (default: --dtype)."
    ),
    fsdp_reduce_dtype: str = typer.Option(
        "float32", "--fsdp-reduce-dtype", help="--learner fsdp: MixedPrecisionPolicy reduce dtype (recorded)."
    ),
    sampler_arg: list[str] = typer.Option(
        [], "--sampler-arg", help="KEY=VALUE: a vLLM engine argument, typed as vLLM types it (repeatable)."
    ),
    learner_arg: list[str] = typer.Option(
        [], "--learner-arg", help="KEY=VALUE: HF from_pretrained's attn_implementation or a config attribute (repeatable)."
    ),
) -> None:
    """Run sampler (vLLM) and learner (HF) on the same tokens; write RUN/ with token tables and gaps."""
    from mismatch_probe.steps.compare import CompareConfig, run_compare

    cfg = CompareConfig(
        out=out,
        model=model,
        sampler_model=sampler_model,
        learner=learner,
        sampler=sampler,
        prompts=prompts,
        rollouts=rollouts,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        overwrite=overwrite,
        align=align,
        recipe=recipe,
        learner_recipe=learner_recipe,
        sampler_recipe=sampler_recipe,
        capture=capture,
        topk=topk,
        capture_rules=list(capture_rule),
        capture_full_rows=capture_full_rows,
        capture_topk=capture_topk,
        full_logits=full_logits,
        nproc=nproc,
        fsdp_timeout_s=fsdp_timeout,
        fsdp_param_dtype=fsdp_param_dtype,
        fsdp_reduce_dtype=fsdp_reduce_dtype,
        sampler_args=list(sampler_arg),
        learner_args=list(learner_arg),
    )
    path, summary = run_compare(cfg, console)
    console.print(summary_table(summary, f"logprob gap, {summary['n_sequences']} sequences ({model})"))
    console.print(f"run written to [bold]{path}[/]")
