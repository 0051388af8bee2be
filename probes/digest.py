"""Row digest and row statistics of captured tensors: the definition, a numpy reference, and the
CPU implementations (a numba kernel, one pass over the data; a pure-torch fallback).

Digest ``mp64`` of a row of ``n`` elements (bit-exact, the same on every device):

- word ``w_i``: the raw bits of element ``i`` (``i = 0 .. n-1``, the row's memory order) read as a
  signed integer of the element's width (1, 2, 4 or 8 bytes) and sign-extended to 64 bits;
- key ``k_i = (i + 1 + c) * 0x9E3779B97F4A7C15 mod 2**64`` (``c``: the row's column offset, 0
  for a whole row);
- ``x = w_i XOR k_i``, then the splitmix64 finalizer: ``x ^= x >> 30; x *= 0xBF58476D1CE4E5B9;
  x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31`` (logical shifts, products mod 2**64);
- digest = the sum of the ``x`` mod 2**64, written as 16 lowercase hex digits.

Each term is a bijection of its word (one changed element always changes the digest) and depends
on its position. The sum is exact in any order, so a row split into column slices (tensor-parallel
shards, ``c`` = the slice's first column) has the digest (sum mod 2**64) of its slices' digests.

Row statistics (float64; NaN and Inf are counted, not summed): ``sum``, ``sum_sq``, ``abs_max``
over the finite elements, ``n_nan``, ``n_inf``; mergeable across shards and ranks (sums add,
maxima take the max). Summation order differs between implementations, so sums may differ in the
last bits between devices; the digest never does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.probes.digest_constants import GOLDEN, MIX1, MIX2  # noqa: E402,F401 (the digest's constants)

DIGEST_NAME = "mp64"
STAT_COLS = ("sum", "sum_sq", "abs_max", "n_nan", "n_inf")  # the float64 [rows, 5] stats layout

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def words_ref(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Rows of raw bytes (uint8 [rows, nbytes], little-endian) -> uint64 words [rows, n]."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    w = raw.view(np.dtype(_SIGNED[itemsize]).newbyteorder("<")).astype(np.int64)
    return w.view(np.uint64)


def digest_ref(words: np.ndarray, col_offset: int = 0) -> np.ndarray:
    """The reference: uint64 digest of each row of ``words`` (uint64 [rows, n])."""
    words = np.asarray(words, dtype=np.uint64)
    n = words.shape[1]
    with np.errstate(over="ignore"):
        k = (np.arange(1, n + 1, dtype=np.uint64) + np.uint64(col_offset)) * np.uint64(GOLDEN)
        x = words ^ k
        x ^= x >> np.uint64(30)
        x *= np.uint64(MIX1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(MIX2)
        x ^= x >> np.uint64(31)
        return x.sum(axis=1, dtype=np.uint64)


def digest_bytes_ref(raw: np.ndarray, itemsize: int, col_offset: int = 0) -> np.ndarray:
    return digest_ref(words_ref(raw, itemsize), col_offset)


def stats_ref(values: np.ndarray) -> np.ndarray:
    """float64 [rows, 5] stats (see STAT_COLS) of float64 values [rows, n]."""
    v = np.asarray(values, dtype=np.float64)
    fin = np.isfinite(v)
    c = np.where(fin, v, 0.0)
    out = np.zeros((v.shape[0], 5))
    out[:, 0] = c.sum(1)
    out[:, 1] = (c * c).sum(1)
    out[:, 2] = np.abs(c).max(1, initial=0.0)
    out[:, 3] = np.isnan(v).sum(1)
    out[:, 4] = np.isinf(v).sum(1)
    return out


def hex_chars(d: Any) -> Any:
    """Digests (uint64/int64 [n], numpy or torch on any device) -> their 16 lowercase hex digits as
    uint8 [n, 16], in array ops (no per-row Python; on CUDA before the host copy)."""
    if isinstance(d, np.ndarray):
        from mismatch_probe.run.ops_packed import hex_chars as table_hex  # one table lookup per byte

        return table_hex(np.ascontiguousarray(d))
    import torch

    b = d.contiguous().view(torch.uint8).reshape(-1, 8).flip(1)
    nib = torch.stack((b >> 4, b & 15), dim=2).reshape(-1, 16)
    return nib + 48 + (nib > 9).to(torch.uint8) * 39


def hex_array(d: np.ndarray, chars: np.ndarray | None = None) -> pa.Array:
    """uint64 digests (or their ``hex_chars``) -> Arrow strings of 16 hex digits."""
    c = np.ascontiguousarray(hex_chars(np.asarray(d)) if chars is None else chars)
    n = c.shape[0]
    offsets = np.arange(0, 16 * (n + 1), 16, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(c))


def hex_digests(d: np.ndarray) -> list[str]:
    return hex_array(d).to_pylist()


# ---- torch: a few tensor ops (any device); used where neither numba nor Triton applies -------
def _i64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _lsr(x: Any, s: int) -> Any:
    return (x >> s) & ((1 << (64 - s)) - 1)  # logical shift on int64


def word_view(t: Any) -> Any:
    """The tensor's elements as signed integers of their width (same memory)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype == torch.bool:
        return t.view(torch.uint8).view(torch.int8)
    return t.view(ints[t.element_size()])


