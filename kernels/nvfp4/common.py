"""Shared Triton plumbing: mode selection (GPU JIT vs CPU interpreter) and exact device helpers.

Mode: on a machine without CUDA (or with ``TRITON_INTERPRET=1`` set before import) every kernel
is wrapped in Triton's ``InterpretedFunction`` directly, so CPU tensors run through the
interpreter *without* setting ``TRITON_INTERPRET`` in the process environment (nothing leaks to
other modules that import Triton). With CUDA, kernels are ``triton.jit`` and take CUDA tensors.

Interpreter fidelity (Triton 3.9, checked by reading ``triton/runtime/interpreter.py``):
fp32 -> fp8/bf16 casts there truncate or round ties away (not RNE), bf16 -> fp32 flushes bf16
subnormals (found by the hypothesis test), and ``tl.dot`` on bf16 operands is wrong. So the
helpers below never use those casts: E4M3 rounding, E4M3/E2M1 decoding and fp32 <-> bf16
conversions are written in exact integer/fp32 arithmetic that is identical on
the GPU and in the interpreter, and the GEMM's dot takes fp32 operands in interpreter mode (exact:
E2M1 x E4M3 values have at most 6 significant bits).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from mismatch_probe import settings

_MODE = settings.get("MISMATCH_PROBE_TRITON_MODE")  # auto | jit (force, e.g. AOT compile tests)
INTERPRET: bool = _MODE != "jit" and (os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available())

if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    def kjit(fn):  # noqa: ANN001, ANN201
        """Decorator: a Triton kernel run by the interpreter (CPU tensors)."""
        return InterpretedFunction(fn)

else:

    def kjit(fn):  # noqa: ANN001, ANN201
        """Decorator: a compiled Triton kernel (CUDA tensors)."""
        return triton.jit(fn)


MIN_CC = (8, 9)  # the kernels convert E4M3 scale bytes in hardware (fp8 conversions: sm_89+); Ampere fails to compile them


@functools.cache
def _cc(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_cc(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (asked once per device)."""
    return _cc(device.index if device.index is not None else torch.cuda.current_device())


def gpu_capable(device: torch.device) -> bool:
    """The NVFP4 Triton kernels run on this CUDA device: compute capability >= :data:`MIN_CC` (checked by
    compiling them for sm_80 / sm_86: the E4M3 conversions do not compile there)."""
    return device.type == "cuda" and device_cc(device) >= MIN_CC


def kernel_device_ok(*tensors: torch.Tensor) -> None:
    """Raise ValueError when tensors are on the wrong device for this process's Triton mode."""
    for t in tensors:
        if INTERPRET and t.device.type != "cpu":
            raise ValueError(f"Triton interpreter mode (no CUDA here) needs CPU tensors, got {t.device}")
        if not INTERPRET and t.device.type != "cuda":
            raise ValueError(
                f"the Triton NVFP4 kernels run on CUDA tensors here; got a tensor on {t.device} "
                "(use the *_ref functions for CPU tensors)"
            )
        if not INTERPRET and not gpu_capable(t.device):
            cc = device_cc(t.device)
            raise ValueError(f"the Triton NVFP4 kernels need a GPU of compute capability >= 8.9 (this one: "
                             f"{cc[0]}.{cc[1]}); use the *_ref functions")


def quant_outputs(x: torch.Tensor, amax: torch.Tensor | None, per_token: bool,
                  op_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor | None]:
    """The buffers a row quantizer writes for ``x`` [rows, K]: (codes, scales, mode, amax, op or None).
    ``mode``: 0 computes the amax per row (``amax`` None), 1 per-token amax given, 2 one amax given."""
    rows, k = x.shape
    dev = x.device
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, k // 16, dtype=torch.uint8, device=dev)
    if amax is None:
        mode, amax_t = 0, torch.empty(rows, dtype=torch.float32, device=dev)
    else:
        mode, amax_t = (1 if per_token else 2), amax
    op = torch.empty(rows, k, dtype=op_dtype, device=dev) if op_dtype is not None else None
    return codes, scales, mode, amax_t, op


def require_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major); call .contiguous() first")


