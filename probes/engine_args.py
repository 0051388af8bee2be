"""``--sampler-arg KEY=VALUE`` / ``--learner-arg KEY=VALUE``: the engines' own settings, passed through.

Sampler arguments are vLLM engine arguments (``vllm.engine.arg_utils.EngineArgs`` fields), typed by
vLLM's own command-line parser, exactly as ``vllm serve --KEY VALUE`` would type them. Learner
arguments are HF ``from_pretrained`` keyword arguments: ``attn_implementation`` or an attribute of
the model's config (typed like the config's value). An unknown key, a bad value, a key the tool
owns (set by one of its own flags) or a setting that conflicts with what the run needs is a
one-line :class:`UsageError` (exit 2). Settings the tool needs are set with a reason, recorded in
the manifest's ``auto`` section.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

from mismatch_probe.errors import UsageError

# vLLM arguments that one of the tool's own flags sets.
SAMPLER_OWNED = {
    "model": "--sampler-model / --model",
    "tokenizer": "--model (the learner's tokenizer is the run's)",
    "dtype": "--dtype (both engines)",
    "seed": "--seed",
}
LEARNER_OWNED = {
    "dtype": "--dtype (both engines)",
    "torch_dtype": "--dtype (both engines)",
    "device_map": "the tool (one device)",
}

EAGER_WHY = (
    "the op-capture hooks run only outside CUDA graphs / torch.compile; with --capture off, "
    "--sampler-arg enforce_eager=false is allowed (with a recipe: decode steps as whole CUDA graphs, no torch.compile)"
)
RECIPE_GRAPHS_WHY = (
    "the recipe's ops run as they are in eager mode (no torch.compile: Inductor would re-fuse the torch code around "
    "the recipe's kernels and change their bits); uniform decode steps replay as whole CUDA graphs of those same "
    "kernels, batches padded to the graph sizes (every op is batch-invariant), prefill runs eager"
)
RECIPE_COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}  # vLLM CompilationConfig: NONE, full decode graphs

PREFIX_WHY = (
    "every token of the prefill rescoring must be computed (and captured); with prefix caching the "
    "prefill view would depend on which requests ran before"
)

STRICT_ATTN_WHY = (
    "the recipe's attention runs the learner's strict kernel over vLLM's paged KV cache through an override "
    "of vLLM's FLASH_ATTN backend (probes/vllm/plugin.py), so the sampler is held to that backend on CUDA"
)


def recipe_graphs(kwargs: dict[str, Any], recipe: str, *, on_cpu: bool, moe: bool) -> dict[str, Any] | None:
    """With a recipe and ``enforce_eager=False``: vLLM's compilation settings that keep the recipe's bits
    (:data:`RECIPE_COMPILATION`), or a one-line error where graphs cannot hold them. None: nothing to set."""
    if recipe == "engine" or kwargs.get("enforce_eager", True):
        return None
    if on_cpu:
        raise UsageError(f"--sampler-arg enforce_eager=false with the {recipe} recipe: vLLM has no CUDA graphs on the "
                         "CPU, and torch.compile would change the recipe's bits (leave enforce_eager at its default)")
    if moe:
        raise UsageError(f"--sampler-arg enforce_eager=false with the {recipe} recipe on a MoE model: the recipe's "
                         "fixed-order experts pick their rows on the host, which a CUDA graph cannot replay")
    from mismatch_probe.kernels.recipes import parse

    linear = parse(recipe).linear
    if linear in ("nvfp4-static", "nvfp4-dynamic-tensor"):
        why = ("it calibrates after vLLM has captured its graphs" if linear == "nvfp4-static"
               else "its activation amax spans the whole batch, and a graph's batch includes padding rows")
        raise UsageError(f"--sampler-arg enforce_eager=false with the {recipe} recipe: {why} "
                         "(nvfp4-per-token and strict run in CUDA graphs)")
    return dict(RECIPE_COMPILATION)


def strict_attention_on_cuda(recipe: str) -> bool:
    """True where the recipe replaces attention and vLLM will run on CUDA (FLASH_ATTN override)."""
    if recipe == "engine":
        return False
    from mismatch_probe.kernels.recipes import parse

    try:
        ops = parse(recipe).ops()
    except Exception:  # an unknown recipe is refused elsewhere, with its own message
        return False
    if "attention" not in ops:
        return False
    import torch

    return torch.cuda.is_available()


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def split_pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}`` (dashes in keys become underscores; a later key wins)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _unknown(flag: str, key: str, known: list[str], what: str) -> UsageError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UsageError(f"{flag} {key}: not {what}{hint}")


def _vllm_parser() -> Any:
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())

    def error(message: str) -> None:  # argparse would print its usage and exit
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _as_bool(flag: str, key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise UsageError(f"{flag} {key}={value}: expected true or false")


def type_sampler_args(raw: dict[str, str]) -> dict[str, Any]:
    """Type each vLLM engine argument with vLLM's own parser; unknown keys name themselves."""
    if not raw:
        return {}
    import argparse

    parser = _vllm_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    typed: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SAMPLER_OWNED:
            raise UsageError(f"--sampler-arg {key}: set by {SAMPLER_OWNED[key]}")
        action = actions.get(key)
        if action is None:
            raise _unknown("--sampler-arg", key, sorted(actions), "a vLLM engine argument")
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            typed[key] = _as_bool("--sampler-arg", key, value)
            continue
        try:
            ns, _ = parser.parse_known_args([action.option_strings[0], value])
        except UsageError as e:
            raise UsageError(f"--sampler-arg {key}={value}: {e}") from None
        typed[key] = getattr(ns, key)
    return typed


