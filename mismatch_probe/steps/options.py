"""Command-line options declared once, as the config fields they fill.

A :class:`Flag` is one option (its flags and help). ``Flag.field(default)`` makes the dataclass
field of a step's config (``CompareConfig``, ``CaptureConfig``) that the option sets: the CLI builds
each command's options from its config's fields (``mismatch_probe.cli.options.command``), so a
field, its flag and its help are written in one place. Options that several commands share are the
module-level flags below; an option of one command only is declared at its field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FLAG = "flag"  # the dataclass field metadata key


@dataclass(frozen=True)
class Flag:
    """One command-line option: ``flags`` (the long one first) and its help text."""

    flags: tuple[str, ...]
    help: str

    def field(self, default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None) -> Any:
        """The config field this option sets (no default and no factory: a required option)."""
        md = {FLAG: self}
        if factory is not None:
            return dataclasses.field(default_factory=factory, metadata=md)
        return dataclasses.field(default=default, metadata=md)


def flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    return f.metadata.get(FLAG)


# -- options of more than one command (compare, capture, diff) ------------------------------------------

OUT = Flag(("--out", "-o"), "Folder to write (compare: the run; capture: the capture; diff: its summary.json and "
           "op_errors.parquet).")
MODEL = Flag(("--model", "-m"), "tiny-llama | tiny-qwen3 | tiny-qwen3-moe | tiny-qwen2 | tiny-gemma3 | local HF folder "
             "(capture: default the run's learner model).")
CAPTURE = Flag(("--capture",), "Op capture: off | digest | stats | full.")
CAPTURE_RULE = Flag(("--capture-rule",), "GLOB=MODE[@START:END] (repeatable; last match wins).")
CAPTURE_FULL_ROWS = Flag(("--capture-full-rows",), "Keep raw values for the first N tokens (by seq_id, pos), the rows "
                         "bisect replays \\[default: 256 under --capture stats].")
CAPTURE_TOPK = Flag(("--capture-topk",), "logits rows: keep the top-k values and ids.")
FULL_LOGITS = Flag(("--full-logits",), "Keep vocabulary-wide logits rows where capture is full.")
MICRO_BATCH_SIZE = Flag(("--micro-batch-size",), "Learner micro-batch size (right padding).")
NPROC = Flag(("--nproc",), "FSDP learner: number of ranks (gloo on CPU, NCCL on CUDA).")
FSDP_TIMEOUT = Flag(("--fsdp-timeout",), "FSDP learner: seconds; a rank that dies or hangs stops the run within this "
                    "(exit code 3).")
RECIPE = Flag(("--recipe",), "engine | strict | nvfp4-dynamic-tensor | nvfp4-static | nvfp4-per-token (compare: both "
              "sides; capture: hf, vllm).")
DTYPE = Flag(("--dtype",), "bfloat16 | float16 | float32 (both engines).")
OVERWRITE = Flag(("--overwrite",), "Replace an existing folder at --out.")
SAMPLER_ARG = Flag(("--sampler-arg",), "KEY=VALUE: a vLLM engine argument, typed as vLLM types it (repeatable).")
LEARNER_ARG = Flag(("--learner-arg",), "KEY=VALUE: HF from_pretrained's attn_implementation or a config attribute "
                   "(repeatable).")
