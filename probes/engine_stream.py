"""The engine's CUDA stream while the recorder captures on a side stream.

The capture kernels (digest and stats of every queued tensor, one Triton launch per dtype) run on a
side stream at the default priority. With the engine's forwards on a stream of the same priority,
a capture kernel that occupies the SMs delays the engine's next kernels until its programs drain.
:func:`engine_stream` runs the forwards on a high-priority stream instead: the GPU's block
scheduler then hands SMs that free up to the engine's pending programs first, so the capture work
fills the engine's idle gaps rather than its critical path. Same kernels and inputs, so the same
bits (the observer-effect checks cover it); the caller's stream is ordered before and after.

``MISMATCH_PROBE_CAPTURE_STREAM``: ``side`` (default) does this; ``side-equal`` keeps the engine on
the caller's stream (the earlier behaviour, for comparison); ``main`` runs the capture kernels on the
engine's stream (nothing to do here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mismatch_probe import settings

_STREAMS: dict[int, Any] = {}  # device index -> the high-priority stream (one per process and device)


@contextlib.contextmanager
def engine_stream(device: Any) -> Iterator[str | None]:
    """Context for the engine's forwards of one capture; yields what the run manifest records
    (None where nothing changes: CPU, or ``MISMATCH_PROBE_CAPTURE_STREAM`` other than ``side``)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or settings.get("MISMATCH_PROBE_CAPTURE_STREAM") != "side":
        yield None
        return
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    hi = _STREAMS.get(idx)
    if hi is None:  # out-of-range priorities map to the highest the device has
        hi = _STREAMS[idx] = torch.cuda.Stream(idx, priority=-100)
    caller = torch.cuda.current_stream(idx)
    hi.wait_stream(caller)
    try:
        with torch.cuda.stream(hi):
            yield f"forwards on a high-priority CUDA stream (priority {hi.priority}), capture kernels on a side stream"
    finally:
        caller.wait_stream(hi)
