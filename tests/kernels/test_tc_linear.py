"""The tensor-core NVFP4 GEMM (kernels/nvfp4/tc_linear.py) on the CPU: layout, dispatch, tolerance.

The Triton interpreter runs the same kernels on CPU tensors (fp32 dot operands there), so these
tests check the logic and the GEMM tolerance of docs/nvfp4.md; the bitwise properties (rows identical
for every M, decode == prefill, grouped == per-expert) are GPU checks (``tc_rows_identical_*``,
``tc_grouped_eq_per_expert``, run by test_kernels_gpu.py and bench/bench_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from mismatch_probe.kernels.checks import tc_within_bound
from mismatch_probe.kernels.nvfp4 import linear as NL
from mismatch_probe.kernels.nvfp4 import ref as R
from mismatch_probe.kernels.nvfp4 import tc_linear as T
from mismatch_probe.kernels.nvfp4.tuning import DEFAULT, DecodeTuning, GemmTuning, PrefillTuning, SegmentRule


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,k", [(48, 256), (70, 96), (5, 64)])
def test_decode_layout_holds_every_code(n, k):
    q = R.nvfp4_quantize_ref(torch.randn(n, k, generator=_g(1)))
    bkc = T.chunk_for(k)
    dec, dsc = T.decode_layout(q.codes, q.scales, bkc)
    nt = -(-n // 64)
    assert dec.shape == (1, nt, k // bkc, 64, bkc // 2) and dsc.shape == (1, nt, k // bkc, 64, bkc // 16)
    rows = dec.transpose(2, 3).reshape(nt * 64, k // bkc, bkc // 2)[:n]
    codes = torch.cat([rows & 15, rows >> 4], dim=2).reshape(n, k)  # chunk: low nibbles, then high
    assert torch.equal(codes, R.unpack_codes(q.codes))
    assert torch.equal(dsc.transpose(2, 3).reshape(nt * 64, k // 16)[:n], q.scales)
    assert not dec.transpose(2, 3).reshape(nt * 64, -1)[n:].any()  # padding rows are zero


def test_nseg_depends_on_n_k_only():
    assert T.nseg_for(8192, 4096) == 1 and T.nseg_for(1024, 1024) == 8 and T.nseg_for(3072, 1024) == 4
    assert T.nseg_for(1536, 2048, grouped=True) == 1 and T.nseg_for(64, 48) == 1  # K % 32 != 0: no decode path
    assert T.chunk_for(48) == 0 and T.chunk_for(96) == 32 and T.chunk_for(768) == 128


def test_nseg_rule_constants():
    """SegmentRule's target / max_segments drive the rule (the probe's candidates), whole chunks per
    segment; the default is 128 / 8 / 8192, passed as data."""
    assert DEFAULT.segments == SegmentRule(128, 8, 8192) and T.prepare(R.nvfp4_quantize_ref(
        torch.randn(16, 64))).tuning is DEFAULT
    rule = SegmentRule(target=512)
    assert T.nseg_for(8192, 8192, rule=rule) == 4 and T.nseg_for(4096, 4096, rule=rule) == 8
    assert T.nseg_for(1024, 3072, rule=rule) == 8
    rule = SegmentRule(target=512, max_segments=16)
    assert T.nseg_for(1024, 2048, rule=rule) == 16 and T.nseg_for(1024, 1024, rule=rule) == 8  # 8 chunks of 128: at most 8
    assert T.nseg_for(1536, 2048, grouped=True, rule=rule) == 1
    w = T.prepare(R.nvfp4_quantize_ref(torch.randn(1024, 2048, generator=_g(1))))
    assert w.nseg == 8 and w.tuned(GemmTuning(segments=rule)).nseg == 16 and w.nseg == 8  # frozen data, copies


def test_tuning_is_frozen_data():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.decode.native = False  # type: ignore[misc]
    assert DecodeTuning.from_config({"SWAP": True, "NSEG": 2, "NATIVE": False}) == DecodeTuning(swap=True, nseg=2,
                                                                                                 native=False)
    assert PrefillTuning.from_config({"FLAT": False, "BN": 128}).overrides() == {"BN": 128}
    assert DEFAULT.with_(decode={"cpi": 2}).decode.overrides() == {"CPI": 2} and DEFAULT.decode.overrides() == {}
    with pytest.raises(ValueError, match="unknown config key"):
        DecodeTuning.from_config({"NSEGS": 2})


@pytest.mark.parametrize("m,n,k,path", [(3, 48, 256, "decode"), (3, 48, 256, "prefill"), (20, 40, 96, "decode"),
                                        (70, 64, 128, "prefill"), (5, 16, 48, "auto")])
def test_tc_matmul_within_gemm_tolerance(m, n, k, path):
    w = R.nvfp4_quantize_ref(torch.randn(n, k, generator=_g(2)))
    a = R.nvfp4_quantize_ref(torch.randn(m, k, generator=_g(3)).to(torch.bfloat16), per_token=True)
    tc_within_bound(T.tc_matmul(a, T.prepare(w), path=path), a, w)


@pytest.mark.parametrize("cfg", [{"SWAP": True}, {"SWAP": True, "NSEG": 2}, {"CPI": 2}])
def test_decode_variants_within_gemm_tolerance(cfg):
    tuning = DEFAULT.with_(decode=DecodeTuning.from_config(cfg))
    w = R.nvfp4_quantize_ref(torch.randn(48, 512, generator=_g(10)))
    a = R.nvfp4_quantize_ref(torch.randn(5, 512, generator=_g(11)).to(torch.bfloat16), per_token=True)
    tc_within_bound(T.tc_matmul(a, T.prepare(w, tuning), path="decode"), a, w)


def test_tc_linear_equals_quantize_then_matmul():
    w = R.nvfp4_quantize_ref(torch.randn(32, 128, generator=_g(4)))
    x = torch.randn(6, 128, generator=_g(5)).to(torch.bfloat16)
    tw = T.prepare(w)
    want = T.tc_matmul(R.nvfp4_quantize_ref(x, per_token=True), tw)
    assert torch.equal(T.tc_linear(x, tw).view(torch.int16), want.view(torch.int16))


def test_bad_calls_are_one_line_errors():
    w = T.prepare(R.nvfp4_quantize_ref(torch.randn(16, 48, generator=_g(6))))
    a = R.nvfp4_quantize_ref(torch.randn(2, 64, generator=_g(7)), per_token=True)
    with pytest.raises(ValueError, match="K mismatch"):
        T.tc_matmul(a, w)
    a48 = R.nvfp4_quantize_ref(torch.randn(2, 48, generator=_g(7)), per_token=True)
    with pytest.raises(ValueError, match="no decode path"):
        T.tc_matmul(a48, w, path="decode")
    with pytest.raises(ValueError, match="path must be one of"):
        T.tc_matmul(a48, w, path="fast")


@pytest.mark.parametrize("scheme,parts", [("nvfp4-per-token", None), ("nvfp4-dynamic-tensor", None),
                                          ("nvfp4-per-token", [32, 16])])
def test_nvfp4_linear_runs_the_kernels_when_selected(monkeypatch, scheme, parts):
    """The recipes' linear calls the tensor-core kernels where use_kernels() says so (CUDA + bf16;
    forced here onto the interpreter), within the GEMM tolerance of its reference path, and says
    which path ran."""
    x = torch.randn(2, 5, 64, generator=_g(8)).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=_g(9)).to(torch.bfloat16)
    ref_lin = NL.NVFP4Linear(scheme, parts)
    y_ref = ref_lin(x, w)
    assert ref_lin.kernel_summary()["paths_used"] == {"reference": 1}
    monkeypatch.setattr(NL, "use_kernels", lambda t: True)
    lin = NL.NVFP4Linear(scheme, parts)
    y = lin(x, w)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    summary = lin.kernel_summary()
    assert summary["paths_used"] == {"triton:decode": 1} and summary["kernel"]["path"] == "decode"
    assert summary["kernel"]["config"]["NSEG"] == T.nseg_for(parts[0] if parts else 48, 64)
    same = (y.view(torch.int16) == y_ref.view(torch.int16)).float().mean().item()
    assert same >= 0.99 and (y.float() - y_ref.float()).abs().max().item() <= 2 ** -6 * y_ref.float().abs().max().item()
    assert lin.describe()["kernels"] == summary


@pytest.mark.parametrize("n,k,m", [(48, 256, 20), (16, 1024, 17)])
def test_prefill_flat_loop_equals_loop_per_segment(n, k, m):
    """The prefill kernel's one K loop across segments (the default) folds each segment's sum into
    the total at the segment's end: the same dots in the same order as one loop per segment, so the
    same bits (here in the interpreter; the GPU sweep of bench/probe_prefill.py checks the wgmma
    build), and within the GEMM tolerance."""
    w = R.nvfp4_quantize_ref(torch.randn(n, k, generator=_g(12)))
    a = R.nvfp4_quantize_ref(torch.randn(m, k, generator=_g(13)).to(torch.bfloat16), per_token=True)
    tw = T.prepare(w)
    assert tw.nseg > 1 and (k // tw.nseg) // T.prefill_config(tw.nseg, k // tw.nseg)["BK"] > 1
    tw = tw.tuned(DEFAULT.with_(prefill={"two_launch": False}))  # the one-loop kernel at NSEG 2 too
    flat = T.tc_matmul(a, tw, path="prefill")
    assert T.kernel_record(m, tw, "prefill")["config"]["FLAT"] is True
    per_seg = T.tc_matmul(a, tw.tuned(DEFAULT.with_(prefill={"two_launch": False, "flat": False})), path="prefill")
    assert torch.equal(flat.view(torch.int16), per_seg.view(torch.int16))
    tc_within_bound(flat, a, w)


@pytest.mark.parametrize("n,k,m", [(48, 256, 20), (40, 256, 37)])
def test_prefill_two_launch_equals_one_loop(n, k, m):
    """Two K segments as two launches of the one-accumulator tile (segment 0's fp32 sums through a
    buffer, then p0 + p1 and the epilogue) give the bits of the one-loop kernel, also when the rows go
    through the buffer in several blocks (PrefillTuning.partial_bytes) and when the second launch runs
    its epilogue on the tile's column halves (PrefillTuning.split_epilogue; n = 40: a half past N)."""
    w = R.nvfp4_quantize_ref(torch.randn(n, k, generator=_g(14)))
    a = R.nvfp4_quantize_ref(torch.randn(m, k, generator=_g(15)).to(torch.bfloat16), per_token=True)
    tw = T.prepare(w)
    assert tw.nseg == 2 and T.two_launch(tw)  # the default at NSEG 2
    one_loop = tw.tuned(DEFAULT.with_(prefill=PrefillTuning.from_config({"TWO_LAUNCH": False})))
    assert not T.two_launch(one_loop)
    one = T.tc_matmul(a, one_loop, path="prefill")
    assert T.two_launch(tw) and not T.two_launch(T.prepare(R.nvfp4_quantize_ref(torch.randn(16, 1024, generator=_g(3)))))
    two = T.tc_matmul(a, tw, path="prefill")
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    blocks = tw.tuned(DEFAULT.with_(prefill={"partial_bytes": 16 * 4 * n}))  # 16 rows per block: several blocks
    assert torch.equal(one.view(torch.int16), T.tc_matmul(a, blocks, path="prefill").view(torch.int16))
    assert T.kernel_record(m, tw, "prefill")["config"]["SPLIT"] is True  # the default: the epilogue by halves
    whole = tw.tuned(DEFAULT.with_(prefill={"split_epilogue": False}))  # the whole tile at once
    assert T.kernel_record(m, whole, "prefill")["config"]["SPLIT"] is False
    assert torch.equal(one.view(torch.int16), T.tc_matmul(a, whole, path="prefill").view(torch.int16))
    tc_within_bound(one, a, w)


