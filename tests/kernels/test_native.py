"""The optional native (CUDA C++) NVFP4 backend, on the CPU: the weight layout and the register
decode it feeds (emulated bit for bit in numpy), the integer/magic-constant E2M1 formula of its
quantizer, and the fallback when it cannot be built. The kernels themselves run on the GPU only
(bench/probe_native.py and the GPU checks compare them with the Triton paths with torch.equal)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mismatch_probe.kernels.nvfp4 import native
from mismatch_probe.kernels.nvfp4.ref import e2m1_decode, e4m3_decode, nvfp4_quantize_ref, unpack_codes
from mismatch_probe.kernels.nvfp4.tuning import GemmTuning, NativeTuning


def _prmt(a: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 d, a, 0, sel (selector nibbles 0-3: bytes of a, 4-7: zero bytes)."""
    out = np.zeros_like(a)
    for j in range(4):
        src = (sel >> (4 * j)) & 7
        byte = (a >> np.uint32(8 * src)) & np.uint32(255) if src < 4 else np.zeros_like(a)
        out |= byte << np.uint32(8 * j)
    return out


def _f16x2(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype("<u4"))[..., None].view(np.float16)


def _fragments(v: np.ndarray, dec: str) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's two fp16 pairs (bit patterns) of one k16 step from the masked word v:
    {k = 2q, 2q+1} from bytes 0, 2 and {k = 2q+8, 2q+9} from bytes 1, 3."""
    if dec == "prmt":
        return _prmt(v, 0x2404), _prmt(v, 0x3414)
    return (v << np.uint32(8)) & np.uint32(0xFF00FF00), v & np.uint32(0xFF00FF00)


@pytest.mark.parametrize("scales,dec", [("e4m3", "prmt"), ("fp16", "prmt"), ("fp16", "shift"), ("e4m3", "shift")])
def test_native_layout_register_decode_gives_the_exact_weight_operand(scales, dec):
    g = torch.Generator().manual_seed(3)
    n, k = 72, 256  # rows padded to 128; two 128-wide chunks; heavy tails give subnormal E4M3 scales
    w = (torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, k, generator=g) * 2)).to(torch.bfloat16)
    q = nvfp4_quantize_ref(w)
    wq, ws, ws16 = native.native_layout(q.codes, q.scales)
    want = (e2m1_decode(unpack_codes(q.codes)) * e4m3_decode(q.scales).repeat_interleave(16, 1) / 128).numpy()
    want = want.astype(np.float16)
    words = wq.numpy().view("<u4").reshape(2, 2, 8, 32, 4)  # nb, chunk, tile, lane, word
    sc = ws.numpy().reshape(2, 2, 8, 8, 8)  # nb, chunk, tile, row g, step
    sc16 = ws16.numpy().view("<u2").reshape(2, 2, 8, 8, 8)
    lane = np.arange(32)
    g_ = lane // 4
    for wi in range(4):
        w32 = words[..., wi].astype(np.uint32)
        va = w32 & np.uint32(0x8E8E8E8E)
        vb = ((w32 >> np.uint32(3)) & np.uint32(0x0E0E0E0E)) | ((w32 << np.uint32(7)) & np.uint32(0x80808080))
        for h, v in ((0, va), (1, vb)):
            s = 2 * wi + h
            if scales == "e4m3":
                sbyte = sc[..., s][:, :, :, g_].astype(np.uint32)  # nb, chunk, tile, lane
                scale = _f16x2((sbyte | (sbyte << np.uint32(16))) << np.uint32(7)) * np.float16(32768)
            else:  # the half-swizzled HMUL2 operand {sf * 2^7, sf * 2^7}
                h16 = sc16[..., s][:, :, :, g_].astype(np.uint32)
                scale = _f16x2(h16 | (h16 << np.uint32(16)))
            f0, f1 = _fragments(v, dec)
            frag = np.concatenate([_f16x2(f0) * scale, _f16x2(f1) * scale], axis=-1)
            nb_, c_, t_, l_, i_ = np.meshgrid(np.arange(2), np.arange(2), np.arange(8), lane, np.arange(4), indexing="ij")
            row = nb_ * 64 + t_ * 8 + l_ // 4
            col = c_ * 128 + s * 16 + 2 * (l_ % 4) + (i_ % 2) + 8 * (i_ // 2)  # fragment k: 2q, 2q+1, 2q+8, 2q+9
            real = row < n
            exp = np.zeros(row.shape, np.float16)
            exp[real] = want[row[real], col[real]]
            assert np.array_equal(frag.view(np.uint16), exp.view(np.uint16))  # padding rows decode to +0
    assert np.array_equal(sc16.view(np.float16).astype(np.float32).ravel(), e4m3_decode(ws).numpy() * 128)


def _ref_codes(y: np.ndarray) -> np.ndarray:
    a = np.abs(np.clip(y, -6, 6))
    idx = (a > 0.25).astype(int) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    return idx | np.where(np.clip(y, -6, 6) < 0, 8, 0)


def _kernel_codes(y: np.ndarray) -> np.ndarray:
    """nvfp4_native.cu's e2m1_code: RNE(min(2a, a + 2, a/2 + 4, 7)) by the 2^23 magic constant,
    each candidate rounded once (fma / add emulated exactly in float64), sign from y + 0."""
    ay = np.abs(y).astype(np.float64)
    c = [(ay * 2 + 8388608).astype(np.float32), (ay + 8388610).astype(np.float32), (ay * 0.5 + 8388612).astype(np.float32)]
    m = np.minimum(np.minimum(c[0], c[1]), np.minimum(c[2], np.float32(8388615)))
    neg = ((y + np.float32(0)).view(np.uint32) >> 31).astype(np.int64)
    return m.view(np.uint32).astype(np.int64) - 0x4B000000 + 8 * neg


def test_kernel_e2m1_formula_matches_the_spec_thresholds():
    rng = np.random.default_rng(0)
    base = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1, 2, 4, 7, 1e30], np.float32)
    near = np.concatenate([base, np.nextafter(base, np.float32(0)), np.nextafter(base, np.float32(np.inf))])
    ys = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * 3, near, -near,
                         np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45], np.float32),
                         (rng.integers(-30, 31, 10_000) * 0.25).astype(np.float32)])
    with np.errstate(all="ignore"):
        assert np.array_equal(_kernel_codes(ys), _ref_codes(ys))


def test_without_cuda_the_native_backend_reports_why_and_is_not_used():
    st = native.status()
    assert st["available"] is False and "CUDA" in st["reason"]
    assert native.load() is None and not native.available()
    from mismatch_probe.kernels.nvfp4 import quant_fast

    assert not quant_fast.use_native_quant(torch.zeros(2, 16, dtype=torch.bfloat16))


def _w(k: int, nseg: int, variant: int | None = None, ks2: bool | None = None, **kw: object) -> SimpleNamespace:
    """A stand-in weight for the records: K, its segments, and the native tuning it carries."""
    return SimpleNamespace(k=k, nseg=nseg, tuning=GemmTuning(native=NativeTuning(variant, ks2)), **kw)


def test_variant_records():
    w = _w(8192, 1)
    r = native.decode_variant(16, w)
    assert r["variant"] == native.DEFAULT_VARIANT and r["MMA"] == "mma.sync m16n8k16"
    assert native.decode_variant(64, w)["MT"] == 4 and native.decode_variant(20, w)["MT"] == 2
    w0 = _w(8192, 1, variant=0)
    assert native.decode_variant(1, w0)["pipeline"] == "cp.async" and native.decode_variant(1, w0)["HALF"] == 1
    w8 = _w(8192, 1, variant=8)
    assert (native.decode_variant(16, w8)["scales"], native.decode_variant(16, w8)["decode"]) == ("fp16", "shift")
    # odd chunk count per K segment, or M > 64 (a forced decode path): the cp.async kernel runs
    assert native.decode_variant(1, _w(1152, 1, variant=8))["CPS"] == 1
    assert native.decode_variant(100, w8)["pipeline"] == "cp.async"
    with pytest.raises(ValueError, match="unknown"):
        native.decode_variant(16, _w(8192, 1, variant=4))  # removed (wgmma)


def test_chunked_variant_records_and_token_layout():
    """Variants 12, 13 take the chunk-major token operand: [M/16][K/128][16][136] fp16, element (r, k)
    at [r // 16, k // 128, r % 16, k % 128], rows past M zero; rows_operand inverts it exactly."""
    w = _w(8192, 1, variant=12)
    r = native.decode_variant(16, w)
    assert (r["variant"], r["STAGES"], r["CPS"], r["NT"]) == (12, 4, 4, 2) and "chunk-major" in r["tokens"]
    w = _w(8192, 1)  # the default off sm_90: 14
    assert native.token_layout(16, w) == 1 and native.token_layout(64, w) == 1 and native.token_layout(65, w) == 0
    assert native.decode_variant(40, w)["CPS"] == 2 and native.decode_variant(40, w)["STAGES"] == 4
    w6 = _w(768, 1)  # 6 chunks: 2 per stage
    assert native.decode_variant(16, w6)["CPS"] == 2 and native.token_layout(16, w6) == 1
    assert native.token_layout(1, _w(1152, 1)) == 0  # odd chunk count: the cp.async kernel
    # 14: 8 consumer warps of one tile at M <= 16 with 4 chunks per stage only
    w, w6 = _w(8192, 1, variant=14), _w(768, 1, variant=14)
    assert native.decode_variant(16, w)["NT"] == 1 and native.decode_variant(16, w6)["NT"] == 2
    assert native.decode_variant(64, w)["NT"] == 2 and native.token_layout(16, w) == 1
    g = torch.Generator().manual_seed(3)
    for m, k in ((1, 256), (16, 384), (37, 1024)):
        op = torch.randn(m, k, generator=g).to(torch.float16)
        cm = native.chunk_operand(op)
        assert cm.shape == (-(-m // 16), k // 128, 16, native.TOKEN_ROW) and cm.is_contiguous()
        rr, kk = torch.meshgrid(torch.arange(m), torch.arange(k), indexing="ij")
        assert torch.equal(cm[rr // 16, kk // 128, rr % 16, kk % 128], op)
        assert not cm.permute(0, 2, 1, 3).reshape(-1, k // 128, native.TOKEN_ROW)[m:].any()
        assert torch.equal(native.rows_operand(cm, m), op)


def test_core_variant_records_and_token_layout():
    """Variant 15 (wgmma, sm_90 only) takes the core-matrix token operand [K/128][16][NTOK/8][8][8] fp16:
    element (r, k) at [k // 128, (k % 128) // 8, r // 8, r % 8, k % 8], rows past M zero, NTOK the least
    of 8, 16, 32, 64 >= M; rows_operand inverts it exactly; off sm_90 asking for it is a clear error."""
    w = _w(8192, 1)
    assert [native.token_cols(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, 64, 64]
    native._STATE["hopper"] = True
    try:
        assert native.default_variant() == 15 and native.token_layout(16, w) == 2
        assert native.token_layout(65, w) == 0
        r = native.decode_variant(16, w)
        assert (r["variant"], r["NTOK"], r["STAGES"], r["CPS"], r["R"]) == (15, 16, 4, 4, 4)
        assert "m64n16k16" in r["MMA"] and "core-matrix" in r["tokens"] and r["decode"] == "shift"
        r = native.decode_variant(64, _w(768, 1))  # 6 chunks: 2 per stage
        assert (r["NTOK"], r["STAGES"], r["CPS"], r["R"]) == (64, 4, 2, 2)
        assert native.decode_variant(65, w)["pipeline"] == "cp.async"
        # two K segments: inside the CTA where the tiles alone fill the GPU (N = 8192: 128 tiles, 132
        # SMs) and M <= 32; across CTAs at two CTAs per SM above M = 32 (256 programs > 132 SMs); at
        # N = 4096 across CTAs with the one-segment ring; the tuning's ks2 forces either way
        native._STATE["sms"] = 132
        w2, w3 = _w(8192, 2, n=8192), _w(8192, 2, n=4096)
        assert native.fused_segments(16, w2, 2) and not native.fused_segments(33, w2, 2)
        r = native.decode_variant(16, w2)
        assert (r["STAGES"], r["CPS"], r["R"]) == (4, 2, 2) and "2 warpgroups" in r["MMA"] and "core-matrix" in r["tokens"]
        assert "a ring per segment" in r["pipeline"]
        r = native.decode_variant(64, w2)
        assert (r["NTOK"], r["STAGES"], r["CPS"], r["R"]) == (64, 2, 2, 2) and "2 CTAs per SM" in r["pipeline"]
        assert not native.fused_segments(16, w3, 2) and native.decode_variant(16, w3)["CPS"] == 4
        assert native.crowded(w2, 2) and not native.crowded(w3, 2) and native.decode_variant(64, w3)["STAGES"] == 4
        w2off = _w(8192, 2, ks2=False, n=8192)
        assert not native.fused_segments(16, w2off, 2) and native.decode_variant(16, w2off)["CPS"] == 4
        assert native.fused_segments(16, _w(8192, 2, ks2=True, n=4096), 2)
        assert not native.fused_segments(16, _w(8192, 1, ks2=True, n=8192), 1)
        native._STATE["hopper"] = False
        assert native.default_variant() == 14 and native.token_layout(16, w) == 1
        with pytest.raises(ValueError, match="sm_90"):
            native.decode_variant(16, _w(8192, 1, variant=15))
    finally:
        native._STATE.pop("hopper", None)
    g = torch.Generator().manual_seed(4)
    for m, k in ((1, 256), (9, 384), (16, 128), (37, 1024), (64, 256)):
        op = torch.randn(m, k, generator=g).to(torch.float16)
        cm = native.core_operand(op)
        nt = native.token_cols(m)
        assert cm.shape == (k // 128, 16, nt // 8, 8, 8) and cm.is_contiguous()
        rr, kk = torch.meshgrid(torch.arange(m), torch.arange(k), indexing="ij")
        assert torch.equal(cm[kk // 128, (kk % 128) // 8, rr // 8, rr % 8, kk % 8], op)
        flat = cm.view(-1)  # the same element by the kernels' address arithmetic (halves)
        off = (((kk // 128) * 16 + (kk % 128) // 8) * (nt // 8) + rr // 8) * 64 + (rr % 8) * 8 + kk % 8
        assert torch.equal(flat[off], op)
        assert not native.rows_operand(cm, nt)[m:].any()
        assert torch.equal(native.rows_operand(cm, m), op)
        assert torch.equal(native.layout_operand(op, 2), cm) and torch.equal(native.layout_operand(op, 0), op)


def test_native_sources_ship_and_key_the_build_cache():
    """Every file of csrc/ (the .cu and the headers it includes) is package data, and the build cache tag
    hashes them all: a changed header rebuilds the extension."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["mismatch_probe.kernels.nvfp4"]
    files = sorted(p.name for p in native.SRC.parent.iterdir() if p.is_file())
    assert "decode_wg.cuh" in files and "nvfp4_native.cu" in files
    for name in files:
        assert any(fnmatch.fnmatch(f"csrc/{name}", g) for g in globs), name
    src = native.SRC.read_text()  # the one translation unit includes every header of csrc/ (split by role)
    for name in files:
        if name.endswith(".cuh"):
            assert f'#include "{name}"' in src, name
    assert {"common.cuh", "decode_cpasync.cuh", "decode_bulk.cuh", "quantize.cuh", "launch.cuh", "dispatch.cuh"} <= set(files)


def test_decode_gemm_passes_the_instance_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-CTA segments and the two-CTAs-per-SM ring are decided once, in Python (fused_segments,
    crowded: what decode_variant records), and handed to the extension, which no longer derives them."""

    calls: list[tuple] = []
    monkeypatch.setattr(native, "load", lambda: SimpleNamespace(decode_wg=lambda *a: calls.append(a)))
    monkeypatch.setitem(native._STATE, "hopper", True)
    monkeypatch.setitem(native._STATE, "sms", 132)
    t = torch.zeros(1)
    for n, m, ks2, crowd in ((8192, 16, True, True), (8192, 64, False, True), (4096, 64, False, False),
                             (4096, 16, False, False)):
        w = _w(8192, 2, n=n, native_w=(t, t, t), amax=t, per_row=True)
        assert native.wgmma_path(m, w, 2)  # variant 15; its K segments: in the CTA (ks2), else a reduce launch
        assert native.reduces_in_kernel(m, w, 2) == ks2
        native.decode_gemm(t, torch.zeros(m, 8192, dtype=torch.float16), w, m, 2, t, t)
        rec = native.decode_variant(m, w)
        assert calls[-1][-3:] == (ks2, crowd, False) and calls[-1][11].dim() == 5  # the core-matrix operand
        assert calls[-1][7:11] == ([n], [2], [0], n)  # one shard: columns [0, n) of rows of stride n
        assert ("both K segments in the CTA" in rec["pipeline"]) == ks2
        assert ("2 CTAs per SM" in rec["pipeline"]) == (crowd and m > 32)


def test_decode_gemm_is_a_dependent_launch_only_when_the_caller_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pdl``: passed through to the extension when asked for and native.PDL allows it, never by default."""
    calls: list[tuple] = []
    monkeypatch.setattr(native, "load", lambda: SimpleNamespace(decode_wg=lambda *a: calls.append(a)))
    monkeypatch.setitem(native._STATE, "hopper", True)
    monkeypatch.setitem(native._STATE, "sms", 132)
    t = torch.zeros(1)
    w = _w(8192, 2, n=8192, native_w=(t, t, t), amax=t, per_row=True)
    a = torch.zeros(16, 8192, dtype=torch.float16)
    native.decode_gemm(t, a, w, 16, 2, t, t)
    native.decode_gemm(t, a, w, 16, 2, t, t, pdl=True)
    monkeypatch.setattr(native, "PDL", False)
    native.decode_gemm(t, a, w, 16, 2, t, t, pdl=True)
    assert [c[-1] for c in calls] == [False, True, False]


def test_recipe_gemm_overlaps_only_a_kernel_that_writes_no_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's GEMM of each shard may start while the kernel before it runs (``after_own_kernel``)
    only where that kernel is the quantizer of its input or the shard before it: not right after the
    weight sync of this call when the input's quantization was shared (no quantizer ran in between)."""
    from mismatch_probe.kernels.nvfp4 import linear as L
    from mismatch_probe.kernels.nvfp4 import tc_linear as T

    lin = L.NVFP4Linear("nvfp4-per-token")
    got: list[bool] = []
    monkeypatch.setattr(T, "tc_matmul", lambda qa, tw, a_op=None, after_own_kernel=False: got.append(after_own_kernel)
                        or torch.zeros(1, 2))
    monkeypatch.setattr(T, "choose", lambda m, w, path="auto": "prefill")
    monkeypatch.setattr(T, "operand_layout", lambda m, w, path="decode": 0)

    def prepared(w: object, key: object = None) -> list[str]:  # a new key: "synced" now
        if key not in lin._tcache:
            lin._tcache[key] = (None, ["s0", "s1", "s2"])
        return lin._tcache[key][1]

    monkeypatch.setattr(lin, "prepared", prepared)
    monkeypatch.setattr(lin, "quantize_input", lambda x2, amax, tw: ("qa", None))
    x = torch.zeros(1, 4)
    lin._kernel_matmul(x, None, None, "q")  # weights synced, input quantized now: every shard
    assert got == [True, True, True]
    lin.shared = L.SharedInput()
    lin.shared.open(x)
    got.clear()
    lin._kernel_matmul(x, None, None, "k", x)  # quantized now (the scope's first): every shard
    lin._kernel_matmul(x, None, None, "v", x)  # shared input, weights synced just now: not shard 0
    lin._kernel_matmul(x, None, None, "k", x)  # shared input, weights cached: every shard
    assert got == [True, True, True, False, True, True, True, True, True]


def test_shards_run_as_one_launch_into_one_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused layer's shards (Qwen3-8B's q, k, v: K 4096, N 4096 / 1024 / 1024, K segments 2 / 8 / 8 by the
    segment rule) go to the wgmma kernel as one table: each shard its columns of the one output, its own
    segments and arrival counters; shards that would take different kernel instances, or more than
    MAX_SHARDS, or a GPU without variant 15, are not grouped (the caller launches them one by one)."""
    from mismatch_probe.kernels.nvfp4.tc_linear import nseg_for

    calls: list[tuple] = []
    monkeypatch.setattr(native, "load", lambda: SimpleNamespace(decode_wg=lambda *a: calls.append(a)))
    monkeypatch.setitem(native._STATE, "hopper", True)
    monkeypatch.setitem(native._STATE, "sms", 132)
    t = torch.zeros(1)

    def shard(n: int, k: int = 4096) -> SimpleNamespace:
        return _w(k, nseg_for(n, k), n=n, grouped=False, native=True, native_w=(t, t, t), amax=t, per_row=False)

    q, k, v = shard(4096), shard(1024), shard(1024)
    assert (q.nseg, k.nseg, v.nseg) == (2, 8, 8)
    for m in (1, 16, 64):
        assert native.shards_ok(m, [q, k, v])
    assert not native.shards_ok(65, [q, k, v]) and not native.shards_ok(16, [q])
    assert not native.shards_ok(16, [q, k, v, v, v])  # more than MAX_SHARDS
    assert not native.shards_ok(16, [shard(4096), shard(1024, k=2048)])  # another K
    wide, narrow = shard(12288, k=1536), shard(4096, k=1536)  # 12 chunks: 1 segment (4 per stage) vs 2 (6: 2)
    assert (wide.nseg, narrow.nseg) == (1, 2) and not native.shards_ok(16, [wide, narrow])
    parts = [torch.zeros(1)] * 3
    native.decode_shards(t, torch.zeros(16, 4096, dtype=torch.float16), [q, k, v], 16, t, parts)
    a = calls[-1]  # by default no counters: the K segments go to a reduce launch per shard
    assert a[6:11] == ([-1, -1, -1], [4096, 1024, 1024], [2, 8, 8], [0, 4096, 5120], 6144)
    assert a[11].shape == (32, 16, 2, 8, 8) and a[-3:] == (False, False, False)
    assert not any(native.reduces_in_kernel(16, w, w.nseg) for w in (q, k, v))
    monkeypatch.setattr(native, "REDUCE_IN_KERNEL", True)  # the option: each shard's counters, the sum in the kernel
    native.decode_shards(t, torch.zeros(16, 4096, dtype=torch.float16), [q, k, v], 16, t, parts)
    a = calls[-1]
    assert a[6] == [0, 64, 80] and all(native.reduces_in_kernel(16, w, w.nseg) for w in (q, k, v))
    assert a[5] is native.counters(torch.device("cpu")) and a[5].dtype == torch.int32 and not a[5].any()
    monkeypatch.setitem(native._STATE, "hopper", False)  # off sm_90: no variant 15, no grouping
    assert not native.shards_ok(16, [q, k, v])
