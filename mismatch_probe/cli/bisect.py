"""``mismatch-probe bisect RUN``: first divergent op, local error per op, ablation."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from mismatch_probe.cli.app import app, console
from mismatch_probe.errors import UsageError


def _f(v: object) -> str:
    return "-" if v is None else (f"{v:.3e}" if isinstance(v, float) else str(v))


@app.command("bisect")
def bisect(
    run: Path = typer.Argument(..., help="A run directory written by compare (with op capture)."),
    replay: bool = typer.Option(True, "--replay/--no-replay", help="Local error by input substitution (loads both engines)."),
    max_rows: int = typer.Option(256, "--max-rows", help="Tokens per op used for input substitution."),
    top: int = typer.Option(10, "--top", help="Rows of the local-error table to print."),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation", help="Rank op classes and layers by aligning them."),
    min_share: float = typer.Option(0.05, "--min-share", help="Ablation: split a set only if it removes this share of the gap."),
    ablation_seqs: int = typer.Option(16, "--ablation-seqs", help="Ablation: score the N largest-gap sequences (0: all)."),
) -> None:
    """Find the first op where the engines differ and rank ops by the error they introduce."""
    from mismatch_probe.run.reader import BISECT, SEQUENCES, RunDir
    from mismatch_probe.run.schema import atomic_write_json
    from mismatch_probe.steps.bisect import Engines, first_divergent, load_op_errors, local_errors, longest_sequence, nvfp4_reason
    from mismatch_probe.steps.bisect import ablation as ablation_step
    from mismatch_probe.steps.ops_stage import read_ops
    from mismatch_probe.steps.validate import at_least, fraction

    at_least(max_rows, "--max-rows", 1)
    at_least(top, "--top", 0)
    at_least(ablation_seqs, "--ablation-seqs", 0)
    fraction(min_share, "--min-share")
    rd = RunDir(run).require_complete()
    manifest = rd.manifest
    cfg = manifest["config"]
    if not os.access(run, os.W_OK):
        raise UsageError(f"cannot write {run / BISECT}: the run folder is not writable (read-only?)")
    errs = load_op_errors(run)
    result: dict = {"schema_version": 1, "run": str(run), "first_divergent": first_divergent(errs)}
    recipes = cfg.get("recipes") or {}
    engine_run = all(recipes.get(side, "engine") == "engine" for side in ("learner", "sampler"))
    result["ablation"], result["ablation_note"] = [], "not run (--no-ablation)"
    if ablation and not engine_run:
        ablation = False
        result["ablation_note"] = f"not run: the run used recipes {recipes}; ablation aligns engine-kernel runs"
    fd0 = result["first_divergent"]["bitwise"]
    if replay or ablation or (fd0 is not None and not engine_run):  # an NVFP4 run's first divergence gets a reason
        if ablation and not rd.has(SEQUENCES):
            raise UsageError(f"{run} has no {SEQUENCES} (written by compare); rerun compare or pass --no-ablation")
        learner_ops = read_ops(run, "learner")
        with console.status("loading both engines"), Engines(cfg, align=ablation, longest=longest_sequence(run)) as engines:
            if engines.dropped:
                result["sampler_unsharded"] = {"dropped": engines.dropped, "reason": "replay and ablation switch ops "
                                               "inside one process: bisect runs the sampler with tensor_parallel_size=1"}
            if replay:
                with console.status("input substitution: each engine's op on the other's captured input"):
                    rows, skipped, failures = local_errors(cfg, learner_ops, read_ops(run, "sampler"), engines, max_rows)
                result["local_errors"], result["not_replayed"] = rows, skipped
                if failures:
                    result["replay_failures"] = failures
            if fd0 is not None and not engine_run:
                reason = nvfp4_reason(cfg, fd0["op"], learner_ops, engines)
                if reason is not None:
                    result["first_divergent"]["reason"] = reason
            if ablation:
                result.update(ablation_step(run, cfg, engines, min_share, ablation_seqs, console))
    atomic_write_json(rd.file(BISECT), result)

    fd = result["first_divergent"]
    t = Table(title=escape(f"bisect: {run}"))
    t.add_column("finding")
    t.add_column("op")
    t.add_column("detail")
    b, tol = fd["bitwise"], fd["tolerance"]
    b_detail = f"equal rows {b['bitwise_equal_frac']:.1%}" if b else "all ops equal"
    tol_detail = f"rel L2 {_f(tol['rel_l2'])} ({tol['dtype']})" if tol else "-"
    t.add_row("first not bitwise equal", b["op"] if b else "none", b_detail)
    dom = fd.get("dominant")
    dom_detail = f"equal rows {dom['bitwise_equal_frac']:.1%} (first op where most rows differ)" if dom else "-"
    t.add_row("dominant divergence", dom["op"] if dom else "none", dom_detail)
    t.add_row("first over tolerance", tol["op"] if tol else "none", tol_detail)
    if "reason" in fd:
        r = fd["reason"]
        detail = (f"act-scaling err {r['rel_error_from_activation_scaling']:.2e}, weight-quant err "
                  f"{r['rel_error_from_weight_quantization']:.2e} ({r['schemes']['learner']} vs {r['schemes']['sampler']})")
        t.add_row("why (NVFP4)", r["reason"], detail)
    console.print(t)
    if replay and result["local_errors"]:
        lt = Table(title="local error by input substitution (sampler op on learner input vs learner output)")
        for c in ("rank", "op", "local", "reverse", "inherited", "total", "bitwise"):
            lt.add_column(c, justify="right" if c != "op" else "left")
        for i, r in enumerate(result["local_errors"][:top], 1):
            lt.add_row(str(i), r["op"], _f(r["local_error"]), _f(r["reverse_local_error"]), _f(r["inherited_error"]),
                       _f(r["total_error"]), f"{r['local_bitwise_frac']:.0%}")
        console.print(lt)
    if result["ablation"]:
        at = Table(title=f"ablation: share of the gap (mean |dlogp| {result['gap_engine']:.3e}) removed by aligning")
        for c in ("group", "kind", "share", "gap after"):
            at.add_column(c, justify="left" if c in ("group", "kind") else "right")
        for r in result["ablation"]:
            at.add_row(str(r["group"]), r["kind"], f"{r['share']:.1%}", _f(r["gap_after"]))
        console.print(at)
        console.print(f"{result['ablation_passes']} passes; all aligned: gap {result['gap_all_aligned']:.3e}")
    console.print(f"written {escape(str(rd.file(BISECT)))}", highlight=False)
