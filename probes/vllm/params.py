"""vLLM's parameters under their HF checkpoint names: fused parameters split back by the model
class's ``packed_modules_mapping`` (the family spec's ``packed_modules`` where the class has none),
MoE expert weights renamed by the spec. Used by weight parity, on one engine or per TP rank."""

from __future__ import annotations

from typing import Any

from mismatch_probe.families import registry
from mismatch_probe.families.base import FamilySpec, resolve_path


def packed_modules(model: Any, spec: FamilySpec) -> dict[str, tuple[str, ...]]:
    """Fused vLLM module -> its HF parts, in order: vLLM's own ``packed_modules_mapping`` of the
    model class where it has one, else the family spec's declared fallback."""
    mapping = getattr(model, "packed_modules_mapping", None) or getattr(type(model), "packed_modules_mapping", None)
    if mapping:
        return {k: tuple(v) for k, v in mapping.items()}
    return dict(spec.packed_modules)


def _split_sizes(model: Any, name: str, n: int, rows: int) -> list[int] | None:
    """Row sizes of a fused parameter's parts: q/k/v from the attention module, else the fused
    module's ``output_sizes``; None: equal parts."""
    module_path = name.rpartition(".")[0]
    parent = resolve_path(model, module_path.rpartition(".")[0])
    if n == 3 and hasattr(parent, "q_size"):
        return [int(parent.q_size), int(parent.kv_size), int(parent.kv_size)]
    sizes = getattr(resolve_path(model, module_path), "output_sizes", None)
    if sizes and len(sizes) == n and sum(sizes) == rows:
        return [int(x) for x in sizes]
    return None


def split_vllm_params(model: Any) -> dict[str, Any]:
    """vLLM named parameters -> HF-named tensors (fused ones split); emptied ones -> None."""
    cfg = getattr(model, "config", None) or getattr(model.model, "config", None)
    spec = registry.get(cfg.model_type)
    packed = packed_modules(model, spec)
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        fused = next((f for f in packed if f".{f}." in name), None)
        if fused is not None:
            parts = packed[fused]
            hf_names = [name.replace(f".{fused}.", f".{part}.") for part in parts]
            if p.numel() == 0:
                out.update(dict.fromkeys(hf_names))
                continue
            sizes = _split_sizes(model, name, len(parts), p.shape[0])
            pieces = p.split(sizes, 0) if sizes else p.chunk(len(parts), 0)
            out.update(zip(hf_names, pieces, strict=True))
            continue
        renamed = next((name[: -len(a)] + b for a, b in spec.vllm_param_renames.items() if name.endswith(a)), None)
        if renamed is not None:
            # vLLM's CPU fused-MoE repacks the expert weights in place (same shape, other layout):
            # their digest then comes from the checkpoint, as for emptied parameters
            out[renamed] = None if p.device.type == "cpu" or p.numel() == 0 else p
            continue
        out[name] = None if p.numel() == 0 else p
    return out