def sampler_kwargs(raw: dict[str, str], *, capture_on: bool, recipe: str) -> tuple[dict[str, Any], dict[str, dict]]:
    """(vLLM kwargs given by the user, typed; auto settings with reasons), or a conflict error."""
    typed = type_sampler_args(raw)
    auto: dict[str, dict] = {}
    if typed.get("enforce_eager") is False and capture_on:
        raise UsageError(
            "--sampler-arg enforce_eager=false conflicts with op capture (--capture): its hooks do not run inside "
            "CUDA graphs / torch.compile (use --capture off to measure that configuration)"
        )
    if typed.get("enforce_eager") is False and recipe != "engine" and "compilation_config" in typed:
        raise UsageError(f"--sampler-arg compilation_config conflicts with the {recipe} recipe: {RECIPE_GRAPHS_WHY}")
    if "enforce_eager" not in typed:
        auto["enforce_eager"] = {"value": True, "reason": EAGER_WHY}
    if strict_attention_on_cuda(recipe):
        chosen = typed.get("attention_backend")  # unset: the runner sets FLASH_ATTN and records why
        if chosen is not None and str(getattr(chosen, "name", chosen)).upper() != "FLASH_ATTN":
            raise UsageError(f"--sampler-arg attention_backend={chosen} conflicts with the {recipe} recipe: {STRICT_ATTN_WHY}")
    if typed.get("enable_prefix_caching"):
        raise UsageError(f"--sampler-arg enable_prefix_caching=true conflicts with the prefill view: {PREFIX_WHY}")
    auto["enable_prefix_caching"] = {"value": False, "reason": PREFIX_WHY}
    return typed, auto


