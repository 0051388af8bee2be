"""One function per report section: each returns an HTML fragment (charts inlined as SVG)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.analysis.gate import CheckResult, fmt_num
from mismatch_probe.reports import plots
from mismatch_probe.reports.html import esc, figure, kv_table, missing, num, table, td, td_num
from mismatch_probe.reports.load import RunData
from mismatch_probe.run.reader import BISECT, OP_ERRORS

HEADLINE = (
    ("mean_abs_dlogp", "mean |dlogp|"),
    ("max_abs_dlogp", "max |dlogp|"),
    ("p99_abs_dlogp", "p99 |dlogp|"),
    ("k3", "k3 (KL est.)"),
    ("clip_frac", "PPO clip fraction"),
    ("mean_abs_dprob", "mean |dprob|"),
    ("seq_max_abs_logratio", "max |seq log-ratio|"),
)
DECOMP_METRICS = (
    "n_tokens", "mean_abs_dlogp", "max_abs_dlogp", "p50_abs_dlogp", "p90_abs_dlogp", "p99_abs_dlogp",
    "mean_dlogp", "mean_abs_dprob", "max_abs_dprob", "k1", "k2", "k3", "chi2", "clip_frac", "tis_frac",
    "seq_mean_abs_logratio", "seq_max_abs_logratio", "pearson_prob", "ppl_learner", "ppl_sampler",
    "n_nonfinite",
)  # fmt: skip
VERDICT_RULE = (
    "Verdict on learner vs sampler-decode (the ratio RL actually uses): identical when max |dlogp| = 0; "
    "small when k3 <= 1e-4 and clip fraction <= 1e-3; moderate when k3 <= 1e-3 and clip fraction <= 1e-2; "
    "large otherwise, or when any logprob is non-finite. Pass --gate-config to judge by your own thresholds."
)


def verdict(summary: dict[str, Any]) -> tuple[str, str]:
    """(verdict key, sentence) from the learner-vs-decode metrics, by the fixed rule above."""
    m = summary["pairs"].get("learner_vs_decode", {})
    mx, k3, clip = (float(m.get(k, math.nan)) for k in ("max_abs_dlogp", "k3", "clip_frac"))
    if not float(m.get("n_tokens", 1) or 0):
        return "nodata", "no response tokens to compare"
    if float(m.get("n_nonfinite", 0) or 0) > 0 or math.isinf(mx):
        return "nonfinite", "non-finite logprobs: some tokens are -inf or NaN on one side"
    if mx == 0:
        return "identical", "learner and sampler logprobs are bitwise identical"
    if math.isnan(k3):
        return "large", "metrics unavailable"
    if k3 <= 1e-4 and clip <= 1e-3:
        return "small", f"small gap: k3 {fmt_num(k3)}, max |dlogp| {fmt_num(mx)}"
    if k3 <= 1e-3 and clip <= 1e-2:
        return "moderate", f"moderate gap: k3 {fmt_num(k3)}, clip fraction {fmt_num(clip)}"
    return "large", f"large gap: k3 {fmt_num(k3)}, clip fraction {fmt_num(clip)}, max |dlogp| {fmt_num(mx)}"


def headline(data: RunData, gate: list[CheckResult] | None) -> tuple[str, str]:
    """Verdict banner, headline metric cards, gate checks; returns (verdict key, html)."""
    key, sentence = verdict(data.summary)
    rule = VERDICT_RULE
    if gate is not None:
        key = "fail" if any(r.verdict == "fail" for r in gate) else "pass"
        n_fail = sum(r.verdict == "fail" for r in gate)
        sentence = f"gate {key}: {n_fail} of {len(gate)} checks failed; {sentence}"
        rule = "Verdict from the gate config given to `report --gate-config`."
    m = data.summary["pairs"].get("learner_vs_decode", {})
    cards: list[tuple[str, str, Any]] = [
        ("n_sequences", "sequences", data.summary.get("n_sequences", data.gaps["seq_id"].nunique())),
        (
            "n_response_tokens",
            "response tokens",
            data.summary.get("n_response_tokens", int(data.gaps["is_response"].sum())),
        ),
    ]
    cards += [(k, label, m.get(k)) for k, label in HEADLINE]
    fv = m.get("full_vocab") or {}
    cards += [(k, f"full-vocab {k}", v) for k, v in fv.items() if isinstance(v, int | float)]
    card_html = "".join(
        f'<div class="card" data-metric="{esc(k)}"><div class="k">{esc(label)}</div><div class="v">{num(v)}</div></div>'
        for k, label, v in cards
    )
    out = [
        f'<div class="verdict" id="verdict"><span class="badge v-{esc(key)}">{esc(key.upper())}</span>'
        f"<div><div>{esc(sentence)}</div><div class='muted'>{esc(rule)}</div></div></div>",
        f'<h3>Headline metrics: learner vs sampler-decode</h3><div class="cards" id="headline-metrics">{card_html}</div>',
    ]
    if gate is not None:
        rows = [
            [
                td(r.name),
                td(r.pair),
                td_num(r.value) if not isinstance(r.value, str) else td(r.value),
                td(r.threshold),
                td(r.verdict, "eq" if r.verdict == "pass" else "ne"),
                td(r.detail),
            ]
            for r in gate
        ]
        out.append(
            "<h3>Gate checks</h3>"
            + table(
                ["check", "pair", "value", "threshold", "verdict", "detail"],
                rows,
                numeric=[2],
                tid="gate-table",
            )
        )
    return key, "\n".join(out)


def weight_parity(data: RunData) -> str:
    """One line: did both engines hold bitwise-equal weights (compare/weight_parity.json)."""
    wp = data.weight_parity
    if not wp:
        return ""
    ok = bool(wp.get("ok"))
    text = f"{wp.get('n_equal', '?')} of {wp.get('n_params', '?')} parameters bitwise equal in learner and sampler"
    diffs = [str(d.get("name", d)) if isinstance(d, dict) else str(d) for d in (wp.get("differences") or [])][:10]
    for key in ("learner_only", "sampler_only"):
        if wp.get(key):
            text += f"; {key.replace('_', ' ')}: {', '.join(map(str, wp[key][:10]))}"
    if diffs:
        text += f"; differ: {', '.join(diffs)}"
    cls = "eq" if ok else "ne"
    return f'<p id="weight-parity" class="{cls}"><b>Weights:</b> {esc(text)}</p>'


def absent_box(data: RunData) -> str:
    items = "".join(f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in data.absent.items())
    notes = "".join(f"<li>{esc(n)}</li>" for n in data.notes)
    parts = []
    if items:
        parts.append(f'<div class="absent" id="absent-sections"><b>Absent sections</b><ul>{items}</ul></div>')
    if notes:
        parts.append(f'<div class="absent" id="notes"><b>Notes</b><ul>{notes}</ul></div>')
    return "\n".join(parts)


def first_divergent(data: RunData) -> dict[str, dict[str, Any] | None]:
    if data.bisect is not None:
        fd = data.bisect.get("first_divergent") or {}
        out = {"bitwise": fd.get("bitwise"), "tolerance": fd.get("tolerance")}
        if "dominant" in fd:  # bisect.json from before the dominant divergence have no such key
            out["dominant"] = fd.get("dominant")
        return out
    ops = data.op_errors
    if ops is None:
        return {}
    from mismatch_probe.analysis.op_errors import first_divergent as first_divergent_op

    fd = first_divergent_op(ops.assign(bitwise_equal_frac=ops["bitwise_equal_frac"].fillna(0)))["bitwise"]
    return {"bitwise": fd and {k: fd[k] for k in ("op", "layer", "exec_order")}}


def _fd_text(fd: dict[str, Any] | None) -> str:
    if not fd:
        return "none (all captured ops agree)"
    return f"{fd.get('op')} (layer {fd.get('layer')}, execution #{fd.get('exec_order')})"


def drift(data: RunData) -> str:
    if data.op_errors is None:
        return missing("Where drift starts", data.absent["Where drift starts"])
    fd = first_divergent(data)
    local = (data.bisect or {}).get("local_errors") or None
    src = BISECT if data.bisect is not None else f"{Path(OP_ERRORS).name} (first op not bitwise equal)"
    label = {"dominant": "dominant divergence (first op where most rows differ)"}
    lines = "".join(f"<li>{label.get(k, f'first divergent op, {k}')}: <b>{esc(_fd_text(v))}</b></li>" for k, v in fd.items())
    cap = "Per-op error of sampler vs learner on the same tokens, in execution order; zeros drawn at the floor."
    if not local:
        why = f"{BISECT} has no local_errors" if data.bisect is not None else f"no {BISECT} (run `mismatch-probe bisect`)"
        cap += f" Local vs inherited error absent: {why}."
    out = f'<ul id="first-divergent">{lines}</ul><p class="muted">source: {esc(src)}</p>' + figure(
        "drift", plots.drift_chart(data.op_errors, fd, local), cap
    )
    from mismatch_probe.reports import depth

    if local and len(data.op_errors) > depth.PER_OP_MAX:  # deep model: aggregate instead of one bar per op
        by_layer, top = depth.aggregated(local)
        out += figure(
            "local-by-layer",
            by_layer,
            f"Local vs inherited error over {len(data.op_errors)} ops, aggregated: local error per decoder layer "
            "and op kind (top), summed per layer next to the error inherited at the layer's last op (bottom).",
        )
        out += figure("local-top", top, "The ops that introduce the most error themselves, with what they inherit.")
    return out


def scatter(data: RunData) -> str:
    return figure(
        "scatter",
        plots.scatter_chart(data.response),
        "Each point is a response token; the dashed line is equality.",
    )


def histogram(data: RunData) -> str:
    return figure(
        "histogram",
        plots.histogram_chart(data.response),
        "Log-spaced bins; tokens with exactly zero gap cannot sit on a log axis: the legend counts them.",
    )


def decomposition(data: RunData) -> str:
    rows = []
    pairs = list(plots.PAIR_LABELS)
    for k in DECOMP_METRICS:
        rows.append([td(k)] + [td_num(data.summary["pairs"].get(p, {}).get(k)) for p in pairs])
    fv_keys = sorted({k for p in pairs for k in (data.summary["pairs"].get(p, {}).get("full_vocab") or {})})
    for k in fv_keys:
        rows.append([td(f"full_vocab.{k}")] + [td_num((data.summary["pairs"][p].get("full_vocab") or {}).get(k)) for p in pairs])
    tbl = table(["metric"] + [plots.PAIR_LABELS[p] for p in pairs], rows, numeric=[1, 2, 3], tid="decomposition-table")
    return (
        figure(
            "decomposition",
            plots.decomposition_chart(data.summary, data.response),
            "sampler-prefill vs sampler-decode isolates the decode path (KV cache, batching); "
            "learner vs sampler-prefill isolates the engines' kernels.",
        )
        + tbl
    )


_CTRL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_VISIBLE = {"\n": "\u21b5", "\t": "\u2192", "\r": "\u240d"}


def _tok_text(data: RunData, tid: int) -> str:
    if data.decode is None:
        return f"<{tid}>"
    s = data.decode([tid])
    return _CTRL.sub(lambda m: _VISIBLE.get(m.group(), "\u00b7"), s) if s else f"<{tid}>"


def worst_tokens(data: RunData, top: int = 25, before: int = 10, after: int = 4) -> str:
    resp = data.response
    key = resp["d_learner_decode"].abs().fillna(-1.0)
    worst = resp.loc[key.sort_values(ascending=False, kind="stable").index[:top]]
    if worst.empty:
        return missing("Worst tokens", "no response tokens in token_gaps.parquet")
    seqs = {sid: g.sort_values("pos") for sid, g in data.gaps[data.gaps["seq_id"].isin(worst["seq_id"])].groupby("seq_id")}
    rows = []
    for r in worst.itertuples():
        g = seqs[r.seq_id]
        pos = g["pos"].to_numpy()
        i = int(np.searchsorted(pos, r.pos))
        lo, hi = max(0, i - before), min(len(g), i + after + 1)
        chips = []
        for j in range(lo, hi):
            tid, is_resp = int(g["token_id"].iloc[j]), bool(g["is_response"].iloc[j])
            cls = "tok hit" if j == i else ("tok" if is_resp else "tok prompt")
            chips.append(f'<span class="{cls}" title="id {tid}, pos {int(pos[j])}">{esc(_tok_text(data, tid))}</span>')
        ctx = ("\u2026" if lo > 0 else "") + "".join(chips) + ("\u2026" if hi < len(g) else "")
        rows.append(
            [
                td_num(r.seq_id),
                td_num(r.pos),
                f'<td class="ctx">{esc(_tok_text(data, int(r.token_id)))}</td>',
                td_num(r.d_learner_decode),
                td_num(r.d_learner_prefill),
                td_num(r.d_prefill_decode),
                td_num(r.lp_learner),
                td_num(r.lp_prefill),
                td_num(r.lp_decode),
                f'<td class="ctx">{ctx}</td>',
            ]
        )
    hdr = [
        "seq",
        "pos",
        "token",
        "learner-decode",
        "learner-prefill",
        "prefill-decode",
        "lp learner",
        "lp prefill",
        "lp decode",
        "context (hit highlighted, prompt greyed)",
    ]
    return (
        '<div class="hscroll">'
        + table(hdr, rows, numeric=[0, 1, 3, 4, 5, 6, 7, 8], cls="sortable", tid="worst-tokens")
        + "</div>"
    )


def op_table(data: RunData) -> str:
    if data.op_errors is None:
        return missing("Op table", data.absent["Op table"])
    ops = data.op_errors
    fd = first_divergent(data).get("bitwise") or {}
    cols = [
        "op",
        "layer",
        "exec_order",
        "dtype",
        "n_rows",
        "bitwise_equal_frac",
        "max_abs_diff",
        "mean_abs_diff",
        "rel_l2",
        "cosine",
        "sqnr_db",
        "max_ulp",
    ]
    rows, rcls = [], []
    for r in ops.itertuples():
        beq = float(r.bitwise_equal_frac) if r.bitwise_equal_frac is not None else math.nan
        rows.append(
            [
                td(r.op),
                td_num(r.layer),
                td_num(r.exec_order),
                td(r.dtype),
                td_num(r.n_rows),
                td_num(beq, "eq" if beq >= 1 else "ne"),
            ]
            + [td_num(getattr(r, c)) for c in cols[6:]]
        )
        rcls.append(
            "first-div"
            if fd
            and r.op == fd.get("op")
            and int(r.exec_order) == fd.get("exec_order", -2)
            or (fd and r.op == fd.get("op") and fd.get("exec_order") is None)
            else ""
        )
    cap = "".join(f"<li>{esc(s)}: {v['rows']:,} rows, {v['bytes'] / 1e6:.1f} MB</li>" for s, v in data.ops_capture.items())
    cap_html = f'<p class="muted">Op capture files:</p><ul class="muted">{cap}</ul>' if cap else ""
    filt = '<input type="search" id="op-filter" data-filter="op-table" placeholder="filter ops, e.g. attn.core or 3.mlp">'
    return (
        cap_html
        + filt
        + '<div class="scroll">'
        + table(cols, rows, numeric=range(1, 12), cls="sortable", row_cls=rcls, tid="op-table")
        + "</div>"
    )


def _f(x: Any) -> float:
    """A JSON number as float; None, strings and bad values become NaN."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _desc(x: Any) -> float:
    """Sort key: largest first, NaN last."""
    v = _f(x)
    return math.inf if math.isnan(v) else -v


