"""Host cost of the pieces of one capture launch (issue 27, a bench diagnostic): each piece timed alone,
N times, median in microseconds, on the machine's own host (a slow host's Python is what limits a small
model's captured forward). Pieces: the recorder's fast path per op (``record_rows`` of a cached layout),
the descriptor table from the queue's flat list, ``launch_desc`` whole and its parts (numpy, pinned
copy, host-to-device copy, the Triton launch), stream waits and events.

    python bench/launch_cost.py            # CUDA
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def timed(fn: Callable[[], object], n: int = 200) -> float:
    try:
        return _timed(fn, n)
    except Exception as e:  # one piece failing leaves the others' figures
        print(f"failed: {e!r}")
        return float("nan")


def _timed(fn: Callable[[], object], n: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def main() -> None:
    from mismatch_probe.probes import digest_triton as D
    from mismatch_probe.probes import recorder as R
    from mismatch_probe.probes.capture import CapturePlan

    dev = torch.device("cuda")
    n_ops = 479
    xs = [torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16) for _ in range(16)]
    dig = torch.empty(1 << 21, dtype=torch.int64, device=dev)
    st = D.split_arena(1 << 21, dev)
    flat: list[int] = []
    for i in range(n_ops):
        x = xs[i % 16]
        flat += [x.data_ptr(), 4096, 1024, 1024, (i * 4096) % ((1 << 21) - 4096), 0]
    d = np.array(flat, np.int64).reshape(-1, 6)
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    rows: dict[str, float] = {}
    rows["np.array(flat list of 479 x 6 ints)"] = timed(lambda: np.array(flat, np.int64).reshape(-1, 6))
    rows["launch_desc (479 tensors, digest only)"] = timed(lambda: D.launch_desc(d, xs[0], 4096, dig, st, False))
    dd = d.copy()
    rows["  numpy part (offsets, alignment)"] = timed(
        lambda: (np.array(dd, dtype=np.int64).reshape(-1, 6), ((dd[:, [0, 2, 3]] * 2) % 16).any()))
    rows["  torch.from_numpy(d).pin_memory()"] = timed(lambda: torch.from_numpy(dd).pin_memory())
    pinned = torch.from_numpy(dd).pin_memory()
    rows["  pinned.to(dev, non_blocking)"] = timed(lambda: pinned.to(dev, non_blocking=True))
    dt = pinned.to(dev)
    dt[:, 0] = 0
    xi = xs[0].view(torch.int16)
    args = dict(KIND=0, BLOCK=D.BLOCK, VEC=8, STATS=False)
    rows["  Triton launch alone"] = timed(lambda: D._rows_kernel[(4096, n_ops)](xi, dt, dig, st, num_warps=D.WARPS, **args))
    rows["side.wait_stream(cur)"] = timed(lambda: side.wait_stream(cur))

    def ctx() -> None:
        with torch.cuda.stream(side):
            pass
    rows["with torch.cuda.stream(side)"] = timed(ctx)

    def ev() -> None:
        e = torch.cuda.Event()
        e.record(side)
        e.query()
    rows["Event() + record + query"] = timed(ev)
    rows["torch.empty 2 Mi int64 (cached)"] = timed(lambda: torch.empty(1 << 21, dtype=torch.int64, device=dev))
    rows["small elementwise op (launch)"] = timed(lambda: xs[0][:1].add_(0))

    # the recorder's fast path, per op call (a digest-only plan, in-memory recorder, launches excluded)
    rec = R.OpRecorder(CapturePlan("digest"), None)
    seq = np.repeat(np.arange(4), 1024)
    pos = np.tile(np.arange(1024), 4)
    for i in range(n_ops):  # layouts cached (the first call of each op takes the general path)
        rec.record_rows(f"layers.{i // 17}.op{i % 17}", xs[i % 16], seq, pos)
    rec.abort()

    def fast() -> None:
        r = R.OpRecorder(CapturePlan("digest"), None)
        r._is_batched, r._device, r._launch = True, dev, lambda: None
        r.buffer_rows = r._limit = 1 << 30
        t = time.perf_counter()
        for i in range(n_ops):
            r.record_rows(f"layers.{i // 17}.op{i % 17}", xs[i % 16], seq, pos)
        fast.t.append((time.perf_counter() - t) / n_ops)
    fast.t = []  # type: ignore[attr-defined]
    for _ in range(20):
        fast()
    rows["record_rows fast path, per op call"] = statistics.median(fast.t[5:]) * 1e6  # type: ignore[attr-defined]
    # where the writer's shared-memory slots live, and whether CUDA page-locks one there
    import os

    from mismatch_probe.probes import recorder_writer as W

    d = W._shm_dir()
    sv = os.statvfs(d)
    path = os.path.join(d, f"mp-launch-cost-{os.getpid()}")
    slot = W._Slot(path, 64 << 20)
    ok = slot.register()
    slot.close()
    print(f"slots in {d} ({sv.f_bavail * sv.f_frsize >> 20} MiB free): cudaHostRegister of a 64 MiB slot: {ok}")
    print(f"\n{torch.cuda.get_device_name()}: host cost of capture launch pieces, median us")
    for k, v in rows.items():
        print(f"{k:44} {v:10.1f}")


if __name__ == "__main__":
    main()
