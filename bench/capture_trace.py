"""Where a captured ``score()`` spends its time, stage by stage (a bench diagnostic, not the product):
timestamps around the recorder's launches and flushes, the learner's forwards, the writer feeder's
wait for each chunk's device copy and its hand-over, the writer process's acknowledgements and the
close, taken by wrapping those functions in this process (the writer process itself is not traced:
its work shows as the time the engine's process waits for its acks).

    from capture_trace import Trace
    tr = Trace().install()       # before the timed rounds
    tr.begin(); r.score(...); tr.end(mode)   # per score()
    tr.summary()                 # per mode: medians of each stage (ms), what the table prints
    tr.uninstall()

Stages (ms, per ``score()``, medians over the rounds):
``fwd``: the learner's forwards (host time of ``padded_forward``: hooks included, no sync);
``launch`` / ``n_launch``: the recorder's queued-kernel launches (host time; inside and outside flushes);
``flush`` / ``n_flush``: the recorder's chunk flushes (host time, their launches included);
``block``: the recording thread blocked handing a chunk over (writer behind);
``hold``: the recording thread keeping side-stream batches' tensors alive (waits when too many are in flight);
``after_fwd``: from the last forward's return until ``close()`` starts (early flush, logprobs, ``.cpu()``);
``close``: ``close()``; of it ``drain`` (until the feeder has handed every chunk over), ``acks`` (then
until the last chunk's ack), ``final`` (then the file's footer and rename);
``ev_wait``: the feeder waiting for chunks' device copies (all chunks; ``ev_wait_last``: the last);
``send``: the feeder's copy into shared memory and the message (all chunks; ``send_last``: the last);
``fwd_cpu``: the main thread's CPU time in the forwards (``time.thread_time``: ``fwd`` minus it is time the
thread waited: the GIL, a blocking call); ``ldesc``: host time in ``digest_triton.launch_desc``;
``gc`` / ``n_gc2``: the interpreter's garbage collections during the ``score()`` (time, full collections);
``cmalloc`` / ``hmalloc`` / ``retries``: the CUDA caching allocators' device and host allocations (``cudaMalloc``,
``cudaHostAlloc``) and allocation retries during the ``score()``; ``staged`` / ``unstaged``: chunks copied by the
device into the writer's shared memory / through pinned buffers (the slot could not be page-locked).

The timeline (ms from the ``score()``'s start; the writer process reports its own times in its
acknowledgements, on the same clock): ``t_fwd`` the last forward's return (host), ``t_dev`` when the
device reached the end of that forward (an event recorded on the engine's stream at its return, waited
for by a helper thread), ``t_w0`` / ``t_wl`` when the writer process received its first / last chunk,
``t_wd`` when it had written the last one, ``t_end`` when ``close()`` returned; ``w_build`` /
``w_write`` its time building the chunks' tables / writing their row groups (sums), ``w_idle`` its time
between chunks (from the first chunk's arrival to the last's, minus its work), ``w_close`` the footer,
close and rename.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

_now = time.perf_counter


class Trace:
    def __init__(self) -> None:
        self.ev: list[tuple[str, float, float]] = []  # (stage, start, duration) of the current score()
        self.rows: dict[str, list[dict[str, float]]] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._t0 = 0.0
        self.wtimes: list[tuple[float, ...]] = []
        self._waiters: list[threading.Thread] = []

    def _wrap(self, owner: Any, name: str, stage: str) -> None:
        orig = getattr(owner, name)
        tr = self

        def wrapped(*a: Any, **k: Any) -> Any:
            t = _now()
            try:
                return orig(*a, **k)
            finally:
                tr.ev.append((stage, t, _now() - t))

        setattr(owner, name, wrapped)
        self._undo.append((owner, name, orig))

    def install(self) -> Trace:
        from mismatch_probe.probes import recorder as recmod
        from mismatch_probe.probes import recorder_writer as rw
        from mismatch_probe.probes.hf import runner as hfrun

        self._wrap(hfrun, "padded_forward", "fwd")
        orig_fwd = hfrun.padded_forward

        def fwd_cpu(*a: Any, **k: Any) -> Any:  # the main thread's CPU time in the forward
            t = time.thread_time()
            try:
                return orig_fwd(*a, **k)
            finally:
                self.ev.append(("fwd_cpu", 0.0, time.thread_time() - t))
                self._device_end()

        hfrun.padded_forward = fwd_cpu
        self._undo.append((hfrun, "padded_forward", orig_fwd))
        from mismatch_probe.probes import digest_triton

        self._wrap(digest_triton, "launch_desc", "ldesc")
        import gc

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                self._gc0 = _now()
            else:
                self.ev.append(("gc" + str(info.get("generation", 0)), self._gc0, _now() - self._gc0))

        gc.callbacks.append(on_gc)
        self._gc_cb = on_gc
        self._wrap(recmod.OpRecorder, "_launch", "launch")
        self._wrap(recmod.OpRecorder, "flush", "flush")
        self._wrap(recmod.OpRecorder, "close", "close")
        self._wrap(recmod.OpRecorder, "_hold_until_done", "hold")
        self._wrap(rw.WriterProcess, "submit", "block")
        self._wrap(rw.WriterProcess, "_drain", "drain")
        self._wrap(rw.WriterProcess, "_ack", "ack")
        orig_stage = rw.WriterProcess.stage

        def stage(wp: Any, parts: dict[str, Any]) -> Any:  # None: the slot was not page-locked (the pinned path)
            got = orig_stage(wp, parts)
            self.ev.append(("staged" if got is not None else "unstaged", 0.0, 0.0))
            return got

        rw.WriterProcess.stage = stage
        self._undo.append((rw.WriterProcess, "stage", orig_stage))
        orig_send = rw.WriterProcess._send
        tr = self
        orig_close = rw.WriterProcess.close

        def wclose(wp: Any) -> None:  # the writer process's own times of this file
            orig_close(wp)
            tr.wtimes = list(wp.times)

        rw.WriterProcess.close = wclose
        self._undo.append((rw.WriterProcess, "close", orig_close))

        def send(self: Any, ev: Any, segs: list, parts: dict[str, Any]) -> None:  # feeder thread
            t = _now()
            if ev is not None:
                ev.synchronize()
            t1 = _now()
            tr.ev.append(("ev_wait", t, t1 - t))
            orig_send(self, ev, segs, parts)  # ev done: its second wait returns at once
            tr.ev.append(("send", t1, _now() - t1))

        rw.WriterProcess._send = send
        self._undo.append((rw.WriterProcess, "_send", orig_send))
        return self

    def uninstall(self) -> None:
        import gc

        if getattr(self, "_gc_cb", None) in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    @staticmethod
    def _alloc_counts() -> dict[str, float]:
        import torch

        if not torch.cuda.is_available():
            return {}
        d = torch.cuda.memory_stats()
        out = {"cmalloc": float(d.get("num_device_alloc", 0)), "retries": float(d.get("num_alloc_retries", 0))}
        try:
            out["hmalloc"] = float(torch.cuda.host_memory_stats().get("num_host_alloc", 0))
        except Exception:  # an older torch
            pass
        return out

    def _device_end(self) -> None:
        """When the device reaches what the engine's stream has queued now: an event, waited for by a
        thread (its wait releases the GIL), so the recording thread goes on at once."""
        import torch

        if not torch.cuda.is_available():
            return
        ev = torch.cuda.Event()
        ev.record()

        def wait() -> None:
            ev.synchronize()
            self.ev.append(("dev", _now(), 0.0))

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        self._waiters.append(th)

    def begin(self) -> None:
        self.ev = []
        self.wtimes: list[tuple[float, ...]] = []
        self._waiters: list[threading.Thread] = []
        self._a0 = self._alloc_counts()
        self._t0 = _now()

    def end(self, mode: str) -> dict[str, float]:
        for th in self._waiters:
            th.join()
        ev = list(self.ev)
        a1 = self._alloc_counts()

        def of(stage: str) -> list[tuple[float, float]]:
            return [(s, d) for st, s, d in ev if st == stage]

        ms = 1e3
        fwd, close = of("fwd"), of("close")
        row: dict[str, float] = {
            "fwd": sum(d for _, d in fwd) * ms,
            "launch": sum(d for _, d in of("launch")) * ms, "n_launch": len(of("launch")),
            "flush": sum(d for _, d in of("flush")) * ms, "n_flush": len(of("flush")),
            "block": sum(d for _, d in of("block")) * ms,
            "hold": sum(d for _, d in of("hold")) * ms,
            "ev_wait": sum(d for _, d in of("ev_wait")) * ms, "send": sum(d for _, d in of("send")) * ms,
            "ev_wait_last": (of("ev_wait")[-1][1] * ms) if of("ev_wait") else 0.0,
            "send_last": (of("send")[-1][1] * ms) if of("send") else 0.0,
            "fwd_cpu": sum(d for _, d in of("fwd_cpu")) * ms, "ldesc": sum(d for _, d in of("ldesc")) * ms,
            "gc": sum(d for st, _, d in ev if st.startswith("gc")) * ms, "n_gc2": len(of("gc2")),
            "staged": len(of("staged")), "unstaged": len(of("unstaged")),
        }
        row.update({k: v - self._a0.get(k, 0.0) for k, v in a1.items()})
        if fwd and close:
            c0, cd = close[-1]
            row["after_fwd"] = (c0 - (fwd[-1][0] + fwd[-1][1])) * ms
            row["close"] = cd * ms
            drains = [s + d for s, d in of("drain") if s >= c0]
            acks = [s + d for s, d in of("ack") if s >= c0]
            t_drain = drains[-1] if drains else c0
            t_acks = max([t_drain, *acks])
            row["drain"] = (t_drain - c0) * ms
            row["acks"] = (t_acks - t_drain) * ms
            row["final"] = (c0 + cd - t_acks) * ms
            t0 = self._t0
            row["t_fwd"] = (fwd[-1][0] + fwd[-1][1] - t0) * ms
            devs = of("dev")
            if devs:
                row["t_dev"] = (devs[-1][0] - t0) * ms
            row["t_end"] = (c0 + cd - t0) * ms
            chunks = [w for w in self.wtimes if len(w) == 3]
            if chunks:
                row["t_w0"] = (chunks[0][0] - t0) * ms
                row["t_wl"] = (chunks[-1][0] - t0) * ms
                row["t_wd"] = (chunks[-1][2] - t0) * ms
                row["w_build"] = sum(b - r for r, b, _ in chunks) * ms
                row["w_write"] = sum(w - b for _, b, w in chunks) * ms
                row["w_idle"] = max(0.0, (chunks[-1][0] - chunks[0][0]) * ms - sum(w - r for r, _, w in chunks[:-1]) * ms)
            closes = [w for w in self.wtimes if len(w) == 2]
            if closes:
                row["w_close"] = (closes[-1][1] - closes[-1][0]) * ms
        self.rows.setdefault(mode, []).append(row)
        return row

    def summary(self, skip_first: bool = True) -> dict[str, dict[str, float]]:
        """Per mode, the median of each stage over the rounds (the first, a warm-up, left out)."""
        out = {}
        for mode, rows in self.rows.items():
            rs = rows[1:] if skip_first and len(rows) > 1 else rows
            keys = sorted({k for r in rs for k in r})
            out[mode] = {k: round(statistics.median(r.get(k, 0.0) for r in rs), 3) for k in keys}
        return out


COLUMNS = ("fwd", "fwd_cpu", "gc", "n_gc2", "cmalloc", "hmalloc", "ldesc", "staged", "unstaged",
           "n_launch", "launch", "n_flush", "flush", "block", "hold", "after_fwd", "close", "drain", "acks", "final",
           "ev_wait", "ev_wait_last", "send", "send_last")
TIMELINE = ("t_fwd", "t_dev", "t_w0", "t_wl", "t_wd", "t_end", "w_build", "w_write", "w_idle", "w_close")


def table(summary: dict[str, dict[str, float]]) -> str:
    head = f"{'mode':18}" + "".join(f"{c:>13}" for c in COLUMNS)
    lines = ["stages per score(), ms, medians (bench/capture_trace.py)", head]
    for mode, s in summary.items():
        lines.append(f"{mode:18}" + "".join(f"{s.get(c, 0.0):13.2f}" for c in COLUMNS))
    lines += ["", "timeline per score(), ms from its start, medians (t_*), and the writer process's work (w_*)",
              f"{'mode':18}" + "".join(f"{c:>10}" for c in TIMELINE)]
    for mode, s in summary.items():
        lines.append(f"{mode:18}" + "".join(f"{s.get(c, 0.0):10.2f}" for c in TIMELINE))
    return "\n".join(lines)
