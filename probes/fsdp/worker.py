"""The FSDP learner's processes: the launcher (torch elastic agent) and the rank worker.

Two entry points of ``python -m mismatch_probe.probes.fsdp.worker``:

* ``--launch JOB --nproc N``: starts N rank processes through torch's own launcher
  (:func:`torch.distributed.launcher.api.elastic_launch`, c10d rendezvous on ``localhost:0``, as
  ``torchrun --standalone`` does, no restarts). When a rank fails, the agent stops the others and
  this process writes ``JOB/failures.json`` (rank, exit code, signal, error) for the parent.
* ``--job JOB`` (what each rank runs): init_process_group (gloo on CPU, NCCL on CUDA), load the HF
  model, FSDP2 ``fully_shard`` per decoder layer then the root, score this rank's micro-batches
  teacher-forced, write ``JOB/dataset/rank=R/part.parquet`` (tokens schema) and a done marker.

The job folder (written by :class:`~mismatch_probe.probes.fsdp.runner.FsdpLearner`) holds
``job.json`` (settings) and ``seqs.json`` (token ids). Everything here is private to FsdpLearner.

Tests inject rank faults through the environment (``MISMATCH_PROBE_TEST_FSDP_FAULT=rank:R:
after_batches:K:kill|hang|raise``: rank R dies, hangs or raises before its micro-batch K); no
option, config field or manifest entry carries it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe import settings

# Data-parallel split: the micro-batches are cut exactly as the single-process HfLearner cuts
# them (consecutive chunks of micro_batch_size, right padding); micro-batch k goes to rank
# k % world. Same batch composition and width -> same kernels -> same logprobs.
FAULT_ENV = "MISMATCH_PROBE_TEST_FSDP_FAULT"  # test-only fault injection (see the module docstring)
SPLIT = "micro-batch round robin (micro-batch k -> rank k % world), cut as HfLearner cuts them"


def micro_batches(n_seqs: int, micro_batch_size: int) -> list[range]:
    return [range(s, min(s + micro_batch_size, n_seqs)) for s in range(0, n_seqs, micro_batch_size)]


def rank_steps(n_seqs: int, micro_batch_size: int, rank: int, world: int) -> list[range | None]:
    """The micro-batches rank ``rank`` runs, one per step; every rank runs the same number of
    steps (FSDP's all-gathers are collective), ``None`` is a dummy forward whose output is dropped."""
    mbs = micro_batches(n_seqs, micro_batch_size)
    n_steps = -(-len(mbs) // world)
    return [mbs[k] if (k := step * world + rank) < len(mbs) else None for step in range(n_steps)]


@dataclass(frozen=True)
class Fault:
    rank: int
    after_batches: int
    action: str  # kill | hang | raise

    @staticmethod
    def parse(spec: str) -> Fault:
        parts = spec.split(":")
        if len(parts) != 5 or parts[0] != "rank" or parts[2] != "after_batches" or parts[4] not in (
            "kill",
            "hang",
            "raise",
        ):
            raise SystemExit(f"bad {FAULT_ENV} {spec!r}: expected rank:R:after_batches:K:kill|hang|raise")
        return Fault(int(parts[1]), int(parts[3]), parts[4])

    def maybe_fire(self, rank: int, batches_done: int) -> None:
        if rank != self.rank or batches_done != self.after_batches:
            return
        print(f"[fsdp rank {rank}] injected fault: {self.action}", file=sys.stderr, flush=True)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "hang":
            while True:
                time.sleep(3600)
        else:
            raise RuntimeError(f"injected fault on rank {rank}")


def _status(job: Path, rank: int, **fields: Any) -> None:
    from mismatch_probe.run.schema import atomic_write_json

    atomic_write_json(job / "status" / f"rank{rank}.json", {"rank": rank, "pid": os.getpid(), **fields})


def _watchdog(seconds: float, rank: int) -> None:
    """Last line of defence: a rank never outlives the run's timeout (even if orphaned)."""

    def fire() -> None:
        print(f"[fsdp rank {rank}] watchdog: still running after {seconds:.0f} s, exiting", file=sys.stderr)
        os._exit(124)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _wrap_fsdp(model: Any, mesh: Any, spec: dict[str, Any]) -> None:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, spec["mp_param_dtype"]),
        reduce_dtype=getattr(torch, spec["mp_reduce_dtype"]),
    )
    layers = model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)