def test_nseg_long_k() -> None:
    """SegmentRule.long_k (8192 by default): where the tiles alone fill the GPU, a K of at least long_k
    still splits in two (a function of (N, K) only); shorter K, more segments already, experts:
    unchanged; None turns it off."""
    assert DEFAULT.segments.long_k == 8192
    assert T.nseg_for(8192, 8192) == 2 and T.nseg_for(28672, 8192) == 2 and T.nseg_for(8192, 28672) == 2
    assert T.nseg_for(8192, 4096) == 1 and T.nseg_for(1024, 8192) == 8 and T.nseg_for(8192, 8192, grouped=True) == 1
    off = SegmentRule(long_k=None)
    assert T.nseg_for(8192, 8192, rule=off) == 1 and T.nseg_for(28672, 8192, rule=off) == 1


def test_tuned_keeps_a_forced_nseg_and_checks_take_a_tuning() -> None:
    """TCWeight.tuned changes nseg only with the segment rule (a probe's forced nseg survives a config
    change); the tc_* named checks run under a given tuning (the benches' per-variant checks)."""
    import dataclasses

    from mismatch_probe.kernels.checks import CHECKS, run_checks

    tw = T.prepare(R.nvfp4_quantize_ref(torch.randn(48, 256, generator=_g(16))))
    forced = dataclasses.replace(tw, nseg=1)
    assert tw.nseg == 2 and forced.tuned(DEFAULT.with_(decode={"native": False})).nseg == 1
    assert forced.tuned(DEFAULT.with_(segments={"target": 1})).nseg == 1 and tw.tuned(GemmTuning()).nseg == 2
    assert {c.name for c in CHECKS if c.tuned} == {c.name for c in CHECKS if c.name.startswith("tc_")}
    (res,) = run_checks(["tc_gemm_decode_vs_reference"], tuning=DEFAULT.with_(decode={"cpi": 2}))
    assert res.status == "pass", res.detail


