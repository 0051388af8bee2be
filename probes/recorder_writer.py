"""The op recorder's writer process: builds the Arrow rows of each chunk and writes them to
``ops.parquet``, outside the engine's process.

Why a process: a writer thread builds Arrow columns and compresses Parquet pages while the
engine's forward runs, and every torch call of the forward releases and re-takes the GIL; a thread
holding it delays the forward (measured: a short GPU forward ran at a fraction of its speed while
the thread wrote). Here the engine's process only waits for the chunk's device-to-host copy (on a
feeder thread, GIL released) and sends a small message (the chunk's op segments); this process builds
the table from views of the slot and writes the row group. The table is the same as the in-memory
path's (tested). On CUDA the device copies the chunk straight into the slot (:meth:`WriterProcess.stage`:
the slot page-locked once with ``cudaHostRegister``); elsewhere, or where CUDA refuses to page-lock it,
the feeder copies the chunk's host arrays into the slot (GIL released).

Slots: files in shared memory (``/dev/shm``) that both processes map once and reuse, chunk after
chunk and recorder after recorder (a slot is a ``_Child``'s, like the process). A new file per chunk
cost more than the Parquet write itself: the kernel allocates and clears every page of a new tmpfs
file, ~1-2 GB/s on the dev box, against ~15 GB/s for a copy into pages mapped already
(``bench/bench_writer_pipe.py``). This process unlinks a slot's file as soon as it has mapped it, so
no file outlives the two processes; the engine's process removes the files it made and this one never
mapped.

Protocol (pickles over two pipes): ``("open", sink, tmp, meta)``; ``("chunk", slot_path, parts,
segs)`` -> ``("ack", rows, value_bytes, slot_path, (received, built, written))`` (the slot is free
again; the times: ``time.perf_counter`` of this process, the same clock as the engine's process:
when the message arrived, its table was built, its row group written); ``("drop", paths)``
(unmap these slots; no reply); ``("close",)`` -> ``("closed", peak RSS MB of this process while it
wrote the file, (received, closed))`` (file renamed into place); ``("abort",)`` -> ``("aborted",)`` (temp file
removed); any failure -> ``("error", text)`` and the process exits. After ``closed``/``aborted`` the
process waits for the next ``open`` (one process serves the recorders of an engine process one after
another); it exits when its pipe closes (the engine's process ended), removing a file left open.

Host memory stays bounded: at most ``queue_chunks`` chunks wait for the feeder and ``queue_chunks`` are with
the process (each in a slot once staged), and a child keeps at most ``2 * queue_chunks + 1`` free slots of
at most ``_SLOT_KEEP`` bytes each between chunks.
"""

from __future__ import annotations

import atexit
import functools
import mmap
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

# a chunk's stats as the device splits them (recorder._device_parts), in the order of the tuple the writers
# take (ops_table._build_packed): [rows, 2] float64 sum and sum_sq, [rows] float64 abs_max, [rows, 2] int32
# n_nan and n_inf, [rows] int16 abs_max's bf16 bits
STATS_PARTS = ("st", "amf", "cnt", "amb")
PARTS = ("dig", *STATS_PARTS, "vals", "tv", "ti")
_SLOT_MIN = 1 << 20  # bytes: slot sizes are rounded up to a multiple of this
_SLOT_KEEP = 64 << 20  # bytes: a larger slot (a chunk of many kept values) is unmapped after its chunk


@functools.cache
def _shm_dir() -> str:
    d = "/dev/shm"
    try:
        if os.path.isdir(d) and os.access(d, os.W_OK) and os.statvfs(d).f_bavail * os.statvfs(d).f_frsize > 1 << 30:
            return d
    except OSError:
        pass
    return tempfile.gettempdir()


