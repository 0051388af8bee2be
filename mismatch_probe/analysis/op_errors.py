"""Op-level comparison of two captures (sampler vs learner on the same tokens), numpy only.

Per canonical op, over the tokens both sides captured: bitwise-equal fraction (from digests, any
mode), and where both sides kept values (``full`` mode): max/mean abs diff, relative L2
``||s - l|| / ||l||``, cosine, SQNR in dB, and the max ULP distance in the op's dtype.
The learner is the reference (``l``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from mismatch_probe.families.opnames import DEFAULT_RTOL, exec_order, split_op

_INT_VIEW = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}
_SIGN = {np.uint16: 0x8000, np.uint32: 0x80000000, np.uint64: 1 << 63}


def decode_rows(values: pd.Series, dtype: str) -> np.ndarray:
    """Raw ``values`` bytes of equal-shaped rows -> float64 matrix [rows, numel]."""
    buf = b"".join(values.tolist())
    n = len(values)
    if dtype == "bfloat16":
        u = np.frombuffer(buf, np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).astype(np.float64).reshape(n, -1)
    if dtype == "bool":
        return np.frombuffer(buf, np.uint8).astype(np.float64).reshape(n, -1)
    return np.frombuffer(buf, np.dtype(dtype)).astype(np.float64).reshape(n, -1)


def _ordered(raw: np.ndarray, ut: type) -> np.ndarray:
    sign = _SIGN[ut]
    mag = (raw & (sign - 1)).astype(np.int64) if ut is not np.uint64 else (raw & (sign - 1)).astype(np.int64)
    return np.where(raw & sign, -mag, mag)


def ulp_distance(a: pd.Series, b: pd.Series, dtype: str) -> float:
    ut = _INT_VIEW.get(dtype)
    if ut is None:
        return math.nan
    ra = np.frombuffer(b"".join(a.tolist()), ut)
    rb = np.frombuffer(b"".join(b.tolist()), ut)
    d = np.abs(_ordered(ra, ut) - _ordered(rb, ut))
    return float(d.max()) if d.size else 0.0


def error_stats(s: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Error of ``s`` against the reference ``ref`` (same shape, float64)."""
    fin = np.isfinite(s) & np.isfinite(ref)
    s, ref = np.where(fin, s, 0.0), np.where(fin, ref, 0.0)
    diff = s - ref
    nd, nr, ns = float(np.linalg.norm(diff)), float(np.linalg.norm(ref)), float(np.linalg.norm(s))
    return {
        "max_abs_diff": float(np.abs(diff).max()) if diff.size else 0.0,
        "mean_abs_diff": float(np.abs(diff).mean()) if diff.size else 0.0,
        "rel_l2": nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf),
        "cosine": 1.0 if nd == 0 else (float((s * ref).sum() / (ns * nr)) if ns > 0 and nr > 0 else 0.0),
        "sqnr_db": 10 * math.log10(nr**2 / nd**2) if nd > 0 and nr > 0 else math.inf,
    }


def _digest_kind(df: pd.DataFrame) -> str:
    d = df["digest"].dropna()
    return "blake2b" if len(d) and str(d.iloc[0]).startswith("blake2b:") else "mp64"


def op_errors(learner: pd.DataFrame, sampler: pd.DataFrame, num_layers: int) -> pd.DataFrame:
    """One row per op both sides captured, in execution order."""
    key = ["op", "seq_id", "pos"]
    cols = key + ["dtype", "digest", "values"]
    m = learner[cols].merge(sampler[cols], on=key, suffixes=("_l", "_s"), validate="one_to_one")
    # digests of different definitions (a v1 capture's blake2b vs mp64) never compare: fall back to values
    same_digest = _digest_kind(learner) == _digest_kind(sampler)
    rows = []
    for op, g in m.groupby("op", sort=False):
        layer, kind = split_op(op)
        same_dtype = (g.dtype_l == g.dtype_s).all()
        row = {
            "op": op,
            "layer": layer,
            "kind": kind,
            "exec_order": exec_order(op, num_layers),
            "dtype": g.dtype_l.iloc[0] if same_dtype else f"{g.dtype_l.iloc[0]}|{g.dtype_s.iloc[0]}",
            "n_rows": len(g),
            "bitwise_equal_frac": float((g.digest_l == g.digest_s).mean()) if same_dtype else 0.0,
        }
        full = g[g.values_l.notna() & g.values_s.notna()]
        if same_dtype and not same_digest:
            row["bitwise_equal_frac"] = float((full.values_l == full.values_s).mean()) if len(full) else math.nan
        if len(full):
            ref = decode_rows(full.values_l, full.dtype_l.iloc[0])
            got = decode_rows(full.values_s, full.dtype_s.iloc[0])
            row.update(error_stats(got, ref) if ref.shape == got.shape else {"rel_l2": math.nan})
            row["max_ulp"] = ulp_distance(full.values_s, full.values_l, row["dtype"]) if same_dtype else math.nan
        rows.append(row)
    cols_out = ["op", "layer", "kind", "exec_order", "dtype", "n_rows", "bitwise_equal_frac", "max_abs_diff",
                "mean_abs_diff", "rel_l2", "cosine", "sqnr_db", "max_ulp"]
    out = pd.DataFrame(rows, columns=cols_out)
    return out.sort_values("exec_order", kind="stable").reset_index(drop=True)


