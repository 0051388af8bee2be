"""``bisect``: where do the learner and the sampler part ways, and which op introduces what?

1. first divergent op: in execution order, the first op whose outputs are not bitwise equal, and
   the first whose relative L2 error exceeds its dtype's default tolerance;
2. local error by input substitution: each engine's implementation of an op is run on the *other*
   engine's captured input and compared with the other engine's output, which separates the error
   an op introduces (local) from the error it inherits (its inputs already differ);
3. ablation over alignment patches (where the alignment recipes are available).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mismatch_probe.analysis.op_errors import error_stats, first_divergent  # noqa: F401 (first_divergent: re-exported)
from mismatch_probe.errors import SchemaError
from mismatch_probe.families.opnames import exec_order, split_op


def _tensors(df: pd.DataFrame, op: str, keys: list[tuple[int, int]]) -> Any:
    """Captured values of ``op`` at ``keys`` as one torch tensor [len(keys), numel]."""
    import torch

    sub = df[df.op == op].set_index(["seq_id", "pos"]).loc[keys]
    dtype = getattr(torch, sub.dtype.iloc[0])
    buf = bytearray(b"".join(sub["values"].tolist()))
    return torch.frombuffer(buf, dtype=dtype).reshape(len(keys), -1).clone()


def _equal_rows(a: Any, b: Any) -> float:
    """Share of rows of ``a`` bitwise equal to ``b``'s."""
    if a.numel() != b.numel():
        return 0.0
    return float((a.reshape(b.shape) == b).all(1).float().mean())


def _f64(t: Any) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def local_errors(cfg: dict[str, Any], learner: pd.DataFrame, sampler: pd.DataFrame, engines: Any,
                 max_rows: int = 256) -> tuple[list[dict[str, Any]], list[str], dict[str, str]]:
    """Input substitution for every replayable op both sides captured in ``full`` mode. Returns
    the rows, the ops not replayed, and why a replay failed (op -> error) where one did.

    ``engines`` is a loaded :class:`Engines` (the sampler's and the learner's modules)."""
    import torch

    from mismatch_probe.probes.replay import op_inputs

    n_layers = int(cfg.get("num_layers", 0))
    full_l = learner[learner["values"].notna()]
    full_s = sampler[sampler["values"].notna()]
    keys_l = full_l.groupby("op")[["seq_id", "pos"]].apply(lambda g: set(zip(g.seq_id, g.pos)))
    keys_s = full_s.groupby("op")[["seq_id", "pos"]].apply(lambda g: set(zip(g.seq_id, g.pos)))
    jobs: list[tuple[str, list[str], list[tuple[int, int]]]] = []
    skipped: list[str] = []
    failures: dict[str, str] = {}
    available = set(keys_l.index) & set(keys_s.index)
    for op in sorted(available, key=lambda o: exec_order(o, n_layers)):
        ins = op_inputs(op, n_layers, available, cfg.get("model_type"))
        if ins is None or any(i not in available for i in ins):
            skipped.append(op)
            continue
        common = set.intersection(keys_l[op], keys_s[op], *(keys_l[i] for i in ins), *(keys_s[i] for i in ins))
        keys = _whole_sequences(common, max_rows) if op.endswith("attn.core") else sorted(common)[:max_rows]
        if keys:
            jobs.append((op, ins, keys))
        else:
            skipped.append(op)
    rows = []
    for op, ins, keys in jobs:
        pos = torch.tensor([p for _, p in keys], dtype=torch.long)
        l_in, s_in = [_tensors(full_l, i, keys) for i in ins], [_tensors(full_s, i, keys) for i in ins]
        lo, so = _tensors(full_l, op, keys), _tensors(full_s, op, keys)
        try:
            si = engines.sampler.replay(op, l_in, pos)
            li = engines.learner.replay(op, s_in, pos)
        except Exception as e:  # noqa: BLE001 - an engine that cannot replay this op: say so, go on
            skipped.append(op)
            failures[op] = f"{type(e).__name__}: {e}"[:300]
            continue
        layer, kind = split_op(op)
        rows.append(
            {
                "op": op,
                "layer": layer,
                "kind": kind,
                "exec_order": exec_order(op, n_layers),
                "n_rows": len(keys),
                "local_error": error_stats(_f64(si), _f64(lo))["rel_l2"] if si.numel() == lo.numel() else math.nan,
                "local_bitwise_frac": _equal_rows(si, lo),
                "reverse_local_error": error_stats(_f64(li), _f64(so))["rel_l2"] if li.numel() == so.numel() else math.nan,
                "inherited_error": max(error_stats(_f64(x), _f64(y))["rel_l2"] for x, y in zip(s_in, l_in, strict=True)),
                "total_error": error_stats(_f64(so), _f64(lo))["rel_l2"],
            }
        )
    rows.sort(key=lambda r: (-(r["local_error"] if not math.isnan(r["local_error"]) else -1), r["exec_order"]))
    return rows, skipped, failures


