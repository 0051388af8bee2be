"""Issue 30, section 2: one line and exit 2, never a traceback (real CLI, subprocesses): text that
is not UTF-8, values the engines would refuse after loading, damaged model and run folders, output
paths that cannot be written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures.synthetic import make_run
from reliability_lib import mp, one_line_error, snapshot

from mismatch_probe.probes.models import resolve_model


@pytest.fixture
def srun(tmp_path: Path) -> Path:
    """A synthetic complete run with op capture and sequences (no engine needed)."""
    run = make_run(tmp_path / "run", ops=True)
    pq.write_table(pa.table({"seq_id": pa.array([0], pa.int32())}), run / "sequences.parquet")
    return run


# ----------------------------------------------------------------------- text


@pytest.mark.parametrize(("content", "needle"), [(b'{"prompt": "caf\xe9"}\n', "not UTF-8"),
                                                 (b'{"prompt": "a\\ud800b"}\n', "surrogate")])
def test_prompts_that_are_not_text(tmp_path: Path, content: bytes, needle: str) -> None:
    p = tmp_path / "p.jsonl"
    p.write_bytes(content)
    one_line_error(mp("compare", "--prompts", p, "--out", tmp_path / "r"), "p.jsonl:1", needle)
    assert not (tmp_path / "r").exists()


def test_rollouts_that_are_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_bytes(b'{"prompt_token_ids": [1], "response_token_ids": [2], "rollout_logprobs": [-1.0], "x": "\xff"}\n')
    one_line_error(mp("compare", "--rollouts", p, "--out", tmp_path / "r"), "r.jsonl line 1", "not UTF-8")


# ----------------------------------------------------------------------- values the engines refuse


@pytest.mark.parametrize(("args", "needle"), [
    (("--temperature", "nan"), "--temperature"), (("--seed", "-1"), "--seed"),
    (("--topk", "100000"), "vocabulary"), (("--sampler-arg", "gpu_memory_utilization=1.5"), "vLLM refuses"),
    (("--learner-arg", "vocab_size=100"), "vocab_size"),
])
def test_values_the_engines_refuse_are_caught_before_they_start(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    one_line_error(mp("compare", *args, "--out", tmp_path / "r"), needle)
    assert not list(tmp_path.iterdir())


def test_a_sampler_that_cannot_start_for_memory_is_one_line(tmp_path: Path) -> None:
    # real vLLM (CPU): it reserves this share of RAM at startup and refuses when less is free; the run
    # stops with its reason and ours, no traceback, and no run folder that reads as complete
    line = one_line_error(mp("compare", "--sampler-arg", "gpu_memory_utilization=0.99", "--out", tmp_path / "r"),
                          "vLLM did not start", "memory", "gpu_memory_utilization=0.99", engines=True)
    assert "To resolve" not in line  # vLLM's advice for its own command line is left out
    assert not (tmp_path / "r").exists()


def test_start_errors_name_the_machines_limit_and_nothing_else() -> None:
    from mismatch_probe.probes.engine_args import start_error

    kv = ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                    "initializing the engine.")
    got = start_error(kv, True, {"gpu_memory_utilization": 0.5})
    assert got is not None and "No available memory for the cache blocks." in got and "Try increasing" not in got
    assert "gpu_memory_utilization=0.5" in got and "NVFP4" in got  # the recipe's own memory named
    assert "NVFP4" not in start_error(kv, False, {})  # type: ignore[operator]
    core = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    assert "printed above" in start_error(core, False, {})  # type: ignore[operator]
    oom = type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "ran out of device memory" in start_error(oom, False, {})  # type: ignore[operator]
    for other in (RuntimeError("shape mismatch in the plugin"), KeyError("layers.0"), ValueError("bad head count")):
        assert start_error(other, False, {}) is None  # a bug keeps its traceback


@pytest.mark.parametrize(("sampler", "learner", "topk", "needle"), [
    ({"max_model_len": 16}, {}, 0, "max_model_len"), ({"max_model_len": 10**6}, {}, 0, "context"),
    ({"max_logprobs": 5}, {}, 20, "max_logprobs"), ({"gpu_memory_utilization": 0.0}, {}, 0, "vLLM refuses"),
    ({}, {"attn_implementation": "flash_attention_2"}, 0, "flash_attention_2"),
    ({}, {"num_attention_heads": 3}, 0, "num_attention_heads"), ({}, {"rms_norm_eps": "x"}, 0, "transformers refuses"),
])
def test_engine_values_name_themselves(sampler: dict, learner: dict, topk: int, needle: str) -> None:
    """The same checks in-process, for the values the CLI cases above do not start a process for."""
    import torch

    from mismatch_probe.errors import UsageError
    from mismatch_probe.steps.validate import engine_values

    if learner.get("attn_implementation") and torch.cuda.is_available():
        pytest.skip("flash attention may be usable on this CUDA host")
    with pytest.raises(UsageError, match=needle):
        engine_values(resolve_model("tiny-qwen3"), [40, 30], topk, sampler, learner)
    engine_values(resolve_model("tiny-qwen3"), [40, 30], 20, {"max_model_len": 64, "max_logprobs": 20}, {})  # fine


# ----------------------------------------------------------------------- model folders


@pytest.mark.parametrize("damage", ["config_list", "truncated_weights"])
def test_damaged_model_folder(tmp_path: Path, damage: str) -> None:
    m = Path(shutil.copytree(resolve_model("tiny-qwen3").path, tmp_path / "m"))
    if damage == "config_list":
        (m / "config.json").write_text("[]")
        needle = "config.json"
    else:
        w = next(m.glob("*.safetensors"))
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
        needle = "safetensors"
    one_line_error(mp("compare", "--model", m, "--out", tmp_path / "r"), needle)


# ----------------------------------------------------------------------- --out and output files


def test_out_paths_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    one_line_error(mp("compare", "--out", tmp_path / "file" / "run"), "not a folder")
    one_line_error(mp("compare", "--out", "/proc/mp-run"), "/proc")
    long = tmp_path / ("r" * 250)
    p = mp("compare", "--out", long, "--n", "0")  # the 250-byte name itself is fine; --n 0 stops it early
    one_line_error(p, "--n")
    one_line_error(mp("compare", "--out", tmp_path / ("r" * 256)), "255")


@pytest.mark.parametrize("target", ["parent_file", "dev_full"])
def test_output_files_that_cannot_be_written(srun: Path, tmp_path: Path, target: str) -> None:
    (tmp_path / "file").write_text("x")
    path = {"parent_file": tmp_path / "file" / "out", "dev_full": Path("/dev/full")}[target]
    before = snapshot(srun)
    for args in (("report", srun, "--out", path), ("gate", srun, "--max-k3", "1", "--junit", path),
                 ("gate", srun, "--max-k3", "1", "--markdown", path)):
        one_line_error(mp(*args))
    one_line_error(mp("diff", f"{srun}:learner", f"{srun}:sampler", "--out", path))
    one_line_error(mp("report", srun, "--out", "/proc/mp-report.html"), "/proc")  # a filesystem that refuses it
    assert snapshot(srun) == before


# ----------------------------------------------------------------------- damaged run folders


DAMAGES = ("list", "version_abc", "no_config", "status_list")
CASES = [("gate", d) for d in DAMAGES] + [(c, d) for c in ("report", "bisect", "capture") for d in ("list", "no_config")] + [
    ("diff", "list"), ("bisect", "version_abc")]


@pytest.mark.parametrize(("command", "damage"), CASES)
def test_damaged_manifest(srun: Path, tmp_path: Path, damage: str, command: str) -> None:
    if command == "diff":  # diff reads the capture's manifest where both sides captured ops
        srun = make_run(tmp_path / "full", n_seq=2, seq_len=12, full_ops=True)
    path = srun / "manifest.json"
    m = json.loads(path.read_text())
    if damage == "list":
        path.write_text("[]")
    else:
        if damage == "version_abc":
            m["schema_version"] = "abc"
        elif damage == "no_config":
            del m["config"]
        else:
            m["status"] = ["complete"]
        path.write_text(json.dumps(m))
    args = {"bisect": ("bisect", srun, "--no-replay", "--no-ablation"), "gate": ("gate", srun, "--max-k3", "1"),
            "report": ("report", srun, "--out", tmp_path / "r.html"),
            "capture": ("capture", "--engine", "hf", "--from", srun, "--out", tmp_path / "cap"),
            "diff": ("diff", f"{srun}:learner", f"{srun}:sampler")}[command]
    one_line_error(mp(*args), "manifest.json")


def test_report_on_a_corrupt_summary_pair(srun: Path, tmp_path: Path) -> None:
    s = json.loads((srun / "compare" / "summary.json").read_text())
    s["pairs"]["learner_vs_prefill"] = [1, 2]
    (srun / "compare" / "summary.json").write_text(json.dumps(s))
    one_line_error(mp("report", srun, "--out", tmp_path / "r.html"), "corrupt run", "learner_vs_prefill")


@pytest.mark.parametrize(("rel", "column"), [("compare/token_gaps.parquet", "lp_learner"), ("learner/tokens.parquet", "logprob")])
def test_a_column_of_the_wrong_type(srun: Path, tmp_path: Path, rel: str, column: str) -> None:
    t = pq.read_table(srun / rel)
    i = t.column_names.index(column)
    t = t.set_column(i, column, pa.array(["x"] * t.num_rows))
    pq.write_table(t, srun / rel)
    args = ("report", srun, "--out", tmp_path / "r.html") if "gaps" in rel else (
        "diff", f"{srun}:learner", f"{srun}:sampler")
    one_line_error(mp(*args), "corrupt run", column)


def test_report_and_bisect_on_a_read_only_run(srun: Path, tmp_path: Path) -> None:
    """A run on a read-only filesystem (a read-only tmpfs): report and bisect cannot write into it."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        shutil.copytree(srun, ro / "run")
        assert subprocess.run(["mount", "-o", "remount,ro", str(ro)], capture_output=True).returncode == 0
        one_line_error(mp("report", ro / "run"), "report.html", "Read-only file system")
        one_line_error(mp("bisect", ro / "run", "--no-replay", "--no-ablation"), "not writable")
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