LOCAL_COLUMNS = (  # bisect.json local_errors key -> header; optional keys shown where present
    ("local_error", "local error"),
    ("reverse_local_error", "reverse local"),
    ("inherited_error", "inherited error"),
    ("total_error", "total error"),
    ("local_bitwise_frac", "local bitwise-equal"),
)


def bisect(data: RunData) -> str:
    if data.bisect is None:
        return missing("Bisect ranking", data.absent["Bisect ranking"])
    out = []
    local = sorted(data.bisect.get("local_errors") or [], key=lambda d: _desc(d.get("local_error")))
    if local:
        cols = [(k, h) for k, h in LOCAL_COLUMNS if any(k in d for d in local)]
        total = float(np.nansum([_f(d.get("local_error")) for d in local])) or math.nan
        rows = [
            [td_num(i + 1), td(d.get("op")), td_num(d.get("layer"))]
            + [td_num(d.get(k)) for k, _ in cols]
            + [td_num(_f(d.get("local_error")) / total)]
            for i, d in enumerate(local[:40])
        ]
        headers = ["rank", "op", "layer"] + [h for _, h in cols] + ["share of local"]
        out.append(
            "<h3>Ops ranked by local error (error introduced by the op itself)</h3>"
            + table(headers, rows, numeric=[i for i in range(len(headers)) if i != 1], cls="sortable", tid="local-errors")
        )
    else:
        out.append(missing("Local error ranking", "bisect.json has no local_errors (bisect ran without --replay?)"))
    skipped = data.bisect.get("not_replayed") or []
    if skipped:
        out.append(f'<p class="muted">Not replayed: {esc(", ".join(map(str, skipped[:30])))}</p>')
    abl = data.bisect.get("ablation") or []
    if abl:
        rows = [
            [td(d.get("group")), td(d.get("kind")), td_num(d.get("share")), td_num(d.get("gap_after"))]
            for d in sorted(abl, key=lambda d: _desc(d.get("share")))
        ]
        out.append(
            "<h3>Ablation: share of the gap each aligned group removes</h3>"
            + figure("ablation", plots.ablation_chart(abl), "Top groups by share.")
            + table(["group", "kind", "share", "gap after"], rows, numeric=[2, 3], cls="sortable", tid="ablation-table")
        )
    else:
        note = data.bisect.get("ablation_note") or f"{BISECT} has no ablation results"
        out.append(missing("Ablation ranking", str(note)))
    return "\n".join(out)