def test_nvfp4_linear_carries_its_tuning(monkeypatch) -> None:
    """NVFP4Linear is made from the scheme (name or Scheme) and a GemmTuning; its prepared weights run
    under that tuning, and a new tuning prepares them again."""
    monkeypatch.setattr(NL, "use_kernels", lambda t: True)
    w = torch.randn(48, 256, generator=_g(17)).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=_g(18)).to(torch.bfloat16)
    lin = NL.NVFP4Linear(NL.SCHEMES["nvfp4-per-token"])
    assert lin.scheme.name == "nvfp4-per-token" and lin.tuning is DEFAULT
    y = lin(x, w)
    (tw,) = lin.prepared(w)
    assert tw.tuning is DEFAULT and tw.nseg == 2
    lin.tuning = DEFAULT.with_(segments={"target": 1})  # one K segment: other bits, within the tolerance
    (tw1,) = lin.prepared(w)
    assert tw1.nseg == 1 and tw1.tuning is lin.tuning and lin.prepared(w)[0] is tw1
    y1 = lin(x, w)
    assert y1.shape == y.shape and (y1.float() - y.float()).abs().max() <= 2 ** -6 * y.float().abs().max()


@pytest.mark.parametrize("n,k,m,prefill", [(48, 256, 20, {}), (40, 256, 37, {"two_launch": False}),
                                           (16, 1024, 17, {"flat": False}), (72, 96, 9, {})])