def _whole_sequences(keys: set[tuple[int, int]], max_rows: int) -> list[tuple[int, int]]:
    """Attention replay needs whole prefill sequences: the (seq, pos) keys of the sequences whose
    positions 0..T-1 are all in ``keys``, in order, as many as fit in ``max_rows`` (at least one)."""
    by_seq: dict[int, set[int]] = {}
    for sq, p in keys:
        by_seq.setdefault(int(sq), set()).add(int(p))
    out: list[tuple[int, int]] = []
    for sq in sorted(by_seq):
        ps = by_seq[sq]
        t = max(ps) + 1
        if len(ps) != t or (out and len(out) + t > max_rows):
            continue
        out += [(sq, p) for p in range(t)]
    return out


DEFAULT_LONGEST = 511  # runs without sequences.parquet: vLLM's context for bisect is then 512 positions


class Engines:
    """Both engines loaded once for bisect: vLLM (with the alignment plugin built in but idle, so
    ablation can switch op classes on and off between passes) and the HF learner."""

    def __init__(self, cfg: dict[str, Any], align: bool, longest: int | None = None) -> None:
        """Each side runs the recipe it ran in the run (``config.recipes``); ``align`` (ablation,
        engine recipes only) builds vLLM with the strict plugin, idle until switched on.
        ``longest``: tokens of the run's longest sequence (vLLM's context, probes.factory.max_model_len)."""
        from mismatch_probe.probes import engine_args as ea
        from mismatch_probe.probes.factory import EngineSpec, build_runner
        from mismatch_probe.probes.models import inspect_model_dir

        self.align = align
        self._loaded = contextlib.ExitStack()  # what __enter__ loaded, released by __exit__
        ms, ml = inspect_model_dir(Path(cfg["sampler_model_dir"])), inspect_model_dir(Path(cfg["model_dir"]))
        dtype = cfg.get("dtype", "bfloat16")
        recipes = cfg.get("recipes") or {}
        longest = DEFAULT_LONGEST if longest is None else longest
        # the run's own engine settings (--sampler-arg / --learner-arg), checked again for this use
        s_recipe = "strict" if align else recipes.get("sampler")
        raw = ea.split_pairs(cfg.get("sampler_args"), "--sampler-arg")
        # replay and ablation switch ops inside one process: the sampler runs unsharded here
        self.dropped = {k: raw.pop(k) for k in ("tensor_parallel_size", "distributed_executor_backend") if k in raw}
        skw, sauto = ea.sampler_kwargs(raw, capture_on=True, recipe=s_recipe or "engine")
        lraw = ea.split_pairs(cfg.get("learner_args"), "--learner-arg")
        lraw.pop(ea.CUDA_GRAPHS, None)  # replay and ablation run the learner's ops one by one: eagerly
        lkw = ea.learner_kwargs(lraw, ml.path)
        self.sampler = build_runner(EngineSpec(
            "vllm", ms, longest, dtype=dtype, engine_kwargs=skw, engine_auto=sauto, recipe=s_recipe,
            recipe_ops=frozenset() if align else None,  # built with the plugin; idle until ablation asks
        ))
        self.learner = build_runner(EngineSpec(
            "hf", ml, longest, dtype=dtype, engine_kwargs=lkw, recipe=None if align else recipes.get("learner"),
        ))

    def __enter__(self) -> Engines:
        with contextlib.ExitStack() as stack:  # the sampler released again if the learner fails to load
            stack.enter_context(self.sampler)
            stack.enter_context(self.learner)
            self._loaded = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loaded.__exit__(*exc)  # the learner first, then the sampler


