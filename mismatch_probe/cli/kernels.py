"""``mismatch-probe kernels``: NVFP4 kernel checks, quantizer conformance, benchmarks.

torch and triton are imported inside the commands only (CLI start-up stays fast).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.table import Table

from mismatch_probe.cli.app import app, console
from mismatch_probe.errors import EngineUnavailable, UsageError

kernels_app = typer.Typer(
    help="NVFP4 kernels: named checks against the reference, quantizer conformance, H200 benchmarks.",
    no_args_is_help=True,
    add_completion=False,
)


@kernels_app.command("check")
def check_cmd(
    only: list[str] = typer.Option(None, "--only", help="Run only these checks (repeatable)."),
    list_only: bool = typer.Option(False, "--list", help="List the check names and exit."),
    json_out: Path = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> int:
    """Run the named checks of the Triton kernels against the pure-torch reference and print a
    pass/fail table; the "kind" column says "bitwise (atol=rtol=0)" for exact comparisons and
    "tolerance (its bound)" otherwise. Exit code 1 when any check fails.

    On a machine without CUDA the kernels run through the Triton interpreter on CPU."""
    from mismatch_probe.kernels.checks import CHECKS, kind_label, run_checks

    if list_only:
        for c in CHECKS:
            gpu = " (GPU only)" if c.gpu_only else ""
            console.print(f"{c.name}  [dim]{kind_label(c.exact, c.bound)}: {c.what}{gpu}[/]", highlight=False)
        return 0
    try:
        results = run_checks(only or None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from mismatch_probe.kernels.nvfp4.common import INTERPRET

    mode = "Triton interpreter on CPU (GEMM dots in fp32)" if INTERPRET else "CUDA"
    table = Table(title=f"NVFP4 kernel checks: {mode}")
    for col in ("check", "kind", "result", "seconds", "detail"):
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for r in results:
        table.add_row(
            r.name,
            kind_label(r.exact, r.bound),
            f"[{style[r.status]}]{r.status}[/]",
            f"{r.seconds:.2f}",
            r.detail,
        )
    out = _stdout()
    out.print(table)
    ran = [r for r in results if r.status != "skip"]
    failed = [r for r in ran if r.status == "fail"]
    skipped = len(results) - len(ran)
    out.print(f"{len(ran) - len(failed)}/{len(ran)} passed" + (f", {skipped} skipped (GPU only)" if skipped else ""))
    if json_out:
        json_out.write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 1 if failed else 0


def _stdout():  # noqa: N802, ANN201
    from rich.console import Console

    return Console(soft_wrap=False)


@kernels_app.command("conformance")
def conformance_cmd(
    tensor_file: Path = typer.Argument(..., help="A captured tensor: .pt/.pth (a tensor or a one-tensor dict) or .npy."),
    per_token: bool = typer.Option(False, "--per-token", help="Per-row global scales instead of one per tensor."),
    json_out: Path = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> int:
    """Quantize TENSOR_FILE with every known NVFP4 quantizer formula (vLLM CUDA, vLLM emulation,
    ModelOpt, compressed-tensors, torchao) and report how their codes, scales and dequantized
    values disagree with the canonical (TE) quantizer."""
    from mismatch_probe.kernels.conformance import disagreement, load_tensor

    try:
        x = load_tensor(str(tensor_file))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not bool(__import__("torch").isfinite(x).all()):
        raise UsageError(f"{tensor_file}: holds NaN/Inf values; conformance needs finite data")
    rows = disagreement(x, per_token=per_token)
    table = Table(title=f"NVFP4 quantizer conformance: {tensor_file.name} {tuple(x.shape)} {x.dtype}, "
                  f"{'per-token' if per_token else 'per-tensor'} global scale")
    for col in ("variant", "codes differ", "scales differ", "dequant differ", "max |dequant diff|",
                "non-zero blocks with scale 0"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    for r in rows:
        table.add_row(
            r["variant"],
            f"{r['codes_differ']:.4%}",
            f"{r['scales_differ']:.4%}",
            f"{r['dequant_differ']:.4%}",
            f"{r['max_abs_dequant_diff']:.4g}",
            str(r["nonzero_blocks_with_zero_scale"]),
        )
    _stdout().print(table)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=1))
    return 0


@kernels_app.command("bench")
def bench_cmd(
    out: Path = typer.Option(Path("."), "--out", help="Folder for results.json."),
    skip_checks: bool = typer.Option(False, "--skip-checks", help="Do not run the bitwise checks first."),
    only: str = typer.Option("checks,quantize,linear,sweep,moe,e2e", "--only",
                             help="Comma list: checks,quantize,linear,sweep,moe,e2e."),
) -> int:
    """Benchmark the kernels on the GPU (named checks, quantize vs copy bandwidth, the NVFP4 GEMM
    paths vs cuBLAS BF16 and FP8, rows-identical sweep, MoE grouped GEMM vs torch._grouped_mm, an HF
    forward) and print the table. Needs CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable("kernels bench needs a CUDA GPU; none is available here")
    parts = [p for p in only.split(",") if p]
    known = ("checks", "quantize", "linear", "sweep", "moe", "e2e")
    bad = [p for p in parts if p not in known]
    if bad:
        raise UsageError(f"--only: unknown part(s) {', '.join(bad)}; use {','.join(known)}")
    root = Path(__file__).resolve().parents[2] / "bench" / "bench_kernels.py"
    if not root.exists():
        raise UsageError(f"benchmark script not found at {root} (run from a source checkout)")
    import runpy

    argv = [str(root), "--out", str(out), "--only", ",".join(parts)] + (["--skip-checks"] if skip_checks else [])
    old = sys.argv
    try:
        sys.argv = argv
        ns = runpy.run_path(str(root), run_name="mismatch_probe_bench")
        return int(ns["main"]())
    finally:
        sys.argv = old


app.add_typer(kernels_app, name="kernels")