class _Slot:
    """A file in shared memory, mapped by the engine's process (here) and by the writer process."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # the pages are allocated now: a full file system is an error here, not a SIGBUS at a
            # later write into the mapping
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            Path(path).unlink(missing_ok=True)
            from mismatch_probe.errors import ProbeError  # the CLI prints it as one line (the worker's text too)

            raise ProbeError(f"op capture: no room for a {size >> 20} MiB writer buffer in {os.path.dirname(path)} "
                             f"([Errno {e.errno}] {e.strerror}); free space there, or set "
                             "MISMATCH_PROBE_CAPTURE_WRITER=thread") from None
        except BaseException:
            os.close(fd)
            Path(path).unlink(missing_ok=True)
            raise
        os.close(fd)
        self.path, self.size = path, size
        self.buf: np.ndarray | None = np.frombuffer(self.mm, np.uint8)
        self.mapped = False  # by the writer process (which then removed the file)
        self.registered: bool | None = None  # page-locked for CUDA copies (None: not tried yet)

    def register(self) -> bool:
        """Page-lock the slot for CUDA (once): device-to-host copies then land here asynchronously,
        with no pinned staging buffer and no host copy. False where CUDA refuses it."""
        if self.registered is None:
            import torch

            assert self.buf is not None
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self.buf.ctypes.data, self.size, 0)
                self.registered = int(rc) == 0
            except Exception:  # no CUDA runtime binding or context here: the pinned path
                self.registered = False
        return self.registered

    def close(self) -> None:
        if self.registered and self.buf is not None:  # no copy into it is in flight (acked, or the stream synced)
            import torch

            try:
                torch.cuda.cudart().cudaHostUnregister(self.buf.ctypes.data)
            except Exception:  # the CUDA context is gone (interpreter exit): nothing left to unpin
                pass
        self.registered = None
        self.buf = None
        if not self.mapped:
            Path(self.path).unlink(missing_ok=True)
        try:
            self.mm.close()
        except BufferError:  # a view still exists somewhere: the mapping goes with it
            pass


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
        self.dir = _shm_dir()
        self.free: list[_Slot] = []  # slots the writer process has mapped and is done with
        self.busy: dict[str, _Slot] = {}  # path -> slot of a chunk not yet acknowledged
        self.dropped: list[str] = []  # slots unmapped here, to unmap there with the next message
        self._n = 0
        # the slot lists: the feeder and, for chunks staged on the device (WriterProcess.stage), the recording thread
        self.lock = threading.RLock()

    # ---- slots (feeder thread; the recording thread only once the feeder is idle) ---------------
    def slot(self, nbytes: int, most: int) -> _Slot:
        """A free slot of at least ``nbytes`` (the smallest that fits), or a new one; free slots too
        small for it are dropped while the child would hold more than ``most`` slots."""
        with self.lock:
            return self._slot(nbytes, most)

    def _slot(self, nbytes: int, most: int) -> _Slot:
        fits = [s for s in self.free if s.size >= nbytes]
        if fits:
            s = min(fits, key=lambda x: x.size)
            self.free.remove(s)
        else:
            while self.free and len(self.free) + len(self.busy) >= most:
                self._drop(min(self.free, key=lambda x: x.size))
            self._n += 1
            size = max(_SLOT_MIN, -(-nbytes // _SLOT_MIN) * _SLOT_MIN)
            s = _Slot(os.path.join(self.dir, f"mp-ops-{os.getpid()}-{id(self)}-{self._n}.bin"), size)
        self.busy[s.path] = s
        return s

    def release(self, path: str) -> None:
        """The writer process is done with the slot at ``path`` (its ack)."""
        with self.lock:
            self._release(path)

    def unused(self, s: _Slot) -> None:
        """A slot taken and never handed over: free again (the process has not mapped it)."""
        with self.lock:
            self.busy.pop(s.path, None)
            self.free.append(s)

    def _release(self, path: str) -> None:
        s = self.busy.pop(path, None)
        if s is None:
            return
        s.mapped = True
        if s.size > _SLOT_KEEP:
            self._drop(s)
        else:
            self.free.append(s)

    def _drop(self, s: _Slot) -> None:
        if s in self.free:
            self.free.remove(s)
        if s.mapped:
            self.dropped.append(s.path)
        s.close()

    def drop_busy(self) -> None:
        """Chunks that will never be acknowledged (an abort, a failed process): their slots go."""
        with self.lock:
            for s in list(self.busy.values()):
                s.close()
            self.busy.clear()

    def take_dropped(self) -> list[str]:
        with self.lock:
            out, self.dropped = self.dropped, []
        return out

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
        for s in [*self.free, *self.busy.values()]:
            s.close()
        self.free, self.busy = [], {}
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


class Staged:
    """A chunk copied (or being copied, until its event) into a slot by :meth:`WriterProcess.stage`:
    the slot, the parts' layout in it (numpy dtype, shape, offset) and the host views the copies write
    (kept until the event has completed)."""

    __slots__ = ("slot", "layout", "views")

    def __init__(self, slot: _Slot, layout: dict[str, tuple[str, tuple, int]], views: list[Any]) -> None:
        self.slot, self.layout, self.views = slot, layout, views


_PAR_COPY_BYTES = 4 << 20  # a CUDA chunk's piece at least this big: copied by torch's intra-op threads


def _copy_into(dst: np.ndarray, src: np.ndarray, threads: bool = False) -> None:
    """``dst[:] = src`` (bytes). ``threads``: a CUDA engine's chunk (the pinned path, where a slot cannot
    be page-locked): large pieces are copied by torch's intra-op threads, not by one (the feeder's copy of
    a stats chunk was the slowest part of that path: 40 ms per 0.6B-shape ``score()`` on an H200 host). A CPU
    engine's pieces stay single-threaded: its own kernels use those threads."""
    if threads and src.nbytes >= _PAR_COPY_BYTES:
        import torch

        torch.from_numpy(dst).copy_(torch.from_numpy(src))
    else:
        dst[:] = src


