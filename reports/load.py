"""Load what a report needs from a run directory; record which optional parts are absent and why.

Required: ``manifest.json`` and ``compare/token_gaps.parquet`` (a missing ``summary.json`` is
recomputed from the gaps). Optional: ``compare/op_errors.parquet``, ``bisect.json``, per-side
``ops.parquet`` (only its metadata is read: full captures can be hundreds of MB), a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from mismatch_probe.analysis.gate import PAIRS
from mismatch_probe.analysis.token_gaps import pair_metrics
from mismatch_probe.errors import SchemaError
from mismatch_probe.run import reader as layout
from mismatch_probe.run.reader import RunDir
from mismatch_probe.run.schema import SCHEMA_VERSION, SCHEMAS, read_schema_version, read_table

OP_ERROR_COLUMNS = (
    "op", "layer", "exec_order", "dtype", "n_rows", "bitwise_equal_frac", "max_abs_diff",
    "mean_abs_diff", "rel_l2", "cosine", "sqnr_db", "max_ulp",
)  # fmt: skip
PAIR_COLUMNS = {
    "learner_vs_decode": ("lp_learner", "lp_decode", "d_learner_decode"),
    "learner_vs_prefill": ("lp_learner", "lp_prefill", "d_learner_prefill"),
    "prefill_vs_decode": ("lp_prefill", "lp_decode", "d_prefill_decode"),
}


@dataclass
class RunData:
    root: Path
    manifest: dict[str, Any]
    summary: dict[str, Any]
    gaps: pd.DataFrame
    op_errors: pd.DataFrame | None = None
    bisect: dict[str, Any] | None = None
    weight_parity: dict[str, Any] | None = None  # compare/weight_parity.json: are both sides' weights equal
    ops_capture: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> rows, columns
    decode: Callable[[list[int]], str] | None = None
    convention: str | None = None  # report --convention: the RL framework whose view to show
    absent: dict[str, str] = field(default_factory=dict)  # section title -> reason
    notes: list[str] = field(default_factory=list)

    @property
    def response(self) -> pd.DataFrame:
        return self.gaps[self.gaps["is_response"]]


def _read_versioned_parquet(path: Path, kind: str, required: tuple[str, ...]) -> pd.DataFrame:
    """Read a Parquet file of a kind schema.py may not define yet (op_errors): version and columns checked."""
    if kind in SCHEMAS:
        return read_table(path, kind).to_pandas()
    ver = read_schema_version(path)
    if ver > SCHEMA_VERSION:
        raise SchemaError(
            f"{path} has schema version {ver}, newer than this mismatch-probe reads ({SCHEMA_VERSION}); upgrade mismatch-probe"
        )
    try:
        df = pq.read_table(path).to_pandas()
    except Exception as e:
        raise SchemaError(f"corrupt Parquet file {path}: {e}") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise SchemaError(f"{path} lacks required columns: {', '.join(missing)}")
    return df


def _summary_from_gaps(gaps: pd.DataFrame) -> dict[str, Any]:
    resp = gaps[gaps["is_response"]]
    pairs = {}
    for pair, (a, b, _) in PAIR_COLUMNS.items():
        pairs[pair] = pair_metrics(resp[a].to_numpy(float), resp[b].to_numpy(float), resp["seq_id"].to_numpy())
    return {
        "schema_version": SCHEMA_VERSION,
        "n_sequences": int(gaps["seq_id"].nunique()),
        "n_response_tokens": int(len(resp)),
        "pairs": pairs,
    }


def _tokenizer(manifest: dict[str, Any]) -> tuple[Callable[[list[int]], str] | None, str]:
    cfg = manifest.get("config") or {}
    model_dir = cfg.get("model_dir")
    if not model_dir:
        return None, "the manifest names no model_dir"
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None, f"{path} not found (model folder moved or deleted?)"
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # missing package or unreadable file: degrade to ids
        return None, f"cannot load {path}: {type(e).__name__}: {e}"

    def decode(ids: list[int]) -> str:
        try:
            return tok.decode([int(i) for i in ids], skip_special_tokens=False)
        except Exception:
            return " ".join(f"<{i}>" for i in ids)

    return decode, ""


def _ops_capture(path: Path) -> dict[str, Any]:
    ver = read_schema_version(path)
    if ver > SCHEMA_VERSION:
        raise SchemaError(f"{path} has schema version {ver}, newer than this mismatch-probe reads; upgrade")
    try:
        md = pq.read_metadata(path)
    except Exception as e:
        raise SchemaError(f"corrupt Parquet file {path}: {e}") from None
    return {"rows": md.num_rows, "bytes": path.stat().st_size, "columns": md.schema.names}


def _capture_info(root: Path, side: str, out: dict[str, dict[str, Any]]) -> None:
    p = root / layout.ops_file(side)
    if p.exists():
        out[side] = _ops_capture(p)
    by_rank = root / layout.ops_by_rank(side)
    ranks = sorted(by_rank.rglob("*.parquet")) if by_rank.is_dir() else []
    if ranks:  # multi-rank capture (FSDP): a dataset partitioned by rank
        parts = [_ops_capture(f) for f in ranks]
        out[f"{side} (by rank, {len(ranks)} files)"] = {
            "rows": sum(x["rows"] for x in parts),
            "bytes": sum(x["bytes"] for x in parts),
            "columns": parts[0]["columns"],
        }


def load_run(run: Path) -> RunData:
    """Read a run directory for the report; SchemaError (exit 2) for missing/corrupt required inputs."""
    root = Path(run)
    rd = RunDir(root)
    manifest = rd.manifest
    gaps_path = rd.file(layout.TOKEN_GAPS)
    if not gaps_path.exists():
        status = manifest.get("status", "?")
        raise SchemaError(f"missing file: {gaps_path} (run status {status!r}); run `mismatch-probe compare` to completion")
    gaps = read_table(gaps_path, "token_gaps").to_pandas()
    data = RunData(root=root, manifest=manifest, summary={}, gaps=gaps)
    if manifest.get("status") != "complete":
        data.notes.append(f"run status is {manifest.get('status')!r}, not 'complete': results may be partial")

    if rd.has(layout.SUMMARY):
        data.summary = rd.summary()
    else:
        data.summary = _summary_from_gaps(gaps)
        data.notes.append(f"{layout.SUMMARY} is missing: headline metrics recomputed from {gaps_path.name}")
    for pair in PAIRS:
        data.summary["pairs"].setdefault(pair, {})

    ope = rd.file(layout.OP_ERRORS)
    if ope.exists():
        df = _read_versioned_parquet(ope, "op_errors", OP_ERROR_COLUMNS[:3])
        for c in OP_ERROR_COLUMNS:
            if c not in df.columns:
                df[c] = np.nan
        data.op_errors = df.sort_values("exec_order", kind="stable").reset_index(drop=True)
    else:
        why = (f"{layout.OP_ERRORS} not found: " + ("the run captured ops but the file is missing (damaged run?)"
               if rd.captured_ops() else "the run has no op capture (compare without op capture)"))
        data.absent["Where drift starts"] = why
        data.absent["Op table"] = why

    data.weight_parity = rd.weight_parity()
    data.bisect = rd.bisect()
    if data.bisect is None:
        data.absent["Bisect ranking"] = f"{layout.BISECT} not found: run `mismatch-probe bisect RUN` to rank ops"

    for side in ("learner", "sampler"):
        try:
            _capture_info(root, side, data.ops_capture)
        except SchemaError as e:  # informational only: the report never reads the captured values
            data.notes.append(f"{side} op capture not summarized: {e}")

    data.decode, why = _tokenizer(manifest)
    if data.decode is None:
        data.notes.append(f"token text unavailable ({why}): worst tokens are shown as token ids")
    return data
