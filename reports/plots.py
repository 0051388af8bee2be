"""Charts for the report: matplotlib (Agg) figures returned as inline SVG strings.

Dense point clouds are rasterized inside the SVG (a PNG image element) so the file stays small;
axes and text stay vector (``svg.fonttype = none``: labels are real text in the DOM).
"""

from __future__ import annotations

import io
import re
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

PER_OP_MAX = 120  # up to this many ops, the per-op bar chart stays (about 8 layers); deeper: reports.depth

plt.rcParams.update(
    {
        "svg.fonttype": "none",
        "svg.hashsalt": "mismatch-probe",
        "font.size": 9,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "figure.dpi": 100,
    }
)
PAIR_LABELS = {
    "learner_vs_decode": "learner vs sampler-decode",
    "learner_vs_prefill": "learner vs sampler-prefill",
    "prefill_vs_decode": "sampler-prefill vs sampler-decode",
}
PAIR_DIFF = {
    "learner_vs_decode": "d_learner_decode",
    "learner_vs_prefill": "d_learner_prefill",
    "prefill_vs_decode": "d_prefill_decode",
}
PAIR_COLORS = {
    "learner_vs_decode": "#d62728",
    "learner_vs_prefill": "#1f77b4",
    "prefill_vs_decode": "#2ca02c",
}
_counter = iter(range(1, 1 << 30))


def to_svg(fig: plt.Figure) -> str:
    """Serialize and close ``fig``; ids are made unique per chart so several SVGs share one page."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    prefix = f"c{next(_counter)}-"
    ids = set(re.findall(r'\bid="([^"]+)"', svg))
    if ids:
        pat = re.compile(r'(\bid="|#)(' + "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True)) + r')(?=["\)])')
        svg = pat.sub(lambda m: m.group(1) + prefix + m.group(2), svg)
    # responsive: drop fixed width/height, keep the viewBox
    svg = re.sub(r'^<svg([^>]*?) width="[^"]+" height="[^"]+"', r"<svg\1", svg, count=1)
    return svg


def _log_label(v: float, _pos: object = None) -> str:
    """Tick label without mathtext (which costs seconds per chart): 1e-3, 0.01, 1, 100."""
    if v == 0:
        return "0"
    e = int(np.floor(np.log10(abs(v)) + 1e-9))
    if abs(v) != 10.0**e:
        return ""
    sign = "-" if v < 0 else ""
    return f"{sign}{10.0**e:g}" if -2 <= e <= 3 else f"{sign}1e{e}"


def _plain_log(ax: plt.Axes, which: str = "y") -> None:
    """Plain-text major tick labels, no minor labels, on a log or symlog axis."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(_log_label))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _finish(fig: plt.Figure, axes: list[plt.Axes], **adjust: float) -> str:
    for ax in axes:
        for which in ("x", "y"):
            if (ax.get_xscale() if which == "x" else ax.get_yscale()) in ("log", "symlog"):
                _plain_log(ax, which)
    fig.subplots_adjust(**adjust)
    return to_svg(fig)


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _floor(values: np.ndarray) -> float:
    pos = values[np.isfinite(values) & (values > 0)]
    return float(pos.min() / 10) if pos.size else 1e-12


