"""The fused producers of a per-token linear's input on the GPU (``kernels/nvfp4/act_quant.py``: act-and-mul +
quantize; ``norm_quant.py``: add + RMSNorm + quantize): their bits against the strict op then the linear's
quantizer, and their time in CUDA graphs at the decode shapes (Qwen3-0.6B's widths 1,024 / 3,072, Qwen3-8B's
4,096 / 12,288), programs of ``CHUNK_BLOCKS`` blocks of a row (the default) against one program per whole
row (the tiling before), next to the strict op alone and the strict op then the quantizer.

    python bench/gpu_producers.py [--ms 1,16,64]

Prints one table, last: per (producer, width, M) the microseconds of each arm (median of 20 replays of a
graph of 20 calls, inputs resident) and whether every arm's bits equal the unfused pair's."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_nvfp4_check import graphed  # noqa: E402  (bench/ is on sys.path when this runs as a script)


def graph_us(fn, reps: int = 20, inner: int = 20) -> float:  # noqa: ANN001
    """Median microseconds of one ``fn()`` call: ``inner`` calls captured in one CUDA graph
    (``gpu_nvfp4_check.graphed``), the median of ``reps`` replays each timed by CUDA events."""
    replay, _ = graphed(lambda: [fn() for _ in range(inner)])
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(times)


def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(
        a.view(torch.int16) if a.element_size() == 2 else a, b.view(torch.int16) if b.element_size() == 2 else b))


def one(kind: str, d: int, m: int, g: torch.Generator) -> tuple[dict[str, float], bool]:
    """The arms' microseconds for producer ``kind`` (act, norm) at width ``d``, ``m`` rows, and whether every
    arm gave the unfused pair's bits."""
    from mismatch_probe.kernels.nvfp4 import act_quant as AQ
    from mismatch_probe.kernels.nvfp4 import norm_quant as NQ
    from mismatch_probe.kernels.nvfp4 import quant_fast
    from mismatch_probe.kernels.nvfp4.tc_linear import OP_DTYPE
    from mismatch_probe.kernels.strict import triton_ops as T

    if kind == "act":
        x = (torch.randn(m, 2 * d, device="cuda", generator=g) * 3).to(torch.bfloat16)
        gate, up = x[:, :d], x[:, d:]
        mod = AQ

        def fused() -> tuple:
            y, (q, op) = AQ.act_quantize(gate, up, "silu", 2)
            return (y,), q, op

        def strict() -> torch.Tensor:
            return T.act_and_mul(gate, up, "silu")

        want_y = (strict(),)
    else:
        x = (torch.randn(m, d, device="cuda", generator=g) * 2).to(torch.bfloat16)
        r = torch.randn(m, d, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(d, device="cuda", generator=g) * 0.1 + 1).to(torch.bfloat16)
        mod = NQ

        def fused() -> tuple:
            y, rout, (q, op) = NQ.norm_quantize(x, r, w, 1e-6, 0.0, True, 2)
            return (y, rout), q, op

        def strict() -> torch.Tensor:
            return T._norm(x, r, w, 1e-6, 0.0, True)[0]

        want_y = T._norm(x, r, w, 1e-6, 0.0, True)
    want = quant_fast.quantize_rows(want_y[0], None, True, emit_op=OP_DTYPE, op_layout=2)
    default = mod.CHUNK_BLOCKS
    res: dict[str, float] = {}
    same = True
    for name, cb in {"chunked (default)": default, "whole row per program": 1 << 20}.items():
        mod.CHUNK_BLOCKS = cb
        try:
            ys, q, op = fused()
            same &= all(bits(a, b) for a, b in zip(ys, want_y, strict=True)) and bits(q.codes, want[0]) and bits(
                q.scales, want[1]) and bits(q.amax, want[2]) and bits(op, want[3])
            res[name] = graph_us(fused)
        finally:
            mod.CHUNK_BLOCKS = default
    res["strict op alone"] = graph_us(strict)
    res["strict op, then quantize"] = graph_us(lambda: quant_fast.quantize_rows(strict(), None, True, emit_op=OP_DTYPE,
                                                                                op_layout=2))
    return res, same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [("norm", 1024), ("norm", 4096), ("act", 3072), ("act", 12288)]
    rows = [(k, d, m, *one(k, d, m, g)) for k, d in shapes for m in (int(v) for v in args.ms.split(","))]
    names = list(rows[0][3])
    print(f"{torch.cuda.get_device_name(0)}; us per call, CUDA graphs, inputs resident; silu, add + RMSNorm; "
          "operand layout 2")
    print("| producer | width | M | " + " | ".join(names) + " | same bits |")
    print("|---|---|---|" + "---:|" * len(names) + "---|")
    for k, d, m, res, same in rows:
        print(f"| {k} | {d} | {m} | " + " | ".join(f"{res[n]:.1f}" for n in names) + f" | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
