"""The compare stages record each engine in the manifest after its release, so what the release says (the
vLLM sampler's note of GPU memory it left allocated) reaches the run; a runner that never loaded is not
recorded. A runner of this test's own (no engine): what is checked is the stage's bookkeeping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.progress import Progress

from mismatch_probe.probes.base import Runner
from mismatch_probe.run.rundir import RunWriter
from mismatch_probe.steps.compare_stages import _loaded


class _Noted(Runner):
    name = "noted"

    def __init__(self, fail_load: bool = False) -> None:
        super().__init__(16)
        self.fail_load = fail_load

    def _load_impl(self) -> None:
        if self.fail_load:
            raise RuntimeError("no room")
        self.info.settings["loaded"] = True

    def _unload_impl(self) -> None:
        self.info.notes.append("the release left 2.00 GiB allocated")

    def _score_impl(self, seqs: list[list[int]], seq_ids: list[int]) -> list[np.ndarray]:
        return [np.zeros(len(s) - 1) for s in seqs]


def test_the_release_note_reaches_the_manifest_on_disk(tmp_path: Path) -> None:
    with RunWriter(tmp_path / "run") as run, Progress(disable=True) as progress:
        with _loaded(_Noted(), "sampler", run, progress, "loading"):
            assert "sampler" not in run.manifest["engines"]  # recorded once, after the release
        on_disk = json.loads((run.dir / "manifest.json").read_text())
    assert on_disk["engines"]["sampler"] == {"engine": "noted", "loaded": True}
    assert on_disk["notes"] == ["the release left 2.00 GiB allocated"]


def test_a_runner_that_never_loaded_is_not_recorded(tmp_path: Path) -> None:
    with RunWriter(tmp_path / "run") as run, Progress(disable=True) as progress:
        with pytest.raises(RuntimeError, match="no room"), _loaded(_Noted(fail_load=True), "learner", run, progress,
                                                                   "loading"):
            pass
        assert run.manifest["engines"] == {} and run.manifest["notes"] == []