def _apply_recipe(model: Any, recipe: str | None) -> tuple[Any, dict[str, Any] | None]:
    """The recipe on the sharded model, as the HF learner applies it (probes/hf/patch.py works on
    FSDP2-sharded modules); static NVFP4 scales are calibrated by every rank on the same batch
    (FSDP's forward is collective). Returns the logprob function and the patch description."""
    from mismatch_probe.kernels.recipes import parse
    from mismatch_probe.probes.hf.patch import calibrate, patch, token_logprobs_fn

    r = parse(recipe or "engine")
    if r.is_engine:
        return token_logprobs_fn(r), None
    handle = patch(model, r)
    n_cal = calibrate(model, handle, int(model.config.vocab_size))
    return token_logprobs_fn(r), handle.describe() | {"calibrated_linears": n_cal}


def _capture(model: Any, plan: dict[str, Any] | None, sink: Path) -> tuple[Any, Any]:
    """Op capture on this rank (the FSDP-wrapped model has HF's module tree): recorder, hooks."""
    if plan is None:
        return None, None
    from mismatch_probe.probes.capture import CapturePlan
    from mismatch_probe.probes.hf.capture import HfCapture
    from mismatch_probe.probes.recorder import OpRecorder

    rec = OpRecorder(CapturePlan.from_json(plan), sink=sink)
    return rec, HfCapture(model, rec)


