"""The fused act-and-mul + per-token NVFP4 quantize (``kernels/nvfp4/act_quant.py``) on the GPU: its bits
against the strict act-and-mul then the linear's quantizer, and its time in CUDA graphs at the decode
shapes (Qwen3-0.6B's D = 3,072, Qwen3-8B's 12,288), programs of ``CHUNK_BLOCKS`` blocks of a row (the
default) against one program per whole row (the tiling before), next to the strict act-and-mul alone.

    python bench/gpu_act_quant.py [--ms 1,16,64] [--ds 3072,12288]

Prints one table, last: per (D, M) the microseconds of each arm (median of 20 replays of a graph of
20 calls, inputs resident) and whether every arm's bits equal the unfused pair's."""

from __future__ import annotations

import argparse
import statistics

import torch


def graph_us(fn, reps: int = 20, inner: int = 20) -> float:  # noqa: ANN001
    """Median microseconds of one ``fn()`` call, ``inner`` calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(times)


def one(d: int, m: int, g: torch.Generator) -> tuple[dict[str, float], bool]:
    """The arms' microseconds at (D, M) and whether every arm gave the unfused pair's bits."""
    from mismatch_probe.kernels.nvfp4 import act_quant as AQ
    from mismatch_probe.kernels.nvfp4 import quant_fast
    from mismatch_probe.kernels.nvfp4.tc_linear import OP_DTYPE
    from mismatch_probe.kernels.strict import triton_ops as T

    x = (torch.randn(m, 2 * d, device="cuda", generator=g) * 3).to(torch.bfloat16)
    gate, up = x[:, :d], x[:, d:]
    ey = T.act_and_mul(gate, up, "silu")
    want = quant_fast.quantize_rows(ey, None, True, emit_op=OP_DTYPE, op_layout=2)
    default = AQ.CHUNK_BLOCKS
    res: dict[str, float] = {}
    same = True
    for name, cb in {"chunked (default)": default, "whole row per program, 4 warps": 1 << 20}.items():
        AQ.CHUNK_BLOCKS = cb
        try:
            y, (q, op) = AQ.act_quantize(gate, up, "silu", 2)
            same &= bool(torch.equal(y.view(torch.int16), ey.view(torch.int16)) and torch.equal(q.codes, want[0])
                         and torch.equal(q.scales, want[1]) and torch.equal(q.amax, want[2])
                         and torch.equal(op.view(torch.int16), want[3].view(torch.int16)))
            res[name] = graph_us(lambda: AQ.act_quantize(gate, up, "silu", 2))
        finally:
            AQ.CHUNK_BLOCKS = default
    res["strict act-and-mul alone"] = graph_us(lambda: T.act_and_mul(gate, up, "silu"))
    res["strict act-and-mul, then quantize"] = graph_us(lambda: quant_fast.quantize_rows(
        T.act_and_mul(gate, up, "silu"), None, True, emit_op=OP_DTYPE, op_layout=2))
    return res, same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--ds", default="3072,12288")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [(d, m, *one(d, m, g)) for d in (int(v) for v in args.ds.split(",")) for m in (int(v) for v in args.ms.split(","))]
    names = list(rows[0][2])
    print(f"{torch.cuda.get_device_name(0)}; us per call, CUDA graphs, inputs resident; silu; operand layout 2")
    print("| D | M | " + " | ".join(names) + " | same bits |")
    print("|---|---|" + "---:|" * len(names) + "---|")
    for d, m, res, same in rows:
        print(f"| {d} | {m} | " + " | ".join(f"{res[n]:.1f}" for n in names) + f" | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
