"""Strict (batch-invariant) ops and their Triton kernels."""
