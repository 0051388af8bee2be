"""FSDP learner benchmark: FSDP2 over N ranks (NCCL on CUDA, gloo on CPU) vs the single-process
HF learner on the same device, same sequences, same micro-batches.

    python bench/bench_fsdp.py [--model tiny-qwen3] [--seqs 64] [--nproc N] [--out DIR]

Measures: wall time of one FSDP ``score`` (launch + rendezvous + load + fully_shard + forward,
i.e. what ``compare --learner fsdp`` pays), each rank's setup and forward time, the single-process
HF load and forward times, and the logprob agreement (bitwise-equal fraction, max |d|) and op
capture agreement (digest-equal fraction, every (op, seq_id, pos) once). Prints a table last;
writes ``results.json`` under ``--out``. Timings are never test assertions.

Without ``pip install`` (the GPU machine): build a package shim and put it on PYTHONPATH:
``S=/tmp/mp; mkdir -p $S; cp -r mismatch_probe $S/; cp -r probes $S/mismatch_probe/probes;
cp -r kernels $S/mismatch_probe/kernels; PYTHONPATH=$S python bench/bench_fsdp.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np


def _agree(ref: list[np.ndarray], got: list[np.ndarray]) -> dict[str, Any]:
    a, b = np.concatenate(ref), np.concatenate(got)
    return {
        "n_tokens": int(a.size),
        "bitwise_equal_frac": float(np.mean(a == b)),
        "max_abs_diff": float(np.max(np.abs(a - b))),
        "mean_abs_diff": float(np.mean(np.abs(a - b))),
    }


def main() -> None:
    import torch

    from mismatch_probe.probes.capture import CapturePlan
    from mismatch_probe.probes.fsdp.runner import FsdpLearner
    from mismatch_probe.probes.hf.runner import HfLearner
    from mismatch_probe.probes.models import resolve_model

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--nproc", type=int, default=min(2, torch.cuda.device_count()) if cuda else 2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-ops", action="store_true", help="skip the op-capture agreement run")
    p.add_argument("--out", type=Path, default=Path("bench_fsdp_out"))
    a = p.parse_args()

    m = resolve_model(a.model)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, m.vocab_size, size=int(rng.integers(a.min_len, a.max_len + 1))).tolist()
            for _ in range(a.seqs)]
    sids = list(range(len(seqs)))
    kw: dict[str, Any] = {"micro_batch_size": a.micro_batch_size, "dtype": a.dtype}
    res: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "n_gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "model": a.model,
        "n_seqs": len(seqs),
        "n_tokens": sum(len(s) for s in seqs),
        "nproc": a.nproc,
        **kw,
    }

    t = time.monotonic()
    with HfLearner(m.path, m.vocab_size, **kw) as hf:
        res["hf_load_s"] = time.monotonic() - t
        t = time.monotonic()
        ref = hf.score(seqs, sids)
        res["hf_score_cold_s"] = time.monotonic() - t
        t = time.monotonic()
        ref2 = hf.score(seqs, sids)
        if cuda:
            torch.cuda.synchronize()
        res["hf_score_warm_s"] = time.monotonic() - t
        res["hf_repeat_bitwise"] = all(np.array_equal(x, y) for x, y in zip(ref, ref2, strict=True))
        if not a.no_ops:
            hf.capture = CapturePlan("digest")
            hf.score(seqs, sids)
            ref_ops = hf.ops.to_pandas()

    with FsdpLearner(m.path, m.vocab_size, nproc=a.nproc, timeout_s=240, **kw) as f:
        try:
            got = f.score(seqs, sids)
        except Exception:
            print(f.last_log)
            raise
        res["fsdp_wall_s"] = f.last_wall_s
        res["fsdp_rank_timings"] = f.rank_timings
        res["fsdp_settings"] = {k: f.info.settings[k] for k in ("world_size", "backend", "mp_param_dtype",
                                                                 "mp_reduce_dtype", "device")}
        res["logprobs_vs_hf"] = _agree(ref, got)
        if not a.no_ops:
            f.capture = CapturePlan("digest")
            f.score(seqs, sids)
            res["fsdp_capture_wall_s"] = f.last_wall_s
            ops = f.ops.to_pandas()
            keys = ["op", "seq_id", "pos"]
            j = ref_ops.merge(ops, on=keys, how="outer", suffixes=("_hf", "_fsdp"), indicator=True)
            res["ops_vs_hf"] = {
                "n_rows": len(ops),
                "unique_keys": bool(not ops.duplicated(keys).any()),
                "same_keys_as_hf": bool((j["_merge"] == "both").all()),
                "digest_equal_frac": float((j["digest_hf"] == j["digest_fsdp"]).mean()),
            }

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    lp = res["logprobs_vs_hf"]
    rows = [
        ("device", f"{res['device']} x{res['n_gpus']}" if cuda else res["device"]),
        ("torch", res["torch"]),
        ("workload", f"{a.model}, {len(seqs)} seqs, {res['n_tokens']} tokens, micro-batch {a.micro_batch_size}"),
        ("FSDP", f"{a.nproc} ranks, {res['fsdp_settings']['backend']}, param {res['fsdp_settings']['mp_param_dtype']}"
                 f", reduce {res['fsdp_settings']['mp_reduce_dtype']}"),
        ("FSDP score wall (launch+load+shard+forward)", f"{res['fsdp_wall_s']:.2f} s"),
        *[(f"  rank {r} setup / forward", f"{v['setup_s']:.2f} s / {v['forward_s']:.3f} s")
          for r, v in sorted(res["fsdp_rank_timings"].items())],
        ("HF single-process load / score cold / warm",
         f"{res['hf_load_s']:.2f} s / {res['hf_score_cold_s']:.3f} s / {res['hf_score_warm_s']:.3f} s"),
        ("logprobs FSDP vs HF: bitwise-equal tokens", f"{lp['bitwise_equal_frac']:.4f} of {lp['n_tokens']}"),
        ("logprobs FSDP vs HF: max |d| / mean |d|", f"{lp['max_abs_diff']:.3e} / {lp['mean_abs_diff']:.3e}"),
    ]
    if "ops_vs_hf" in res:
        o = res["ops_vs_hf"]
        rows.append(("ops FSDP vs HF: digest-equal rows",
                     f"{o['digest_equal_frac']:.4f} of {o['n_rows']} (unique {o['unique_keys']}, "
                     f"same keys {o['same_keys_as_hf']})"))
    w = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{w}}  {v}" for k, v in rows))


if __name__ == "__main__":
    main()
