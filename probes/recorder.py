"""The op recorder: per canonical op and token, the ``mp64`` digest and mergeable stats of the row,
computed where the tensor lives, plus raw values for the rows the plan keeps in ``full`` and the
top-k of ``logits`` rows.

Cost model (what keeps capture cheap at scale):

- CUDA: each captured tensor is queued (a reference, no copy; up to 4 GiB or 1,024 tensors, and
  launched at each new micro-batch of the HF learner: see _QUEUE_BYTES);
  queued tensors of one dtype are digested and reduced by ONE Triton launch (``digest_triton``)
  into a device arena of ``buffer_rows`` rows. When the arena fills, or the run ends, it is
  copied with one asynchronous copy per part (digests; the stats as the kernel wrote them, the file's
  float64 sums, float64 abs_max, int32 counts and abs_max's bf16 bits) straight into the writer
  process's shared memory (page-locked once per slot; pinned host buffers where that is refused, or
  with the writer thread); the writer waits for that copy's event, builds the Arrow rows per op call
  (never per row) and writes them. No copy per op, no synchronization inside the forward, nothing per
  row in Python.
- CPU: a numba kernel (one pass over each row) writes straight into the host arena.
- ``full`` rows are gathered on the device (``index_select``) and copied with the arena;
  ``logits`` rows keep the top-k (values and ids) unless the plan keeps them ``full``.
- Rows stream to ``ops.parquet`` in row groups (:class:`~mismatch_probe.run.schema.StreamWriter`).
  Host memory is bounded by ``queue_chunks + 2`` chunks (each ``buffer_rows`` rows of 48 bytes
  plus at most ``buffer_bytes`` of values), whatever the number of tokens: the recording thread
  waits when the writer falls behind. The writer process's shared-memory slots (at most
  ``2 * queue_chunks + 1`` of them, reused) come on top; see ``recorder_writer.py``.

Recording only reads tensors: it never changes what the engine computes (tested: logprobs with
and without capture are bitwise equal). An engine that overwrites a tensor in place after the hook
read it (vLLM's CUDA kernels: the fused add + RMSNorm rewrites its input and the residual, rotary
rewrites q and k) would change a queued tensor before its launch: such an engine's recorder is made
with ``copy_on_record=True``, which queues a device copy taken at the hook, on the engine's stream.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe import settings
from mismatch_probe.probes.digest import digest_stats_cpu
from mismatch_probe.probes.ops_table import FULL, STATS, _build_packed, _build_table, _dtype_name, _ops_schema, _Rows, _Seg
from mismatch_probe.probes.recorder_writer import STATS_PARTS
from mismatch_probe.run.schema import DIGEST_KEY

BUFFER_ROWS = 1 << 20  # default rows per chunk (device arena, one host copy, one row group)
# CUDA, plans that keep stats (40 host bytes a row, not 8): smaller chunks, so the rows of all but the last
# reach the writer while the forward runs and the wait after it is short. H200, HF learner score(), the
# whole cost (BENCHMARKS.md, issue 27): stats 1.87x -> 1.38x of capture off on the 8B shape, 2.35x -> 1.95x
# on the 0.6B shape; digest-only chunks stay large (on the host-bound 0.6B forward each chunk's host work
# costs more than the shorter wait saves: 1.36x -> 1.71x with 128 Ki rows). With the writer's shared-memory
# slots (round 7, 2026-12-05, 0.6B shape, stats): 128 Ki rows 2.03x, 256 Ki 1.75x, 512 Ki 1.76x -> 256 Ki.
# With the writer's row groups written while it builds the next (round 14, H100, two processes, medians of
# the per-round ratios): 256 Ki 1.63x / 1.56x, 384 Ki 1.53x / 1.49x, 512 Ki 1.52x / 1.71x -> 384 Ki (a flush
# costs ~0.7 ms of host time in the forward; fewer of them now that the writer keeps up with larger chunks)
STATS_BUFFER_ROWS = 3 << 17
# CUDA, stats plans, forwards marked (start_batch): the forward's chunk ends are spread evenly over all but its
# last _STATS_TAIL of rows (each chunk at most STATS_BUFFER_ROWS), so its last chunk, which the writer writes
# after the forward while score() waits, is that small tail rather than whatever was left of the 384 Ki cuts
# (0.6B shape: 1.87 Mi rows a forward, 4 chunks of 384 Ki and a last one of 380 Ki; 8B: the last of 3 x 384 Ki
# and 78 Ki). H100, round 15 (BENCHMARKS.md): the 8B stats score() 2-4% faster in four calls, the 0.6B within
# 0.01-0.03x either way; 0: the fixed cuts (bench stats@t0)
_STATS_TAIL = 0.1
# CUDA, digest-only plans: the arena holds up to 2 Mi rows, and a forward's chunk ends where about _TAIL of
# its rows are left (from the rows per token of the plan's previous forward in this process), so the
# last forward's last chunk, the rows score() waits for after it, is small; before any forward of the plan,
# and after that one boundary, chunks end at BUFFER_ROWS as before. H100, 0.6B shape (BENCHMARKS.md, issue
# 27 round 10): the wait in close() 12.0 -> 7.8 ms on the 0.6B shape (1.96 Mi rows a forward); 8B unchanged.
CUDA_BUFFER_ROWS = 1 << 21
_TAIL = 0.22
_ROWS_PER_TOKEN: dict[str, float] = {}  # plan (its JSON) -> arena rows per token of its last forward
# CUDA: queued tensors launch when their bytes reach _QUEUE_BYTES (each tensor counted as at least
# _QUEUE_BYTES // _QUEUE_OPS, so at most _QUEUE_OPS tensors wait), and at each new micro-batch of the HF
# learner (launch(): after the previous forward's logprobs reached the host, so the kernels overlap the
# next forward instead of delaying this one's last kernels). Each launch costs host time (descriptor
# table, stream wait, event: ~0.5 ms on the H200 host); the queue holds at most _QUEUE_BYTES of captured
# tensors alive beyond their use in the engine (plus the batches in flight, _HELD_MAX).
_QUEUE_OPS = 1024
_QUEUE_BYTES = 4 << 30
_COPY_QUEUE_BYTES = 1 << 30  # copy_on_record: the queued copies are memory the engine did not plan for
# CPU: kept values go to the writer in pieces of this size, so it writes them while the engine runs on
_CPU_VALUE_BYTES = 64 << 20
_HELD_MAX = 4  # side-stream batches in flight before the recording thread waits for the oldest
_QUEUE_CHUNKS = 2  # chunks waiting for the writer before recording blocks
# CUDA + writer process: a chunk's device rows copied straight into the writer process's shared memory
# (page-locked once per slot), not into pinned buffers the feeder then copies into it (recorder_writer.
# WriterProcess.stage). H100, 0.6B shape, stats (BENCHMARKS.md, issue 27 round 10): the feeder's hand-over
# per score() 29.2 -> 5.0 ms, the wait for it in close() 2.5 -> 1.5 ms; False: the pinned path (bench @noslot)
_D2H_TO_SLOT = True
_META = {DIGEST_KEY: b"mp64"}
_SIDE_STREAMS: dict[int, Any] = {}  # CUDA device index -> the recorders' side stream (see OpRecorder._side)
_NOROWS = object()


def _queue_cost(nbytes: int) -> int:
    """What a queued tensor adds to the queue: its bytes, at least _QUEUE_BYTES // _QUEUE_OPS."""
    return max(nbytes, _QUEUE_BYTES // _QUEUE_OPS)


@dataclass(slots=True)
class _Layout:
    """What :meth:`OpRecorder.record_rows` reuses for an op's tensor of a known dtype, shape and
    strides: its rows as the kernel reads them, and the segment fields."""

    n: int  # rows (tokens)
    dtype_name: str
    row_shape: list[int]
    width: int
    itemsize: int
    row_stride: int
    nbytes: int
    qkeys: tuple[Any, Any] = ()  # queue keys (dtype, stats) for stats False / True
    qcost: int = 0  # what it adds to the queue (_queue_cost of nbytes)


@dataclass(frozen=True, slots=True)
class _Cuts:
    """Where a forward's chunks end on CUDA when its caller marks it (``start_batch``) and ``buffer_rows`` was
    not given (:meth:`OpRecorder._place_limit`): the rows before the forward's last ``tail`` (a fraction) in the
    fewest even chunks of at most the arena's rows, none shorter than ``least``; the tail in chunks of ``base``.
    Digest-only plans: a 2 Mi-row arena, one chunk of at least BUFFER_ROWS before a tail of _TAIL; plans that
    keep stats: chunks of at most STATS_BUFFER_ROWS before a tail of _STATS_TAIL. A tail of 0: no placement
    (chunks of ``buffer_rows``)."""

    base: int
    tail: float
    least: int

    @staticmethod
    def of(stats: bool) -> _Cuts:
        if stats:
            return _Cuts(STATS_BUFFER_ROWS, _STATS_TAIL, 0)
        return _Cuts(BUFFER_ROWS, _TAIL, BUFFER_ROWS)


# (op, dtype, shape, strides) -> _Layout, shared by all recorders of the process: a recorder's
# first forward takes the fast path too (the bench scores 3 micro-batches per recorder)
_LAYOUTS: dict[tuple[Any, ...], _Layout] = {}
_LAYOUTS_MAX = 1 << 16


class OpRecorder:
    """Records op rows; writes them to ``sink`` (a path: streamed ``ops.parquet``) or keeps them in
    memory (``sink=None``: :meth:`table`). Call :meth:`close` when done (``table`` does it)."""

    def __init__(self, plan: Any = None, sink: Path | None = None, *, buffer_rows: int | None = None,
                 buffer_bytes: int = 256 << 20, batched: bool = False, copy_on_record: bool = False) -> None:
        from mismatch_probe.probes.capture import CapturePlan

        self.plan = plan or CapturePlan()
        self.seen_ops: list[str] = []
        self._seen: set[str] = set()
        self.buffer_rows = int(buffer_rows or BUFFER_ROWS)
        self._rows_given = buffer_rows is not None
        self._limit = self.buffer_rows  # rows at which the current chunk ends (see CUDA_BUFFER_ROWS)
        self._cuts: _Cuts | None = None  # where a marked forward's chunks end (CUDA, buffer_rows not given)
        self._flushed = 0  # arena rows of the chunks handed over so far
        self._fwd: tuple[int, int] | None = None  # the current forward's (arena rows before it, its rows per op)
        self._pkey: str | None = None  # the plan as the key of _ROWS_PER_TOKEN (made at first use)
        self.buffer_bytes = int(buffer_bytes)
        self.rows_written = 0
        self.value_bytes = 0
        self.writer_peak_rss_mb: float | None = None  # the writer process's (the engine's process reports its own)
        # device chunks copied straight into the writer's shared memory / through pinned buffers (a slot CUDA
        # would not page-lock, or the writer thread): the manifest says which path this run's rows took
        self.chunks_staged = 0
        self.chunks_pinned = 0
        # row sets of the current batch (the seq_ids/pos arrays of _bkey), one per plan rule set
        self._set_batch(None, None)
        self._opkey: dict[str, tuple[int, ...]] = {}  # op -> its plan rule set (the key of _brows)
        self._topk_op = "logits" if getattr(self.plan, "topk", 0) else None  # its top-k: never the fast path
        self._window: tuple[np.ndarray, np.ndarray] | None = None  # sorted seq ids, full-row limit each
        self._writer: Any = None
        self._tables: list[pa.Table] = []
        self.queue_chunks = _QUEUE_CHUNKS  # chunks waiting for the writer before recording blocks
        # rows are written by a separate process (recorder_writer.py: no GIL shared with the engine)
        # or, for in-memory recorders and MISMATCH_PROBE_CAPTURE_WRITER=thread, by a thread
        self.writer_mode = "memory" if sink is None else _writer_mode()
        self._proc: Any = None
        self._sink = None if sink is None else Path(sink)
        if sink is not None:
            from mismatch_probe.run.schema import StreamWriter

            if self.writer_mode == "process":
                from mismatch_probe.probes.recorder_writer import WriterProcess

                self._sink.parent.mkdir(parents=True, exist_ok=True)
                self._tmp = StreamWriter.temp_path(self._sink)
                try:  # started now: its imports overlap the engine's first forward
                    self._proc = WriterProcess(self._sink, self._tmp, _META, self.queue_chunks)
                except OSError:  # no process can be started here: the writer thread writes the same rows
                    Path(self._tmp).unlink(missing_ok=True)
                    self.writer_mode = "thread"
            if self.writer_mode == "thread":
                from mismatch_probe.probes.ops_table import packed_writer

                self._writer = packed_writer(self._sink, _META)
        self._device: Any = None
        self.force_batched = batched
        # batched path: queue a copy taken at the hook, not a reference (the engine may overwrite the
        # tensor in place before the queue launches; see the module docstring)
        self.copy_on_record = copy_on_record
        self._queue_limit = _COPY_QUEUE_BYTES if copy_on_record else _QUEUE_BYTES
        self._is_batched: bool | None = None
        self._closed = False
        self._reset_chunk()
        self._arenas: list[Any] = []
        self._thread: Any = None
        self._error: BaseException | None = None
        # (dtype, stats) -> (tensors, their descriptor rows flattened: 6 ints per tensor; a list: its extend
        # costs 50 ns an op call, an array('q')'s 270 ns, more than the one conversion per launch it saves)
        self._queue: dict[Any, tuple[list[Any], list[int]]] = {}
        self._qb = 0  # queue cost: bytes queued (see _enqueue)
        self._stream: Any = False  # not decided yet (see _side)
        self._held: collections.deque = collections.deque()

    # ---- setup ---------------------------------------------------------------------------
    def begin(self, seq_ids: list[int], lengths: list[int]) -> None:
        """The sequences about to be scored: fixes the rows of the plan's ``full_rows`` window (the
        first ``full_rows`` tokens in (seq_id, pos) order, the rows bisect replays), so every
        engine keeps the same rows whatever order it computes them in."""
        n = int(getattr(self.plan, "full_rows", 0) or 0)
        if n <= 0:
            self._window = None
            return
        order = np.argsort(np.asarray(seq_ids, np.int64), kind="stable")
        ids = np.asarray(seq_ids, np.int64)[order]
        lens = np.asarray(lengths, np.int64)[order]
        before = np.concatenate([[0], np.cumsum(lens)[:-1]])
        self._window = (ids, np.clip(n - before, 0, lens))
        self._set_batch(None, None)

    def _set_batch(self, seq: Any, pos: Any) -> None:
        """The row sets cached for the batch (seq, pos) (by identity) start over."""
        self._bkey, self._brows, self._bn = (seq, pos), {}, -1 if seq is None else len(seq)

    def _in_window(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
        if self._window is None:
            return None
        ids, lim = self._window
        j = np.clip(np.searchsorted(ids, seq), 0, len(ids) - 1)
        return (ids[j] == seq) & (pos < lim[j])

    def _rows(self, op: str, seq: Any, pos: Any) -> _Rows | None:
        """The rows of ``op`` in the batch (seq, pos): computed once per batch and plan rule set (ops
        of one batch with the same rules share one _Rows, and its device copy)."""
        if seq is not self._bkey[0] or pos is not self._bkey[1]:
            self._set_batch(seq, pos)
        key = self.plan.rule_key(op)
        if key in self._brows:
            return self._brows[key]
        s = np.asarray(seq, dtype=np.int64)
        p = np.asarray(pos, dtype=np.int64)
        modes = self.plan.modes_for(op, p, window=self._in_window(s, p))
        keep = np.nonzero((s >= 0) & (modes > 0))[0]
        rows = None
        if keep.size:
            mk = modes[keep]
            rows = _Rows(keep, s[keep], p[keep], mk, keep[mk == FULL], stats=bool((mk >= STATS).any()))
        self._brows[key] = rows
        return rows

    # ---- recording -----------------------------------------------------------------------
    def record_rows(self, op: str, tensor: Any, seq_ids: Any, pos: Any) -> None:
        """:meth:`record` of ``tensor`` viewed as one row per token (``[len(seq_ids), -1]``, or one
        value per token if 1-D): what the engines' hooks call with ``[batch, time, ...]`` outputs.

        On the batched (CUDA) path, an op recorded before (by any recorder of this process) in the
        same dtype, shape and strides costs appends to three flat lists (its segment and descriptor row
        come from the layout cached at that first call: no torch call but ``data_ptr``, no reshape);
        a slow host is what limits a small model's forward, so the cost per op call is what
        capture costs there. Rows kept ``full`` and the logits' top-k take the general path."""
        if self._is_batched and not self.copy_on_record:
            lay = _LAYOUTS.get((op, tensor.dtype, tensor.shape, tensor.stride()))
            if lay is not None and op != self._topk_op:
                # the op's rows in this batch: two dict lookups (its rule set, that set's rows)
                key = self._opkey.get(op)
                if key is None:
                    key = self._opkey[op] = self.plan.rule_key(op)
                rows = self._brows.get(key, _NOROWS) if seq_ids is self._bkey[0] and pos is self._bkey[1] else _NOROWS
                if rows is _NOROWS:
                    rows = self._rows(op, seq_ids, pos)
                if rows is None:
                    return
                off = self._used
                n = lay.n
                if not rows.full.size and off + n <= self._limit and n == self._bn:
                    if op not in self._seen:
                        self._seen.add(op)
                        self.seen_ops.append(op)
                    self._used = off + n
                    # appends to flat lists only: no object per op that the garbage collector tracks (each
                    # one kept until the chunk ends makes the interpreter's full collections more frequent)
                    self._fast.extend((op, lay, rows, off))
                    self._enqueue(tensor, lay.qkeys[rows.stats], (tensor.data_ptr(), n, lay.width, lay.row_stride, off, 0),
                                  lay.qcost)
                    return
        n = len(seq_ids)
        flat = tensor.reshape(n, -1) if tensor.dim() > 1 else tensor.reshape(n)
        self.record(op, flat, seq_ids, pos)
        key = (op, tensor.dtype, tensor.shape, tensor.stride())
        if (self._is_batched and key not in _LAYOUTS and flat.dim() == 2 and flat.shape[1] and flat.stride(1) == 1
                and flat.numel() and flat.data_ptr() == tensor.data_ptr()):
            if len(_LAYOUTS) >= _LAYOUTS_MAX:  # many batch widths: start over (bounded memory)
                _LAYOUTS.clear()
            _LAYOUTS[key] = _Layout(
                n, _dtype_name(flat.dtype), list(flat.shape[1:]), int(flat.shape[1]), flat.element_size(),
                int(flat.stride(0)), flat.numel() * flat.element_size(), ((flat.dtype, False), (flat.dtype, True)),
                _queue_cost(flat.numel() * flat.element_size()))

    def record(self, op: str, tensor: Any, seq_ids: Any, pos: Any) -> None:
        """Record ``tensor[i]`` as op ``op`` of token (``seq_ids[i]``, ``pos[i]``); rows whose
        ``seq_id`` is negative (padding) are dropped."""
        import torch

        n_tok = len(seq_ids)
        t = tensor.detach()
        if t.shape[0] != n_tok:
            raise RuntimeError(f"capture of {op}: {t.shape[0]} rows for {n_tok} tokens")
        rows = self._rows(op, seq_ids, pos)
        if rows is None:
            return
        shape = list(t.shape[1:])
        t = t.reshape(n_tok, -1) if t.dim() != 2 else t
        if t.shape[1] and t.stride(-1) != 1:
            t = t.contiguous()
        if op not in self._seen:
            self._seen.add(op)
            self.seen_ops.append(op)
        if self._device is None:
            self._device = t.device
        cuda = self._batched(t)
        if cuda and self.copy_on_record:  # on the engine's stream, before its next kernel can overwrite t
            t = t.clone(memory_format=torch.contiguous_format)
        k = rows.keep.size
        need = t.shape[0] if cuda else k
        if need > self.buffer_rows:
            raise ValueError(f"capture of {op}: {need} rows at once exceed buffer_rows={self.buffer_rows}")
        if self._used + need > self._limit:
            self.flush()
        off = self._used
        seg = _Seg(op, _dtype_name(t.dtype), shape, int(t.shape[1]), t.element_size(), rows, off, cuda)
        self._used += need
        if cuda:
            if t.shape[1]:  # an empty row's digest and stats are never read
                self._enqueue(t, (t.dtype, rows.stats), (t.data_ptr(), t.shape[0], t.shape[1], t.stride(0), off, 0),
                              _queue_cost(t.numel() * t.element_size()))
        else:
            sel = t if k == t.shape[0] else t[torch.from_numpy(rows.keep)]
            dig, st = self._arena()
            digest_stats_cpu(sel, dig[off : off + k], st[off : off + k])
        if rows.full.size:
            if cuda:
                if rows.full_dev is None:  # once per batch and row set; pinned: no host sync
                    idx = torch.from_numpy(rows.full)
                    idx = idx.pin_memory() if t.device.type == "cuda" else idx
                    rows.full_dev = idx.to(t.device, non_blocking=True)
                v = t.index_select(0, rows.full_dev)
            else:
                v = t[torch.from_numpy(rows.full)].contiguous()
            self._values.append(v)
            self._vbytes += v.numel() * v.element_size()
        if op == "logits" and getattr(self.plan, "topk", 0) and (rows.modes >= STATS).any():
            kk = min(int(self.plan.topk), t.shape[1])
            src = t if cuda else sel
            tv, ti = torch.topk(src, kk, dim=1)
            seg.has_topk = True
            seg.topk_rows = self._topk_n + (rows.keep if cuda else np.arange(k))
            self._topk_n += src.shape[0]
            self._topk.append((tv.float(), ti.int()))
        self._seg(seg)
        if self._vbytes > (self.buffer_bytes if cuda else min(self.buffer_bytes, _CPU_VALUE_BYTES)):
            self.flush()

    # ---- device arena (CUDA) ---------------------------------------------------------------
    def _reset_chunk(self) -> None:
        self._segs: list[Any] = []  # _Seg objects, or tuples of their fields (fast path)
        self._fast: list[Any] = []  # fast-path segments not yet in _segs: (op, layout, rows, arena row) flattened
        self._values: list[Any] = []
        self._topk: list[tuple[Any, Any]] = []
        self._topk_n = 0
        self._vbytes = 0
        self._used = 0

    def _arena(self) -> tuple[Any, Any]:
        """(digests, stats) of the current chunk: numpy arrays (CPU: stats float64 [rows, 5]) or device
        tensors (the batched path: stats as the tuple of ``digest_triton.split_arena``)."""
        import torch

        if not self._arenas:
            if self._is_batched:
                from mismatch_probe.probes.digest_triton import split_arena

                # stats as the file's parts (STATS_PARTS), written so by the kernel: a chunk's copy slices them
                self._arenas.append((torch.empty(self.buffer_rows, dtype=torch.int64, device=self._device),
                                     split_arena(self.buffer_rows, self._device)))
            else:
                self._arenas.append((np.empty(self.buffer_rows, np.uint64), np.empty((self.buffer_rows, 5))))
        return self._arenas[0]

    def _seg(self, seg: _Seg | None = None) -> None:
        """Move the fast path's pending segments to ``_segs`` (in recording order), then ``seg``."""
        f = self._fast
        if f:  # as tuples of _Seg's fields (the writer makes the _Seg objects; tuples pickle fast)
            segs = self._segs
            for i in range(0, len(f), 4):
                lay = f[i + 1]
                segs.append((f[i], lay.dtype_name, lay.row_shape, lay.width, lay.itemsize, f[i + 2], f[i + 3], True))
            f.clear()
        if seg is not None:
            self._segs.append(seg)

    def _queue_of(self, key: tuple[Any, bool]) -> tuple[list[Any], list[int]]:
        """The queue of ``key`` (dtype, stats; stats False: digests only, for ops whose rows are all
        kept in digest mode): (tensors, their descriptor rows flattened). The lists live as long as
        the recorder (fast-path entries append to them); a launch empties them."""
        q = self._queue.get(key)
        if q is None:
            q = self._queue[key] = ([], [])
        return q

    def _enqueue(self, t: Any, key: tuple[Any, bool], desc: tuple[int, ...], cost: int) -> None:
        """Queue ``t`` (a reference) with its descriptor row (address, rows, columns, row stride,
        arena row, column offset: see digest_triton.launch_desc) for the next launch of its ``key``;
        ``cost``: :func:`_queue_cost` of its bytes."""
        q = self._queue_of(key)
        q[0].append(t)
        q[1].extend(desc)
        self._qb += cost
        if self._qb >= self._queue_limit:
            self._launch()

    def launch(self) -> None:
        """Launch the queued tensors' kernels now (the HF capture calls it when a new micro-batch
        starts: the previous forward is done, its logprobs on the host)."""
        if self._is_batched:
            self._launch()

    def start_batch(self, rows: int) -> None:
        """A forward of ``rows`` rows per op starts (the HF capture's micro-batch; padding included):
        the queued kernels launch (:meth:`launch`), the previous forward's rows per token are noted
        for the plan, and this forward's chunk end is placed (see ``CUDA_BUFFER_ROWS``)."""
        self.launch()
        self._note_forward()
        self._fwd = (self._flushed + self._used, int(rows))
        self._place_limit()

    def _plan_key(self) -> str:
        import json

        if self._pkey is None:
            self._pkey = json.dumps(self.plan.to_json(), sort_keys=True, default=str)
        return self._pkey

    def _note_forward(self) -> None:
        """The rows per token of the forward that just ended, for the next forwards of this plan."""
        if self._fwd is not None and self._cuts is not None:
            start, rows = self._fwd
            done = self._flushed + self._used - start
            if done > 0 and rows > 0:
                _ROWS_PER_TOKEN[self._plan_key()] = done / rows

    def _place_limit(self) -> None:
        """Where the current chunk ends (at each forward's start and after each flush): without ``_cuts``,
        at ``buffer_rows``; with them (see :class:`_Cuts`), the rows of the forward still to come before its
        tail, from the plan's rows per token of its previous forward, cut into the fewest even chunks of at
        most ``buffer_rows`` (none shorter than ``least``); the tail, and a forward before the rows per token
        are known, in chunks of ``base``. Chunks end between op calls, so the last chunk before the tail may
        stop short of it: a remainder under one op call's rows (or an eighth of ``base``) joins the tail
        instead of making a chunk of one op call (the 0.6B shape: 4 Ki rows)."""
        c = self._cuts
        if c is None:
            self._limit = self.buffer_rows
            return
        lim = c.base
        per = _ROWS_PER_TOKEN.get(self._plan_key())
        if per is not None and self._fwd is not None:
            start, rows = self._fwd
            body = int(per * rows * (1 - c.tail)) - (self._flushed + self._used - start)
            if body > max(rows, c.base // 8):
                m = -(-body // self.buffer_rows)
                lim = max(c.least, self._used + -(-body // m))
        self._limit = min(self.buffer_rows, lim)

    def _side(self) -> Any:
        """The CUDA stream the recorder's device work runs on (None: the engine's own stream).

        On a side stream the digest/stats kernels and the chunk copies overlap the engine's
        kernels (they are integer-ALU-bound, the engine's GEMMs are not); each batch waits for an
        event recorded on the engine's stream after the tensors it reads were produced, and the
        tensors stay referenced until an event after the batch has completed, so the allocator
        never hands their memory to the engine while they are read.

        One side stream per device for the whole process (:data:`_SIDE_STREAMS`), not one per
        recorder: the caching allocator keeps freed blocks per stream, so a recorder per ``score()``
        on a stream of its own made the arena's blocks anew each time (``cudaMalloc``: 3 per
        ``score()`` on the 0.6B shape, host time inside the forward) and reserved memory per stream."""
        import torch

        if self._stream is False:
            self._stream = None
            if self._device.type == "cuda" and settings.get("MISMATCH_PROBE_CAPTURE_STREAM") != "main":
                idx = self._device.index if self._device.index is not None else torch.cuda.current_device()
                st = _SIDE_STREAMS.get(idx)
                if st is None:
                    st = _SIDE_STREAMS[idx] = torch.cuda.Stream(idx)
                self._stream = st
        return self._stream

    def _after_engine(self) -> Any:
        """Context: device work ordered after everything the engine's stream has queued so far."""
        import contextlib

        import torch

        side = self._side() if self._is_batched else None
        if side is None:
            return contextlib.nullcontext()
        side.wait_stream(torch.cuda.current_stream(self._device))
        return torch.cuda.stream(side)

    def _hold_until_done(self, refs: list[Any]) -> None:
        """Keep ``refs`` alive until the side stream's work queued so far has run."""
        import torch

        if self._stream is None or self._stream is False:
            return
        done = torch.cuda.Event()
        done.record(self._stream)
        self._held.append((done, refs))
        while self._held and (self._held[0][0].query() or len(self._held) > _HELD_MAX):
            self._held[0][0].synchronize()  # done already, unless too many batches are in flight
            self._held.popleft()

    def _launch(self) -> None:
        from mismatch_probe.probes import digest_triton

        if not self._qb:
            return
        refs = []
        with self._after_engine():
            dig, st = self._arena()
            for (_, stats), (ts, flat) in self._queue.items():
                if not ts:
                    continue
                desc = np.array(flat, np.int64).reshape(-1, 6)
                for i in range(0, len(ts), 512):
                    part = desc[i : i + 512]
                    digest_triton.launch_desc(part, ts[i], int(part[:, 1].max()), dig, st, stats)
                refs.append(ts.copy())
                ts.clear()
                flat.clear()
        self._hold_until_done(refs)
        self._qb = 0  # queue cost (bytes)

    # ---- chunks: device -> host -> Arrow -> sink ---------------------------------------------
    def flush(self, engine_waits: bool = False) -> None:
        """End the current chunk: start its copy to the host and hand it to the writer thread,
        which waits for the copy, builds the Arrow rows and writes a row group. ``engine_waits``: the
        engine's current stream waits for this chunk's device work (its kernels and copy) before its next
        kernels: for the forward's last chunk, whose rows the writer then writes while the engine computes
        the logprobs (on the high-priority engine stream the logprobs' kernels came first and the writer
        got the chunk only after them: see ``probes/hf/runner.py`` CAPTURE_FIRST)."""
        import torch

        self._flush()
        self._place_limit()
        if engine_waits and self._is_batched and self._side() is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def _flush(self) -> None:
        import torch

        self._seg()
        if not self._segs:
            return
        u = self._used
        self._flushed += u
        if self._is_batched:
            self._launch()
            with self._after_engine():  # the values and top-k were gathered on the engine's stream
                parts = self._device_parts(u)
                # on CUDA with the writer process: straight into its shared memory; else (or where a slot
                # cannot be page-locked) one copy per part into pinned host memory
                staged = self._proc.stage(parts) if _D2H_TO_SLOT and self._proc is not None else None
                host = {} if staged is not None else {k: self._to_host([v]) for k, v in parts.items()}
                if staged is not None:
                    self.chunks_staged += 1
                else:
                    self.chunks_pinned += 1
                ev = None
                if self._device.type == "cuda":
                    ev = torch.cuda.Event()
                    ev.record()
            self._hold_until_done([self._values, self._topk, list(parts.values())])
            if staged is not None:  # copied into the writer process's memory already: only its message is left
                segs = self._segs
                self._reset_chunk()
                self._proc.submit((ev, segs, staged))
                return
            hs = tuple(host.get(k) for k in STATS_PARTS) if "st" in host else None
            job = (ev, self._segs, host["dig"], hs, host.get("vals"), host.get("tv"), host.get("ti"))
        else:
            dig, st = self._arena()
            self._arenas.clear()  # the writer owns these arrays now; the next chunk gets new ones
            # the values in pieces (the feeder writes them one after another: no concatenated copy here)
            vals = [v.reshape(-1).view(torch.uint8).numpy() for v in self._values] or None
            tv = torch.cat([a for a, _ in self._topk]).numpy() if self._topk else None
            ti = torch.cat([b for _, b in self._topk]).numpy() if self._topk else None
            job = (None, self._segs, dig[:u], st[:u], vals, tv, ti)
        self._reset_chunk()
        self._submit(job)

    def _device_parts(self, u: int) -> dict[str, Any]:
        """The chunk's parts on the device, as the packed ops.parquet stores them (names of
        ``recorder_writer.PARTS``): raw digests (8 bytes a row); for a chunk with stats rows the stats as the
        kernel wrote them (``recorder_writer.STATS_PARTS``: float64 sum and sum_sq, float64 abs_max, int32 NaN / Inf
        counts, abs_max's bf16 bits: 42 bytes a row over the bus, no host-side pass; none for a chunk of
        digest-only ops, whose stats columns are null); the kept values and the logits' top-k. Enqueued on
        the current stream."""
        import torch

        dig, st = self._arena()
        parts = {"dig": dig[:u]}
        if self._chunk_has_stats():
            # the kernel wrote the stats as these parts (digest_triton.split_arena): slices, no kernel here;
            # abs_max's bf16 bits are exact for a bf16 op's rows (whose maxima are bf16 values), and the writer
            # stores 2 bytes for them instead of 8 (ops_table._abs_max_blob) without converting anything
            parts.update((name, a[:u]) for name, a in zip(STATS_PARTS, st, strict=True))
        if self._values:
            parts["vals"] = torch.cat([v.reshape(-1).view(torch.uint8) for v in self._values])
        if self._topk:
            parts["tv"] = torch.cat([a for a, _ in self._topk])
            parts["ti"] = torch.cat([b for _, b in self._topk])
        return parts

    def _chunk_has_stats(self) -> bool:
        return any((g.rows if isinstance(g, _Seg) else g[5]).stats for g in self._segs)

    def _submit(self, job: tuple) -> None:
        import queue
        import threading

        if self.writer_mode == "process":
            ev, segs, dig, st, vals, tv, ti = job
            sp = dict(zip(STATS_PARTS, st, strict=True)) if isinstance(st, tuple) else {"st": st}
            self._proc.submit((ev, segs, {"dig": dig, **sp, "vals": vals, "tv": tv, "ti": ti}))
            return
        if self._thread is None:
            self._jobs: queue.Queue = queue.Queue(maxsize=self.queue_chunks)
            self._thread = threading.Thread(target=self._writer_loop, name="op-recorder-writer", daemon=True)
            self._thread.start()
        self._jobs.put(job)  # blocks while queue_chunks chunks wait: host memory stays bounded
        if self._error is not None:
            raise self._error

    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._error is None:
                try:
                    self._drain(*job)
                except BaseException as e:  # reported by the recording thread
                    self._error = e

    @staticmethod
    def _to_host(parts: list[Any]) -> Any:
        """One asynchronous copy into pinned memory (CUDA); a plain copy for CPU tensors."""
        import torch

        if not parts:
            return None
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        if flat.device.type != "cuda":
            return flat.clone()
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        return host

    def _batched(self, t: Any) -> bool:
        """CUDA tensors (or ``batched=True``: the same path on CPU tensors through Triton's
        interpreter, for tests) go through the queued Triton launches and the device arena."""
        if self._is_batched is None:
            self._is_batched = t.device.type == "cuda" or self.force_batched
            if self._is_batched and not self._rows_given:  # nothing recorded yet: the arena is not made
                stats = self.plan.keeps_stats()
                if stats:
                    self.buffer_rows = min(self.buffer_rows, STATS_BUFFER_ROWS)
                cuts = _Cuts.of(stats)
                if self._fwd is not None and cuts.tail > 0:  # forwards marked (start_batch)
                    self._cuts = cuts
                    if not stats:
                        self.buffer_rows = max(self.buffer_rows, CUDA_BUFFER_ROWS)
                self._place_limit()
        return self._is_batched

    def _drain(self, ev: Any, segs: list[_Seg], dig: Any, st: Any, vals: Any, tv: Any, ti: Any) -> None:
        if ev is not None:
            ev.synchronize()
        if isinstance(vals, list):
            vals = np.concatenate(vals)
        if not isinstance(dig, np.ndarray):
            dig = dig.numpy()  # int64 digests (the uint64 bits)
            st = None if st is None else tuple(None if a is None else a.numpy() for a in st) if isinstance(st, tuple) \
                else st.numpy()
            vals = None if vals is None else vals.numpy()
            tv = None if tv is None else tv.numpy()
            ti = None if ti is None else ti.numpy()
        self.value_bytes += 0 if vals is None else int(vals.size)
        if self._writer is not None:  # streamed: the packed layout (one row per segment, blobs)
            table = _build_packed(segs, dig, st, vals, tv, ti)
            self.rows_written += int(np.asarray(table.column("n")).sum())
            self._writer.write(table)
        else:
            if isinstance(st, tuple):  # the in-memory table takes the arena's [rows, 5] float64 layout
                st = np.column_stack([st[0], st[1], st[2].astype(np.float64)])
            table = _build_table(segs, dig, st, vals, tv, ti)
            self.rows_written += table.num_rows
            self._tables.append(table)

    def _join(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Write everything still buffered; finalize the file (atomic rename)."""
        if self._closed:
            return
        self._note_forward()
        try:
            self.flush()
            self._join()
            if self._error is not None:
                raise self._error
            if self._proc is not None:
                self._proc.close()
                self.rows_written, self.value_bytes = self._proc.rows, self._proc.value_bytes
                self.writer_peak_rss_mb = self._proc.peak_rss_mb
                self._proc = None
        except BaseException:
            self.abort()
            raise
        if self._writer is not None:
            self._writer.close()
        self._closed = True
        self._release_device()

    def _release_device(self) -> None:
        """Drop the arena and held tensors once the side stream has finished with them."""
        if self._stream:
            self._stream.synchronize()
        self._held.clear()
        self._arenas.clear()

    def abort(self) -> None:
        """Drop everything (the temp file too): nothing half-written stays behind."""
        self._closed = True
        for ts, flat in self._queue.values():
            ts.clear()
            flat.clear()
        self._qb = 0
        if self._thread is not None:
            self._error = self._error or RuntimeError("aborted")
            self._join()
        self._release_device()
        if self._writer is not None:
            self._writer.abort()
        if self._proc is not None:
            self._proc.abort()
            self._proc = None
        if self.writer_mode == "process":
            Path(self._tmp).unlink(missing_ok=True)

    def summary(self) -> dict[str, Any]:
        """What was kept, for the manifest."""
        return {"plan": self.plan.to_json(), "digest": "mp64 (probes/digest.py)", "rows": self.rows_written,
                "value_bytes": self.value_bytes, "buffer_rows": self.buffer_rows, "buffer_bytes": self.buffer_bytes,
                "streamed": self._sink is not None, "writer": self.writer_mode,
                **({"writer_peak_rss_mb": self.writer_peak_rss_mb} if self.writer_peak_rss_mb is not None else {}),
                **({"device_chunks": {"staged": self.chunks_staged, "pinned": self.chunks_pinned}}
                   if self.chunks_staged or self.chunks_pinned else {})}

    def table(self) -> pa.Table:
        """The whole ``ops`` table (in-memory recorders only)."""
        from mismatch_probe.run.schema import conform

        self.close()
        if self._sink is not None:
            raise RuntimeError("this recorder streamed its rows to a file")
        if not self._tables:
            return _ops_schema().empty_table()
        return conform(pa.concat_tables(self._tables), "ops")


def _writer_mode() -> str:
    """``MISMATCH_PROBE_CAPTURE_WRITER``; ``auto``: a writer process beside a CUDA forward (no GIL
    shared with its launches), a thread on a CPU-only machine (measured: the whole `capture` command
    1.28x vs 1.34x of --capture off on 2 cores, BENCHMARKS.md)."""
    mode = settings.get("MISMATCH_PROBE_CAPTURE_WRITER")
    if mode == "auto":
        import torch

        mode = "process" if torch.cuda.is_available() else "thread"
    return mode
