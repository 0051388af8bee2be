"""Tiny HTML helpers: escaping, numbers, tables, figures."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

from mismatch_probe.analysis.gate import fmt_num


def esc(x: Any) -> str:
    return escape(str(x), quote=True)


def num(x: Any) -> str:
    """A number for display; None/NaN/inf spelled out."""
    if x is None:
        return "-"
    if isinstance(x, bool | str):
        return esc(x)
    try:
        return esc(fmt_num(float(x)))
    except (TypeError, ValueError):
        return esc(x)


def sort_key(x: Any) -> str:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return esc(x)
    return "nan" if math.isnan(f) else repr(f)


def td_num(x: Any, cls: str = "") -> str:
    return f'<td class="n {cls}" data-v="{sort_key(x)}">{num(x)}</td>'


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    numeric: Iterable[int] = (),
    cls: str = "",
    row_cls: Sequence[str] | None = None,
    tid: str = "",
) -> str:
    """``rows`` hold ready-made ``<td>`` strings (use :func:`td`, :func:`td_num`)."""
    numeric = set(numeric)
    head = "".join(f'<th class="{"n" if i in numeric else ""}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = []
    for i, r in enumerate(rows):
        rc = f' class="{row_cls[i]}"' if row_cls and row_cls[i] else ""
        body.append(f"<tr{rc}>{''.join(r)}</tr>")
    idattr = f' id="{tid}"' if tid else ""
    return f'<table class="{cls}"{idattr}><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def td(x: Any, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f"<td{c}>{esc(x)}</td>"


def kv_table(d: dict[str, Any], tid: str = "") -> str:
    rows = []
    for k, v in d.items():
        shown = json.dumps(v, default=str) if isinstance(v, dict | list) else v
        rows.append([td(k), td("-" if shown is None else shown)])
    return table(["key", "value"], rows, tid=tid)


def figure(name: str, svg: str, caption: str) -> str:
    n = esc(name)
    cap = f"<figcaption>{esc(caption)}</figcaption>"
    return f'<figure class="chart" data-chart="{n}" id="chart-{n}">{svg}{cap}</figure>'


def missing(section: str, why: str) -> str:
    return f'<p class="missing" data-absent="{esc(section)}">Section absent: {esc(why)}</p>'
