"""Local vs inherited error at real depth (30-80 layers): aggregated by layer and op kind, and the
top contributors, instead of one bar pair per op (a 60-layer model has ~900 ops).

``local_error`` is the error an op introduces itself (its inputs substituted with the learner's),
``inherited_error`` what arrives with its inputs (bisect.json ``local_errors``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from mismatch_probe.reports.plots import PER_OP_MAX, _finish, _num, plt  # noqa: F401 (PER_OP_MAX: re-exported)

KIND_GROUPS = (  # op kind -> group, first match wins
    ("norm", re.compile(r"(^|_|\.)norm$|norm\b")),
    ("attention", re.compile(r"^attn\.")),
    ("mlp / moe", re.compile(r"^(mlp|moe)\.")),
    ("residual", re.compile(r"^(resid_mid|out)$")),
)


def op_kind(op: str) -> str:
    """``'12.attn.q'`` -> ``'attn.q'``; ops outside the layers keep their name."""
    head, _, rest = op.partition(".")
    return rest if head.isdigit() and rest else op


def kind_group(kind: str) -> str:
    for name, pat in KIND_GROUPS:
        if pat.search(kind):
            return name
    return "other"


def local_frame(local: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(
        {
            "op": [str(d.get("op")) for d in local],
            "layer": [int(_num(d.get("layer"))) if np.isfinite(_num(d.get("layer"))) else -1 for d in local],
            "local": [_num(d.get("local_error")) for d in local],
            "inherited": [_num(d.get("inherited_error")) for d in local],
        }
    )
    df["kind"] = df["op"].map(op_kind)
    df["group"] = df["kind"].map(kind_group)
    return df


def aggregated(local: list[dict[str, Any]], top: int = 15) -> tuple[str, str]:
    """(SVG of local error per layer x op kind plus per-layer totals, SVG of the top contributors)."""
    df = local_frame(local)
    return _by_layer(df), _top(df, top)


def _by_layer(df: pd.DataFrame) -> str:
    layers = df[df.layer >= 0]
    kinds = list(dict.fromkeys(layers["kind"]))  # execution order within a layer
    lay = sorted(layers["layer"].unique())
    grid = layers.pivot_table(index="kind", columns="layer", values="local", aggfunc="sum").reindex(index=kinds, columns=lay)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 2.2 + 0.16 * len(kinds) + 2.6), sharex=True,
                                  gridspec_kw={"height_ratios": [0.16 * len(kinds) + 0.6, 2.2]})  # fmt: skip
    vals = grid.to_numpy(float)
    pos = vals[np.isfinite(vals) & (vals > 0)]
    lo, hi = (float(pos.min()), float(pos.max())) if pos.size else (1e-12, 1e-11)
    from matplotlib.colors import LogNorm

    shown = np.where(vals > 0, vals, np.nan)
    im = ax.imshow(shown, aspect="auto", cmap="viridis", norm=LogNorm(vmin=lo, vmax=max(hi, lo * 10)),
                   extent=(-0.5, len(lay) - 0.5, len(kinds) - 0.5, -0.5), interpolation="nearest")  # fmt: skip
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels(kinds, fontsize=7)
    ax.grid(False)
    ax.set_title("Local error per layer and op kind (blank: exactly 0 or not replayed)")
    fig.colorbar(im, ax=[ax], fraction=0.03, pad=0.01, label="local error")
    per_layer = layers.groupby("layer")["local"].sum().reindex(lay).to_numpy(float)
    # inherited error arriving at the layer's last op: what the layer passes on
    inherited = layers.groupby("layer")["inherited"].last().reindex(lay).to_numpy(float)
    allv = np.concatenate([per_layer, inherited])
    fl = float(allv[np.isfinite(allv) & (allv > 0)].min() / 10) if np.any(allv > 0) else 1e-12
    x = np.arange(len(lay))
    ax2.bar(x, np.where(per_layer > 0, per_layer, fl), width=0.8, color="#d62728", label="local, summed over the layer's ops")
    ax2.plot(x, np.where(inherited > 0, inherited, fl), "-o", ms=2.5, color="#7f7f7f", lw=1,
             label="inherited at the layer's last op")  # fmt: skip
    ax2.set_yscale("log")
    ax2.set_ylabel("error")
    ax2.legend(loc="upper left", fontsize=7)
    step = max(1, len(lay) // 20)
    ax2.set_xticks(x[::step])
    ax2.set_xticklabels([f"L{v}" for v in lay[::step]], fontsize=7)
    ax2.set_xlabel("decoder layer")
    return _finish(fig, [ax2], hspace=0.25, right=0.88)


def _top(df: pd.DataFrame, top: int) -> str:
    d = df[np.isfinite(df["local"])].sort_values("local", ascending=False, kind="stable").head(top)
    d = d.iloc[::-1]  # largest at the top of a horizontal bar chart
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.28 * max(len(d), 1)))
    y = np.arange(len(d))
    allv = np.concatenate([d["local"].to_numpy(float), d["inherited"].to_numpy(float)])
    fl = float(allv[np.isfinite(allv) & (allv > 0)].min() / 10) if np.any(allv > 0) else 1e-12
    loc, inh = d["local"].to_numpy(float), d["inherited"].to_numpy(float)
    ax.barh(y + 0.2, np.where(loc > 0, loc, fl), height=0.4, color="#d62728", label="local (introduced here)")
    ax.barh(y - 0.2, np.where(inh > 0, inh, fl), height=0.4, color="#7f7f7f", label="inherited (from inputs)")
    ax.set_yticks(y)
    ax.set_yticklabels(d["op"].tolist(), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("error")
    ax.set_title(f"Top {len(d)} ops by local error")
    ax.legend(loc="lower right", fontsize=7)
    return _finish(fig, [ax], left=0.2)
