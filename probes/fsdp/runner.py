"""FSDP learner adapter: the HF model sharded with FSDP2 over N ranks (gloo on CPU, NCCL on CUDA).

Each ``score`` call writes the sequences to a temp job folder, launches N ranks through torch's
elastic launcher (:mod:`mismatch_probe.probes.fsdp.worker`), waits with a bounded timeout, then
reads the per-rank dataset (``rank=R/part.parquet``, pyarrow.dataset, hive partitioning) and
merges it, checking that every (seq_id, pos) appears exactly once.

Failure handling: a rank that dies, raises or hangs ends the whole run within ``timeout_s`` with
:class:`FsdpRankError` naming the rank (exit code 3 in the CLI). The per-rank dataset stays in the
temp folder until every rank has finished and the merge checked out; only then is it moved to
``dataset_dest`` (inside the staged run directory), so a failed run holds no partial dataset.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import ProbeError, UsageError
from mismatch_probe.probes.fsdp.worker import SPLIT
from mismatch_probe.probes.hf.runner import HfModelRunner

DTYPES = ("bfloat16", "float16", "float32")


class FsdpRankError(ProbeError):
    """A rank of the FSDP learner died, raised or hung; the run was stopped. CLI exit code 3
    (2 is a usage error; 3 says the input was fine but the distributed learner failed)."""

    exit_code = 3


class FsdpLearner(HfModelRunner):
    """HF model under FSDP2 (``fully_shard`` per decoder layer, then the root), data parallel over
    ``nproc`` ranks, micro-batched with right padding exactly as :class:`HfLearner`."""

    name = "fsdp"

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        *,
        nproc: int = 2,
        timeout_s: float = 300.0,
        mp_param_dtype: str | None = None,
        mp_reduce_dtype: str = "float32",
        seq_meta: list[tuple[int, int, int]] | tuple[tuple[int, int, int], ...] | None = None,
        dataset_dest: Path | None = None,
        ops_dataset_dest: Path | None = None,
        **common: Any,
    ) -> None:
        """``common``: the keyword arguments of :class:`HfModelRunner` (``recipe``: applied on every rank).

        ``seq_meta``: (seq_id, prompt_id, n_prompt_tokens) per sequence of each score() call; default:
        seq_id from score()'s seq_ids (else the index), prompt_id = seq_id, every scored token
        counted as a response token. Its seq_ids win over score()'s. ``dataset_dest`` /
        ``ops_dataset_dest``: where the per-rank datasets go after a successful score() (tokens; ops
        where ``capture`` is set); None: they are discarded with the temp folder."""
        super().__init__(model_dir, vocab_size, **common)
        self.nproc = nproc
        self.timeout_s = timeout_s
        self.mp_param_dtype = mp_param_dtype or self.dtype
        self.mp_reduce_dtype = mp_reduce_dtype
        self.seq_meta: list[tuple[int, int, int]] | None = (
            None if seq_meta is None else [(int(a), int(b), int(c)) for a, b, c in seq_meta]
        )
        self.dataset_dest: Path | None = None if dataset_dest is None else Path(dataset_dest)
        self.ops_dataset_dest: Path | None = None if ops_dataset_dest is None else Path(ops_dataset_dest)
        self.last_wall_s: float | None = None  # launch to all ranks done, of the last score()
        self.last_log = ""  # tail of the launcher's and ranks' output of the last score()
        self.rank_timings: dict[int, dict[str, Any]] = {}  # per rank: setup_s (init+load+shard), forward_s

    # -- Runner ---------------------------------------------------------------------------
    def _load_impl(self) -> None:
        import torch

        if self.nproc < 1:
            raise UsageError(f"--nproc must be >= 1, got {self.nproc}")
        if self.timeout_s <= 0:
            raise UsageError("--fsdp-timeout must be > 0 seconds")
        for flag, v in (("--dtype", self.dtype), ("--fsdp-param-dtype", self.mp_param_dtype),
                        ("--fsdp-reduce-dtype", self.mp_reduce_dtype)):
            if v not in DTYPES:
                raise UsageError(f"{flag} must be one of {', '.join(DTYPES)}, got {v!r}")
        if not (self.model_dir / "config.json").is_file():
            raise UsageError(f"{self.model_dir} is not an HF model folder (no config.json)")
        self._choose_device()
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"FSDP learner device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() < self.nproc:
            raise UsageError(f"--nproc {self.nproc} needs {self.nproc} GPUs; {torch.cuda.device_count()} visible")
        self.threads_per_rank = max(1, (os.cpu_count() or 1) // self.nproc)
        self.info.settings.update(
            {
                "world_size": self.nproc,
                "backend": "nccl" if self.device == "cuda" else "gloo",
                "launcher": "torch.distributed.launcher.api.elastic_launch (c10d rendezvous localhost:0, "
                "standalone, max_restarts 0)",
                "sharding": "FSDP2 fully_shard per decoder layer, then root (reshard_after_forward)",
                "mp_param_dtype": self.mp_param_dtype,
                "mp_reduce_dtype": self.mp_reduce_dtype,
                "data_parallel_split": SPLIT,
                **self._model_settings(),
                "timeout_s": self.timeout_s,
                "threads_per_rank": self.threads_per_rank if self.device == "cpu" else None,
                "torch_version": torch.__version__,
                "dataset": "tokens partitioned by rank (rank=R/part.parquet)",
            }
        )
        self.info.notes.append(
            "FSDP reduce dtype only acts on gradient reduction; the learner's forward does not use it"
        )
        from mismatch_probe.kernels.recipes import parse

        try:
            self.info.settings["recipe"] = parse(self.recipe or "engine").describe()
        except ValueError as e:
            raise UsageError(str(e)) from None

    def _unload_impl(self) -> None:
        pass

    def _score_impl(self, seqs: list[list[int]], seq_ids: list[int] | None = None) -> list[np.ndarray]:
        ids = list(range(len(seqs))) if seq_ids is None else list(seq_ids)
        meta = self.seq_meta or [(sid, sid, 1) for sid in ids]
        if len(meta) != len(seqs):
            raise ValueError(f"seq_meta has {len(meta)} entries for {len(seqs)} sequences")
        if len({m[0] for m in meta}) != len(meta):
            raise ValueError("seq_meta: seq_id values are not unique")
        n_mb = -(-len(seqs) // self.micro_batch_size)
        if n_mb < self.nproc:
            self.info.notes.append(
                f"FSDP: {len(seqs)} sequences make {n_mb} micro-batches of up to {self.micro_batch_size}: "
                f"{self.nproc - n_mb} of {self.nproc} ranks only ran dummy forwards (lower --micro-batch-size "
                "to spread the work; the micro-batches are cut as the HF learner cuts them)"
            )
        job = Path(tempfile.mkdtemp(prefix="mismatch-probe-fsdp-"))
        try:
            self._write_job(job, seqs, meta)
            t0 = time.monotonic()
            self._run_ranks(job)
            self.last_wall_s = time.monotonic() - t0
            out = merge_rank_dataset(job / "dataset", seqs, meta, self.nproc)
            if (job / "recipe.json").is_file():  # rank 0's patch description (patched ops, NVFP4 kernels)
                self.info.settings["recipe"] = json.loads((job / "recipe.json").read_text())
            if self.capture is not None:
                self.ops = merge_rank_ops(job / "ops", self.nproc)
                self.info.settings["unobservable_ops"] = list(_unobservable())
            # all ranks finished and the merge checked out: only now into the (staged) run
            _move(job / "dataset", self.dataset_dest)
            if self.capture is not None:
                _move(job / "ops", self.ops_dataset_dest)
            return out
        finally:
            shutil.rmtree(job, ignore_errors=True)

    # -- the job --------------------------------------------------------------------------
    def _write_job(self, job: Path, seqs: list[list[int]], meta: list[tuple[int, int, int]]) -> None:
        (job / "status").mkdir()
        spec = {
            "model_dir": str(self.model_dir.resolve()),
            "dtype": self.dtype,
            "device_type": self.device,
            "micro_batch_size": self.micro_batch_size,
            "attn_implementation": self.attn_implementation,
            "model_kwargs": self.model_kwargs,
            "mp_param_dtype": self.mp_param_dtype,
            "mp_reduce_dtype": self.mp_reduce_dtype,
            "timeout_s": self.timeout_s,
            "threads_per_rank": self.threads_per_rank,
            "recipe": self.recipe,
            "seq_meta": [list(m) for m in meta],
            "capture": self.capture.to_json() if self.capture is not None else None,
        }
        (job / "job.json").write_text(json.dumps(spec))
        (job / "seqs.json").write_text(json.dumps(seqs))

    def _run_ranks(self, job: Path) -> None:
        cmd = [sys.executable, "-m", "mismatch_probe.probes.fsdp.worker", "--launch", "--job", str(job),
               "--nproc", str(self.nproc)]
        log = open(job / "launcher.log", "wb")  # noqa: SIM115 (closed in finally)
        # cwd: the job folder, so that no folder named mismatch_probe in the caller's cwd shadows the package
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=job)
        deadline = time.monotonic() + self.timeout_s
        reported = 0
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                reported = self._report_progress(job, reported)
                if time.monotonic() > deadline:
                    self._stop(proc, job)
                    raise FsdpRankError(self._timeout_message(job))
        except BaseException:
            self._stop(proc, job)
            raise
        finally:
            log.close()
            self.last_log = _tail(job / "launcher.log", 200, "\n")  # launcher + ranks' output, for debugging
        self._report_progress(job, reported)
        if rc != 0:
            raise FsdpRankError(self._failure_message(job, rc))
        missing = [r for r in range(self.nproc) if not (job / "status" / f"rank{r}.done").exists()]
        if missing:
            raise FsdpRankError(f"FSDP rank(s) {_ranks(missing)} of {self.nproc} exited without finishing")
        st = self._statuses(job)
        self.rank_timings = {r: {k: st[r].get(k) for k in ("setup_s", "forward_s")} for r in st}

    def _statuses(self, job: Path) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for r in range(self.nproc):
            try:
                out[r] = json.loads((job / "status" / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                pass
        return out

    def _report_progress(self, job: Path, reported: int) -> int:
        if self.progress is None:
            return reported
        done = sum(int(s.get("seqs_done", 0)) for s in self._statuses(job).values())
        if done > reported:
            self.progress(done - reported)
        return max(done, reported)

    def _stop(self, proc: subprocess.Popen[bytes], job: Path) -> None:
        """Stop the launcher (its agent stops the ranks), then any rank still alive, by pid."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for st in self._statuses(job).values():
            pid = int(st.get("pid", 0))
            if pid > 0 and _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _timeout_message(self, job: Path) -> str:
        st = self._statuses(job)
        unfinished = [r for r in range(self.nproc) if not (job / "status" / f"rank{r}.done").exists()]
        # a rank inside a forward (waiting in a collective) is further than one that never entered it
        progress = {
            r: (int(st[r].get("steps_done", 0)) + int(st[r].get("steps_started", 0)) if r in st else -1)
            for r in unfinished
        }
        least = min(progress.values(), default=-1)
        stuck = [r for r, p in progress.items() if p == least]
        where = ", ".join(
            f"rank {r}: {st[r].get('phase')}, {st[r].get('steps_done', 0)}/{st[r].get('n_steps', '?')} micro-batches done"
            if r in st else f"rank {r}: not started"
            for r in unfinished
        )
        return (
            f"FSDP rank{'s' if len(stuck) > 1 else ''} {_ranks(stuck)} of {self.nproc} hung: the learner did not finish within "
            f"--fsdp-timeout {self.timeout_s:g} s and was stopped ({where})"
        )

    def _failure_message(self, job: Path, rc: int) -> str:
        try:
            failures: list[dict[str, Any]] = json.loads((job / "failures.json").read_text())
        except (OSError, ValueError):
            tail = _tail(job / "launcher.log")
            return f"FSDP launcher failed (exit {rc}) before any rank reported: {tail}"
        # Root cause first: ranks that failed on their own, not those stopped by the agent (SIGTERM).
        own = [f for f in failures if f.get("signal") != "SIGTERM"] or failures
        own.sort(key=lambda f: f.get("timestamp") or 0)
        st = self._statuses(job)
        parts = []
        for f in own:
            r = int(f["rank"])
            how = f"killed by {f['signal']}" if f.get("signal") else f"exited with code {f['exitcode']}"
            if f.get("error"):
                how += f": {f['error']}"
            done = f"after {st[r].get('steps_done', 0)} micro-batches" if r in st else "before it started"
            parts.append(f"rank {r} {how} ({done})")
        return f"FSDP learner failed: {'; '.join(parts)}; all {self.nproc} ranks were stopped"


