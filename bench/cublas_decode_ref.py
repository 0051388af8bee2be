"""cuBLAS bf16 at the decode shapes of bench/decode_lab.cu (N = K = 8192, M = 1, 16, 32, 64), timed the
lab's way in the same call: CUDA graphs of 30 launches, the median of 15 replays, the weight the same
in every launch ("same-w") or rotating over 3 copies ("rot-3": 384 MiB, several times the 60 MB L2).

    python bench/cublas_decode_ref.py
"""

from __future__ import annotations

import torch


def time_us(fn, rot: int) -> float:  # noqa: ANN001
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % rot)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for i in range(30):
                fn(i % rot)
    ts = []
    with torch.cuda.stream(s):  # the replays and their events on one stream
        for _ in range(15):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(s)
            g.replay()
            e1.record(s)
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1000 / 30)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    n = k = 8192
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    print(f"{'cuBLAS bf16 N=K=8192':28s} {'M':>4s} {'us same-w':>10s} {'us rot-3':>10s}")
    for m in (1, 16, 32, 64):
        xm = x[:m]
        t1 = time_us(lambda i, xm=xm: xm @ ws[i].t(), 1)
        t3 = time_us(lambda i, xm=xm: xm @ ws[i].t(), 3)
        print(f"{'cuBLAS bf16':28s} {m:4d} {t1:10.2f} {t3:10.2f}")


if __name__ == "__main__":
    main()
