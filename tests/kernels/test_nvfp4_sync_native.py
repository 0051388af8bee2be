"""The native weight sync (``csrc/sync.cuh``, used by kernels/nvfp4/sync.py on a CUDA device), on the CPU:
its output assembly emulated bit for bit in numpy (the nibble pairing of ``sync_pair`` and
``sync_native_words``, the byte permutes, the lane-pair shuffles and every store address of
``sync_quant_kernel``) gives the reference ``decode_layout`` and ``native.native_layout`` bytes; its
per-block arithmetic (``sync_block``, fp32 in numpy) the reference quantizer's codes and scales; the shard
table's program numbering covers every element and tile exactly once (the kernels' binary search
emulated); the lazily viewed :class:`sync.SyncedWeight` behaves as a TCWeight. The kernels themselves run
on the GPU only (bench/gpu_nvfp4_check.py --only b compares them with the reference path)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mismatch_probe.kernels.nvfp4 import native, sync
from mismatch_probe.kernels.nvfp4.ref import e4m3_decode, nvfp4_quantize_ref
from mismatch_probe.kernels.nvfp4.tc_linear import TCWeight, prepare
from mismatch_probe.kernels.nvfp4.tuning import DEFAULT

CUH = Path(sync.__file__).parent / "csrc" / "sync.cuh"


def _const(name: str) -> int:
    """A ``constexpr int`` of sync.cuh (products of earlier constants and literals evaluated)."""
    text = CUH.read_text()
    vals: dict[str, int] = {}
    for m in re.finditer(r"constexpr int (\w+) = ([^;]+);", text):
        vals[m.group(1)] = int(eval(m.group(2), {}, dict(vals)))  # noqa: S307 - our own header's constants
    return vals[name]


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 d, a, b, sel (selector nibbles: bytes 0-3 of a, 4-7 of b)."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * j)) & 7))) & 255) << (8 * j) for j in range(4))


def _pair(a: int, b: int) -> tuple[int, int]:  # sync_pair
    even = (a & 0x0F0F0F0F) | ((b << 4) & 0xF0F0F0F0)
    odd = ((a >> 4) & 0x0F0F0F0F) | (b & 0xF0F0F0F0)
    return _prmt(even, odd, 0x5140), _prmt(even, odd, 0x7362)


def _bits(m: int) -> int:  # sync_native_bits
    return ((m & 0x07070707) << 1) | ((m & 0x08080808) << 4) | (m & 0x70707070) | ((m >> 7) & 0x01010101)


def _native_words(a: list[int], b: list[int]) -> list[int]:  # sync_native_words
    e0 = (a[0] & 0x0F0F0F0F) | ((b[0] << 4) & 0xF0F0F0F0)
    o0 = ((a[0] >> 4) & 0x0F0F0F0F) | (b[0] & 0xF0F0F0F0)
    e1 = (a[1] & 0x0F0F0F0F) | ((b[1] << 4) & 0xF0F0F0F0)
    o1 = ((a[1] >> 4) & 0x0F0F0F0F) | (b[1] & 0xF0F0F0F0)
    x, y = _prmt(e0, e1, 0x5140), _prmt(e0, e1, 0x7362)
    xo, yo = _prmt(o0, o1, 0x5140), _prmt(o0, o1, 0x7362)
    return [_bits(_prmt(x, xo, 0x5410)), _bits(_prmt(x, xo, 0x7632)), _bits(_prmt(y, yo, 0x5410)),
            _bits(_prmt(y, yo, 0x7632))]


def _put(out: np.ndarray, byte_off: int, words: list[int]) -> None:
    out[byte_off:byte_off + 4 * len(words)] = np.asarray(words, "<u4").view(np.uint8)


def _emulate(codes: np.ndarray, scales: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """sync_quant_kernel's stores for one shard, from its standard-packed codes and scale bytes (the
    per-block arithmetic is quant_rows_kernel's, checked on the GPU): codes, scales, dec, dsc, wq, ws16."""
    nt, chunks = -(-n // 64), k // 128
    o = {"codes": np.zeros(n * k // 2, np.uint8), "scales": np.zeros(n * k // 16, np.uint8),
         "dec": np.full(nt * 64 * k // 2, 0xAA, np.uint8), "dsc": np.full(nt * 64 * k // 16, 0xAA, np.uint8),
         "wq": np.full(nt * 64 * k // 2, 0xAA, np.uint8), "ws16": np.full(nt * 64 * k // 8, 0xAA, np.uint8)}
    sf16 = (e4m3_decode(torch.from_numpy(scales.copy())) * 128).to(torch.float16).view(torch.int16).numpy()
    for tile in range(nt):
        for rl in range(64):
            r = tile * 64 + rl
            real = r < n
            for c in range(chunks):
                tix = tile * chunks + c
                lanes = []
                for wp in (0, 1):
                    pk, sb, h = [], [], []
                    for cb in (2 * wp, 2 * wp + 1, 4 + 2 * wp, 5 + 2 * wp):
                        gb = c * 8 + cb
                        if real:
                            wd = codes[r, gb * 8:gb * 8 + 8].view("<u4")
                            pk.append([int(wd[0]), int(wd[1])])
                            sb.append(int(scales[r, gb]))
                            h.append(int(sf16[r, gb]) & 0xFFFF)
                        else:
                            pk.append([0, 0])
                            sb.append(0)
                            h.append(0)
                    lanes.append((pk, sb, h))
                for wp, (pk, sb, h) in enumerate(lanes):
                    ppk, psb, ph = lanes[wp ^ 1]  # the partner lane's registers (the shuffles)
                    if real:
                        _put(o["codes"], r * k // 2 + c * 64 + 16 * wp, [pk[0][0], pk[0][1], pk[1][0], pk[1][1]])
                        _put(o["codes"], r * k // 2 + c * 64 + 32 + 16 * wp, [pk[2][0], pk[2][1], pk[3][0], pk[3][1]])
                    d = [*_pair(pk[0][0], pk[2][0]), *_pair(pk[0][1], pk[2][1]), *_pair(pk[1][0], pk[3][0]),
                         *_pair(pk[1][1], pk[3][1])]
                    _put(o["dec"], tix * 4096 + rl * 64 + 32 * wp, d)
                    s0, s1 = sb[0] | (sb[1] << 8), sb[2] | (sb[3] << 8)
                    ps0, ps1 = psb[0] | (psb[1] << 8), psb[2] | (psb[3] << 8)
                    pwp = wp ^ 1  # the partner lane sends (its wp ? s0 : s1)
                    got = ps0 if pwp else ps1
                    word = (got | (s1 << 16)) if wp else (s0 | (got << 16))
                    if real:
                        _put(o["scales"], r * k // 16 + c * 8 + 4 * wp, [word])
                    _put(o["dsc"], tix * 512 + rl * 8 + 4 * wp, [word])
                    nw = [_native_words(pk[0], pk[1]), _native_words(pk[2], pk[3])]
                    pnw = [_native_words(ppk[0], ppk[1]), _native_words(ppk[2], ppk[3])]
                    gw = [pnw[j & 1][j >> 1] if pwp else pnw[j & 1][2 + (j >> 1)] for j in range(4)]
                    for qq in range(2):
                        words = ([gw[2 * qq], nw[0][2 + qq], gw[2 * qq + 1], nw[1][2 + qq]] if wp
                                 else [nw[0][qq], gw[2 * qq], nw[1][qq], gw[2 * qq + 1]])
                        _put(o["wq"], tix * 4096 + rl * 64 + 16 * (2 * wp + qq), words)
                    f0, f1 = h[0] | (h[1] << 16), h[2] | (h[3] << 16)
                    pf0, pf1 = ph[0] | (ph[1] << 16), ph[2] | (ph[3] << 16)
                    fg = pf0 if pwp else pf1
                    _put(o["ws16"], tix * 1024 + rl * 16 + 8 * wp, [fg, f1] if wp else [f0, fg])
    return o


@pytest.mark.parametrize(("n", "k"), [(64, 128), (70, 256), (130, 384)])
def test_native_sync_stores_give_the_reference_layouts(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    x = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    x[3, :16] = 0
    x[5, 40] = 3e4
    q = nvfp4_quantize_ref(x)
    tw = prepare(q)
    wq, ws, ws16 = native.native_layout(tw.codes, tw.scales)
    got = _emulate(q.codes.numpy(), q.scales.numpy(), n, k)
    assert np.array_equal(got["codes"], q.codes.numpy().reshape(-1))
    assert np.array_equal(got["scales"], q.scales.numpy().reshape(-1))
    assert np.array_equal(got["dec"], tw.dec.numpy().reshape(-1))
    assert np.array_equal(got["dsc"], tw.dsc.numpy().reshape(-1))
    assert np.array_equal(got["wq"], wq.numpy())
    assert np.array_equal(got["dsc"], ws.numpy())
    assert np.array_equal(got["ws16"], ws16.numpy())


def _find(tab: np.ndarray, col: int, p: int) -> int:  # sync_find
    lo, hi = 0, tab.shape[0] - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if tab[mid, col] <= p:
            lo = mid
        else:
            hi = mid - 1
    return lo


def test_native_sync_table_covers_every_element_and_tile_once() -> None:
    mod = SimpleNamespace(sync_cols=_const("SYNC_COLS"), sync_amax_elems=_const("SYNC_AMAX_ELEMS"),
                          sync_chunks=_const("SYNC_CH"))
    assert mod.sync_amax_elems == _const("SYNC_THREADS") * _const("SYNC_AMAX_VEC") * _const("SYNC_AMAX_STEPS") * 8
    ws = [torch.empty(300, 1024, dtype=torch.bfloat16), torch.empty(96, 256, dtype=torch.bfloat16),
          torch.empty(40, 2048, dtype=torch.bfloat16), torch.empty(16, 128, dtype=torch.bfloat16)]
    parts = [[200, 50, 50], [48, 48], None, None]
    sizes = [sync.shard_sizes(w.shape[0], p) for w, p in zip(ws, parts)]
    shards, _ = sync._layout(ws, sizes, DEFAULT)
    base = sync._base(ws)
    for fused in (False, True):
        tab, na, nq = sync._native_table(ws, shards, base, fused, mod)
        assert tab.shape == (len(shards), mod.sync_cols) and tab.dtype == np.int64
        seen_a = {i: [] for i in range(len(shards))}
        for p in range(na):
            i = _find(tab, 11, p)
            e0 = (p - tab[i, 11]) * mod.sync_amax_elems
            assert 0 <= e0 < tab[i, 1] * tab[i, 2]
            seen_a[i].append(e0)
        seen_q = {i: set() for i in range(len(shards))}
        for p in range(nq):
            i = _find(tab, 12, p)
            q = p - tab[i, 12]
            tile, grp = divmod(int(q), int(tab[i, 13]))
            assert tile * 64 < tab[i, 1] and grp * mod.sync_chunks < tab[i, 2] // 128
            seen_q[i].add((tile, grp))
        for i, sh in enumerate(shards):
            assert seen_a[i] == list(range(0, sh.n * sh.k, mod.sync_amax_elems))
            assert len(seen_q[i]) == -(-sh.n // 64) * -(-(sh.k // 128) // mod.sync_chunks)
            w = ws[sh.w]
            assert tab[i, 0] == (w.data_ptr() - base.data_ptr()) // 2 + sh.r0 * sh.k
            assert tab[i, 3] == sh.w * 8 + sh.j and tab[i, 4] == (sh.w * 8 + 6 if fused else tab[i, 3])
            assert list(tab[i, 5:7]) == sh.offs[:2] and tab[i, 8] == sh.offs[3] and tab[i, 10] == sh.offs[5]
            assert tab[i, 7] == (-1 if sh.plan[3] else sh.offs[2])  # no decode-layout tiles with the native layout
            assert tab[i, 9] == (sh.offs[4] if sh.plan[3] else -1)


def test_synced_weight_is_a_tcweight_with_lazy_views() -> None:
    x = (torch.randn(130, 256, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    ref = prepare(nvfp4_quantize_ref(x))
    native.decode_ok(ref)
    shards, nbytes = sync._layout([x], [[130]], DEFAULT)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    ab = torch.zeros(1, 8)
    ab[0, 0] = ref.amax[0]
    (sh,) = shards
    nb = sh.plan[4]
    assert sh.plan[3] and nb[2] == 0  # a native-layout shard: the sync writes no decode-layout tiles
    for o, t in zip(sh.offs, (ref.codes, ref.scales, None, ref.dsc, *ref.native_w[::2])):
        if t is not None:
            buf[o:o + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8)
    assert nb[4] == ref.native_w[0].numel()
    tw = sync._tcweight(sh, buf, ab, 0, DEFAULT)
    assert isinstance(tw, TCWeight) and "codes" not in tw.__dict__ and tw.native_w is None
    sync._decide_native([tw], [0])
    assert tw.native is True and native.decode_ok(tw)
    for f in ("codes", "scales", "amax", "dsc"):
        a, b = getattr(tw, f), getattr(ref, f)
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), f
    t1 = tw.tuned(dataclasses.replace(DEFAULT))
    assert "dec" not in tw.__dict__ and "dec" not in t1.__dict__  # made only where the Triton decode reads it
    assert torch.equal(tw.dec, ref.dec) and tw.dec.shape == ref.dec.shape and "dec" in tw.__dict__
    assert all(torch.equal(a, b) for a, b in zip(tw.native_w, ref.native_w))
    assert (tw.n, tw.k, tw.bkc, tw.nseg, tw.per_row, tw.grouped) == (ref.n, ref.k, ref.bkc, ref.nseg, False, False)
    assert tw.codes.data_ptr() == buf.data_ptr()  # views, not copies
    t2 = tw.tuned(dataclasses.replace(DEFAULT))
    assert torch.equal(t2.codes, ref.codes) and t2.native and t2.native_w is tw.native_w
    flagged = sync._tcweight(sh, buf, ab, 0, DEFAULT)
    sync._decide_native([flagged], [2])
    assert flagged.native is False and flagged.native_w is None and not native.decode_ok(flagged)
    with pytest.raises(AttributeError):
        _ = tw.no_such_field


def _block_math(x: torch.Tensor, amax: float) -> tuple[np.ndarray, np.ndarray]:
    """sync_block (and the amax handling of sync_quant_kernel) in numpy fp32, every step correctly rounded
    as the CUDA intrinsics are: (codes [n, K] uint8, scale bytes [n, K/16])."""
    n, k = x.shape
    bits = x.view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
    xf = (bits << 16).view(np.float32)
    a = bits & 0x7FFF
    fin = np.where(a < 0x7F80, a, 0).reshape(n, k // 16, 16)
    vmax = (fin.max(2).astype(np.uint32) << 16).view(np.float32)
    am = np.float32(amax)
    with np.errstate(all="ignore"):
        s_enc = np.float32(2688.0) / am
        s_enc = np.float32(3.4028234663852886e38) if not s_enc <= 3.4028234663852886e38 else s_enc  # fminf
        if am == 0 or s_enc == 0:
            s_enc = np.float32(1.0)
        s_dec = np.float32(1.0) / s_enc
        mult = s_enc * np.float32(0.1666666716337204)
        v = np.minimum(vmax * mult, np.float32(448.0))
        v = np.where(np.isnan(v), np.float32(448.0), v)  # fminf(NaN, 448) = 448
        sb = torch.from_numpy(v).to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)
        sf = torch.from_numpy(sb.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()
        enc = np.float32(1.0) / (sf * s_dec)
        enc = np.where(enc <= 3.4028234663852886e38, enc, np.float32(3.4028234663852886e38)).astype(np.float32)
        y = xf.reshape(n, k // 16, 16) * enc[:, :, None]
        ay = np.abs(y)
        m = np.minimum(np.minimum(ay * np.float32(2) + np.float32(8388608), ay + np.float32(8388610)),
                       np.minimum(ay * np.float32(0.5) + np.float32(8388612), np.float32(8388615)))
    neg = ((y + np.float32(0)).view(np.uint32) >> 31).astype(np.uint32)
    codes = (m.view(np.uint32) - 0x4B000000 + 8 * neg).astype(np.uint8)
    bad = (a >= 0x7F80).reshape(n, k // 16, 16).any(2) | np.isnan(am)
    codes = np.where(bad[:, :, None], 0, codes).reshape(n, k).astype(np.uint8)
    return codes, np.where(bad, 0x7F, sb).astype(np.uint8)


@pytest.mark.parametrize("amax_kind", ["own", "nan", "inf", "zero"])
def test_native_sync_block_math_is_the_reference_quantizer(amax_kind: str) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 256, generator=g) * 0.02
    x[0, :16] = 0
    x[2, 17], x[3, 40], x[4, :] = 3e4, -2e-30, 1e-35
    x[5, 32:48] = torch.tensor([1e-6] * 15 + [-5e3])
    x[6, 3], x[7, 100], x[8, 200] = float("nan"), float("inf"), float("-inf")
    x[9, 64:80] = -0.0
    x = x.bfloat16()
    own = float(torch.where(torch.isfinite(x.float()), x.float().abs(), 0).amax())
    amax = {"own": own, "nan": float("nan"), "inf": float("inf"), "zero": 0.0}[amax_kind]
    ref = nvfp4_quantize_ref(x, amax=torch.tensor([amax], dtype=torch.float32))
    codes, scales = _block_math(x, amax)
    packed = codes.reshape(24, -1, 2)
    assert np.array_equal(packed[..., 0] | (packed[..., 1] << 4), ref.codes.numpy())
    assert np.array_equal(scales, ref.scales.numpy())


@pytest.mark.parametrize("scheme", ["nvfp4-per-token", "nvfp4-static"])
def test_native_sync_launch_order_and_the_triton_rest(monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    """With the native kernels on (a stub module records its calls): one native amax launch over every
    shard, then the shared amax of a fused scheme, then one native fused launch over the shards of 128-wide
    decode chunks and the Triton fused kernel over the rest (K % 128 != 0); no Triton amax pass."""
    calls: list[tuple] = []

    def sync_weights(base, tab, ab, buf, na, nq):  # noqa: ANN001, ANN202
        calls.append(("native", len(tab), na > 0, nq > 0))

    mod = SimpleNamespace(sync_cols=_const("SYNC_COLS"), sync_amax_elems=_const("SYNC_AMAX_ELEMS"),
                          sync_chunks=_const("SYNC_CH"), sync_weights=sync_weights)
    monkeypatch.setattr(sync, "_native_module", lambda dev: mod)
    monkeypatch.setattr(sync, "_amax_pass", lambda *a: calls.append(("triton amax",)))
    monkeypatch.setattr(sync, "_fuse_amax", lambda ab: calls.append(("fuse",)) or ab.view(torch.int32)[:, 3:6])
    monkeypatch.setattr(sync, "_launch_sync", lambda ws, shards, *a: calls.append(("triton fused", len(shards))))
    ws = [torch.zeros(96, 1024, dtype=torch.bfloat16), torch.zeros(32, 96, dtype=torch.bfloat16)]  # bkc 128, 32
    out, _ = sync._sync_async(ws, [[32, 32, 32], None], scheme, DEFAULT)
    fuse = [("fuse",)] if sync._scheme(scheme).fused_weight_amax else []
    assert calls == [("native", 4, True, False), *fuse, ("native", 3, False, True), ("triton fused", 1)]
    calls.clear()
    sync._sync_async(ws[:1], [[32, 32, 32]], scheme, DEFAULT)  # every shard native: the amax table again
    assert calls == [("native", 3, True, False), *fuse, ("native", 3, False, True)]
    assert [len(o) for o in out] == [3, 1]