def load_op_errors(run_dir: Path) -> pd.DataFrame:
    from mismatch_probe.run.reader import OP_ERRORS, RunDir

    errs = RunDir(run_dir).op_errors()
    if errs is None:
        raise SchemaError(f"{run_dir} has no op capture ({OP_ERRORS}); run compare with --capture full")
    return errs


def longest_sequence(run_dir: Path) -> int | None:
    """Tokens of the run's longest sequence (vLLM's context for bisect), None without sequences.parquet."""
    from mismatch_probe.run.reader import SEQUENCES, RunDir

    rd = RunDir(run_dir)
    if not rd.has(SEQUENCES):
        return None
    return max((len(t) for t in rd.sequences().column("token_ids").to_pylist()), default=None)


def ablation(run_dir: Path, cfg: dict[str, Any], engines: Engines, min_share: float, n_seqs: int,
             console: Any = None) -> dict[str, Any]:
    """Ablation over the run's largest-gap sequences (see :mod:`.ablation`): bisect.json's ablation
    entries. ``console``: where each pass's progress bar goes (None: no bars)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mismatch_probe.families.registry import families
    from mismatch_probe.kernels.recipes import OP_KINDS
    from mismatch_probe.run.reader import RunDir
    from mismatch_probe.steps.ablation import run_ablation

    seqs = RunDir(run_dir).sequences().to_pydict()
    spec = families().get(cfg.get("model_type", ""))
    moe = spec.moe if spec else cfg.get("model_type") == "qwen3_moe"
    picked = gap_sequences(run_dir, seqs["seq_id"], n_seqs)
    kinds = [k for k in OP_KINDS if moe or k != "moe"]
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=False, disable=console is None) as progress:
        res = run_ablation(engines, [seqs["token_ids"][i] for i in picked], [seqs["n_prompt"][i] for i in picked], kinds,
                           int(cfg.get("num_layers", 0)), min_share, progress=progress)
    return {
        "ablation_seq_ids": [int(seqs["seq_id"][i]) for i in picked],
        "ablation": res["ranking"],
        "ablation_note": res["metric"],
        "ablation_passes": res["n_passes"],
        "ablation_trace": res["passes"],
        "gap_engine": res["gap_engine"],
        "gap_all_aligned": res["gap_all_aligned"],
    }


def gap_sequences(run_dir: Path, seq_ids: list[int], n: int) -> list[int]:
    """Indices (into ``seq_ids``) of the sequences the ablation scores: those with a nonzero gap
    (mean |dlogp| over response tokens, learner vs sampler prefill, from the run's tokens), the
    ``n`` largest (n <= 0: all of them). All sequences when the tokens are missing or none differs."""
    from mismatch_probe.run.reader import RunDir

    every = list(range(len(seq_ids)))
    cols = ["seq_id", "pos", "is_response", "logprob", "source"]
    rd = RunDir(run_dir)
    try:
        lt = rd.tokens("learner").select(cols).to_pandas()
        st = rd.tokens("sampler").select(cols).to_pandas()
    except (OSError, ValueError, KeyError, SchemaError):
        return every
    j = lt[lt.is_response].merge(st[st.is_response & (st.source == "prefill")], on=["seq_id", "pos"], suffixes=("_l", "_s"))
    gap = (j.logprob_l - j.logprob_s).abs().groupby(j.seq_id).mean()
    differ = sorted((i for i in every if float(gap.get(seq_ids[i], 0.0)) > 0), key=lambda i: (-float(gap[seq_ids[i]]), i))
    if not differ:
        return every
    return sorted(differ[:n] if n > 0 else differ)


def nvfp4_reason(cfg: dict[str, Any], op: str, learner: pd.DataFrame, engines: Engines) -> dict[str, Any] | None:
    """The reason a first divergent quantized linear differs (see mismatch_probe.analysis.nvfp4_reason),
    from the learner's captured input of ``op``."""
    from mismatch_probe.analysis.nvfp4_reason import explain_linear
    from mismatch_probe.probes.replay import op_inputs

    full = learner[learner["values"].notna()]
    ins = op_inputs(op, int(cfg.get("num_layers", 0)), set(full.op), cfg.get("model_type"))
    if not ins or ins[0] not in set(full.op):
        return None
    rows = full[full.op == ins[0]]
    x = _tensors(full, ins[0], sorted(zip(rows.seq_id, rows.pos)))
    return explain_linear(op, x, engines)
