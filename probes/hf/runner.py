"""HF transformers learner adapter: teacher-forced forward, fp32 log-softmax."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.probes.base import Runner


def token_logprobs(logits: Any, ids: Any) -> Any:
    """fp32 log-softmax of ``logits[b, t]`` gathered at ``ids[b, t + 1]``: shape [B, T - 1]."""
    import torch

    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def padded_forward(model: Any, chunk: list[list[int]], device: Any, graphs: Any = None) -> tuple[Any, Any]:
    """One micro-batch forward, right-padded to the longest sequence with an attention mask (the
    learner's forward, shared by the HF learner and every FSDP rank): returns (logits, ids).

    ``use_cache=False``, as RL learners call the model to score (verl's actor passes it): no KV cache is
    built, so the checkpoint's ``config.use_cache`` does not decide which path attention reads its keys
    from, and no copy of every layer's keys and values into a cache is made (2 allocations and 2 copies
    per layer: host time on a host-bound forward). ``graphs``: a :class:`~mismatch_probe.probes.hf.graphs.GraphedForward`
    of ``model`` (the same forward replayed from CUDA graphs, where that gives the same bits)."""
    import torch

    width = max(len(s) for s in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.long)
    mask = torch.zeros(len(chunk), width, dtype=torch.long)
    for i, s in enumerate(chunk):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    if graphs is not None:
        return graphs(ids, mask, any(len(s) < width for s in chunk)), ids
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids


# op capture: the last micro-batch's rows are handed to the writer as soon as its forward returns (nothing is
# recorded after the logits), so their digests, copy and Parquet write overlap the logprobs' kernels and their
# copy to the host; False: at close(), after the logprobs (the bench's A/B switch, MODE@lateflush)
EARLY_FLUSH = True
# ... and the engine's stream waits for that chunk's digests and copy before the logprobs' kernels: the engine's
# high-priority stream otherwise ran the logprobs first and the chunk reached the writer only after them, so
# score() waited for the logprobs, then the chunk's digests, then its Parquet write (H100, 0.6B shape: the
# last chunk's copy ready 7.4 ms after the forward's return in both modes); now the write overlaps the
# logprobs. Same kernels, same bits; False: the bench's A/B switch (MODE@lpfirst)
CAPTURE_FIRST = True
TOPK_CHUNK_ELEMS = 1 << 26  # fp32 elements of one [positions, V] slice (256 MB): bounds the extra memory


def record_topk(
    log_softmax: Any,
    logits: Any,
    ids: Any,
    chunk: list[list[int]],
    seq_ids: list[int],
    k: int,
    support: dict[int, dict[str, np.ndarray]],
) -> dict[int, dict[str, np.ndarray]]:
    """From the full distribution of one micro-batch, on its device, one host copy at the end:
    per sequence ``topk_ids``/``topk_logprobs`` [len-1, K], ``entropy`` and ``sampled_rank`` (of the
    scored token, 1 = most likely) [len-1], and ``lp_at_NAME_topk`` [len-1, K2]: the logprobs at the
    sampler's top-K ids of each support NAME (NaN where the sampler gave none). Positions are taken
    in slices of at most ``TOPK_CHUNK_ELEMS / V`` rows, so the extra memory stays bounded."""
    import torch

    lg = logits[:, :-1]
    b, t, v = lg.shape
    lg = lg.reshape(b * t, v)
    tok = ids[:, 1:].reshape(b * t)
    names = sorted({n for sid in seq_ids for n in support.get(sid, {})})
    sups = {}
    for name in names:
        kk = next(support[sid][name].shape[1] for sid in seq_ids if name in support.get(sid, {}))
        sup = torch.full((b, t, kk), -1, dtype=torch.long)
        for i, sid in enumerate(seq_ids):
            a = support.get(sid, {}).get(name)
            if a is not None:
                sup[i, : a.shape[0]] = torch.from_numpy(a)
        sups[name] = sup.reshape(b * t, kk).to(lg.device)
    parts: dict[str, list[Any]] = {}
    step = max(1, TOPK_CHUNK_ELEMS // v)
    for a in range(0, b * t, step):
        lpf = log_softmax(lg[a : a + step])  # [rows, V] fp32
        lp_tok = lpf.gather(-1, tok[a : a + step, None])
        top_v, top_i = lpf.topk(k, dim=-1)
        got = {
            "topk_ids": top_i,
            "topk_logprobs": top_v,
            "entropy": -(lpf.exp() * lpf).nan_to_num(nan=0.0).sum(-1),
            "sampled_rank": (lpf > lp_tok).sum(-1) + 1,
        }
        for name, sup in sups.items():
            sl = sup[a : a + step]
            at = lpf.gather(-1, sl.clamp(min=0))
            got[f"lp_at_{name}_topk"] = torch.where(sl >= 0, at, torch.full_like(at, float("nan")))
        for key, val in got.items():
            parts.setdefault(key, []).append(val)
        del lpf
    host = {key: torch.cat(vals).reshape(b, t, *vals[0].shape[1:]).cpu().numpy() for key, vals in parts.items()}
    out: dict[int, dict[str, np.ndarray]] = {}
    for i, (sid, s) in enumerate(zip(seq_ids, chunk, strict=True)):
        n = len(s) - 1
        out[sid] = {key: val[i, :n].copy() for key, val in host.items()}
    return out


class HfModelRunner(Runner):
    """What the HF learner and the FSDP learner share: an HF model folder loaded with
    ``from_pretrained`` (``dtype``, ``attn_implementation``, other ``model_kwargs``), scored in
    micro-batches with right padding, with an optional kernels recipe."""

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        *,
        micro_batch_size: int = 8,
        dtype: str = "bfloat16",
        device: str | None = None,
        attn_implementation: str = "sdpa",
        progress: Callable[[int], None] | None = None,
        model_kwargs: dict[str, Any] | None = None,
        recipe: str | None = None,
        capture: Any = None,
        ops_dest: Path | None = None,
        auto: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(vocab_size, capture=capture, ops_dest=ops_dest, auto=auto, progress=progress)
        self.model_dir = Path(model_dir)
        self.micro_batch_size = micro_batch_size
        self.dtype = dtype
        self.device = device
        self.attn_implementation = attn_implementation
        self.model_kwargs = dict(model_kwargs or {})  # --learner-arg: other from_pretrained kwargs (config overrides)
        self.recipe = recipe  # kernels.recipes name (None / 'engine': the model's own ops)

    def _choose_device(self) -> None:
        """``device`` None: CUDA when available, else the CPU (recorded with the reason)."""
        import torch

        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.info.auto["device"] = {"value": self.device, "reason": "CUDA available" if self.device == "cuda" else "no CUDA"}

    def _model_settings(self) -> dict[str, Any]:
        """The manifest settings of the model's load and forward."""
        import transformers

        return {
            "dtype": self.dtype,
            "device": self.device,
            "micro_batch_size": self.micro_batch_size,
            "padding_side": "right",
            "attn_implementation": self.attn_implementation,
            **({"learner_args": dict(self.model_kwargs)} if self.model_kwargs else {}),
            "logsoftmax_dtype": "float32",
            "transformers_version": transformers.__version__,
        }

    def weight_parity(self, digests: dict[str, Any], sampler_dir: Path) -> dict[str, Any]:
        """This learner's weights against the sampler's ``digests`` (see probes.parity): the model it
        holds, or (FSDP: the ranks hold the shards) the checkpoint it loads, read here."""
        from mismatch_probe.probes.parity import weight_parity

        model = self._parity_model()
        if model is None:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype="auto")
        return weight_parity(model, digests, Path(sampler_dir))

    def _parity_model(self) -> Any:
        return None


