"""Synthetic run directories (numpy only) for tests, the report benchmark and demos.

Shapes follow the run-directory format exactly (schema.write_table), values are random but
plausible: a small learner/sampler logprob gap, ops that agree bitwise up to some layer and
then drift, a bisect result. Nothing here needs torch or vLLM.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa

from mismatch_probe.compare import pair_metrics
from mismatch_probe.gate import PAIRS
from mismatch_probe.schema import SCHEMA_VERSION, atomic_write_json, write_table

LAYER_OPS = (
    "input_norm", "attn.q", "attn.k", "attn.v", "attn.q_norm", "attn.k_norm", "attn.core", "attn.o",
    "resid_mid", "post_attn_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.down", "out",
)  # fmt: skip
WORDS = ("the", "a", "model", "token", "gap", "learner", "sampler", "is", "of", "to", "and", "in", "logprob")


def op_names(n_layers: int) -> list[tuple[str, int]]:
    """(canonical op, layer) in execution order for a dense decoder."""
    names = [(f"{layer}.{op}", layer) for layer in range(n_layers) for op in LAYER_OPS]
    return names + [("final_norm", -1), ("logits", -1)]


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer.json (tokenizers package only) so the report can decode token text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "\n": 1}
    for i in range(2, vocab_size):
        vocab[f"{WORDS[i % len(WORDS)]}{i // len(WORDS)}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))


def _gaps(rng: np.random.Generator, n_seq: int, seq_len: int, prompt_len: int, vocab: int, scale: float) -> pa.Table:
    seq = np.repeat(np.arange(n_seq, dtype=np.int32), seq_len)
    pos = np.tile(np.arange(seq_len, dtype=np.int32), n_seq)
    resp = pos >= prompt_len
    tok = rng.integers(2, vocab, size=seq.size, dtype=np.int32)
    lp_pre = -rng.gamma(1.5, 1.2, size=seq.size)
    lp_dec = np.where(resp, lp_pre + rng.normal(0, scale / 4, size=seq.size), np.nan)
    lp_lrn = lp_pre + rng.normal(0, scale, size=seq.size)
    lp_lrn = np.where(rng.random(seq.size) < 0.3, lp_pre, lp_lrn)  # some tokens agree exactly
    return pa.table(
        {
            "seq_id": seq,
            "prompt_id": seq // 2,
            "pos": pos,
            "token_id": tok,
            "is_response": resp,
            "lp_learner": lp_lrn,
            "lp_prefill": lp_pre,
            "lp_decode": pa.array(lp_dec, mask=~resp),
            "d_learner_decode": pa.array(lp_lrn - lp_dec, mask=~resp),
            "d_learner_prefill": lp_lrn - lp_pre,
            "d_prefill_decode": pa.array(lp_pre - lp_dec, mask=~resp),
        }
    )


def _token_tables(gaps: pa.Table) -> dict[str, pa.Table]:
    base = {c: gaps[c] for c in ("seq_id", "prompt_id", "pos", "token_id", "is_response")}
    out = {}
    for side, col, src in (("learner", "lp_learner", "learner"), ("sampler", "lp_prefill", "prefill")):
        out[side] = pa.table({**base, "logprob": gaps[col], "source": pa.array([src] * gaps.num_rows)})
    return out


def _summary(gaps: pa.Table) -> dict:
    g = gaps.to_pandas()
    r = g[g["is_response"]]
    cols = {
        "learner_vs_decode": ("lp_learner", "lp_decode"),
        "learner_vs_prefill": ("lp_learner", "lp_prefill"),
        "prefill_vs_decode": ("lp_prefill", "lp_decode"),
    }
    pairs = {p: pair_metrics(r[a].to_numpy(), r[b].to_numpy(), r["seq_id"].to_numpy()) for p, (a, b) in cols.items()}
    assert set(pairs) == set(PAIRS)
    return {
        "schema_version": SCHEMA_VERSION,
        "n_sequences": int(g["seq_id"].nunique()),
        "n_response_tokens": len(r),
        "pairs": pairs,
    }


def _op_errors(rng: np.random.Generator, n_layers: int, n_rows: int, diverge_at: int) -> pa.Table:
    names = op_names(n_layers)
    rows = []
    err = 0.0
    for i, (op, layer) in enumerate(names):
        if i >= diverge_at:
            err = max(err * 1.15, 1e-3) * float(rng.uniform(0.8, 1.3))
        eq = 1.0 if i < diverge_at else float(rng.uniform(0.2, 0.9))
        rows.append(
            {
                "op": op,
                "layer": layer,
                "kind": op.split(".", 1)[1] if layer >= 0 else op,
                "exec_order": i,
                "dtype": "bfloat16" if op != "logits" else "float32",
                "n_rows": n_rows,
                "bitwise_equal_frac": eq,
                "max_abs_diff": err * 8,
                "mean_abs_diff": err,
                "rel_l2": err / 2,
                "cosine": 1.0 - err * err,
                "sqnr_db": float("inf") if err == 0 else float(20 * np.log10(2 / err)),
                "max_ulp": 0 if err == 0 else int(rng.integers(1, 64)),
            }
        )
    return pa.Table.from_pylist(rows)


def _ops_full(rng: np.random.Generator, names: list[tuple[str, int]], n_seq: int, seq_len: int, width: int) -> pa.Table:
    n_tok = n_seq * seq_len
    n = n_tok * len(names)
    op_idx = np.repeat(np.arange(len(names)), n_tok)
    blob = rng.integers(0, 256, size=n * width * 2, dtype=np.uint8).tobytes()
    values = pa.Array.from_buffers(
        pa.binary(),
        n,
        [None, pa.py_buffer(np.arange(n + 1, dtype=np.int32) * (width * 2)), pa.py_buffer(blob)],
    )
    return pa.table(
        {
            "op": pa.array([names[i][0] for i in range(len(names))]).take(pa.array(op_idx)),
            "layer": pa.array(np.array([layer for _, layer in names], dtype=np.int32)[op_idx]),
            "seq_id": np.tile(np.repeat(np.arange(n_seq, dtype=np.int32), seq_len), len(names)),
            "pos": np.tile(np.arange(seq_len, dtype=np.int32), n_seq * len(names)),
            "dtype": pa.array(["bfloat16"] * len(names)).take(pa.array(op_idx)),
            "shape": pa.array([[width]] * len(names), type=pa.list_(pa.int64())).take(pa.array(op_idx)),
            "numel": np.full(n, width, dtype=np.int64),
            "sum": rng.normal(size=n),
            "sum_sq": rng.random(n) * width,
            "abs_max": rng.random(n) * 4,
            "n_nan": np.zeros(n, dtype=np.int64),
            "n_inf": np.zeros(n, dtype=np.int64),
            "digest": pa.array(["0" * 16] * len(names)).take(pa.array(op_idx)),
            "values": values,
        }
    )


def _bisect(names: list[tuple[str, int]], diverge_at: int, rng: np.random.Generator) -> dict:
    fd = {"op": names[diverge_at][0], "layer": names[diverge_at][1], "exec_order": diverge_at}
    tol_i = min(diverge_at + 3, len(names) - 1)
    local, inherited = [], 0.0
    for i, (op, layer) in enumerate(names):
        le = 0.0 if i < diverge_at else float(rng.lognormal(-7, 1.0))
        local.append({"op": op, "layer": layer, "local_error": le, "inherited_error": inherited})
        inherited = inherited * 1.05 + le
    kinds = ["attn.core", "mlp.down", "input_norm", "attn.o", "mlp.act", "logits"]
    shares = rng.dirichlet(np.ones(len(kinds)))
    abl = [
        {"group": k, "kind": "op_kind", "share": float(s), "gap_after": float(1e-3 * (1 - s))}
        for k, s in zip(kinds, shares, strict=True)
    ]
    n_layers = max(layer for _, layer in names) + 1
    abl += [
        {"group": f"layers {a}-{a + 1}", "kind": "layer_range", "share": 0.5, "gap_after": 5e-4} for a in range(0, n_layers, 2)
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "first_divergent": {
            "bitwise": fd,
            "tolerance": {"op": names[tol_i][0], "layer": names[tol_i][1], "exec_order": tol_i},
        },
        "local_errors": local,
        "ablation": abl,
    }


def make_run(
    root: Path,
    *,
    n_seq: int = 8,
    seq_len: int = 48,
    prompt_len: int = 16,
    vocab: int = 512,
    ops: bool = False,
    full_ops: bool = False,
    bisect: bool = False,
    n_layers: int = 4,
    hidden: int = 128,
    scale: float = 2e-3,
    seed: int = 0,
    tokenizer: bool = True,
) -> Path:
    """Write a complete synthetic run directory at ``root``; returns ``root``."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    model_dir = root / "_model"
    if tokenizer:
        write_tokenizer(model_dir, vocab)
    gaps = _gaps(rng, n_seq, seq_len, prompt_len, vocab, scale)
    for side, t in _token_tables(gaps).items():
        write_table(root / side / "tokens.parquet", t, "tokens")
    write_table(root / "compare" / "token_gaps.parquet", gaps, "token_gaps")
    atomic_write_json(root / "compare" / "summary.json", _summary(gaps))
    parity = {"n_params": 9 * n_layers + 3, "n_equal": 9 * n_layers + 3, "differences": [], "learner_only": [],
              "sampler_only": [], "ok": True}  # fmt: skip
    atomic_write_json(root / "compare" / "weight_parity.json", parity)
    names = op_names(n_layers)
    diverge_at = min(len(LAYER_OPS) + 6, len(names) - 1)  # layer 1, attn.core
    if ops:
        write_table(root / "compare" / "op_errors.parquet", _op_errors(rng, n_layers, n_seq * seq_len, diverge_at), "op_errors")
    if full_ops:
        for side in ("learner", "sampler"):
            write_table(root / side / "ops.parquet", _ops_full(rng, names, n_seq, seq_len, hidden), "ops")
    if bisect:
        atomic_write_json(root / "bisect.json", _bisect(names, diverge_at, rng))
    now = dt.datetime.now(dt.UTC).isoformat()
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "status": "complete",
        "command": f"mismatch-probe compare --model synthetic-qwen3 --out {root}",
        "config": {
            "model": "synthetic-qwen3",
            "model_dir": str(model_dir),
            "sampler_model": None,
            "learner": "hf",
            "sampler": "vllm",
            "n": 2,
            "max_tokens": seq_len - prompt_len,
            "temperature": 1.0,
            "seed": seed,
            "recipe": {"name": "bf16", "linear": "bf16", "attention": "engine default"},
        },
        "versions": {
            "python": "3.11",
            "torch": "synthetic",
            "vllm": "synthetic",
            "transformers": "synthetic",
        },
        "host": "synthetic",
        "started_at": now,
        "finished_at": now,
        "auto": {"dtype": {"value": "bfloat16", "reason": "model config torch_dtype"}},
        "notes": ["synthetic run built by mismatch_probe.reports.synthetic"],
    }
    atomic_write_json(root / "manifest.json", manifest)
    return root
