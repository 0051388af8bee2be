"""The HF learner's forward replayed from CUDA graphs (``--learner-arg cuda_graphs=true``).

A host-bound learner forward (a small model, or a recipe of many Triton launches) spends most of its
wall time launching kernels; replaying a graph of the same kernels costs one launch. Each micro-batch
shape (batch, width, padded or not) is captured once and replayed for every later micro-batch of that
shape. What makes it safe to leave on:

- **Same bits, checked.** A shape's first micro-batch runs eagerly, as without graphs (its logits are
  what the call returns); its graph is then captured and replayed on the same inputs, and kept only if
  the replay equals that eager forward bit for bit (``torch.equal``). A shape whose capture fails or
  whose replay differs runs eagerly from then on; the manifest says which and why. (Measured on the
  H100 and the H200, Qwen3-0.6B and 8B shapes: the nvfp4-per-token forward replays bitwise; the bf16
  one does not, first at layer 0's ``o_proj`` output, the q/k/v projections before it still equal:
  SDPA's output or the cuBLAS GEMM of ``o_proj`` changes inside a capture. So a bf16 learner stays eager.)
- **No host decision on the data.** A micro-batch without padding is captured without an attention
  mask (HF drops an all-ones mask eagerly too); a padded one with its mask as a device input, which HF
  turns into the 4-D mask inside the graph (``is_tracing`` is true while capturing), so another
  micro-batch of that shape with other lengths replays the same kernels on its own mask.
- **Bounded memory.** At most :data:`MAX_GRAPHS` shapes keep a graph (least recently used goes first),
  each with its memory pool and its static inputs and logits.

The logits a replay returns are the graph's static output: read them before the next forward (the
learner turns them into logprobs at once). Graphs pay where shapes repeat (fixed-length scoring, many
micro-batches of one width); a micro-batch of a new width costs its eager forward plus two warm-ups and
a capture. Capture hooks (``--capture``) run only eagerly: the tool refuses both together.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

MAX_GRAPHS = 4
_MAX_EAGER_NOTES = 8  # reasons kept for the manifest (shapes that run eagerly)


@dataclass
class _Graph:
    graph: Any
    ids: Any
    mask: Any
    logits: Any


@dataclass
class GraphStats:
    """What the manifest records (the learner's settings, key "cuda_graphs")."""

    captured: int = 0
    replays: int = 0
    eager_calls: int = 0
    evicted: int = 0
    eager_shapes: dict[str, str] = field(default_factory=dict)  # "BxW[+pad]" -> why it runs eagerly

    def to_json(self) -> dict[str, Any]:
        return {"max_graphs": MAX_GRAPHS, "captured": self.captured, "replays": self.replays,
                "eager_calls": self.eager_calls, "evicted": self.evicted, "eager_shapes": dict(self.eager_shapes)}


class GraphedForward:
    """``model(input_ids=ids, attention_mask=mask, use_cache=False).logits``, replayed from a CUDA graph
    per micro-batch shape once that graph is known to give the eager forward's bits."""

    def __init__(self, model: Any, max_graphs: int = MAX_GRAPHS) -> None:
        self.model = model
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[tuple[int, int, bool], _Graph] = collections.OrderedDict()
        self._eager: set[tuple[int, int, bool]] = set()
        self.stats = GraphStats()

    def _eager_forward(self, ids: Any, mask: Any) -> Any:
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def __call__(self, ids: Any, mask: Any, padded: bool) -> Any:
        """Logits of the micro-batch ``ids`` [B, W] (``mask``: its attention mask; ``padded``: whether any
        row is shorter than W, known on the host)."""
        key = (int(ids.shape[0]), int(ids.shape[1]), bool(padded))
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            g.ids.copy_(ids, non_blocking=True)
            if g.mask is not None:
                g.mask.copy_(mask, non_blocking=True)
            g.graph.replay()
            self.stats.replays += 1
            return g.logits
        logits = self._eager_forward(ids, mask)
        self.stats.eager_calls += 1
        if key not in self._eager:
            self._try_capture(key, ids, mask if padded else None, logits)
        return logits

    def _refuse(self, key: tuple[int, int, bool], why: str) -> None:
        self._eager.add(key)
        if len(self.stats.eager_shapes) < _MAX_EAGER_NOTES:
            self.stats.eager_shapes[f"{key[0]}x{key[1]}{'+pad' if key[2] else ''}"] = why

    def _try_capture(self, key: tuple[int, int, bool], ids: Any, mask: Any, eager: Any) -> None:
        import torch

        static_ids = ids.clone()
        static_mask = None if mask is None else mask.clone()
        try:
            side = torch.cuda.Stream(ids.device)
            side.wait_stream(torch.cuda.current_stream(ids.device))
            with torch.cuda.stream(side):  # warm-ups off the capture's pool (lazy inits, autotuning)
                for _ in range(2):
                    self._eager_forward(static_ids, static_mask)
            torch.cuda.current_stream(ids.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._eager_forward(static_ids, static_mask)
            graph.replay()
            same = bool(torch.equal(out, eager))
        except Exception as e:  # noqa: BLE001 - the engine cannot be captured: this shape runs eagerly
            torch.cuda.synchronize(ids.device)
            self._refuse(key, f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            return
        if not same:
            self._refuse(key, "the replay is not bitwise the eager forward")
            return
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.evicted += 1
        self._graphs[key] = _Graph(graph, static_ids, static_mask, out)
        self.stats.captured += 1

    def clear(self) -> None:
        """Drop every graph (and its memory pool) and what was learned per shape: the model's ops changed."""
        self._graphs.clear()
        self._eager.clear()
