"""Orchestration: the compare and bisect steps and their stages (call engines, write the run directory)."""