def manifest(data: RunData) -> str:
    m = data.manifest
    cfg = m.get("config") or {}
    head = {k: m.get(k) for k in ("status", "host", "started_at", "finished_at", "schema_version") if k in m}
    out = [f'<pre id="command">{esc(m.get("command", "-"))}</pre>', kv_table(head, tid="run-info")]
    out.append("<h3>Versions</h3>" + kv_table(m.get("versions") or {}, tid="versions"))
    out.append("<h3>Config</h3>" + kv_table({k: v for k, v in cfg.items() if k != "recipe"}, tid="config"))
    recipe = cfg.get("recipe")
    out.append(
        "<h3>Recipe</h3>"
        + (
            f'<pre id="recipe">{esc(json.dumps(recipe, indent=2, default=str))}</pre>'
            if recipe is not None
            else "<p class='muted'>no recipe recorded</p>"
        )
    )
    auto = m.get("auto") or {}
    if auto:
        rows = [
            [
                td(k),
                td((v or {}).get("value") if isinstance(v, dict) else v),
                td((v or {}).get("reason", "") if isinstance(v, dict) else ""),
            ]
            for k, v in auto.items()
        ]
        out.append("<h3>Auto-chosen settings</h3>" + table(["setting", "value", "reason"], rows, tid="auto"))
    shown = {"command", "config", "versions", "auto", "notes", *head}
    extra = {k: v for k, v in m.items() if k not in shown}
    if extra:
        out.append("<h3>Other manifest fields</h3>" + kv_table(extra, tid="manifest-extra"))
    if m.get("notes"):
        out.append("<h3>Notes</h3><ul>" + "".join(f"<li>{esc(n)}</li>" for n in m["notes"]) + "</ul>")
    files = sorted(p for p in data.root.rglob("*") if p.is_file() and not p.name.startswith("."))
    rows = [[td(p.relative_to(data.root)), td_num(p.stat().st_size)] for p in files[:200]]
    out.append("<h3>Files</h3>" + table(["file", "bytes"], rows, numeric=[1], tid="files"))
    return "\n".join(out)
