"""The op recorder's writer process: builds the Arrow rows of each chunk and writes them to
``ops.parquet``, outside the engine's process.

Why a process: a writer thread builds Arrow columns and compresses Parquet pages while the
engine's forward runs, and every torch call of the forward releases and re-takes the GIL; a thread
holding it delays the forward (measured: a short GPU forward ran at a fraction of its speed while
the thread wrote). Here the engine's process only waits for the chunk's device-to-host copy (on a
feeder thread, GIL released), writes the chunk's bytes to one file in shared memory (``/dev/shm``,
one ``write`` call, GIL released) and sends a small message (the chunk's op segments); this
process reads the file, builds the table and writes the row group. The table is the same as the
in-memory path's (tested).

Protocol (pickles over two pipes): ``("open", sink, tmp, meta)``; ``("chunk", data_path, parts,
segs)`` -> ``("ack", rows, value_bytes, data_path)``; ``("close",)`` -> ``("closed", peak RSS MB
of this process while it wrote the file)`` (file
renamed into place); ``("abort",)`` -> ``("aborted",)`` (temp file removed); any failure ->
``("error", text)`` and the process exits. After ``closed``/``aborted`` the process waits for the
next ``open`` (one process serves the recorders of an engine process one after another); it exits
when its pipe closes (the engine's process ended), removing a file left open.

Host memory stays bounded: the feeder keeps at most ``queue_chunks`` chunks in flight.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

PARTS = ("dig", "st", "cnt", "vals", "tv", "ti")  # st + cnt: the stats split on the device (recorder.flush)


@functools.cache
def _shm_dir() -> str:
    d = "/dev/shm"
    try:
        if os.path.isdir(d) and os.access(d, os.W_OK) and os.statvfs(d).f_bavail * os.statvfs(d).f_frsize > 1 << 30:
            return d
    except OSError:
        pass
    return tempfile.gettempdir()


class _Child:
    """One writer process and its two pipes; kept for the next recorder of this process when a
    recorder is done with it (a process start costs more than a short forward)."""

    def __init__(self) -> None:
        r_child, w_parent = os.pipe()
        r_parent, w_child = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mismatch_probe.probes.recorder_writer", str(r_child), str(w_child)],
            pass_fds=(r_child, w_child), stdin=subprocess.DEVNULL)
        os.close(r_child)
        os.close(w_child)
        self.tx = Connection(w_parent, readable=False)
        self.rx = Connection(r_parent, writable=False)
        # the feeder thread lives as long as the process: a recorder's set-up starts no thread
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None

    def feed(self, writer: WriterProcess, job: tuple | None) -> None:
        """Queue ``job`` of ``writer`` for the feeder thread (None: set ``writer.fed`` when every
        job queued before it is handed over)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._feed, name="op-recorder-feeder", daemon=True)
            self.thread.start()
        self.jobs.put((writer, job))

    def _feed(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            writer, job = item
            if job is None:
                writer.fed.set()
            elif writer.error is None:
                try:
                    writer._send(*job)
                except BaseException as e:  # reported by the recording thread
                    writer.error = e
                finally:
                    writer.slots.release()
            else:
                writer.slots.release()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
        for c in (self.tx, self.rx):
            c.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_IDLE: list[_Child] = []
_IDLE_LOCK = threading.Lock()


def _take_child() -> _Child:
    with _IDLE_LOCK:
        while _IDLE:
            c = _IDLE.pop()
            if c.alive():
                return c
            c.stop()
    return _Child()


def _give_back(c: _Child) -> None:
    with _IDLE_LOCK:
        if c.alive() and not _IDLE:
            _IDLE.append(c)
            return
    c.stop()


def _stop_idle() -> None:
    with _IDLE_LOCK:
        while _IDLE:
            _IDLE.pop().stop()


atexit.register(_stop_idle)


class WriterProcess:
    """Parent side of one ``ops.parquet``: the writer process's feeder thread turns queued chunk
    jobs into files + messages for it. ``submit`` blocks while ``queue_chunks`` jobs wait (bounded
    memory)."""

    def __init__(self, sink: Path, tmp: str, meta: dict[bytes, bytes], queue_chunks: int) -> None:
        self.child = _take_child()
        self.proc, self.tx, self.rx = self.child.proc, self.child.tx, self.child.rx
        self.tx.send(("open", str(sink), tmp, meta))
        self.dir = _shm_dir()
        self.queue_chunks = queue_chunks
        self.slots = threading.Semaphore(queue_chunks)  # jobs queued and not yet handed over
        self.fed = threading.Event()
        self.error: BaseException | None = None
        self.rows = 0
        self.value_bytes = 0
        self.peak_rss_mb: float | None = None
        self._inflight = 0
        self._n = 0
        self._files: set[str] = set()

    # ---- feeder thread -----------------------------------------------------------------------
    def _send(self, ev: Any, segs: list, parts: dict[str, Any]) -> None:
        if ev is not None:
            ev.synchronize()  # the chunk's device-to-host copy (GIL released while waiting)
        self._n += 1
        path = os.path.join(self.dir, f"mp-ops-{os.getpid()}-{id(self)}-{self._n}.bin")
        layout = {}
        off = 0
        self._files.add(path)
        with open(path, "wb") as f:
            for name in PARTS:
                a = parts.get(name)
                if a is None:
                    continue
                pieces = a if isinstance(a, list) else [a]  # a list: byte pieces of one part (CPU values)
                pieces = [np.ascontiguousarray(x.numpy() if hasattr(x, "numpy") else x) for x in pieces]
                n = sum(x.nbytes for x in pieces)
                layout[name] = ("|u1", (n,), off) if isinstance(a, list) else (pieces[0].dtype.str, pieces[0].shape, off)
                for x in pieces:
                    f.write(memoryview(x.reshape(-1).view(np.uint8)))
                off += n
        while self._inflight >= self.queue_chunks:
            self._recv_ack()
        self.tx.send(("chunk", path, layout, segs))
        self._inflight += 1

    def _recv_ack(self) -> None:
        msg = self._recv()
        if msg[0] != "ack":
            raise RuntimeError(f"op writer process: unexpected {msg[0]!r}")
        self.rows += msg[1]
        self.value_bytes += msg[2]
        self._files.discard(msg[3])
        self._inflight -= 1

    def _recv(self) -> tuple:
        try:
            msg = self.rx.recv()
        except EOFError:
            raise RuntimeError(f"op writer process exited (code {self.proc.wait()})") from None
        if msg[0] == "error":
            raise RuntimeError(f"op writer process failed:\n{msg[1]}")
        return msg

    # ---- recording thread ----------------------------------------------------------------------
    def submit(self, job: tuple) -> None:
        self.slots.acquire()  # blocks while queue_chunks jobs wait: host memory stays bounded
        self.child.feed(self, job)
        if self.error is not None:
            raise self.error

    def _drain(self) -> None:
        """Wait until the feeder has handed over (or dropped) every job of this file."""
        self.fed.clear()
        self.child.feed(self, None)
        self.fed.wait()

    def close(self) -> None:
        self._drain()
        if self.error is not None:
            raise self.error
        while self._inflight:
            self._recv_ack()
        self.tx.send(("close",))
        msg = self._recv()
        if msg[0] != "closed":
            raise RuntimeError("op writer process did not close the file")
        self.peak_rss_mb = msg[1]
        self._finish(reuse=True)

    def abort(self) -> None:
        self.error = self.error or RuntimeError("aborted")  # the feeder drops the jobs not yet handed over
        self._drain()
        ok = False
        try:
            self.tx.send(("abort",))
            while self._recv()[0] != "aborted":
                pass
            ok = True
        except Exception:
            pass
        self._finish(reuse=ok)

    def _finish(self, reuse: bool = False) -> None:
        for p in self._files:
            Path(p).unlink(missing_ok=True)
        if reuse:
            _give_back(self.child)
        else:
            self.child.stop()


# ---- the writer process ----------------------------------------------------------------------
def _read_parts(path: str, layout: dict[str, tuple[str, tuple, int]]) -> dict[str, np.ndarray]:
    """The chunk's arrays, mapped from the file (no copy: the packed table's blobs are views of
    the mapped pages where the arena rows are contiguous)."""
    size = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for dt, shape, _ in layout.values())
    buf = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)) if size else np.zeros(0, np.uint8)
    out = {}
    for name, (dt, shape, off) in layout.items():
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        out[name] = buf[off : off + n].view(np.dtype(dt)).reshape(shape)
    return out