def test_prefill_weights_decoded_in_registers_give_the_same_bits(n, k, m, prefill):
    """PrefillTuning.decode_weights: the prefill kernel decodes the weights from codes and scale bytes
    (gemm_tc._w_dec) instead of reading the fp16 operand TCWeight.op(): the same operand values, so
    the same bits, on every loop form (two launches at NSEG 2, one flat loop, a loop per segment; a
    partial last row tile, K of one segment); and it never builds the operand. Scale bytes 0x7F (a
    NaN-flagged block) decode to NaN in both (NaN rows where they are used)."""
    w = R.nvfp4_quantize_ref(torch.randn(n, k, generator=_g(16)))
    w.codes[1, :4] = torch.tensor([0x88, 0x08, 0x80, 0xF7], dtype=torch.uint8)  # -0 codes, both nibbles
    a = R.nvfp4_quantize_ref(torch.randn(m, k, generator=_g(17)).to(torch.bfloat16), per_token=True)
    ref = T.tc_matmul(a, T.prepare(w).tuned(DEFAULT.with_(prefill=prefill)), path="prefill")
    tw = T.prepare(w).tuned(DEFAULT.with_(prefill={**prefill, "decode_weights": True}))
    got = T.tc_matmul(a, tw, path="prefill")
    assert tw._op is None  # no fp16 operand kept
    assert T.kernel_record(m, tw, "prefill")["config"]["WDEC"] is True
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    w.scales[3, 0] = 0x7F
    nan_ref = T.tc_matmul(a, T.prepare(w), path="prefill")
    nan_got = T.tc_matmul(a, T.prepare(w).tuned(DEFAULT.with_(prefill={"decode_weights": True})), path="prefill")
    assert nan_got[:, 3].isnan().all() and nan_ref[:, 3].isnan().all()
    assert torch.equal(torch.nan_to_num(nan_got.float()), torch.nan_to_num(nan_ref.float()))


