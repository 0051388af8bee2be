"""The learner's side of strict alignment across TP ranks (kernels/strict/tp.py): when the sampler
splits its row-parallel linears along K over N ranks, the HF model's ``o_proj`` / ``down_proj``
compute the same N slices in one process (fp32 partials, fixed tree, one rounding)."""

from __future__ import annotations

import types
from typing import Any

import torch

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # HF names of the layers vLLM splits along K


def split_row_parallel(model: torch.nn.Module, n: int) -> list[str]:
    """Give the row-parallel linears an instance ``forward`` computing the K-sliced strict linear
    with ``n`` slices (call after the strict patch; its undo removes it). Returns the module names."""
    from mismatch_probe.kernels.strict.tp import ksplit_linear

    done = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.endswith(ROW_PARALLEL):

            def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
                return ksplit_linear(x, self.weight, self.bias, n)

            mod.forward = types.MethodType(forward, mod)
            done.append(name)
    return done