class HfLearner(HfModelRunner):
    """Single-process HF model, micro-batched with right padding (as RL learners do)."""

    name = "hf"

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        *,
        recipe_ops: set[str] | frozenset[str] | None = None,
        recipe_layers: set[int] | frozenset[int] | None = None,
        topk: int = 0,
        topk_support: Mapping[int, Mapping[str, np.ndarray]] | None = None,
        row_parallel_slices: int = 1,
        cuda_graphs: bool = False,
        **common: Any,
    ) -> None:
        """``common``: the keyword arguments of :class:`HfModelRunner`. ``topk`` (--topk K): record
        own top-K, entropy, sampled-token rank and the logprobs at the sampler's top-K ids of
        ``topk_support`` (seq_id -> name -> sampler ids [len-1, K], -1: none); ``row_parallel_slices``
        N > 1: the row-parallel linears reduce K in N slices as a TP = N sampler does (strict);
        ``cuda_graphs``: the forward replayed from CUDA graphs per micro-batch shape where the replay gives the
        eager forward's bits (probes/hf/graphs.py; CUDA, no op capture)."""
        super().__init__(model_dir, vocab_size, **common)
        self.recipe_ops = recipe_ops  # subset of op classes / decoder layers patched (bisect's ablation)
        self.recipe_layers = recipe_layers
        self._patch: Any = None
        self.model: Any = None
        self.topk = topk
        self.topk_support: dict[int, dict[str, np.ndarray]] = {int(k): dict(v) for k, v in (topk_support or {}).items()}
        self.row_parallel_slices = row_parallel_slices
        self.topk_out: dict[int, dict[str, np.ndarray]] = {}  # seq_id -> recorded arrays (see record_topk)
        self.cuda_graphs = cuda_graphs
        self._graphs: Any = None  # GraphedForward, made at load

    def _load_impl(self) -> None:
        import torch
        import transformers

        self._choose_device()
        if str(self.device) == "cpu" and (self.capture is not None or self.ops_dest is not None):
            import threading

            from mismatch_probe.probes.digest import warm_cpu_kernels

            threading.Thread(target=warm_cpu_kernels, name="capture-kernel-warmup", daemon=True).start()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=getattr(torch, self.dtype), attn_implementation=self.attn_implementation,
            **self.model_kwargs,
        ).to(self.device)
        self.model.eval()
        self._apply_recipe()
        self._split_row_parallel()
        self.info.settings.update(self._model_settings())
        if self.cuda_graphs:
            if str(self.device).split(":")[0] != "cuda":
                from mismatch_probe.errors import UsageError

                raise UsageError(f"--learner-arg cuda_graphs=true needs a CUDA device, the learner runs on {self.device}")
            from mismatch_probe.probes.hf.graphs import GraphedForward

            self._graphs = GraphedForward(self.model)

    def _split_row_parallel(self) -> None:
        """Strict recipe and a tensor-parallel sampler: the row-parallel linears reduce K in the
        sampler's N slices (kernels/strict/tp.py), so both compute one reduction tree."""
        n = self.row_parallel_slices
        if n <= 1:
            return
        from mismatch_probe.probes.hf.tp import split_row_parallel

        names = split_row_parallel(self.model, n)
        self.info.settings["row_parallel_k_slices"] = n
        self.info.auto["row_parallel_k_slices"] = {
            "value": n,
            "reason": f"the sampler splits o_proj/down_proj along K over {n} TP ranks: the learner's strict linear "
            f"reduces K in the same {n} slices (fp32 partials, fixed tree, one rounding) on {len(names)} modules",
        }

    def _apply_recipe(self) -> None:
        """Patch the model's ops with the recipe (probes.hf.patch); calibrate static NVFP4 scales."""
        from mismatch_probe.kernels.recipes import parse
        from mismatch_probe.probes.hf.patch import calibrate, patch, token_logprobs_fn

        r = parse(self.recipe or "engine")
        self._logprobs = token_logprobs_fn(r)
        from mismatch_probe.probes.hf.patch import log_softmax_fn

        self._log_softmax = log_softmax_fn(r)
        if r.is_engine:
            self.info.settings["recipe"] = r.describe()
            return
        self._patch = patch(self.model, r, ops=self.recipe_ops, layers=self.recipe_layers)
        n_cal = calibrate(self.model, self._patch, self.vocab_size)
        self.info.settings["recipe"] = self._patch.describe() | {"calibrated_linears": n_cal}

    @contextlib.contextmanager
    def _recipe_impl(self, recipe: str, ops: list[str] | None, layers: list[int] | None) -> Iterator[None]:
        from mismatch_probe.probes.hf.patch import patch, token_logprobs_fn

        if self._graphs is not None:  # a graph replays the kernels it captured: none may outlive the ops' switch
            self._graphs.clear()
        handle = patch(self.model, recipe, ops=ops, layers=layers)
        saved = self._logprobs
        self._logprobs = token_logprobs_fn(recipe if ops is None or "logsoftmax" in ops else None)
        try:
            yield
        finally:
            handle.undo()
            self._logprobs = saved
            if self._graphs is not None:
                self._graphs.clear()

    def nvfp4_state(self, name: str) -> Any:
        """The NVFP4 linear state of the patched HF module ``name`` (None: not an NVFP4 linear)."""
        return None if self._patch is None else self._patch.nvfp4.get(name)

    def linear_weight(self, name: str) -> Any:
        """The weight of the HF linear module ``name`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
        self._check_loaded()
        return self.model.get_submodule(name).weight.detach()

    def _replay_impl(self, op: str, inputs: list[Any], pos: Any) -> Any:
        from mismatch_probe.probes.replay import hf_replay

        return hf_replay(self.model, op, inputs, pos)

    def _parity_model(self) -> Any:
        return self.model

    def _unload_impl(self) -> None:
        if self._graphs is not None:
            self._graphs.clear()
            self._graphs = None
        if self._patch is not None:
            self._patch.undo()
            self._patch = None
        self.model = None

    def _score_impl(self, seqs: list[list[int]], seq_ids: list[int]) -> list[np.ndarray]:
        import contextlib

        import torch

        from mismatch_probe.probes.engine_stream import engine_stream
        from mismatch_probe.probes.hf.capture import HfCapture
        from mismatch_probe.probes.recorder import OpRecorder

        out: list[np.ndarray] = []
        mb = self.micro_batch_size
        rec = OpRecorder(self.capture, sink=self.ops_dest) if self.capture is not None else None
        cap = HfCapture(self.model, rec) if rec is not None else None
        graphs = self._graphs if rec is None else None  # a captured score runs eagerly (hooks do not run in a replay)
        if rec is not None:
            rec.begin(seq_ids, [len(s) for s in seqs])
        try:
            with torch.inference_mode(), cap if cap is not None else contextlib.nullcontext(), \
                    engine_stream(self.device) if rec is not None else contextlib.nullcontext() as stream_note:
                if stream_note is not None:
                    self.info.settings["capture_engine_stream"] = stream_note + (
                        "; the logprobs after the last chunk's digests and copy" if EARLY_FLUSH and CAPTURE_FIRST else "")
                for start in range(0, len(seqs), mb):
                    chunk = seqs[start : start + mb]
                    if cap is not None:
                        cap.set_batch(seq_ids[start : start + mb], [len(s) for s in chunk], max(len(s) for s in chunk))
                    logits, ids = padded_forward(self.model, chunk, self.device, graphs)
                    if rec is not None and EARLY_FLUSH and start + mb >= len(seqs):
                        rec.flush(engine_waits=CAPTURE_FIRST)
                    lp = self._logprobs(logits, ids).double().cpu().numpy()
                    out.extend(lp[i, : len(s) - 1].copy() for i, s in enumerate(chunk))
                    if self.topk:
                        batch_ids = seq_ids[start : start + mb]
                        top = record_topk(self._log_softmax, logits, ids, chunk, batch_ids, self.topk, self.topk_support)
                        self.topk_out.update(top)
                    if self.progress is not None:
                        self.progress(len(chunk))
        except BaseException:
            if rec is not None:
                rec.abort()
            raise
        if rec is not None:
            self._finish_capture(rec)
            self.info.settings["unobservable_ops"] = list(HfCapture.unobservable)
        if self._graphs is not None:  # which shapes replayed from graphs, which ran eagerly and why
            self.info.settings["cuda_graphs"] = self._graphs.stats.to_json()
        if self._patch is not None and isinstance(self.info.settings.get("recipe"), dict):
            # which NVFP4 GEMM path ran per linear (reference / triton:decode / triton:prefill)
            self.info.settings["recipe"]["nvfp4_kernels"] = self._patch.describe()["nvfp4_kernels"]
            # linear calls that reused their block's activation quantization (docs/nvfp4.md, SharedInput)
            self.info.settings["recipe"]["nvfp4_shared_inputs"] = self._patch.shared.hits
        return out