def merge_rank_dataset(
    root: Path, seqs: list[list[int]], meta: list[tuple[int, int, int]], world: int
) -> list[np.ndarray]:
    """Read ``root/rank=R/part.parquet`` (R < world) and return the logprobs per sequence;
    every (seq_id, pos) must appear exactly once, and every scored position must be there."""
    import pyarrow.dataset as ds

    from mismatch_probe.run.schema import read_table

    for r in range(world):
        read_table(root / f"rank={r}" / "part.parquet", "tokens")  # schema version check
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    df = table.select(["seq_id", "pos", "logprob", "rank"]).to_pandas()
    dup = df.duplicated(["seq_id", "pos"], keep=False)
    if dup.any():
        sid, pos = int(df[dup]["seq_id"].iloc[0]), int(df[dup]["pos"].iloc[0])
        ranks = sorted(int(r) for r in df[dup & (df.seq_id == sid) & (df.pos == pos)]["rank"])
        raise FsdpRankError(f"FSDP merge: (seq_id {sid}, pos {pos}) was scored by more than one rank ({ranks})")
    index = {m[0]: i for i, m in enumerate(meta)}
    out = [np.full(len(s) - 1, np.nan) for s in seqs]
    counts = np.zeros(len(seqs), np.int64)
    for sid, g in df.groupby("seq_id"):
        if int(sid) not in index:
            raise FsdpRankError(f"FSDP merge: unknown seq_id {sid} in the rank dataset")
        i = index[int(sid)]
        pos = g["pos"].to_numpy()
        if pos.min() < 1 or pos.max() > len(seqs[i]) - 1:
            raise FsdpRankError(f"FSDP merge: seq_id {sid} has positions outside 1..{len(seqs[i]) - 1}")
        out[i][pos - 1] = g["logprob"].to_numpy()
        counts[i] = len(pos)
    short = [meta[i][0] for i, s in enumerate(seqs) if counts[i] != len(s) - 1]
    if short:
        raise FsdpRankError(f"FSDP merge: {len(short)} sequences incomplete (first seq_id {short[0]})")
    return out


