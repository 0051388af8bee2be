"""Benchmark `mismatch-probe report` on a run of 64 sequences x 256 tokens with full op capture.

The run is built synthetically (tests/fixtures/synthetic.py) with the shapes of a tiny Qwen3
(4 layers, hidden 128, 15 canonical ops per layer + final_norm + logits, bf16 values stored in
full mode in both sides' ops.parquet), plus op_errors.parquet and bisect.json. Prints a table;
figures go to BENCHMARKS.md (## report). Not a test: timings are never asserted.

    python bench/bench_report.py [--workdir DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mismatch_probe.reports import build_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the synthetic-run fixture lives under tests/
from fixtures.synthetic import make_run  # noqa: E402

CLI = [sys.executable, "-c", "import sys; from mismatch_probe.cli.main import main; main(sys.argv[1:])"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-seq", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-report-"))
    run = work / "run"

    t0 = time.perf_counter()
    make_run(run, n_seq=args.n_seq, seq_len=args.seq_len, prompt_len=32, vocab=2048, ops=True, full_ops=True,
             bisect=True, n_layers=4, hidden=128, seed=0)  # fmt: skip
    t_build = time.perf_counter() - t0
    ops_mb = sum((run / s / "ops.parquet").stat().st_size for s in ("learner", "sampler")) / 1e6
    run_mb = sum(p.stat().st_size for p in run.rglob("*") if p.is_file()) / 1e6

    inproc = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out, absent = build_report(run, work / "report.html")
        inproc.append(time.perf_counter() - t0)
        assert not absent, absent
    cli, cli_cpu = [], []
    for _ in range(args.repeat):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([*CLI, "report", str(run), "--out", str(work / "report-cli.html")], check=True, capture_output=True)
        cli.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli_cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    html_mb = out.stat().st_size / 1e6
    startup = [_timed([*CLI, "--help"]) for _ in range(args.repeat)]
    imports = [_timed([sys.executable, "-c", "import mismatch_probe.reports.render"]) for _ in range(args.repeat)]

    rows = [
        ("run", f"{args.n_seq} seqs x {args.seq_len} tokens, tiny Qwen3 shapes (4 layers, hidden 128)"),
        ("run dir size", f"{run_mb:.0f} MB (ops.parquet both sides: {ops_mb:.0f} MB)"),
        ("build synthetic run", f"{t_build:.1f} s"),
        ("report, in-process (median)", f"{statistics.median(inproc):.2f} s  (all: {', '.join(f'{t:.2f}' for t in inproc)})"),
        ("report, CLI cold start (median)", f"{statistics.median(cli):.2f} s  (all: {', '.join(f'{t:.2f}' for t in cli)})"),
        ("report, CLI cold start, CPU time (median)", f"{statistics.median(cli_cpu):.2f} s (user + sys; load-independent)"),
        ("of which: CLI start-up (--help)", f"{statistics.median(startup):.2f} s"),
        ("of which: report imports (mpl, pandas, pyarrow)", f"{statistics.median(imports):.2f} s"),
        ("HTML size", f"{html_mb:.2f} MB"),
        ("load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}"),
        ("machine", f"{platform.node()} {platform.machine()} {platform.python_version()}, {_cpus()} CPUs"),
    ]
    w = max(len(k) for k, _ in rows)
    print(f"{'metric':<{w}} | value")
    print("-" * w + "-|-" + "-" * 40)
    for k, v in rows:
        print(f"{k:<{w}} | {v}")


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