# ----------------------------------------------------------------------- capture's values


@pytest.mark.parametrize(("args", "needle"), [(("--micro-batch-size", "0"), "--micro-batch-size"),
                                              (("--recipe", "strictt"), "strictt"), (("--dtype", "half-ish"), "--dtype"),
                                              (("--dtype", "float64"), "--dtype")])
def test_capture_validates_its_values(srun: Path, tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    one_line_error(mp("capture", "--engine", "hf", "--from", srun, "--out", tmp_path / "cap", *args), needle)
    assert not (tmp_path / "cap").exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_cache_that_cannot_be_used(tmp_path: Path, where: str) -> None:
    cache = {"file": tmp_path / "cache", "proc": Path("/proc/mp-cache")}[where]
    if where == "file":
        cache.write_text("x")
    one_line_error(mp("compare", "--out", tmp_path / "r", env={"MISMATCH_PROBE_CACHE": str(cache)}), "MISMATCH_PROBE_CACHE")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_full_disk_is_one_line(tmp_path: Path, writer: str) -> None:
    """ENOSPC while the run is written (from the op writer process, or its thread): one line, exit 2."""
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        p = mp("compare", "--out", small / "run", "--capture", "full", "--n", "1", "--max-tokens", "4",
               env={"MISMATCH_PROBE_CAPTURE_WRITER": writer})
        one_line_error(p, "No space left on device", engines=True)
        assert not (small / "run").exists()
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
