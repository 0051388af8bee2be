"""Host-side launch arithmetic as plain integers: the same values as ``triton.cdiv`` and
``triton.next_power_of_2``, which are ``constexpr_function`` objects in Triton >= 3.5 (a wrapper that
unwraps every argument: ~1-3 us a call on the host; a forward of a patched model makes hundreds)."""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ``y > 0``: ``triton.cdiv``'s ``(x + y - 1) // y``."""
    return (x + y - 1) // y


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2``: 0 for ``n <= 0``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
