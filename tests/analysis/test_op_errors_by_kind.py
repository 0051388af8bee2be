"""``analysis.op_errors.by_kind``: the per-op errors summarized per op kind (``diff --by-kind``)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mismatch_probe.analysis.op_errors import BY_KIND_COLUMNS, by_kind, op_errors


def _table(values: dict[str, np.ndarray]) -> pd.DataFrame:
    rows = []
    for op, v in values.items():
        for i, row in enumerate(v.astype(np.float32)):
            rows.append({"op": op, "seq_id": 0, "pos": i, "dtype": "float32", "digest": row.tobytes().hex(),
                         "values": row.tobytes()})
    return pd.DataFrame(rows)


def test_by_kind_aggregates_layers_in_execution_order() -> None:
    rng = np.random.default_rng(0)
    ref = {op: rng.standard_normal((4, 8)) for op in ("embed", "0.attn.o", "1.attn.o", "2.attn.o", "0.attn.q", "logits")}
    other = {op: v.copy() for op, v in ref.items()}
    other["1.attn.o"][1] *= 1.5  # one row of four differs: rel L2 = 0.5 * ||row|| / ||all||
    other["2.attn.o"] *= 1.25  # every row: rel L2 0.25
    errs = op_errors(_table(ref), _table(other), num_layers=3)
    k = by_kind(errs)
    assert list(k.columns) == BY_KIND_COLUMNS
    assert list(k.kind) == ["embed", "attn.q", "attn.o", "logits"]
    o = k[k.kind == "attn.o"].iloc[0]
    assert o.n_ops == 3 and o.n_rows == 12
    assert o.bitwise_equal_frac == (4 + 3 + 0) / 12
    rel1 = 0.5 * np.linalg.norm(ref["1.attn.o"][1]) / np.linalg.norm(ref["1.attn.o"])
    assert o.rel_l2_first == 0.0 and math.isclose(o.rel_l2_max, max(rel1, 0.25), rel_tol=1e-6)
    assert math.isclose(o.rel_l2_median, min(rel1, 0.25), rel_tol=1e-6)  # median of {0, rel1, 0.25}
    assert (k[k.kind != "attn.o"].bitwise_equal_frac == 1.0).all() and (k[k.kind != "attn.o"].rel_l2_max == 0).all()


def test_by_kind_without_values_and_empty() -> None:
    rng = np.random.default_rng(1)
    a = _table({"0.attn.q": rng.standard_normal((2, 4))})
    b = a.copy()
    b.loc[0, "digest"] = "ff"
    a["values"], b["values"] = None, None  # digest-only captures: no rel L2
    k = by_kind(op_errors(a, b, num_layers=1))
    assert k.iloc[0].bitwise_equal_frac == 0.5 and math.isnan(k.iloc[0].rel_l2_max)
    assert by_kind(op_errors(a.iloc[:0], b.iloc[:0], num_layers=1)).empty
