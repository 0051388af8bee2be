"""Tensor parallelism in the vLLM sampler (``--sampler-arg tensor_parallel_size=N``).

vLLM runs N worker processes (multiprocessing executor), each holding a shard of the model:

- column-parallel linears (``qkv_proj``, ``gate_up_proj``) output this rank's heads / columns, and
  so do the ops computed on them (q/k norms, rotary, attention per head, SiLU-and-mul);
- row-parallel linears (``o_proj``, ``down_proj``) and the MoE block output full rows after their
  all-reduce; norms, residual stream and router logits are replicated;
- vocab-parallel logits are gathered (to rank 0, or to all ranks).

Capture runs in every worker (hooks installed through ``LLM.apply_model``; a capture job stays on
the worker's model between calls) and its raw rows come back to the driver, which merges the shards
into the canonical unsharded rows: the sharded ops' row bytes are concatenated in rank order
(key/value heads that vLLM replicates when there are fewer of them than ranks are taken once),
replicated ops come from rank 0; then one recorder with the run's plan computes digests, stats and
top-k exactly as a single-process capture does. (Cost: the workers ship the raw rows of every
selected op; narrow the selection with ``--capture-rule`` on large models.) Weight parity merges the
parameter shards the same way (concatenated along the dimension where a shard is smaller than the
checkpoint's tensor, vocab padding cut off). Under the strict recipe, row-parallel linears compute
kernels/strict/tp.py's K-sliced strict linear (:func:`.plugin.row_parallel_targets`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import UsageError

# canonical op suffixes computed on a rank's own heads / columns
SHARDED = ("attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.rope_q", "attn.rope_k", "attn.core",
           "mlp.gate", "mlp.up", "mlp.act")
KV_OPS = ("attn.k", "attn.v", "attn.k_norm", "attn.rope_k")  # replicated per kv head when heads < ranks

BIND_WHY = (
    "vLLM's CPU workers each need their own cores (without a binding it refuses: 'Not enough allowed NUMA "
    "nodes'): the cores this process may use, split into equal contiguous groups, one per rank"
)
MP_WHY = "tensor parallelism runs one worker process per rank (vLLM's multiprocessing executor)"
SERIAL_WHY = (
    "the capture hooks and weight digests run in every worker through LLM.apply_model, whose function vLLM "
    "pickles only with this set (local IPC between this process and its own workers)"
)


def op_suffix(op: str) -> str:
    head, _, rest = op.partition(".")
    return rest if head.isdigit() else op


def tp_size(kwargs: dict[str, Any]) -> int:
    return int(kwargs.get("tensor_parallel_size") or 1)


def cpu_bind(tp: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: the allowed cores in ``tp`` equal groups."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < tp:
        raise UsageError(f"--sampler-arg tensor_parallel_size={tp} needs {tp} CPU cores here; this process may use {len(cores)}")
    per = len(cores) // tp
    groups = [cores[r * per : (r + 1) * per] for r in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def prepare(kwargs: dict[str, Any], user: dict[str, Any], on_cpu: bool, auto: dict[str, dict]) -> None:
    """Engine settings and environment for ``tensor_parallel_size > 1`` (before ``vllm.LLM``)."""
    tp = tp_size(kwargs)
    if "distributed_executor_backend" not in user:
        kwargs["distributed_executor_backend"] = "mp"
        auto["distributed_executor_backend"] = {"value": "mp", "reason": MP_WHY}
    if on_cpu:
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if not bind or bind == "auto":
            bind = cpu_bind(tp)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            auto["VLLM_CPU_OMP_THREADS_BIND"] = {"value": bind, "reason": BIND_WHY}
        else:
            auto["VLLM_CPU_OMP_THREADS_BIND"] = {"value": bind, "reason": "set by the user (environment)"}
        if "gpu_memory_utilization" not in user:  # each rank reserves its fraction of the node's RAM
            kwargs["gpu_memory_utilization"] = rank_memory_fraction(kwargs["gpu_memory_utilization"], tp)
            auto["gpu_memory_utilization"] = {
                "value": kwargs["gpu_memory_utilization"],
                "reason": f"each of the {tp} CPU ranks reserves this fraction of the node's RAM and checks it against "
                "the free (not cached) memory at start: the single-process fraction / ranks, at most half the free "
                "memory / ranks",
            }
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    auto["VLLM_ALLOW_INSECURE_SERIALIZATION"] = {"value": "1", "reason": SERIAL_WHY}


def rank_memory_fraction(single: float, tp: int) -> float:
    """Per-rank ``gpu_memory_utilization`` on CPU: ``single`` (or half the free memory) split over
    the ranks, but at least 1.5 GiB a rank (a rank's weights and buffers come out of it first)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        free, floor = 0.5 * vm.free / vm.total, 1.5 * 2**30 / vm.total
    except Exception:
        free, floor = single, 0.05
    return round(max(floor, min(single, free) / tp), 3)


# ---- capture in every worker ---------------------------------------------------------------


def _full_plan(plan: Any) -> Any:
    """The same selection as ``plan`` with every selected row kept in ``full`` (raw values): the
    driver merges the shards from their bytes, then records them with the user's plan."""
    from mismatch_probe.probes.capture import CapturePlan, CaptureRule

    def up(mode: str) -> str:
        return "off" if mode == "off" else "full"

    return CapturePlan(up(plan.default), [CaptureRule(r.pattern, up(r.mode), r.pos_range) for r in plan.rules])


class _RankRecorder:
    """What one worker records, raw: the sharded ops (its kept kv heads) on every rank, the
    replicated ops on rank 0 only."""

    def __init__(self, plan: Any, rank: int, kv_keep: bool) -> None:
        from mismatch_probe.probes.recorder import OpRecorder

        self.rec = OpRecorder(_full_plan(plan), copy_on_record=True)  # in-place kernels: OpRecorder's docstring
        self.rank = rank
        self.kv_keep = kv_keep

    def record(self, op: str, tensor: Any, seq_ids: np.ndarray, pos: np.ndarray) -> None:
        if tensor is None:
            return
        suffix = op_suffix(op)
        if suffix in SHARDED:
            if suffix in KV_OPS and not self.kv_keep:
                return
        elif self.rank != 0:
            return
        self.rec.record(op, tensor, seq_ids, pos)


def _ipc(table: Any) -> bytes:
    import pyarrow as pa

    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _from_ipc(data: bytes) -> Any:
    import pyarrow as pa

    return pa.ipc.open_stream(data).read_all()


class CaptureJob:
    """Sent to every worker by ``apply_model``: installs the canonical-op hooks on the worker's model
    and keeps them there (``model._mp_tp_capture``) until :func:`collect`."""

    def __init__(self, plan: Any, seqs: list[list[int]], seq_ids: list[int]) -> None:
        self.plan, self.seqs, self.seq_ids = plan, seqs, seq_ids

    def __call__(self, model: Any) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        from mismatch_probe.probes.vllm.capture import VllmCapture

        rank = get_tensor_model_parallel_rank()
        qkv = model.model.layers[0].self_attn.qkv_proj
        replicas = int(getattr(qkv, "num_kv_head_replicas", 1) or 1)
        rec = _RankRecorder(self.plan, rank, kv_keep=rank % replicas == 0)
        cap = VllmCapture(rec, self.seqs, self.seq_ids)  # type: ignore[arg-type]
        cap.install(model)
        model._mp_tp_capture = (cap, rec)
        return rank


def collect(model: Any) -> dict[str, Any]:
    """Remove the worker's hooks; return its rank, raw rows (Arrow IPC bytes) and capture notes."""
    from vllm.distributed import get_tensor_model_parallel_rank

    cap, rec = model._mp_tp_capture
    cap.remove()
    del model._mp_tp_capture
    return {
        "rank": get_tensor_model_parallel_rank(),
        "rows": _ipc(rec.rec.table()),
        "unobservable": cap.unobservable,
        "unmatched_rows": cap.unmatched_rows,
    }


def merge_into(parts: list[dict[str, Any]], recorder: Any) -> None:
    """Record every rank's raw rows, merged into canonical unsharded rows (see the module doc),
    into ``recorder`` (which applies the user's plan: digests, stats, values, top-k)."""
    import torch

    tables = [_from_ipc(p["rows"]).to_pandas() for p in sorted(parts, key=lambda p: p["rank"])]
    ops = list(dict.fromkeys(op for df in tables for op in df["op"].tolist()))  # execution order
    for op in ops:
        pieces, keys, dtype = [], None, ""
        for df in tables:
            d = df[df["op"] == op]
            if d.empty:
                continue  # a replicated op (rank 0 only) or a kv head this rank does not keep
            d = d.sort_values(["seq_id", "pos"], kind="stable")
            k = d[["seq_id", "pos"]].to_numpy(np.int64)
            if keys is None:
                keys, dtype = k, str(d["dtype"].iloc[0])
            elif not np.array_equal(keys, k):
                raise RuntimeError(f"tensor-parallel capture of {op}: the ranks captured different tokens")
            pieces.append(np.frombuffer(b"".join(d["values"].tolist()), np.uint8).reshape(len(d), -1))
        if keys is None:
            continue
        raw = np.ascontiguousarray(np.concatenate(pieces, axis=1))
        recorder.record(op, torch.from_numpy(raw).view(getattr(torch, dtype)), keys[:, 0], keys[:, 1])


def captured_generate(sampler: Any, prompts: list[Any], sp: Any, seqs: list[list[int]], seq_ids: list[int]) -> Any:
    """``generate`` with the capture installed in every TP worker; the merged rows go through one
    recorder with the run's plan (streamed to ``sampler.ops_dest`` where set)."""
    from mismatch_probe.probes.recorder import OpRecorder

    llm = sampler.llm
    llm.apply_model(CaptureJob(sampler.capture, seqs, seq_ids))
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        parts = llm.apply_model(collect)
    rec = OpRecorder(sampler.capture, sink=sampler.ops_dest)
    rec.begin(seq_ids, [len(s) for s in seqs])
    try:
        merge_into(parts, rec)
    except BaseException:
        rec.abort()
        raise
    sampler._finish_capture(rec)
    sampler.info.settings["unobservable_ops"] = parts[0]["unobservable"]
    sampler.info.settings["capture_unmatched_rows"] = max(p["unmatched_rows"] for p in parts)
    sampler.info.settings["capture_merge"] = (
        f"{len(parts)} TP ranks: the raw rows of the sharded ops ({', '.join(SHARDED)}) concatenated in rank "
        "order, the others from rank 0, then recorded once with the run's plan"
    )
    return outs


# ---- weight parity over shards -------------------------------------------------------------


def engine_tp_size(llm: Any) -> int:
    try:
        return int(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    except AttributeError:
        return 1


def shard_params(model: Any) -> dict[str, Any]:
    """(In a worker) this rank's HF-named parameter shards as plain tensors (vLLM's parameters
    carry loader attributes that cannot be pickled back to the driver)."""
    from mismatch_probe.probes.vllm.params import split_vllm_params

    return {n: None if t is None else t.detach().to("cpu").clone() for n, t in split_vllm_params(model).items()}


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    out: dict[str, list[int]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for n in sf.keys():
                out[n] = list(sf.get_slice(n).get_shape())
    return out


def merge_param_shards(parts: list[dict[str, Any]], model_dir: Path) -> dict[str, Any]:
    """HF-named full tensors from every rank's :func:`split_vllm_params` (None: emptied by vLLM)."""
    import torch

    shapes = checkpoint_shapes(model_dir)
    out: dict[str, Any] = {}
    for name in parts[0]:
        ts = [p.get(name) for p in parts]
        if any(t is None for t in ts):
            out[name] = None
            continue
        full = shapes.get(name)
        if full is None or list(ts[0].shape) == full:
            out[name] = ts[0]  # replicated
            continue
        dims = [d for d in range(len(full)) if ts[0].shape[d] != full[d]]
        if len(dims) != 1:
            out[name] = None  # not a shard of the checkpoint's tensor: compare from the checkpoint
            continue
        d = dims[0]
        kv = name.split(".")[-2] in ("k_proj", "v_proj")
        if kv and sum(t.shape[d] for t in ts) > full[d] and full[d] % ts[0].shape[d] == 0:
            step = len(ts) // (full[d] // ts[0].shape[d])
            ts = ts[::step]  # kv heads replicated over ranks: each once
        if name.endswith("experts.gate_up_proj"):  # fused [gate; up] per rank
            halves = [t.chunk(2, d) for t in ts]
            cat = torch.cat([h[0] for h in halves] + [h[1] for h in halves], d)
        else:
            cat = torch.cat(ts, d)
        out[name] = cat.narrow(d, 0, full[d])  # vocab padding cut off
    return out
