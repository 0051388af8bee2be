"""User-facing errors: the CLI prints them as one line and exits with their code."""

from __future__ import annotations


class ProbeError(Exception):
    """An error caused by the user's input or environment (exit code 2, no traceback)."""

    exit_code = 2


class UsageError(ProbeError):
    """Bad flags, files or values given by the user."""


class EngineUnavailable(ProbeError):
    """An engine (vLLM, CUDA, ...) cannot be used here; the message says why."""


class SchemaError(ProbeError):
    """A run directory or Parquet file that is missing, corrupt or of an unknown schema."""
