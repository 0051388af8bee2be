"""Pre-flight parity: do both engines hold the same weights and tokenize prompts the same way?

A weight-sync bug looks exactly like a kernel mismatch downstream, so ``compare`` checks first.
Parameters are named as in the HF checkpoint; vLLM's fused parameters are split back by the model
class's ``packed_modules_mapping`` (``qkv_proj`` -> q/k/v, ``gate_up_proj`` -> gate/up; the family
spec's ``packed_modules`` where the class has none), MoE expert weights renamed by the spec.
vLLM's CPU backend repacks linear weights into its own layout and empties the original
parameter: for those the digest is taken from the checkpoint the sampler loaded (``source:
"checkpoint"``), cast to the engine's dtype; so are the MoE expert weights, which its fused-MoE
repacks in place (HF's fused ``experts.gate_up_proj`` / ``experts.down_proj`` are assembled from
the checkpoint's per-expert tensors).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from mismatch_probe.probes.vllm.params import packed_modules, split_vllm_params  # noqa: F401 (re-exported)


def tensor_digest(t: Any) -> str:
    import torch

    raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest() + f":{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}"


_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(model_dir: Path, names: list[str]) -> dict[str, Any]:
    """Checkpoint tensors by HF parameter name. HF's fused expert parameters (``experts.gate_up_proj``
    [E, 2I, H], ``experts.down_proj`` [E, H, I]) are assembled from per-expert checkpoint tensors."""
    import torch
    from safetensors import safe_open

    out: dict[str, Any] = {}
    parts: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            keys = set(sf.keys())
            for n in names:
                if n in keys:
                    out[n] = sf.get_tensor(n)
                elif m := _FUSED_EXPERTS.match(n):
                    for k in keys:
                        if k.startswith(m.group(1) + ".") and k.endswith((".gate_proj.weight", ".up_proj.weight",
                                                                          ".down_proj.weight")):
                            parts[k] = sf.get_tensor(k)
    for n in names:
        m = _FUSED_EXPERTS.match(n)
        if n in out or not m:
            continue
        base, n_exp = m.group(1), 0
        while f"{base}.{n_exp}.down_proj.weight" in parts:
            n_exp += 1
        if n_exp == 0:
            continue
        if m.group(2) == "down_proj":
            out[n] = torch.stack([parts[f"{base}.{e}.down_proj.weight"] for e in range(n_exp)])
        else:
            out[n] = torch.stack([torch.cat([parts[f"{base}.{e}.gate_proj.weight"], parts[f"{base}.{e}.up_proj.weight"]])
                                  for e in range(n_exp)])
    return out


def sampler_weight_digests(llm: Any, model_dir: Path) -> dict[str, dict[str, str]]:
    """{hf_name: {"digest", "source"}} of what the vLLM engine holds."""
    from mismatch_probe.probes.vllm import tp as vllm_tp

    if vllm_tp.engine_tp_size(llm) > 1:  # every rank's shards, merged
        tensors: dict[str, Any] = vllm_tp.merge_param_shards(llm.apply_model(vllm_tp.shard_params), model_dir)
    else:
        tensors = llm.apply_model(split_vllm_params)[0]
    import torch

    # the engine's dtype (--dtype): the floating dtype holding the most elements
    sizes: dict[Any, int] = {}
    for t in tensors.values():
        if t is not None and t.is_floating_point():
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    dtype = max(sizes, key=lambda k: sizes[k]) if sizes else None
    res = {}
    for n, t in tensors.items():
        if t is None:
            continue
        source = "engine"
        if dtype is not None and t.is_floating_point() and t.dtype != dtype and torch.equal(t.to(dtype).to(t.dtype), t):
            # vLLM's CPU GEMM keeps some biases upcast to fp32 (its SGL kernel, where the CPU has it):
            # exact, so the value the engine computes with is the checkpoint's in --dtype
            t, source = t.to(dtype), "engine (upcast exactly by vLLM's CPU GEMM)"
        res[n] = {"digest": tensor_digest(t), "source": source}
    missing = [n for n, t in tensors.items() if t is None]
    # the engine cast the checkpoint to its dtype (--dtype) before repacking: digest what it held
    for n, t in checkpoint_tensors(model_dir, missing).items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        res[n] = {"digest": tensor_digest(t), "source": "checkpoint"}
    return res


def weight_parity(learner_model: Any, sampler: dict[str, dict[str, str]], sampler_dir: Path) -> dict[str, Any]:
    """Compare the learner's parameters with the sampler's digests; list every difference."""
    learner = {n: p for n, p in learner_model.named_parameters()}
    diffs: list[dict[str, Any]] = []
    differing = [n for n in learner if n in sampler and tensor_digest(learner[n]) != sampler[n]["digest"]]
    ref = checkpoint_tensors(sampler_dir, differing)
    for n in differing:
        entry: dict[str, Any] = {"param": n, "sampler_source": sampler[n]["source"]}
        if n in ref and ref[n].shape == learner[n].shape:
            d = (learner[n].detach().cpu().double() - ref[n].double()).abs()
            entry["max_abs_diff"] = float(d.max())
            entry["n_differ"] = int((d > 0).sum())
        diffs.append(entry)
    only_l = sorted(set(learner) - set(sampler))
    only_s = sorted(set(sampler) - set(learner))
    return {
        "n_params": len(learner),
        "n_equal": len(learner) - len(differing) - len(only_l),
        "differences": diffs,
        "learner_only": only_l,
        "sampler_only": only_s,
        "ok": not diffs and not only_l and not only_s,
    }
