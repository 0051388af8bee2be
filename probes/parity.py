"""Pre-flight parity: do both engines hold the same weights and tokenize prompts the same way?

A weight-sync bug looks exactly like a kernel mismatch downstream, so ``compare`` checks first.
Parameters are named as in the HF checkpoint; vLLM's fused parameters are split back
(``qkv_proj`` -> q/k/v, ``gate_up_proj`` -> gate/up). vLLM's CPU backend repacks linear weights
into its own layout and empties the original parameter: for those the digest is taken from the
checkpoint the sampler loaded (``source: "checkpoint"``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


def tensor_digest(t: Any) -> str:
    import torch

    raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest() + f":{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}"


def split_vllm_params(model: Any) -> dict[str, Any]:
    """vLLM named parameters -> HF-named tensors (fused ones split); emptied ones -> None."""
    out: dict[str, Any] = {}
    layers = model.model.layers
    for name, p in model.named_parameters():
        if p.numel() == 0:
            for hf in _hf_names(name, layers):
                out[hf] = None
            continue
        if ".qkv_proj." in name:
            a = layers[int(name.split(".")[2])].self_attn
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split([a.q_size, a.kv_size, a.kv_size], 0), strict=True):
                out[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            g, u = p.chunk(2, 0)
            out[name.replace("gate_up_proj", "gate_proj")] = g
            out[name.replace("gate_up_proj", "up_proj")] = u
        elif name.endswith("routed_experts.w13_weight"):
            out[name.replace("experts.routed_experts.w13_weight", "experts.gate_up_proj")] = p
        elif name.endswith("routed_experts.w2_weight"):
            out[name.replace("experts.routed_experts.w2_weight", "experts.down_proj")] = p
        else:
            out[name] = p
    return out


def _hf_names(name: str, layers: Any) -> list[str]:
    if ".qkv_proj." in name:
        return [name.replace("qkv_proj", x) for x in ("q_proj", "k_proj", "v_proj")]
    if ".gate_up_proj." in name:
        return [name.replace("gate_up_proj", x) for x in ("gate_proj", "up_proj")]
    return [name]


def checkpoint_tensors(model_dir: Path, names: list[str]) -> dict[str, Any]:
    from safetensors import safe_open

    out: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for n in names:
                if n in sf.keys():
                    out[n] = sf.get_tensor(n)
    return out


def sampler_weight_digests(llm: Any, model_dir: Path) -> dict[str, dict[str, str]]:
    """{hf_name: {"digest", "source"}} of what the vLLM engine holds."""
    tensors: dict[str, Any] = llm.apply_model(split_vllm_params)[0]
    res = {n: {"digest": tensor_digest(t), "source": "engine"} for n, t in tensors.items() if t is not None}
    missing = [n for n, t in tensors.items() if t is None]
    for n, t in checkpoint_tensors(model_dir, missing).items():
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