def test_reduce_segments_writes_a_column_block_of_a_wider_output():
    """The K segments' reduce (what a fused layer's shard gets after the one-launch decode GEMM): the
    partials added in segment order, then the epilogue, rounded once to bf16, written into the shard's
    columns of the layer's output (its row stride), nothing else touched; equal to the contiguous call."""
    w = T.prepare(R.nvfp4_quantize_ref(torch.randn(48, 256, generator=_g(5))))
    m, n, nseg = 5, 48, 4
    part = torch.randn(nseg, m, n, generator=_g(6))
    a_amax = torch.rand(m, generator=_g(7)) + 0.5
    full = torch.empty(m, n, dtype=torch.bfloat16)
    T.reduce_segments(part, a_amax, w, full, nseg)
    tot = ((part[0] + part[1]) + part[2]) + part[3]
    want = ((tot * 128.0) * ((a_amax[:, None] * w.amax) * 1.3840171675383317e-07)).to(torch.bfloat16)
    assert torch.equal(full, want)
    wide = torch.zeros(m, 100, dtype=torch.bfloat16)
    T.reduce_segments(part, a_amax, w, wide[:, 30:30 + n], nseg)
    assert torch.equal(wide[:, 30:30 + n], full) and not wide[:, :30].any() and not wide[:, 30 + n:].any()


@pytest.mark.parametrize("count", [2, 3, 4])
def test_reduce_shards_one_launch_equals_each_shards_own_reduce(count: int):
    """A fused layer's shards whose K segments were left to a reduce (q, k, v) in one launch: each shard's
    columns are the bits of its own reduce launch (its own segments, amax per tensor or per row, its columns
    of the layer's output, a shard that needed none in between left untouched)."""
    import dataclasses

    base = T.prepare(R.nvfp4_quantize_ref(torch.randn(48, 256, generator=_g(8))))
    m = 5
    shapes = [(48, 2, False), (16, 8, True), (32, 3, False), (48, 1, True)][:count]
    items, c0 = [], 7  # columns 0-6: a shard with no reduce (left as is)
    for i, (n, nseg, per_row) in enumerate(shapes):
        amax = torch.rand(n if per_row else 1, generator=_g(20 + i)) + 0.25
        w = dataclasses.replace(base, amax=amax, per_row=per_row, nseg=nseg, codes=base.codes[:n], scales=base.scales[:n])
        items.append((torch.randn(nseg, m, n, generator=_g(30 + i)), w, c0))
        c0 += n + (5 if i == 0 else 0)  # a gap after the first: its columns another shard's
    a_amax = torch.rand(m, generator=_g(9)) + 0.5
    want = torch.full((m, c0 + 3), 7.0, dtype=torch.bfloat16)
    for part, w, c in items:
        T.reduce_segments(part, a_amax, w, want[:, c:c + w.n], w.nseg)
    got = torch.full_like(want, 7.0)
    T.reduce_shards(items, a_amax, got)
    assert torch.equal(got, want)
    assert (got[:, :7] == 7.0).all() and (got[:, 7 + 48:7 + 53] == 7.0).all() and (got[:, c0:] == 7.0).all()
