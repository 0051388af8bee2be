"""Ablation: which op classes (then which layers) account for how much of the logprob gap?

Switch the strict (aligned, identical in both engines) implementation on for a *set* of op
classes in both engines at once, re-score the run's sequences, and measure the remaining gap
(mean |dlogp| over response tokens, learner vs sampler prefill). The share of a set is the gap it
removes. Sets are bisected (delta debugging): a set is split only while it removes a noticeable
part of the gap, so k relevant classes among n cost O(k log n) passes, not n; where neither half
of a set removes a noticeable part but the set does, its members are tried one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

GapFn = Callable[[frozenset[str], frozenset[int] | None], float]


def bisect_sets(items: Sequence[Any], share: Callable[[frozenset[Any]], float], min_share: float) -> list[dict[str, Any]]:
    """Leaves (single items) whose share >= ``min_share``, found by halving; every evaluated set
    is returned with its share (``evaluated``), so the search is auditable."""
    found: list[dict[str, Any]] = []

    def visit(group: list[Any], s: float) -> None:
        if len(group) == 1:
            found.append({"group": group[0], "share": s})
            return
        mid = len(group) // 2
        halves = [(half, share(frozenset(half))) for half in (group[:mid], group[mid:])]
        if len(group) > 2 and all(sh < min_share for _, sh in halves):
            # contributions that only show together (aligning half of them moves the gap less than
            # the threshold): look at the members one by one (a finer granularity, as ddmin does)
            halves = [([item], share(frozenset([item]))) for item in group]
        for half, sh in halves:
            if sh >= min_share:
                visit(half, sh)

    whole = list(items)
    visit(whole, share(frozenset(whole)))
    return sorted(found, key=lambda r: -r["share"])


def run_ablation(engines: Any, seqs: list[list[int]], n_prompt: list[int], kinds: Sequence[str],
                 num_layers: int, min_frac: float = 0.05, progress: Any = None) -> dict[str, Any]:
    """Rank op classes, then the layers of the top class, by their share of the gap.

    ``engines`` stay loaded for every pass (each runner's ``recipe_applied`` switches op sets in
    place, the sampler's plugin and the learner's patch alike); ``seqs`` are the sequences to score
    (the caller picks the ones that carry the gap).
    ``progress``: a ``rich.progress.Progress``; each pass gets a bar named by its op set, advanced
    after the sampler and after the learner scored."""
    mask = np.concatenate([np.arange(1, len(s)) >= n for s, n in zip(seqs, n_prompt, strict=True)])
    learner, sampler = engines.learner, engines.sampler
    passes: list[dict[str, Any]] = []

    seen: dict[tuple[frozenset[str], frozenset[int] | None], float] = {}

    def gap(ops: frozenset[str], layers: frozenset[int] | None) -> float:
        if layers is not None and layers == frozenset(range(num_layers)):
            layers = None  # every layer: the class-level pass
        if (ops, layers) in seen:  # e.g. the whole set: the all-aligned pass is also the search's root
            return seen[(ops, layers)]
        where = "" if layers is None else f" @ layers {sorted(layers)}"
        desc = f"pass {len(passes) + 1}: {', '.join(sorted(ops)) or 'engine (none aligned)'}{where}"
        task = None if progress is None else progress.add_task(desc, total=2)
        subset = {"ops": sorted(ops), "layers": None if layers is None else sorted(layers)}
        with sampler.recipe_applied("strict", **subset):
            ls = np.concatenate(sampler.score(seqs))
        if task is not None:
            progress.advance(task)
        with learner.recipe_applied("strict", **subset):
            ll = np.concatenate(learner.score(seqs))
        if task is not None:
            progress.advance(task)
        g = float(np.abs(ll - ls)[mask].mean()) if mask.any() else 0.0
        passes.append({"ops": sorted(ops), "layers": None if layers is None else sorted(layers), "gap": g})
        seen[(ops, layers)] = g
        if task is not None:
            progress.update(task, description=f"{desc} -> gap {g:.3e}")
        return g

    base = gap(frozenset(), None)
    aligned = gap(frozenset(kinds), None)
    min_share = min_frac * base
    by_kind = bisect_sets(list(kinds), lambda s: base - gap(s, None), min_share) if base > 0 else []
    by_layer: list[dict[str, Any]] = []
    if by_kind and num_layers > 0:
        top = frozenset([by_kind[0]["group"]])
        by_layer = bisect_sets(list(range(num_layers)), lambda ls: base - gap(top, ls), min_share)
        by_layer = [{"group": f"{by_kind[0]['group']} @ layer {r['group']}", **{k: v for k, v in r.items() if k != "group"}}
                    for r in by_layer]
    ranking = [{"group": r["group"], "kind": "op_kind", "share": r["share"] / base if base else 0.0,
                "gap_removed": r["share"], "gap_after": base - r["share"]} for r in by_kind]
    ranking += [{"group": r["group"], "kind": "layer", "share": r["share"] / base if base else 0.0,
                 "gap_removed": r["share"], "gap_after": base - r["share"]} for r in by_layer]
    return {"gap_engine": base, "gap_all_aligned": aligned, "ranking": ranking, "passes": passes,
            "n_passes": len(passes), "n_kinds": len(kinds), "metric": "mean |dlogp|, learner vs sampler prefill"}