def merge_rank_ops(root: Path, world: int) -> Any:
    """Read the per-rank ops dataset (``root/rank=R/part.parquet``) into one ``ops`` table;
    every captured (op, seq_id, pos) must appear exactly once."""
    import pyarrow as pa

    from mismatch_probe.run.schema import conform, read_table

    parts = []
    for r in range(world):  # read_table: schema version check, and the packed layout of a streamed capture unpacked
        t = read_table(root / f"rank={r}" / "part.parquet", "ops")
        if "rank" in t.column_names:
            t = t.drop_columns(["rank"])
        parts.append(t.append_column("rank", pa.array(np.full(len(t), r, dtype=np.int32))))
    table = pa.concat_tables(parts, promote_options="default")
    keys = table.select(["op", "seq_id", "pos", "rank"]).to_pandas()
    dup = keys.duplicated(["op", "seq_id", "pos"], keep=False)
    if dup.any():
        row = keys[dup].iloc[0]
        ranks = sorted(int(r) for r in keys[dup & (keys.op == row.op) & (keys.seq_id == row.seq_id)
                                           & (keys.pos == row.pos)]["rank"])
        raise FsdpRankError(
            f"FSDP merge: op {row.op} (seq_id {int(row.seq_id)}, pos {int(row.pos)}) captured by more "
            f"than one rank ({ranks})"
        )
    return conform(table, "ops")


def _unobservable() -> tuple[str, ...]:
    from mismatch_probe.probes.hf.capture import HfCapture

    return tuple(HfCapture.unobservable)


def _move(src: Path, dest: Path | None) -> None:
    if dest is None:
        return
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), dest)


def _ranks(rs: list[int]) -> str:
    return ", ".join(str(r) for r in rs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _tail(path: Path, n: int = 3, sep: str = " | ") -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return sep.join(lines[-n:]) or "(empty log)"
