"""Reading a run folder: :class:`RunDir`, the one reader used by steps, gate and report.

Every file name of the run folder is spelled here (and only here, with :mod:`.rundir` writing
them). Every reader validates what it returns: a missing, corrupt or mistyped file is a
:class:`SchemaError` (one line, exit 2) worded ``corrupt run: FILE: what``.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.errors import SchemaError
from mismatch_probe.run.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

# the run folder's layout (relative paths)
MANIFEST = "manifest.json"
SEQUENCES = "sequences.parquet"
SUMMARY = "compare/summary.json"
TOKEN_GAPS = "compare/token_gaps.parquet"
OP_ERRORS = "compare/op_errors.parquet"
WEIGHT_PARITY = "compare/weight_parity.json"
TRAINER_TOKENS = "compare/trainer_tokens.parquet"
BISECT = "bisect.json"
REPORT = "report.html"
SUMMARY_NAME = "summary.json"  # diff --out's files
OP_ERRORS_NAME = "op_errors.parquet"
DIFF_FILES = (SUMMARY_NAME, OP_ERRORS_NAME)
SIDES = ("learner", "sampler")
CAPTURE_MODES = ("digest", "stats", "full")
# metrics every pair block of summary.json holds (analysis.metrics.GAP_METRICS)
_PAIR_REQUIRED = ("mean_abs_dlogp", "max_abs_dlogp", "p50_abs_dlogp", "p90_abs_dlogp", "p99_abs_dlogp", "k3")
_PAIRS = ("learner_vs_decode", "learner_vs_prefill", "prefill_vs_decode")


def tokens_file(side: str) -> str:
    return f"{side}/tokens.parquet"


def ops_file(side: str) -> str:
    return f"{side}/ops.parquet"


def tokens_by_rank(side: str) -> str:
    return f"{side}/tokens_by_rank"


def ops_by_rank(side: str) -> str:
    return f"{side}/ops_by_rank"


def weights_file(side: str) -> str:
    return f"{side}/weights.json"


def corrupt(path: Path | str, what: str) -> SchemaError:
    return SchemaError(f"corrupt run: {path}: {what}")


def _kind(v: object) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string"}.get(type(v), type(v).__name__)


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A run's JSON file (manifest, summary, bisect): a JSON object whose ``schema_version`` (if
    any) is an integer this version reads; SchemaError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise SchemaError(f"corrupt run: {path}: missing {what}" if path.parent.is_dir() else f"missing {what}: {path}")
    try:
        obj = json.loads(path.read_bytes())
    except OSError as e:
        raise corrupt(path, f"cannot read the {what}: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(path, f"corrupt {what}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise corrupt(path, f"corrupt {what}: expected a JSON object, got {_kind(obj)}")
    ver = obj.get("schema_version", SCHEMA_VERSION)
    if not isinstance(ver, int) or isinstance(ver, bool):
        raise corrupt(path, f"schema_version {ver!r} is not an integer")
    if ver > SCHEMA_VERSION:
        raise SchemaError(
            f"{path} has schema version {ver}, newer than this mismatch-probe reads ({SCHEMA_VERSION}); upgrade mismatch-probe"
        )
    return obj


def _number(v: object) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def validate_summary(obj: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """Check ``compare/summary.json``: a ``pairs`` object whose blocks are objects (or null) holding numbers."""
    pairs = obj.get("pairs")
    if not isinstance(pairs, dict):
        raise corrupt(path, f"'pairs' is {_kind(pairs)}, expected an object")
    for name in _PAIRS:
        if name not in pairs:
            raise corrupt(path, f"'pairs' lacks {name} (compare writes all of {', '.join(_PAIRS)})")
    for name, block in pairs.items():
        if block is None:
            continue
        if not isinstance(block, dict):
            raise corrupt(path, f"pair {name} is {_kind(block)}, expected an object")
        for k in _PAIR_REQUIRED:
            if k not in block:
                raise corrupt(path, f"pair {name} lacks {k}")
            if not _number(block[k]):
                raise corrupt(path, f"{name}.{k} is {_kind(block[k])}, expected a number")
        for k, v in block.items():
            if k == "conventions":
                if not isinstance(v, dict) or not all(isinstance(d, dict) for d in v.values()):
                    raise corrupt(path, f"{name}.conventions is {_kind(v)}, expected an object of objects")
                bad = [f"{fw}.{m}" for fw, d in v.items() for m, x in d.items() if not _number(x)]
            elif k == "full_vocab":
                if not isinstance(v, dict):
                    raise corrupt(path, f"{name}.full_vocab is {_kind(v)}, expected an object")
                bad = [m for m, x in v.items() if not _number(x)]
            else:
                bad = [] if _number(v) else [k]
            if bad:
                raise corrupt(path, f"{name}.{bad[0] if k == bad[0] else k + '.' + bad[0]} is not a number")
    return obj


def validate_bisect(obj: dict[str, Any], path: Path | str) -> dict[str, Any]:
    fd = obj.get("first_divergent")
    if not isinstance(fd, dict):
        raise corrupt(path, f"'first_divergent' is {_kind(fd)}, expected an object")
    for kind in ("bitwise", "tolerance"):
        v = fd.get(kind)
        if v is not None and not (isinstance(v, dict) and isinstance(v.get("op"), str)):
            raise corrupt(path, f"first_divergent.{kind} is {_kind(v)}, expected an object with an 'op' or null")
    return obj


class RunDir:
    """A run folder (``compare``) or capture folder (``capture``), read and validated lazily."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise SchemaError(f"run directory not found: {path}")

    def file(self, rel: str) -> Path:
        return self.path / rel

    def has(self, rel: str) -> bool:
        return (self.path / rel).exists()

    # ------------------------------------------------------------------ manifest

    @cached_property
    def manifest(self) -> dict[str, Any]:
        path = self.file(MANIFEST)
        if not path.exists():
            raise SchemaError(f"missing run manifest: {self.path} is not a mismatch-probe run (no {MANIFEST})")
        m = read_json(path, "run manifest")
        if "schema_version" not in m:
            raise corrupt(path, "no schema_version")
        if not isinstance(m.get("status"), str):
            raise corrupt(path, f"'status' is {_kind(m.get('status'))}, expected a string")
        if not isinstance(m.get("config"), dict):
            raise corrupt(path, f"'config' is {_kind(m.get('config'))}, expected an object")
        for key in ("auto", "engines", "capture", "rollouts", "parity"):
            if key in m and m[key] is not None and not isinstance(m[key], dict):
                raise corrupt(path, f"'{key}' is {_kind(m[key])}, expected an object")
        return m

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["config"]

    def require_complete(self, what: str = "") -> RunDir:
        status = self.manifest["status"]
        if status != "complete":
            need = f"; {what}" if what else ""
            raise SchemaError(f"{self.path} is not complete (status: {status!r}){need}")
        return self

    def config_int(self, key: str, default: int) -> int:
        v = self.config.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise corrupt(self.file(MANIFEST), f"config.{key} is {_kind(v)}, expected an integer")
        return v

    def captured_ops(self) -> bool:
        """Whether this run's compare captured ops (so op_errors.parquet must be there)."""
        mode = self.config.get("capture")
        return mode in CAPTURE_MODES or any(self.ops_present(s) for s in SIDES)

    # ------------------------------------------------------------------ JSON files

    def summary(self) -> dict[str, Any]:
        path = self.file(SUMMARY)
        return validate_summary(read_json(path, "comparison summary"), path)

    def bisect(self) -> dict[str, Any] | None:
        path = self.file(BISECT)
        if not path.exists():
            return None
        return validate_bisect(read_json(path, "bisect result"), path)

    def weight_parity(self) -> dict[str, Any] | None:
        path = self.file(WEIGHT_PARITY)
        return read_json(path, "weight parity") if path.exists() else None

    # ------------------------------------------------------------------ tables

    def table(self, rel: str, kind: str) -> pa.Table:
        from mismatch_probe.run.schema import read_table

        path = self.file(rel)
        if not path.exists():
            raise corrupt(path, "missing file")
        return read_table(path, kind)

    def sequences(self) -> pa.Table:
        return self.table(SEQUENCES, "sequences")

    def tokens(self, side: str) -> pa.Table:
        return self.table(tokens_file(side), "tokens")

    def token_gaps(self) -> pa.Table:
        return self.table(TOKEN_GAPS, "token_gaps")

    def ops_present(self, side: str) -> bool:
        return self.has(ops_file(side)) or self.file(ops_by_rank(side)).is_dir()

    def ops(self, side: str) -> pd.DataFrame | None:
        """``side/ops.parquet``, or the rank-partitioned ``side/ops_by_rank`` merged (each
        (op, seq_id, pos) once); None when the side captured no ops."""
        import pandas as pd

        from mismatch_probe.run.schema import read_table

        if self.has(ops_file(side)):
            return self.table(ops_file(side), "ops").to_pandas()
        d = self.file(ops_by_rank(side))
        if not d.is_dir():
            return None
        parts = [read_table(p, "ops").to_pandas() for p in sorted(d.rglob("*.parquet"))]
        df = pd.concat(parts, ignore_index=True) if parts else None
        if df is not None and df.duplicated(["op", "seq_id", "pos"]).any():
            raise corrupt(d, "an (op, seq_id, pos) row appears in more than one rank")
        return df

    def op_errors(self) -> pd.DataFrame | None:
        """``compare/op_errors.parquet``; None when the run captured no ops; a captured run
        without it is corrupt."""
        if not self.has(OP_ERRORS):
            if self.captured_ops():
                raise corrupt(self.file(OP_ERRORS), "missing file (the run captured ops, so compare wrote it)")
            return None
        df = self.table(OP_ERRORS, "op_errors").to_pandas()
        return df