@functools.cache
def _np_dtype(dt: Any) -> str:
    """The numpy dtype string of a torch dtype of the parts a recorder stages (torch's own mapping)."""
    import torch

    return torch.empty(0, dtype=dt).numpy().dtype.str


class WriterProcess:
    """Parent side of one ``ops.parquet``: the writer process's feeder thread turns queued chunk
    jobs into files + messages for it. ``submit`` blocks while ``queue_chunks`` jobs wait (bounded
    memory)."""

    def __init__(self, sink: Path, tmp: str, meta: dict[bytes, bytes], queue_chunks: int) -> None:
        self.child = _take_child()
        self.proc, self.tx, self.rx = self.child.proc, self.child.tx, self.child.rx
        self.tx.send(("open", str(sink), tmp, meta))
        self.queue_chunks = queue_chunks
        self.slots = threading.Semaphore(queue_chunks)  # jobs queued and not yet handed over
        self.fed = threading.Event()
        self.error: BaseException | None = None
        self.rows = 0
        self.value_bytes = 0
        self.peak_rss_mb: float | None = None
        self._inflight = 0
        # the process's (received, built, written) times of each chunk and (received, closed) of the
        # close, in order (bench/capture_trace.py lays them beside the engine's stages)
        self.times: list[tuple[float, ...]] = []

    # ---- feeder thread -----------------------------------------------------------------------
    def _send(self, ev: Any, segs: list, parts: Any) -> None:
        if ev is not None:
            ev.synchronize()  # the chunk's device-to-host copy (GIL released while waiting)
        if isinstance(parts, Staged):  # copied into its slot by the device already: a message, no host copy
            parts.views.clear()
            self._hand_over(parts.slot.path, parts.layout, segs)
            return
        pieces: dict[str, list[np.ndarray]] = {}
        for name in PARTS:
            a = parts.get(name)
            if a is not None:  # a list: byte pieces of one part (CPU values)
                pieces[name] = [np.ascontiguousarray(x.numpy() if hasattr(x, "numpy") else x)
                                for x in (a if isinstance(a, list) else [a])]
        total = sum(x.nbytes for ps in pieces.values() for x in ps)
        # filled while up to queue_chunks chunks are with the process (queue_chunks + 1 slots)
        slot = self.child.slot(total, self.queue_chunks + 1)
        layout = {}
        off = 0
        for name, ps in pieces.items():
            n = sum(x.nbytes for x in ps)
            a = parts[name]
            layout[name] = ("|u1", (n,), off) if isinstance(a, list) else (ps[0].dtype.str, ps[0].shape, off)
            for x in ps:  # one copy into pages mapped already (the GIL released while it runs)
                _copy_into(slot.buf[off : off + x.nbytes], x.reshape(-1).view(np.uint8), threads=ev is not None)
                off += x.nbytes
        self._hand_over(slot.path, layout, segs)

    def _hand_over(self, path: str, layout: dict[str, Any], segs: list) -> None:
        """The chunk in the slot at ``path`` to the process, once fewer than ``queue_chunks`` are with it."""
        while self._inflight >= self.queue_chunks:
            self._recv_ack()
        self._send_drops()
        self._tx(("chunk", path, layout, segs))
        self._inflight += 1

    def _send_drops(self) -> None:
        """Tell the process to unmap the slots dropped here since the last message (their pages are
        freed once both sides have unmapped them)."""
        dropped = self.child.take_dropped()
        if dropped:
            self._tx(("drop", dropped))

    def _tx(self, msg: tuple) -> None:
        try:
            self.tx.send(msg)
        except OSError:  # its end of the pipe is closed: the process is gone
            raise RuntimeError(f"op writer process exited (code {self.proc.wait()})") from None

    def _recv_ack(self) -> None:
        msg = self._recv()
        if msg[0] != "ack":
            raise RuntimeError(f"op writer process: unexpected {msg[0]!r}")
        self._ack(msg)

    def _ack(self, msg: tuple) -> None:
        self.rows += msg[1]
        self.value_bytes += msg[2]
        self.times.append(msg[4])
        self.child.release(msg[3])
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
        """Queue ``job`` = (event, segments, parts: host arrays by name, or a :class:`Staged`) for the
        feeder; blocks while ``queue_chunks`` jobs wait (a staged job took its turn in :meth:`stage`)."""
        if not isinstance(job[2], Staged):
            self.slots.acquire()  # blocks while queue_chunks jobs wait: host memory stays bounded
        self.child.feed(self, job)
        if self.error is not None:
            raise self.error

    def stage(self, parts: dict[str, Any]) -> Staged | None:
        """Copy a chunk's tensors (by part name, in :data:`PARTS` order) into a slot of shared memory,
        asynchronously on the current stream: for CUDA tensors the slot is page-locked once
        (``cudaHostRegister``), so the device writes the bytes the writer process reads, with no pinned
        staging buffer and no host copy. The caller records the event that ends the copies and passes
        the result to :meth:`submit`. None (nothing queued) where the slot cannot be page-locked.
        Blocks while ``queue_chunks`` jobs wait, as :meth:`submit` does."""
        import torch

        total = sum(t.numel() * t.element_size() for t in parts.values())
        self.slots.acquire()
        try:
            # up to queue_chunks staged + queue_chunks with the process, and one more
            slot = self.child.slot(total, 2 * self.queue_chunks + 1)
            if any(t.is_cuda for t in parts.values()) and not slot.register():
                self.child.unused(slot)
                self.slots.release()
                return None
            assert slot.buf is not None
            layout, views, off = {}, [], 0
            for name, t in parts.items():
                n = t.numel() * t.element_size()
                dst = torch.from_numpy(slot.buf[off : off + n])
                dst.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
                layout[name] = (_np_dtype(t.dtype), tuple(t.shape), off)
                views.append(dst)
                off += n
        except BaseException:
            self.slots.release()
            raise
        return Staged(slot, layout, views)

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
        self._send_drops()  # an idle process holds no slot dropped here
        self._tx(("close",))
        msg = self._recv()
        if msg[0] != "closed":
            raise RuntimeError("op writer process did not close the file")
        self.peak_rss_mb = msg[1]
        self.times.append(msg[2])
        self._finish(reuse=True)

    def abort(self) -> None:
        self.error = self.error or RuntimeError("aborted")  # the feeder drops the jobs not yet handed over
        self._drain()
        ok = False
        try:
            self.tx.send(("abort",))
            while (msg := self._recv())[0] != "aborted":
                if msg[0] == "ack":  # a chunk handed over before the abort: its slot is free
                    self._ack(msg)
            self._send_drops()
            ok = True
        except Exception:
            pass
        self._finish(reuse=ok)

    def _finish(self, reuse: bool = False) -> None:
        # every chunk handed over was acknowledged (or the process failed): a slot still busy was
        # never handed over, or never will be read; its file (if the process never mapped it) goes here
        self.child.drop_busy()
        if reuse:
            _give_back(self.child)
        else:
            self.child.stop()


