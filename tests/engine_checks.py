"""Checks that need both real engines in one process; run by tests/probes/test_capture_real.py in a
subprocess (vLLM keeps per-process state). Prints one JSON object with the findings."""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mismatch_probe.probes.capture import CapturePlan  # noqa: E402
from mismatch_probe.probes.hf.runner import HfLearner  # noqa: E402
from mismatch_probe.probes.models import resolve_model  # noqa: E402
from mismatch_probe.probes.vllm.runner import VllmSampler  # noqa: E402


def main() -> None:
    name = sys.argv[1]
    mi = resolve_model(name)
    rng = np.random.default_rng(0)
    lengths = [5, 41, 12, 3, 27, 18, 9]  # 7 sequences of different lengths, distinct random tokens
    seqs = [[int(t) for t in rng.choice(np.arange(8, mi.vocab_size), size=n, replace=False)] for n in lengths]
    ids = [100 + i for i in range(len(seqs))]
    out: dict = {}
    # chunked prefill: at most 32 tokens per step, so long sequences are split across steps
    s = VllmSampler(mi.path, mi.vocab_size, max_model_len=64, llm_kwargs={"max_num_batched_tokens": 32, "max_num_seqs": 8})
    with s:
        plain = s.score(seqs, ids)
        s.capture = CapturePlan("full")
        hooked = s.score(seqs, ids)
        batched = s.ops.to_pandas()
        alone = [s.score([q], [i]) and s.ops.to_pandas() for q, i in zip(seqs, ids, strict=True)]
        s.capture = None
        after = s.score(seqs, ids)
        out["vllm_observer_equal"] = all(np.array_equal(a, b) for a, b in zip(plain, hooked, strict=True))
        out["vllm_after_remove_equal"] = all(np.array_equal(a, b) for a, b in zip(plain, after, strict=True))
        out["vllm_unmatched_rows"] = s.info.settings["capture_unmatched_rows"]
        emb = s.llm.apply_model(lambda m: m.model.embed_tokens.weight.detach().clone())[0]

        def direct(m: object) -> dict:
            """Call vLLM's own modules on a fixed input tensor (independent of the capture)."""
            g = torch.Generator().manual_seed(1)
            x = torch.randn(6, m.model.config.hidden_size, generator=g).to(torch.bfloat16)
            a = m.model.layers[0].self_attn
            pos = torch.arange(6)
            res = {"x": x, "norm": m.model.layers[0].input_layernorm(x)}
            q = (torch.randn(6, a.q_size, generator=g) * 0.5).to(torch.bfloat16)
            k = (torch.randn(6, a.kv_size, generator=g) * 0.5).to(torch.bfloat16)
            res["q_in"], res["k_in"] = q, k
            res["rope_q"], res["rope_k"] = a.rotary_emb(pos, q.clone(), k.clone())
            return {kk: v.clone() for kk, v in res.items()}

        vd = s.llm.apply_model(direct)[0]
        held = s.llm  # a reference the release must not depend on (vLLM 0.26 has no finalizer to shut down)
    # the release shut the engine core down: vLLM's start-up gc.freeze undone (else its cycles never free)
    out["vllm_release_unfroze"] = gc.get_freeze_count() == 0
    del held
    # mapping: every embed row must be the embedding of the token at (seq_id, pos)
    ok, n_rows = True, 0
    for sid, seq in zip(ids, seqs, strict=True):
        rows = batched[(batched.op == "embed") & (batched.seq_id == sid)].sort_values("pos")
        n_rows += len(rows)
        if rows.pos.tolist() != list(range(len(seq))):
            ok = False
        for p, v in zip(rows.pos, rows["values"], strict=True):
            got = torch.frombuffer(bytearray(v), dtype=torch.bfloat16)
            ok &= bool(torch.equal(got, emb[seq[p]]))
    out["mapping_embed_ok"] = ok
    out["mapping_rows"] = n_rows
    out["n_tokens"] = sum(lengths)
    out["duplicate_rows"] = int(batched.duplicated(["op", "seq_id", "pos"]).sum())
    # alone vs batched, per op: share of rows whose digest is the same
    al = __import__("pandas").concat(alone)
    m = batched.merge(al, on=["op", "seq_id", "pos"], suffixes=("_b", "_a"))
    out["alone_rows_matched"] = len(m) == len(batched) == len(al)
    eq = (m.digest_b == m.digest_a).groupby(m.op).mean()
    out["alone_equal_by_kind"] = {k: float(eq[[o for o in eq.index if o.split(".", 1)[-1] == k]].mean())
                                  for k in ("embed", "input_norm", "attn.rope_q", "attn.core", "logits") if any(
                                      o.split(".", 1)[-1] == k for o in eq.index)}
    # HF side: observer effect, and the same modules called directly on the same tensors
    h = HfLearner(mi.path, mi.vocab_size, micro_batch_size=4)
    with h:
        plain = h.score(seqs, ids)
        h.capture = CapturePlan("full")
        hooked = h.score(seqs, ids)
        h.capture = None
        after = h.score(seqs, ids)
        out["hf_observer_equal"] = all(np.array_equal(a, b) for a, b in zip(plain, hooked, strict=True))
        out["hf_after_remove_equal"] = all(np.array_equal(a, b) for a, b in zip(plain, after, strict=True))
        from mismatch_probe.probes.replay import _hf_rope

        model = h.model
        with torch.inference_mode():
            hn = model.model.layers[0].input_layernorm(vd["x"])
            a = model.model.layers[0].self_attn
            hq = _hf_rope(model, a, [vd["q_in"], vd["k_in"]], torch.arange(6), 0).reshape(6, -1)
        out["direct_norm_equal"] = bool(torch.equal(hn, vd["norm"]))
        out["direct_rope_equal"] = bool(torch.equal(hq, vd["rope_q"].reshape(6, -1)))
        out["direct_rope_max_diff"] = float((hq.float() - vd["rope_q"].float().reshape(6, -1)).abs().max())
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
