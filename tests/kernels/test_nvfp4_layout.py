"""The recipes' NVFP4 path is one chain of modules: ``linear.NVFP4Linear`` -> ``tc_linear`` (the GEMM) ->
its kernels, and nothing on it reaches the exact per-16-block cross-check stack of ``nvfp4/reference/``
(read with ``ast``: every import counts, deferred ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

NVFP4 = Path(__file__).resolve().parents[2] / "kernels" / "nvfp4"


def _imports(mod: str) -> set[str]:
    """The nvfp4 modules ``mod`` imports (relative imports inside the package)."""
    path = NVFP4 / (mod.replace(".", "/") + ".py")
    if not path.exists():
        path = NVFP4 / mod.replace(".", "/") / "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module)
            else:
                out.update(a.name for a in node.names)
    return out


def test_the_recipes_path_is_one_chain_without_the_reference_stack() -> None:
    seen, todo = set(), ["linear"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(m))
    assert not any(m.startswith("reference") for m in seen), sorted(seen)
    assert seen == {"linear", "tc_linear", "gemm_tc", "native", "quant_fast", "triton_quant", "ref", "common", "moe",
                    "tuning", "schemes", "sync", "fused_input"}, sorted(seen)


def test_the_package_map_names_the_production_path_first() -> None:
    import mismatch_probe.kernels as K
    import mismatch_probe.kernels.nvfp4 as N

    doc = N.__doc__ or ""
    assert doc.index(":class:`linear.NVFP4Linear`") < doc.index(":mod:`tc_linear`: **the** NVFP4 GEMM") < doc.index(
        ":mod:`reference`")
    assert not any(v.startswith("nvfp4.reference") for v in K._EXPORTS.values())
    assert {"NVFP4Linear", "prepare", "tc_matmul", "tc_grouped", "GemmTuning"} <= set(K.__all__)