# ---- the writer process ----------------------------------------------------------------------
def _read_parts(buf: np.ndarray, layout: dict[str, tuple[str, tuple, int]]) -> dict[str, np.ndarray]:
    """The chunk's arrays, views of the slot ``buf`` (the packed table's blobs are views of the
    mapped pages where the arena rows are contiguous)."""
    out = {}
    for name, (dt, shape, off) in layout.items():
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        out[name] = buf[off : off + n].view(np.dtype(dt)).reshape(shape)
    return out


def _map_slot(path: str) -> tuple[mmap.mmap, np.ndarray]:
    """Map the slot file at ``path`` (read only) and remove the file: the mapping keeps its pages
    for both processes, and no file outlives them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    os.unlink(path)
    return mm, np.frombuffer(mm, np.uint8)


def _unmap(slot: tuple[mmap.mmap, np.ndarray] | None) -> None:
    if slot is None:
        return
    mm = slot[0]
    del slot
    try:
        mm.close()
    except BufferError:  # a view is still alive: the mapping goes with it
        pass


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


class _RowGroups:
    """Writes the built tables on a thread of this process, in order, and acks each chunk when its row group is
    written (its slot is free again then), so the next chunk's table is built while this one is written: the
    Parquet write releases the GIL. H100 host, 0.6B shape, stats: build ~1 ms and write ~3-4 ms per 256 Ki
    rows, one after the other before. At most one table waits (the slots bound the rest)."""

    def __init__(self, tx: Connection) -> None:
        self.tx = tx
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._t = threading.Thread(target=self._run, name="mp-rowgroups", daemon=True)
        self._t.start()

    def put(self, job: tuple) -> None:
        self.check()
        self._q.put(job)

    def wait(self, check: bool = True) -> None:
        """Every table put so far written and acked (before close, abort, drop or another file); ``check``:
        raise the thread's error, if any."""
        self._q.join()
        if check:
            self.check()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        import time

        while True:
            job = self._q.get()
            try:
                if self.error is None:
                    writer, table, path, rows, value_bytes, t_recv, t_built = job
                    writer.write(table)
                    del table, job  # no view of the slot outlives the ack (the engine refills it)
                    self.tx.send(("ack", rows, value_bytes, path, (t_recv, t_built, time.perf_counter())))
            except BaseException as e:  # reported now (the engine may be waiting for this ack), raised by main
                self.error = e
                self.tx.send(("error", traceback.format_exc()))
            finally:
                self._q.task_done()