def digest_torch(t: Any, col_offset: int = 0) -> Any:
    """int64 [rows] digests (the uint64 bits) of a 2-D tensor, in torch ops on its device."""
    import torch

    n = t.shape[1]
    k = (torch.arange(1, n + 1, dtype=torch.int64, device=t.device) + col_offset) * _i64(GOLDEN)
    x = word_view(t).to(torch.int64) ^ k
    x ^= _lsr(x, 30)
    x *= _i64(MIX1)
    x ^= _lsr(x, 27)
    x *= _i64(MIX2)
    x ^= _lsr(x, 31)
    return x.sum(1)


def stats_torch(t: Any) -> Any:
    """float64 [rows, 5] stats of a 2-D tensor, in torch ops on its device."""
    import torch

    f = t.to(torch.float64) if t.dtype != torch.bool else t.to(torch.uint8).to(torch.float64)
    fin = torch.isfinite(f)
    c = torch.where(fin, f, torch.zeros((), dtype=f.dtype, device=f.device))
    out = torch.empty(t.shape[0], 5, dtype=torch.float64, device=t.device)
    out[:, 0] = c.sum(1)
    out[:, 1] = (c * c).sum(1)
    out[:, 2] = c.abs().amax(1) if t.shape[1] else 0.0
    out[:, 3] = torch.isnan(f).sum(1)
    out[:, 4] = torch.isinf(f).sum(1)
    return out


# ---- numba (CPU): one pass per row over the data; digest and stats together ------------------
_NB: Any = None


def _numba_kernels() -> Any:
    global _NB
    if _NB is None:
        try:
            from mismatch_probe.probes import digest_numba

            _NB = digest_numba
        except Exception:  # numba missing or broken: the torch fallback computes the same digest
            _NB = False
    return _NB


def warm_cpu_kernels() -> None:
    """Import the numba kernels and load their compiled code for the usual dtypes (for a thread
    started while the engine loads its model, so the first captured op does not pay for it)."""
    import torch

    nb = _numba_kernels()
    if nb:
        for dt in (torch.bfloat16, torch.float32):
            nb.rows(torch.zeros(1, 8, dtype=dt), np.zeros(1, np.uint64), np.zeros((1, 5)))


def digest_stats_cpu(t: Any, dig_out: np.ndarray, st_out: np.ndarray, col_offset: int = 0) -> None:
    """Digest and stats of the rows of a 2-D CPU tensor into ``dig_out`` (uint64 [rows]) and
    ``st_out`` (float64 [rows, 5]) (numba when available, else torch ops)."""
    nb = _numba_kernels()
    if nb and t.shape[1] > 0 and t.dtype in nb.SUPPORTED:
        if t.stride(-1) != 1:
            t = t.contiguous()
        nb.rows(t, dig_out, st_out, col_offset)
        return
    dig_out[:] = digest_torch(t, col_offset).numpy().view(np.uint64)
    st_out[:] = stats_torch(t).numpy()