def drift_chart(ops: pd.DataFrame, first: dict[str, dict[str, Any] | None], local: list[dict[str, Any]] | None) -> str:
    """Op error along depth (execution order); first divergent ops marked; local vs inherited error
    per op (up to ``PER_OP_MAX`` ops; deeper runs get the aggregated charts of ``depth``)."""

    if local and len(ops) > PER_OP_MAX:
        local = None
    n_panels = 2 if local else 1
    fig, axes = plt.subplots(n_panels, 1, figsize=(10, 3.4 * n_panels), sharex=True, squeeze=False)
    ax = axes[0, 0]
    x = np.arange(len(ops))
    rel = ops["rel_l2"].to_numpy(float)
    mad = ops["max_abs_diff"].to_numpy(float)
    floor = _floor(np.concatenate([rel, mad]))
    bitwise = ops["bitwise_equal_frac"].to_numpy(float)
    eq = bitwise >= 1.0
    ax.plot(x, np.where(rel > 0, rel, floor), "-", color="#1f77b4", lw=1, label="relative L2 error")
    ax.plot(x, np.where(mad > 0, mad, floor), "-", color="#ff7f0e", lw=1, alpha=0.8, label="max |diff|")
    ax.scatter(x[eq], np.full(eq.sum(), floor), marker="s", s=10, color="#2ca02c", label="bitwise equal", zorder=3)
    ax.scatter(x[~eq], np.where(rel[~eq] > 0, rel[~eq], floor), s=12, color="#d62728", label="differs", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("error (sampler vs learner)")
    ax.set_title("Where drift starts: op error along depth")
    styles = {"bitwise": ("#d62728", "--"), "tolerance": ("#9467bd", ":"), "dominant": ("#ff7f0e", "-.")}
    offsets = {"bitwise": 0, "tolerance": 1, "dominant": 2}
    index = {(r.op, int(r.exec_order)): i for i, r in enumerate(ops.itertuples())}
    by_op = {r.op: i for i, r in enumerate(ops.itertuples())}
    for kind, fd in first.items():
        if not fd:
            continue
        i = index.get((fd.get("op"), fd.get("exec_order")), by_op.get(fd.get("op")))
        if i is None:
            continue
        for a in axes[:, 0]:
            a.axvline(i, color=styles.get(kind, styles["bitwise"])[0], ls=styles.get(kind, styles["bitwise"])[1], lw=1.2)
        ax.annotate(
            f"dominant divergence: {fd.get('op')}" if kind == "dominant" else f"first divergent ({kind}): {fd.get('op')}",
            (i, ax.get_ylim()[1]),
            xytext=(4, -12 - 12 * offsets.get(kind, 0)),
            textcoords="offset points",
            color=styles.get(kind, styles["bitwise"])[0],
            fontsize=8,
        )
    ax.legend(loc="lower right", fontsize=7, ncol=4)
    if local:
        ax2 = axes[1, 0]
        loc = {d.get("op"): d for d in local}
        le = np.array([_num(loc.get(op, {}).get("local_error")) for op in ops["op"]])
        ie = np.array([_num(loc.get(op, {}).get("inherited_error")) for op in ops["op"]])
        fl = _floor(np.concatenate([le, ie]))
        # zeros at the floor; NaN (op not replayed) not drawn
        ax2.bar(x - 0.2, np.where(le > 0, le, np.where(le == 0, fl, np.nan)), width=0.4, color="#d62728",
                label="local (introduced here)")  # fmt: skip
        ax2.bar(x + 0.2, np.where(ie > 0, ie, np.where(ie == 0, fl, np.nan)), width=0.4, color="#7f7f7f",
                label="inherited (from inputs)")  # fmt: skip
        ax2.set_yscale("log")
        ax2.set_ylabel("error")
        ax2.set_title("Local vs inherited error (input substitution)")
        ax2.legend(loc="upper left", fontsize=7)
    bottom = axes[-1, 0]
    layers = ops["layer"].to_numpy(int)
    starts = [i for i in range(len(layers)) if i == 0 or layers[i] != layers[i - 1]]
    ticks: list[int] = []
    gap = max(2, len(layers) // 40)  # keep labels apart (e.g. "embed" right before "L0")
    for i in starts[:: max(1, len(starts) // 24)]:
        if not ticks or i - ticks[-1] >= gap:
            ticks.append(i)
    bottom.set_xticks(ticks)
    bottom.set_xticklabels([ops["op"].iloc[i] if layers[i] < 0 else f"L{layers[i]}" for i in ticks], fontsize=7)
    bottom.set_xlabel("ops in execution order (ticks: start of each layer)")
    return _finish(fig, list(axes[:, 0]), hspace=0.3)


def scatter_chart(resp: pd.DataFrame, max_points: int = 200_000) -> str:
    """Learner vs sampler-decode logprob of each response token, and the gap against the logprob."""
    d = resp[["lp_learner", "lp_decode", "d_learner_decode"]].dropna()
    if len(d) > max_points:
        d = d.sample(max_points, random_state=0)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    s, lrn, gap = d["lp_decode"].to_numpy(), d["lp_learner"].to_numpy(), d["d_learner_decode"].to_numpy()
    fin = np.isfinite(s) & np.isfinite(lrn)
    a1.scatter(s[fin], lrn[fin], s=3, alpha=0.4, color="#1f77b4", rasterized=True, lw=0)
    if fin.any():
        lo, hi = float(min(s[fin].min(), lrn[fin].min())), float(max(s[fin].max(), lrn[fin].max(), 0))
        a1.plot([lo, hi], [lo, hi], color="k", lw=0.8, ls="--", label="y = x")
        a1.legend(loc="upper left", fontsize=7)
    a1.set_xlabel("sampler (decode) logprob")
    a1.set_ylabel("learner logprob")
    a1.set_title("Learner vs sampler logprob, response tokens")
    gfin = fin & np.isfinite(gap)
    a2.scatter(s[gfin], gap[gfin], s=3, alpha=0.4, color="#d62728", rasterized=True, lw=0)
    nz = np.abs(gap[gfin])
    nz = nz[nz > 0]
    a2.set_yscale("symlog", linthresh=float(nz.min()) if nz.size else 1e-6)
    a2.axhline(0, color="k", lw=0.6)
    a2.set_xlabel("sampler (decode) logprob")
    a2.set_ylabel("learner - sampler (symlog)")
    a2.set_title("Gap against token logprob")
    return _finish(fig, [a1, a2], wspace=0.3)


def histogram_chart(resp: pd.DataFrame) -> str:
    """|dlogp| histogram per pair on log-spaced bins; exact zeros counted in the legend."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    all_abs = np.concatenate([np.abs(resp[c].to_numpy(float)) for c in PAIR_DIFF.values()])
    pos = all_abs[np.isfinite(all_abs) & (all_abs > 0)]
    if pos.size:
        lo, hi = np.log10(pos.min()), np.log10(pos.max())
        bins = np.logspace(np.floor(lo), np.ceil(hi) + (hi == lo), 60)
    else:
        bins = np.logspace(-9, 0, 60)
    for pair, col in PAIR_DIFF.items():
        v = np.abs(resp[col].to_numpy(float))
        v = v[~np.isnan(v)]
        n_zero = int((v == 0).sum())
        n_inf = int(np.isinf(v).sum())
        p = v[np.isfinite(v) & (v > 0)]
        label = f"{PAIR_LABELS[pair]} ({n_zero} exactly 0" + (f", {n_inf} inf" if n_inf else "") + ")"
        ax.hist(p, bins=bins, histtype="step", lw=1.4, color=PAIR_COLORS[pair], label=label)
    ax.set_xscale("log")
    if pos.size:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no nonzero gaps", transform=ax.transAxes, ha="center", color="#5b6475")
    ax.set_xlabel("|learner - sampler| logprob (log scale)")
    ax.set_ylabel("tokens")
    ax.set_title("Distribution of |dlogp| over response tokens")
    ax.legend(fontsize=7, loc="upper right")
    return _finish(fig, [ax])


def decomposition_chart(summary: dict[str, Any], resp: pd.DataFrame) -> str:
    """Gap of each engine pair (mean/p99/max |d|), and mean |d| along the response position."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 1.4]})
    stats = ("mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp")
    w = 0.26
    vals = np.array([[float(summary["pairs"].get(p, {}).get(s, np.nan)) for s in stats] for p in PAIR_DIFF])
    fl = _floor(vals.ravel())
    for i, pair in enumerate(PAIR_DIFF):
        v = np.where(np.isfinite(vals[i]), vals[i], np.nan)  # inf bars cannot be drawn; the table shows them
        a1.bar(
            np.arange(3) + (i - 1) * w,
            np.where(v > 0, v, fl),
            width=w,
            color=PAIR_COLORS[pair],
            label=PAIR_LABELS[pair],
        )
    a1.set_xticks(np.arange(3))
    a1.set_xticklabels(["mean |d|", "p99 |d|", "max |d|"])
    a1.set_yscale("log")
    a1.set_title("Decomposition of the gap by engine pair")
    a1.legend(fontsize=6.5, loc="upper left")
    if len(resp):
        start = resp.groupby("seq_id")["pos"].transform("min")
        rel = (resp["pos"] - start).to_numpy()
        nb = int(min(32, max(1, rel.max() + 1)))
        edges = np.linspace(0, rel.max() + 1, nb + 1)
        which = np.clip(np.digitize(rel, edges) - 1, 0, nb - 1)
        centers = (edges[:-1] + edges[1:]) / 2
        for pair, col in PAIR_DIFF.items():
            v = np.abs(resp[col].to_numpy(float))
            ok = np.isfinite(v)
            sums = np.bincount(which[ok], weights=v[ok], minlength=nb)
            cnt = np.bincount(which[ok], minlength=nb)
            with np.errstate(invalid="ignore", divide="ignore"):
                m = sums / cnt
            a2.plot(centers, m, "-o", ms=2.5, lw=1.2, color=PAIR_COLORS[pair], label=PAIR_LABELS[pair])
        if np.nanmax(np.abs(resp[list(PAIR_DIFF.values())].to_numpy(float))) > 0:
            a2.set_yscale("symlog", linthresh=fl)
    a2.set_xlabel("response position (tokens after the prompt)")
    a2.set_ylabel("mean |d|")
    a2.set_title("Gap along the response")
    return _finish(fig, [a1, a2], wspace=0.3)


def ablation_chart(ablation: list[dict[str, Any]], top: int = 20) -> str:
    """Horizontal bars: share of the final gap each alignment group accounts for."""
    rows = sorted(ablation, key=lambda r: -np.nan_to_num(_num(r.get("share")), nan=-np.inf))[:top]
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.2))
    labels = [f"{r.get('group')} ({r.get('kind')})" for r in rows][::-1]
    shares = [_num(r.get("share")) for r in rows][::-1]
    ax.barh(np.arange(len(rows)), shares, color="#9467bd")
    ax.set_yticks(np.arange(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("share of the final logprob gap removed by aligning the group")
    ax.set_title("Ablation ranking")
    return _finish(fig, [ax])
