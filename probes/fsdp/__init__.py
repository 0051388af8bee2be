"""The FSDP learner: the launcher-side runner and the per-rank worker."""