def run_rank(job: Path, fault: Fault | None) -> None:
    import datetime as dt

    import numpy as np
    import pyarrow as pa
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from mismatch_probe.probes.hf.runner import padded_forward
    from mismatch_probe.run.schema import write_table

    t_start = time.monotonic()
    spec = json.loads((job / "job.json").read_text())
    seqs: list[list[int]] = json.loads((job / "seqs.json").read_text())
    meta: list[list[int]] = spec["seq_meta"]  # (seq_id, prompt_id, n_prompt_tokens) per sequence
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    _watchdog(float(spec["timeout_s"]) + 30, rank)
    _status(job, rank, phase="init", steps_done=0, seqs_done=0)

    cuda = spec["device_type"] == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(spec["threads_per_rank"]))
    timeout = dt.timedelta(seconds=float(spec["timeout_s"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=device if cuda else None)
    try:
        mesh = init_device_mesh(device.type, (world,))
        _status(job, rank, phase="loading", steps_done=0, seqs_done=0)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model_dir"], dtype=getattr(torch, spec["dtype"]), attn_implementation=spec["attn_implementation"],
            **spec.get("model_kwargs", {}),
        )
        model.eval()
        _wrap_fsdp(model, mesh, spec)  # moves this rank's shards to `device`
        logprobs_fn, recipe_info = _apply_recipe(model, spec.get("recipe"))
        if rank == 0 and recipe_info is not None:
            from mismatch_probe.run.schema import atomic_write_json

            atomic_write_json(job / "recipe.json", recipe_info)

        rec, cap = _capture(model, spec.get("capture"), job / "ops" / f"rank={rank}" / "part.parquet")
        if rec is not None:  # the full-rows window is over all sequences, whichever rank holds them
            rec.begin([m[0] for m in meta], [len(s) for s in seqs])
        steps = rank_steps(len(seqs), int(spec["micro_batch_size"]), rank, world)
        t_ready = time.monotonic()
        _status(job, rank, phase="sharded", steps_done=0, steps_started=0, n_steps=len(steps), seqs_done=0)
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("seq_id", "prompt_id", "pos", "token_id", "is_response", "logprob")}
        seqs_done = 0
        with torch.no_grad(), cap if cap is not None else contextlib.nullcontext():
            for done, mb in enumerate(steps):
                if fault is not None:
                    fault.maybe_fire(rank, done)
                _status(job, rank, phase=f"forward {done + 1}", steps_done=done, steps_started=done + 1,
                        n_steps=len(steps), seqs_done=seqs_done)
                chunk = [seqs[i] for i in mb] if mb is not None else [[0, 0]]
                if cap is not None:  # seq_id -1: the dummy step's rows are not recorded
                    sids = [meta[k][0] for k in mb] if mb is not None else [-1]
                    cap.set_batch(sids, [len(s) for s in chunk], max(len(s) for s in chunk))
                logits, ids = padded_forward(model, chunk, device)
                if mb is not None:
                    lp = logprobs_fn(logits, ids).double().cpu().numpy()
                    for i, k in enumerate(mb):
                        s, (seq_id, prompt_id, n_prompt) = seqs[k], meta[k]
                        pos = np.arange(1, len(s))
                        cols["seq_id"].append(np.full(pos.size, seq_id))
                        cols["prompt_id"].append(np.full(pos.size, prompt_id))
                        cols["pos"].append(pos)
                        cols["token_id"].append(np.asarray(s[1:]))
                        cols["is_response"].append(pos >= n_prompt)
                        cols["logprob"].append(lp[i, : len(s) - 1])
                    seqs_done += len(mb)
                _status(job, rank, phase="scoring", steps_done=done + 1, steps_started=done + 1, n_steps=len(steps),
                        seqs_done=seqs_done)
        if cuda:
            torch.cuda.synchronize()
        t_fwd = time.monotonic() - t_ready
        empty = {"is_response": np.zeros(0, bool), "logprob": np.zeros(0)}
        data = {k: np.concatenate(v) if v else empty.get(k, np.zeros(0, np.int64)) for k, v in cols.items()}
        table = pa.table(data)
        table = table.append_column("source", pa.array(["learner"] * table.num_rows, pa.string()))
        write_table(job / "dataset" / f"rank={rank}" / "part.parquet", table, "tokens")
        if rec is not None:
            rec.close()
        _status(job, rank, phase="done", steps_done=len(steps), n_steps=len(steps), seqs_done=seqs_done,
                setup_s=round(t_ready - t_start, 3), forward_s=round(t_fwd, 3))
        (job / "status" / f"rank{rank}.done").touch()
    finally:
        dist.destroy_process_group()


def launch(job: Path, nproc: int) -> int:
    """Run ``nproc`` ranks via the elastic agent; on failure write ``failures.json``, return 1."""
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mismatch_probe.run.schema import atomic_write_json

    spec = json.loads((job / "job.json").read_text())
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads_per_rank"]))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"mismatch-probe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        rdzv_configs={"timeout": int(spec["timeout_s"])},
    )
    args = ["-m", "mismatch_probe.probes.fsdp.worker", "--job", str(job)]
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as e:
        failures = [
            {
                "rank": r,
                "local_rank": f.local_rank,
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "timestamp": f.timestamp,
                "error": _error_line(f.error_file),
            }
            for r, f in sorted(e.failures.items())
        ]
        atomic_write_json(job / "failures.json", failures)
        return 1
    return 0


def _error_line(error_file: str) -> str | None:
    """The last line of a rank's Python traceback, from the error file torch elastic wrote."""
    try:
        data = json.loads(Path(error_file).read_text())
        msg = data["message"]
        text = msg.get("message", "") if isinstance(msg, dict) else str(msg)
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return lines[-1].strip() if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="fsdp_worker", description="private: FsdpLearner's launcher and ranks")
    p.add_argument("--job", type=Path, required=True)
    p.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.launch:
        sys.exit(launch(a.job, a.nproc))
    fault_spec = settings.get(FAULT_ENV)
    fault = Fault.parse(fault_spec) if fault_spec else None
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        record(run_rank)(a.job, fault)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