DOMINANT_EQUAL_FRAC = 0.5  # "dominant divergence": the first op where most rows differ


def first_divergent(errs: pd.DataFrame) -> dict[str, Any]:
    """First op (execution order) not bitwise equal, first over its dtype's tolerance, and the
    dominant divergence: the first op where most rows (bitwise-equal fraction < 0.5) differ (a
    first op with a few 1-ulp rows, e.g. GEMM batch variance, is often not where the engines part),
    from an op-errors table (the one definition: bisect, gate and the report use it)."""
    errs = errs.sort_values("exec_order", kind="stable")

    def pick(mask: pd.Series) -> dict[str, Any] | None:
        hit = errs[mask]
        if hit.empty:
            return None
        r = hit.iloc[0]
        return {
            "op": r.op,
            "layer": int(r.layer),
            "exec_order": int(r.exec_order),
            "bitwise_equal_frac": float(r.bitwise_equal_frac),
            "rel_l2": None if pd.isna(r.rel_l2) else float(r.rel_l2),
            "dtype": r["dtype"],
        }

    tol = errs.dtype.map(lambda d: DEFAULT_RTOL.get(str(d), 1e-2))
    over = errs.rel_l2.notna() & (errs.rel_l2 > tol)
    return {"bitwise": pick(errs.bitwise_equal_frac < 1.0), "tolerance": pick(over),
            "dominant": pick(errs.bitwise_equal_frac < DOMINANT_EQUAL_FRAC), "dominant_equal_frac": DOMINANT_EQUAL_FRAC,
            "tolerances": DEFAULT_RTOL}


BY_KIND_COLUMNS = ["kind", "n_ops", "n_rows", "bitwise_equal_frac", "rel_l2_first", "rel_l2_median", "rel_l2_max",
                   "max_abs_diff", "max_ulp"]


def by_kind(errs: pd.DataFrame) -> pd.DataFrame:
    """The op-errors table summarized per op kind (``attn.o`` over all layers; ``embed``, ``logits``
    alone), in execution order: ops, rows, bitwise-equal fraction over all rows, relative L2 at the
    kind's first layer, its median and max over layers (NaN where no side kept values), max abs diff
    and max ULP distance."""
    if errs.empty:
        return pd.DataFrame(columns=BY_KIND_COLUMNS)
    errs = errs.sort_values("exec_order", kind="stable")
    rows = []
    for kind, g in errs.groupby("kind", sort=False):
        rel = g.rel_l2.dropna()
        rows.append({
            "kind": kind,
            "n_ops": len(g),
            "n_rows": int(g.n_rows.sum()),
            "bitwise_equal_frac": float((g.bitwise_equal_frac * g.n_rows).sum() / g.n_rows.sum()),
            "rel_l2_first": float(g.rel_l2.iloc[0]) if not pd.isna(g.rel_l2.iloc[0]) else math.nan,
            "rel_l2_median": float(rel.median()) if len(rel) else math.nan,
            "rel_l2_max": float(rel.max()) if len(rel) else math.nan,
            "max_abs_diff": float(g.max_abs_diff.max()) if g.max_abs_diff.notna().any() else math.nan,
            "max_ulp": float(g.max_ulp.max()) if g.max_ulp.notna().any() else math.nan,
        })
    return pd.DataFrame(rows, columns=BY_KIND_COLUMNS)
