"""HF transformers learner adapter: teacher-forced forward, fp32 log-softmax."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.probes.base import Runner


def token_logprobs(logits: Any, ids: Any) -> Any:
    """fp32 log-softmax of ``logits[b, t]`` gathered at ``ids[b, t + 1]``: shape [B, T - 1]."""
    import torch

    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class HfLearner(Runner):
    """Single-process HF model, micro-batched with right padding (as RL learners do)."""

    name = "hf"

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        *,
        micro_batch_size: int = 8,
        dtype: str = "bfloat16",
        device: str | None = None,
        attn_implementation: str = "sdpa",
        progress: Any = None,
        recipe: str | None = None,
        recipe_ops: set[str] | None = None,
        recipe_layers: set[int] | None = None,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(vocab_size)
        self.model_dir = Path(model_dir)
        self.recipe = recipe  # kernels.recipes name (None / 'engine': the model's own ops)
        self.recipe_ops = recipe_ops  # subset of op classes / decoder layers patched (bisect's ablation)
        self.recipe_layers = recipe_layers
        self._patch: Any = None
        self.micro_batch_size = micro_batch_size
        self.dtype = dtype
        self.device = device
        self.attn_implementation = attn_implementation
        self.model_kwargs = dict(model_kwargs or {})  # --learner-arg: other from_pretrained kwargs (config overrides)
        self.progress = progress  # callable(n_done) or None
        self.model: Any = None

    def _load_impl(self) -> None:
        import torch
        import transformers

        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.info.auto["device"] = {"value": self.device, "reason": "CUDA available" if self.device == "cuda" else "no CUDA"}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=getattr(torch, self.dtype), attn_implementation=self.attn_implementation,
            **self.model_kwargs,
        ).to(self.device)
        self.model.eval()
        self._apply_recipe()
        self.info.settings.update(
            {
                "dtype": self.dtype,
                "device": self.device,
                "micro_batch_size": self.micro_batch_size,
                "padding_side": "right",
                "attn_implementation": self.attn_implementation,
                **({"learner_args": dict(self.model_kwargs)} if self.model_kwargs else {}),
                "logsoftmax_dtype": "float32",
                "transformers_version": transformers.__version__,
            }
        )

    def _apply_recipe(self) -> None:
        """Patch the model's ops with the recipe (kernels.patch_hf); calibrate static NVFP4 scales."""
        from mismatch_probe.kernels.patch_hf import calibrate, patch, token_logprobs_fn
        from mismatch_probe.kernels.recipes import parse

        r = parse(self.recipe or "engine")
        self._logprobs = token_logprobs_fn(r)
        if r.is_engine:
            self.info.settings["recipe"] = r.describe()
            return
        self._patch = patch(self.model, r, ops=self.recipe_ops, layers=self.recipe_layers)
        n_cal = calibrate(self.model, self._patch, self.vocab_size)
        self.info.settings["recipe"] = self._patch.describe() | {"calibrated_linears": n_cal}

    def _unload_impl(self) -> None:
        if self._patch is not None:
            self._patch.undo()
            self._patch = None
        self.model = None

    def _score_impl(self, seqs: list[list[int]], seq_ids: list[int]) -> list[np.ndarray]:
        import contextlib

        import torch

        from mismatch_probe.probes.capture import OpRecorder
        from mismatch_probe.probes.hf_capture import HfCapture

        out: list[np.ndarray] = []
        mb = self.micro_batch_size
        rec = OpRecorder(self.capture) if self.capture is not None else None
        cap = HfCapture(self.model, rec) if rec is not None else None
        with torch.inference_mode(), cap if cap is not None else contextlib.nullcontext():
            for start in range(0, len(seqs), mb):
                chunk = seqs[start : start + mb]
                if cap is not None:
                    cap.set_batch(seq_ids[start : start + mb], [len(s) for s in chunk], max(len(s) for s in chunk))
                width = max(len(s) for s in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.long)
                for i, s in enumerate(chunk):
                    ids[i, : len(s)] = torch.tensor(s)
                    mask[i, : len(s)] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                logits = self.model(input_ids=ids, attention_mask=mask).logits
                lp = self._logprobs(logits, ids).double().cpu().numpy()
                out.extend(lp[i, : len(s) - 1].copy() for i, s in enumerate(chunk))
                if self.progress is not None:
                    self.progress(len(chunk))
        if rec is not None:
            self.ops = rec.table()
            self.info.settings["unobservable_ops"] = list(HfCapture.unobservable)
        return out