def _peak_rss_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def main(rfd: int, wfd: int) -> None:
    from mismatch_probe.probes.ops_table import _build_packed, packed_writer

    rx, tx = Connection(rfd, writable=False), Connection(wfd, readable=False)
    writer = None
    try:
        while True:
            try:
                msg = rx.recv()
            except EOFError:  # the engine's process is gone: leave no half-written file
                if writer is not None:
                    writer.abort()
                return
            if msg[0] == "open":
                _peak_rss_reset()
                _, sink, tmp, meta = msg
                writer = packed_writer(Path(sink), meta, tmp=tmp)
            elif msg[0] == "chunk":
                _, path, layout, segs = msg
                p = _read_parts(path, layout)
                os.unlink(path)
                st = (p["st"], p["cnt"]) if "cnt" in p else p.get("st")
                table = _build_packed(segs, p["dig"], st, p.get("vals"), p.get("tv"), p.get("ti"))
                assert writer is not None
                writer.write(table)
                vals = p.get("vals")
                rows = int(np.asarray(table.column("n")).sum())
                tx.send(("ack", rows, 0 if vals is None else int(vals.size), path))
            elif msg[0] == "close":  # the file is complete; wait for the next one
                assert writer is not None
                writer.close()
                writer = None
                tx.send(("closed", _peak_rss_mb()))
            elif msg[0] == "abort":
                if writer is not None:
                    writer.abort()
                writer = None
                tx.send(("aborted",))
    except BaseException:
        if writer is not None:
            writer.abort()
        try:
            tx.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
