"""Host cost of the CUDA recorder's fast path on any machine: one Qwen3-0.6B-shaped forward's
``record_rows`` calls (the tensors the HF capture hands over, recorded once on the CPU at 4 x SEQ
tokens) replayed through ``OpRecorder(batched=True)`` with the CUDA parts of a launch stubbed (the
descriptor table is still built; no Triton launch, stream wait, pinned copy or event). The queue's
byte limit is scaled by SEQ / 1024, so the launches per forward are those of 4 x 1,024 tokens.

    python bench/replay_record.py [--seq 64] [--scores 30]

Prints per forward (3 forwards per recorder, as bench_capture's score()): median ms, us per op,
launches per forward. BENCHMARKS.md, "Op capture", has the figures."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import build_model  # noqa: E402

from mismatch_probe.probes import digest_triton  # noqa: E402
from mismatch_probe.probes import recorder as recmod  # noqa: E402
from mismatch_probe.probes.capture import CapturePlan  # noqa: E402
from mismatch_probe.probes.hf.capture import HfCapture  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--scores", type=int, default=30)
    a = ap.parse_args()
    model = build_model("qwen3-0.6b", "cpu")
    calls: list[tuple[str, torch.Tensor]] = []

    class Log:
        def record_rows(self, op: str, t: torch.Tensor, seq: object, pos: object) -> None:
            calls.append((op, t))

        def launch(self) -> None:
            pass

    cap = HfCapture(model, Log())  # type: ignore[arg-type]
    cap.set_batch([0, 1, 2, 3], [a.seq] * 4, a.seq)
    with torch.inference_mode(), cap:
        ids = torch.randint(0, 1000, (4, a.seq))
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    launches = [0]

    def stub(desc: object, x: torch.Tensor, max_rows: int, dig: object, st: object, stats: bool = True) -> None:
        launches[0] += 1
        d = np.array(desc, dtype=np.int64).reshape(-1, 6)
        d[:, 0] -= x.data_ptr()
        torch.from_numpy(d)

    digest_triton.launch_desc = stub
    recmod._QUEUE_BYTES = int(recmod._QUEUE_BYTES * a.seq / 1024)

    def score() -> list[float]:
        rec = recmod.OpRecorder(CapturePlan("digest"), None, batched=True, buffer_rows=1 << 22)
        rec.begin([0, 1, 2, 3], [a.seq] * 4)
        out = []
        for _ in range(3):
            cap.set_batch([0, 1, 2, 3], [a.seq] * 4, a.seq)  # a new batch each forward, as the learner's
            t0 = time.perf_counter()
            rec.launch()
            for op, t in calls:
                rec.record_rows(op, t, cap._seq, cap._pos)
            out.append(time.perf_counter() - t0)
        return out

    score()  # layouts cached
    launches[0] = 0
    times = [t for _ in range(a.scores) for t in score()]
    med = statistics.median(times)
    print(f"{len(calls)} ops per forward; per forward {med * 1e3:.3f} ms median, {med / len(calls) * 1e6:.2f} us per op, "
          f"{launches[0] / (3 * a.scores):.1f} launches per forward")


if __name__ == "__main__":
    main()
