"""Capture plans, the op recorder and the op-level error metrics, without engines."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from mismatch_probe.analysis.op_errors import error_stats, op_errors, ulp_distance
from mismatch_probe.errors import UsageError
from mismatch_probe.families.opnames import canonical_ops, exec_order, split_op
from mismatch_probe.probes.capture import CapturePlan, CaptureRule, decode_values
from mismatch_probe.probes.recorder import OpRecorder


def test_rule_parsing_and_last_match_wins():
    plan = CapturePlan("stats", [CaptureRule.parse("*.mlp.*=full"), CaptureRule.parse("3.mlp.*=digest@0:4")])
    pos = np.arange(8)
    assert plan.modes_for("1.mlp.down", pos).tolist() == [3] * 8  # full
    assert plan.modes_for("3.mlp.down", pos).tolist() == [1] * 4 + [3] * 4  # digest on 0..3, full after
    assert plan.modes_for("logits", pos).tolist() == [2] * 8  # stats
    for bad in ("nomode", "x=loud", "x=full@5:2", "x=full@a:b"):
        with pytest.raises(UsageError):
            CaptureRule.parse(bad)


def test_recorder_modes_stats_and_values_roundtrip():
    rec = OpRecorder(CapturePlan("full", [CaptureRule.parse("b=digest"), CaptureRule.parse("c=off")]))
    x = torch.tensor([[1.0, -2.0, float("nan")], [0.5, 0.25, float("inf")], [9.0, 9.0, 9.0]], dtype=torch.bfloat16)
    seq, pos = np.array([0, 0, -1]), np.array([0, 1, 0])  # the third row is padding
    for op in ("a", "b", "c"):
        rec.record(op, x, seq, pos)
    t = rec.table().to_pandas()
    assert sorted(t.op.unique()) == ["a", "b"] and len(t) == 4
    a = t[t.op == "a"].sort_values("pos")
    assert a["sum"].tolist() == [-1.0, 0.75] and a.n_nan.tolist() == [1, 0] and a.n_inf.tolist() == [0, 1]
    assert a.abs_max.tolist() == [2.0, 0.5] and a.numel.tolist() == [3, 3]
    back = decode_values(a["values"].iloc[0], "bfloat16", [3])
    assert torch.equal(back[:2], x[0, :2]) and torch.isnan(back[2])
    b = t[t.op == "b"]
    assert b["values"].isna().all() and (b.digest == a.digest.values).all()


def test_ulp_and_error_stats():
    a = torch.tensor([1.0, -0.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125, 0.0, 2.0], dtype=torch.bfloat16)  # 1 ulp at 1.0; -0 vs +0 is 0 ulp
    ser = lambda t: pd.Series([t.view(torch.uint8).numpy().tobytes()])  # noqa: E731
    assert ulp_distance(ser(a), ser(b), "bfloat16") == 1.0
    s = error_stats(np.array([1.0, 2.0]), np.array([1.0, 2.0]))
    assert s["rel_l2"] == 0 and s["cosine"] == pytest.approx(1.0) and math.isinf(s["sqnr_db"])


def test_op_errors_orders_and_compares():
    def rows(vals: list[float]) -> pd.DataFrame:
        t = torch.tensor(vals, dtype=torch.float32)
        return pd.DataFrame({"op": ["0.attn.q", "embed"], "seq_id": [0, 0], "pos": [0, 0], "dtype": ["float32"] * 2,
                             "digest": [str(v) for v in vals], "values": [t[i:i + 1].numpy().tobytes() for i in range(2)]})
    errs = op_errors(rows([1.0, 2.0]), rows([1.5, 2.0]), num_layers=2)
    assert errs.op.tolist() == ["embed", "0.attn.q"]
    assert errs.bitwise_equal_frac.tolist() == [1.0, 0.0]
    assert errs.max_abs_diff.tolist() == [0.0, 0.5]


def test_canonical_names():
    ops = canonical_ops(2, moe=False)
    assert ops[0] == "embed" and ops[-2:] == ["final_norm", "logits"]
    assert [exec_order(o, 2) for o in ops] == sorted(exec_order(o, 2) for o in ops)
    assert split_op("3.mlp.down") == (3, "mlp.down") and split_op("logits") == (-1, "logits")
    assert "0.moe.router_logits" in canonical_ops(1, moe=True) and "0.mlp.gate" not in canonical_ops(1, moe=True)


def test_engine_stream_changes_nothing_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The high-priority engine stream is CUDA-only and only for the default `side` setting: on the
    CPU, or with `side-equal` / `main`, the context yields None and leaves the current stream alone
    (the CUDA path is exercised by bench/gpu_capture.sh: logprobs with capture == without)."""
    from mismatch_probe.probes.engine_stream import engine_stream

    for value in ("side", "side-equal", "main"):
        monkeypatch.setenv("MISMATCH_PROBE_CAPTURE_STREAM", value)
        with engine_stream("cpu") as note:
            assert note is None
