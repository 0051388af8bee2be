"""Device and disk rates behind a captured ``score()``'s tail (issue 27, a bench diagnostic):

* the digest / stats kernel (``digest_triton.launch``) on one tensor of a shape the forward records, against a
  device-to-device copy of the same bytes (CUDA events, median of 5 after a warm-up; weights of nothing:
  the tensor resident): the logits of the 0.6B shape's 4 x 1,024 tokens ([4096, 151936] bf16) are the last op
  the forward records, so their digests run after the forward on the device;
* the temp directory's write rate (where the bench's ``ops.parquet`` goes): 16 MiB written in 1 MiB
  ``os.write`` calls and in one call, and the same bytes as a Parquet file through ``pq.ParquetWriter``
  (one binary column) on a plain file and on a 16 MiB-buffered stream; page cache, no fsync.

    python bench/digest_rate.py            # CUDA; prints a table last
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch


def dev_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def host_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    from mismatch_probe.probes import digest_triton

    rows: list[tuple[str, float, str]] = []
    dev = torch.device("cuda")
    cap = 1 << 16
    dig = torch.empty(cap, dtype=torch.int64, device=dev)
    st = digest_triton.split_arena(cap, dev)
    for name, shape in (("logits [4096, 151936] bf16", (4096, 151936)), ("mlp act [4096, 3072] bf16", (4096, 3072)),
                        ("hidden [4096, 1024] bf16", (4096, 1024))):
        x = torch.randn(*shape, device=dev).to(torch.bfloat16)
        y = torch.empty_like(x)
        gb = x.numel() * 2 / 1e9
        for stats in (False, True):
            ms = dev_ms(lambda x=x, s=stats: digest_triton.launch([(x, 0, 0)], dig, st, s))
            rows.append((f"{'stats' if stats else 'digest'} kernel, {name}", ms, f"{gb / ms * 1e3:.0f} GB/s read"))
        ms = dev_ms(lambda x=x, y=y: y.copy_(x))
        rows.append((f"copy, {name}", ms, f"{2 * gb / ms * 1e3:.0f} GB/s read + write"))
        del x, y
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tempfile.mkdtemp(prefix="digest-rate-")
    buf = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()
    mb = len(buf) / 1e6

    def write(piece: int) -> None:
        fd = os.open(os.path.join(d, "raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for i in range(0, len(buf), piece):
                os.write(fd, buf[i : i + piece])
        finally:
            os.close(fd)

    col = pa.BinaryArray.from_buffers(pa.binary(), 16, [None, pa.py_buffer(np.arange(0, 17 << 20, 1 << 20, dtype=np.int32)),
                                                        pa.py_buffer(buf)])
    table = pa.table({"blob": col})

    def parquet(buffered: bool) -> None:
        p = os.path.join(d, "t.parquet")
        sink = pa.BufferedOutputStream(pa.OSFile(p, "wb"), 16 << 20) if buffered else p
        w = pq.ParquetWriter(sink, table.schema, compression="none", use_dictionary=False, write_statistics=False)
        w.write_table(table)
        w.close()
        if buffered:
            sink.close()

    for label, fn in (("write 16 MiB in 1 MiB os.write calls", lambda: write(1 << 20)),
                      ("write 16 MiB in one os.write", lambda: write(len(buf))),
                      ("Parquet 16 MiB blob column, plain file", lambda: parquet(False)),
                      ("Parquet 16 MiB blob column, 16 MiB buffered stream", lambda: parquet(True))):
        ms = host_ms(fn)
        rows.append((f"{label} ({d})", ms, f"{mb / ms:.2f} GB/s"))
    print(f"\n{torch.cuda.get_device_name()}: digest kernel vs copy (device time), temp dir write rate (host)")
    for label, ms, rate in rows:
        print(f"{label:75} {ms:9.3f} ms  {rate}")


if __name__ == "__main__":
    main()