@kjit
def e4m3_round(v):
    """fp32 v in [0, 448] (finite) -> (E4M3 byte as int32, its fp32 value); RNE, saturating."""
    # normal range (>= 2^-6): round the fp32 mantissa to 3 bits, RNE; carries move the exponent
    u = v.to(tl.int32, bitcast=True)
    lsb = (u >> 20) & 1
    r = (u + 0x7FFFF + lsb) & -1048576  # ~0xFFFFF
    rn = r.to(tl.float32, bitcast=True)
    e = (r >> 23) - 120  # (exp - 127) + 7
    byte_n = (e << 3) | ((r >> 20) & 7)
    # subnormal range (< 2^-6): multiples of 2^-9, RNE via the 2^14 magic constant
    rs = (v + 16384.0) - 16384.0
    byte_s = (rs * 512.0).to(tl.int32)
    small = v < 0.015625
    val = tl.where(small, rs, rn)
    byte = tl.where(small, byte_s, byte_n)
    return byte, val


@kjit
def e4m3_decode(b):
    """E4M3 bytes (int32 0..255) -> fp32; 0x7F/0xFF -> NaN."""
    ex = (b >> 3) & 15
    mant = b & 7
    sign = (b & 128) << 24
    normal = ((ex + 120) << 23) | (mant << 20)
    sub = mant.to(tl.float32) * 0.001953125
    mag = tl.where(ex == 0, sub, normal.to(tl.float32, bitcast=True))
    val = tl.where(sign != 0, -mag, mag)
    return tl.where((b & 127) == 127, float("nan"), val)


@kjit
def e2m1_encode(y):
    """fp32 y in [-6, 6] -> int32 E2M1 codes (RNE thresholds; sign bit 8 when y < 0)."""
    a = tl.abs(y)
    idx = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return idx | tl.where(y < 0, 8, 0)


@kjit
def e2m1_decode(c):
    """int32 E2M1 codes -> fp32 values (code 8 -> -0.0).

    The nibble s|e1 e0|m is placed in the fp32 bit fields (sign bit 31, exponent bits 24-23,
    mantissa bit 22): that float is E2M1 * 2^-126 exactly (e = 0 lands on the fp32 subnormal
    2^-127 * m), so one exact multiply by 2^126 gives the value (``mul.f32``: no flush to zero)."""
    bits = ((c & 7) << 22) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@kjit
def unpack_decode_tile(p):
    """[R, C] packed bytes -> [R, 2C] fp32 E2M1 values (low nibble first), as e2m1_decode."""
    p32 = p.to(tl.int32)
    lo = (((p32 & 7) << 22) | ((p32 & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    hi = (((p32 & 112) << 18) | ((p32 & 128) << 24)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    return tl.reshape(tl.join(lo, hi), (p.shape[0], p.shape[1] * 2))


@kjit
def load_as_f32(ptrs, mask, XBITS: tl.constexpr):
    """Load and widen to fp32. XBITS: the pointer holds bf16 *bit patterns* (int16), widened by a
    16-bit shift: exact for every value, subnormals included (the interpreter's bf16 -> fp32 cast
    flushes bf16 subnormals; the GPU's does not)."""
    if XBITS:
        return (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@kjit
def bf16_bits_rne(x):
    """fp32 -> bf16 bit pattern (int32 holding 16 bits), round to nearest even; NaN stays NaN."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.to(tl.int32)


@kjit
def bf16_round(x):
    """fp32 -> fp32 holding the nearest-even bf16 value."""
    return (bf16_bits_rne(x) << 16).to(tl.float32, bitcast=True)


@kjit
def unpack_tile(p):
    """[R, C] packed bytes (any int) -> [R, 2C] int32 codes (low nibble first)."""
    p32 = p.to(tl.int32)
    return tl.reshape(tl.join(p32 & 15, (p32 >> 4) & 15), (p.shape[0], p.shape[1] * 2))


# Reductions through ``tl.reduce`` with the standard combine functions: ``tl.max``/``tl.sum``
# are themselves ``@triton.jit`` functions, which the interpreter cannot call unless
# TRITON_INTERPRET was set when Triton was imported; ``tl.reduce`` is a builtin it patches.
@kjit
def rmax(x, axis: tl.constexpr):
    """max over ``axis`` (inputs here are never NaN)."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@kjit
def rsum(x, axis: tl.constexpr):
    """sum over ``axis`` (order is the backend's: used only where bits are not checked)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


def launch(kernel, grid, *args, **kwargs) -> None:  # noqa: ANN001
    """Launch a kernel; in interpreter mode silence numpy's divide-by-zero warnings (the spec's
    1/0 -> inf -> FLT_MAX cap is intended) and drop GPU-only launch options."""
    if INTERPRET:
        import numpy as np

        for key in ("num_warps", "num_stages"):
            kwargs.pop(key, None)
        with np.errstate(all="ignore"):
            kernel[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