def main(rfd: int, wfd: int) -> None:
    import time

    from mismatch_probe.probes.ops_table import _build_packed, packed_writer

    now = time.perf_counter
    rx, tx = Connection(rfd, writable=False), Connection(wfd, readable=False)
    writer = None
    groups = _RowGroups(tx)
    slots: dict[str, tuple[mmap.mmap, np.ndarray]] = {}  # path -> mapping, for the life of the process
    try:
        while True:
            try:
                msg = rx.recv()
                t_recv = now()
            except EOFError:  # the engine's process is gone: leave no half-written file
                groups.wait(check=False)
                if writer is not None:
                    writer.abort()
                return
            if msg[0] == "chunk":
                _, path, layout, segs = msg
                if path not in slots:
                    slots[path] = _map_slot(path)
                p = _read_parts(slots[path][1], layout)
                st = tuple(p.get(k) for k in STATS_PARTS) if "cnt" in p else p.get("st")
                table = _build_packed(segs, p["dig"], st, p.get("vals"), p.get("tv"), p.get("ti"))
                assert writer is not None
                vals = p.get("vals")
                rows = int(np.asarray(table.column("n")).sum())
                value_bytes = 0 if vals is None else int(vals.size)
                del p, st, vals
                groups.put((writer, table, path, rows, value_bytes, t_recv, now()))
                del table
                continue
            groups.wait(check=msg[0] != "abort")  # every other message after the row groups before it
            if msg[0] == "open":
                _peak_rss_reset()
                _, sink, tmp, meta = msg
                writer = packed_writer(Path(sink), meta, tmp=tmp)
            elif msg[0] == "drop":
                for path in msg[1]:
                    _unmap(slots.pop(path, None))
            elif msg[0] == "close":  # the file is complete; wait for the next one
                assert writer is not None
                writer.close()
                writer = None
                tx.send(("closed", _peak_rss_mb(), (t_recv, now())))
            elif msg[0] == "abort":
                if writer is not None:
                    writer.abort()
                writer = None
                tx.send(("aborted",))
    except BaseException:
        groups.wait(check=False)  # the thread is not writing while the file is removed
        if writer is not None:
            writer.abort()
        if groups.error is None:  # the thread's own error was reported by it
            try:
                tx.send(("error", traceback.format_exc()))
            except Exception:
                pass
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