def _attn_choices() -> list[str]:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return sorted({"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()})
    except Exception:  # older transformers: the common ones
        return ["eager", "flash_attention_2", "flex_attention", "sdpa"]


def _typed_like(flag: str, key: str, value: str, current: Any) -> Any:
    if isinstance(current, bool):
        return _as_bool(flag, key, value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    if current is None or isinstance(parsed, type(current)):
        return parsed
    if isinstance(current, float) and isinstance(parsed, int):
        return float(parsed)
    raise UsageError(f"{flag} {key}={value}: expected a {type(current).__name__} like the config's {current!r}")


CUDA_GRAPHS = "cuda_graphs"  # --learner-arg cuda_graphs=true: the HF learner's forward replayed from CUDA graphs
GRAPHS_CAPTURE_WHY = "its hooks do not run inside CUDA graphs (use --capture off to measure that configuration)"


def learner_kwargs(raw: dict[str, str], model_dir: Path | str, *, capture_on: bool = False,
                   learner: str = "hf") -> dict[str, Any]:
    """HF ``from_pretrained`` kwargs: ``attn_implementation`` or attributes of the model's config; and
    ``cuda_graphs`` (the tool's: the HF learner's forward from CUDA graphs, probes/hf/graphs.py), or a
    conflict error."""
    if not raw:
        return {}
    if CUDA_GRAPHS in raw and _as_bool("--learner-arg", CUDA_GRAPHS, raw[CUDA_GRAPHS]):
        if learner != "hf":
            raise UsageError(f"--learner-arg {CUDA_GRAPHS}=true needs --learner hf (the FSDP learner runs eagerly)")
        if capture_on:
            raise UsageError(f"--learner-arg {CUDA_GRAPHS}=true conflicts with op capture (--capture): {GRAPHS_CAPTURE_WHY}")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).to_dict()
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in LEARNER_OWNED:
            raise UsageError(f"--learner-arg {key}: set by {LEARNER_OWNED[key]}")
        if key == CUDA_GRAPHS:
            out[key] = _as_bool("--learner-arg", key, value)
        elif key == "attn_implementation":
            choices = _attn_choices()
            if value not in choices:
                raise UsageError(f"--learner-arg attn_implementation={value}: must be one of {', '.join(choices)}")
            out[key] = value
        elif key in config:
            out[key] = _typed_like("--learner-arg", key, value, config[key])
        else:
            known = ["attn_implementation", CUDA_GRAPHS, *config]
            raise _unknown("--learner-arg", key, known, "a from_pretrained argument or config attribute")
    return out


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """Values as JSON can hold them (vLLM config objects as their repr), for the manifest."""
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


# vLLM refusing to start for want of memory, as its messages say it (vLLM 0.26: the GPU and CPU workers'
# startup check, the KV cache sizing), or a CUDA out-of-memory error during its profile run
_MEMORY_WORDS = ("memory utilization", "available memory", "kv cache", "cache blocks", "out of memory")
# vLLM's engine process failed before it was up (CUDA: the engine core runs in its own process, which has
# printed its own error above this one)
_CORE_FAILED = "engine core initialization failed"


def start_error(e: BaseException, nvfp4: bool, kwargs: dict[str, Any]) -> str | None:
    """One line for a vLLM engine that would not start for a reason of the machine, not of the tool: its
    memory (checked at startup, or the KV cache left after the profile run) or its engine process's failure
    (its own error is printed above). ``nvfp4``: the sampler's recipe has NVFP4 linears (their layouts'
    memory is named). None for anything else (the traceback stays: it may be a bug)."""
    text = str(e).strip()
    low = text.lower()
    if "kv_cache_memory_bytes" in kwargs:  # the CPU's KV cache sized from the run (probes/vllm/cpu_kv.py)
        hint = (f"it ran with kv_cache_memory_bytes={kwargs['kv_cache_memory_bytes']}; --sampler-arg "
                "kv_cache_memory_bytes=N or gpu_memory_utilization=F sets what vLLM may take")
    else:
        hint = (f"it ran with gpu_memory_utilization={kwargs['gpu_memory_utilization']}"
                if "gpu_memory_utilization" in kwargs else "it ran with vLLM's default memory share") + \
            "; --sampler-arg gpu_memory_utilization=F sets the share vLLM may take"
    if nvfp4:
        hint += (" (the NVFP4 recipe keeps ~5.2 bytes per linear weight against bf16's 2, measured by vLLM as "
                 "activation memory: docs/gpu.md)")
    if isinstance(e, RuntimeError) and _CORE_FAILED in low:
        return f"vLLM's engine process did not start (its error is printed above; if it ran out of memory: {hint})"
    if type(e).__name__ == "OutOfMemoryError":  # torch's (CUDA): its first line says how much it tried
        return f"vLLM ran out of device memory while starting: {text.splitlines()[0][:160]} ({hint})"
    if isinstance(e, (ValueError, RuntimeError, MemoryError)) and any(w in low for w in _MEMORY_WORDS):
        # its first sentence: vLLM's messages go on with advice for its own command line, not ours
        first = re.split(r"(?<=[.)])\s+(?=[A-Z])", text.splitlines()[0])[0]
        return f"vLLM did not start: {first[:300]} ({hint})"
    return None
