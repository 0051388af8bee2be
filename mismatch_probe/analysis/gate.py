"""CI gate on a run's logprob gap: threshold checks, verdicts, Markdown and JUnit XML output.

No engine imports: the gate reads ``RUN/manifest.json``, ``RUN/compare/summary.json`` and, for
the first-divergent-op check, ``RUN/bisect.json`` (or ``RUN/compare/op_errors.parquet``).

A check is ``[PAIR.]METRIC OP VALUE`` with OP one of ``<= < >= > ==``; PAIR defaults to the
gate's pair (``learner_vs_decode``). Metrics are the keys of ``summary.json`` for that pair
(see :mod:`mismatch_probe.analysis.metrics`), where the run captured top-K logprobs the keys of the pair's
``full_vocab`` block (``kl_fwd``, ``kl_rev``, ``top1_agree``, ...), and each RL framework's
metrics under its own names as ``conventions.FRAMEWORK.NAME`` (e.g.
``conventions.verl.rollout_is_eff_sample_size>=0.99``, see :mod:`mismatch_probe.analysis.conventions`),
optionally after the pair (``learner_vs_prefill.conventions.slime.mis_kl<=1e-3``). A NaN or
infinite value never passes a ``<=`` check. A check whose metric the run did not record is
*skipped* (``--strict`` makes that a failure). A metric name nobody defines is a usage error.

Verdicts: ``pass``, ``fail``, ``skip``. Exit codes (see ``cmd_report.gate``): 0 all pass (or
skip), 1 any fail, 2 usage or input error.
"""

from __future__ import annotations

import math
import re
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.analysis import token_gaps
from mismatch_probe.analysis.conventions import FRAMEWORKS, framework_metrics
from mismatch_probe.analysis.metrics import GAP_METRICS, RATIO_METRICS
from mismatch_probe.errors import UsageError
from mismatch_probe.run.reader import BISECT, OP_ERRORS, SUMMARY, RunDir, corrupt

PAIRS = tuple(token_gaps.PAIRS)  # pair names are defined once, in analysis/token_gaps.py
TRAINER_PAIRS = tuple(token_gaps.TRAINER_PAIRS)  # runs of compare --rollouts with trainer logprobs
FULL_VOCAB_METRICS = (
    "kl_fwd", "kl_rev", "top1_agree", "topk_overlap", "sampled_rank_mean", "sampled_rank_max",
    "sampled_in_topk_frac", "entropy_learner", "entropy_sampler", "n_positions",
)  # fmt: skip
OTHER_METRICS = ("n_tokens", "n_nonfinite", "pearson_prob", "ppl_learner", "ppl_sampler")
KNOWN_METRICS = frozenset(GAP_METRICS + RATIO_METRICS + FULL_VOCAB_METRICS + OTHER_METRICS)
_x = np.array([-1.0, -2.0])
CONVENTION_METRICS: dict[str, frozenset[str]] = {
    f: frozenset(v) for f, v in framework_metrics(_x, _x - 0.5, np.array([0, 1])).items()
}
OPS = ("<=", ">=", "==", "<", ">")
FIRST_DIVERGENT = "first_divergent_op"

# flag / TOML key -> metric it bounds from above
MAX_FLAGS: dict[str, tuple[str, ...]] = {
    "max_mean_abs_dlogp": ("mean_abs_dlogp",),
    "max_max_abs_dlogp": ("max_abs_dlogp",),
    "max_k3": ("k3",),
    "max_clip_frac": ("clip_frac",),
    "max_kl": ("kl_fwd", "kl_rev"),
}
TOML_KEYS = frozenset(MAX_FLAGS) | {
    "pair",
    "checks",
    "allow_first_divergent",
    "first_divergent_kind",
    "strict",
}

_CHECK_RE = re.compile(r"^\s*(?P<key>[A-Za-z0-9_.]+)\s*(?P<op><=|>=|==|<|>)\s*(?P<val>\S+)\s*$")


# --------------------------------------------------------------------------- run inputs


def first_divergent_from_run(run: Path | RunDir, kind: str = "bitwise") -> tuple[bool, dict[str, Any] | None, str]:
    """(known, first divergent op or None, source or why unknown) from bisect.json, else op_errors.parquet.

    ``known`` is False when the run captured no ops, or, for the tolerance kind, holds no
    bisect.json (tolerances by dtype are bisect's). A run that captured ops but lost the file the
    check needs is corrupt (SchemaError, exit 2), never a skip.
    """
    rd = run if isinstance(run, RunDir) else RunDir(run)
    bis = rd.bisect()
    if bis is not None:
        return True, bis["first_divergent"].get(kind), BISECT
    if kind != "bitwise" and rd.captured_ops():
        return False, None, f"the {kind} first divergent op comes from {BISECT}: run `mismatch-probe bisect RUN`"
    errs = rd.op_errors()
    if errs is None:
        return False, None, f"no op capture in this run (no {BISECT} or {OP_ERRORS})"
    if kind != "bitwise":
        return False, None, f"the {kind} first divergent op comes from {BISECT}: run `mismatch-probe bisect RUN`"
    from mismatch_probe.analysis.op_errors import first_divergent

    errs["bitwise_equal_frac"] = errs["bitwise_equal_frac"].fillna(0.0)
    fd = first_divergent(errs)["bitwise"]
    return True, fd and {k: fd[k] for k in ("op", "layer", "exec_order")}, Path(OP_ERRORS).name


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    metric: str
    op: str
    threshold: float
    pair: str

    @property
    def name(self) -> str:
        return f"{self.pair}.{self.metric} {self.op} {fmt_num(self.threshold)}"


@dataclass
class CheckResult:
    check: Check | None  # None for the first-divergent-op check
    name: str
    pair: str
    value: float | str | None
    threshold: str
    verdict: str  # pass | fail | skip
    detail: str = ""


@dataclass
class GateConfig:
    pair: str = "learner_vs_decode"
    checks: list[Check] = field(default_factory=list)
    allow_first_divergent: bool | None = None  # None: not checked
    first_divergent_kind: str = "bitwise"
    strict: bool = False


def fmt_num(x: float | str | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(x).lower()
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if float(x).is_integer() and abs(x) < 1e9:
        return str(int(x))
    return f"{x:.4g}"


def _to_float(v: Any, where: str) -> float:
    if isinstance(v, bool):
        raise UsageError(f"{where}: expected a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: expected a number, got {v!r}") from None


def _threshold(v: Any, where: str) -> float:
    """A threshold: a number that is not NaN (a NaN bound would fail every run: a usage error)."""
    x = _to_float(v, where)
    if math.isnan(x):
        raise UsageError(f"{where}: a threshold must be a number, not NaN")
    return x


def _check_pair(pair: str, where: str) -> str:
    if pair not in PAIRS + TRAINER_PAIRS:
        raise UsageError(f"{where}: unknown pair {pair!r}; choose one of {', '.join(PAIRS + TRAINER_PAIRS)}")
    return pair


def parse_check(spec: str, default_pair: str) -> Check:
    """Parse ``[PAIR.]METRIC OP VALUE`` (e.g. ``k3<=1e-4``, ``prefill_vs_decode.max_abs_dlogp<0.01``)."""
    m = _CHECK_RE.match(spec)
    if not m:
        raise UsageError(f"bad check {spec!r}: expected [PAIR.]METRIC<=VALUE (operators: {' '.join(OPS)})")
    parts = m["key"].split(".")
    pair = default_pair
    if len(parts) > 1 and parts[0] not in ("conventions", "full_vocab"):
        pair, parts = parts[0], parts[1:]
    pair = _check_pair(pair, f"check {spec!r}")
    metric = ".".join(parts)
    _check_metric(metric, spec)
    return Check(metric, m["op"], _threshold(m["val"], f"check {spec!r}"), pair)


def _check_metric(metric: str, spec: str) -> None:
    parts = metric.split(".")
    if parts[0] == "full_vocab" and len(parts) == 2:
        parts = parts[1:]
    if len(parts) == 1:
        if parts[0] not in KNOWN_METRICS:
            raise UsageError(
                f"check {spec!r}: unknown metric {parts[0]!r}; known: {', '.join(sorted(KNOWN_METRICS))}, "
                "and conventions.FRAMEWORK.NAME"
            )
        return
    if parts[0] != "conventions" or len(parts) != 3:
        raise UsageError(f"check {spec!r}: unknown metric {metric!r}; a framework's metric is conventions.FRAMEWORK.NAME")
    fw, name = parts[1], parts[2]
    if fw not in CONVENTION_METRICS:
        raise UsageError(f"check {spec!r}: unknown framework {fw!r}; choose one of {', '.join(FRAMEWORKS)}")
    if name not in CONVENTION_METRICS[fw]:
        raise UsageError(
            f"check {spec!r}: unknown metric {name!r} of {fw}; known: {', '.join(sorted(CONVENTION_METRICS[fw]))}"
        )


def max_checks(key: str, value: float, pair: str) -> list[Check]:
    return [Check(metric, "<=", float(value), pair) for metric in MAX_FLAGS[key]]


def load_toml(path: Path) -> dict[str, Any]:
    """Read a gate TOML file: keys at top level or under ``[gate]`` (not both); unknown keys are errors."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"gate config not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"invalid gate config {path}: {e}") from None
    if "gate" in data:
        if not isinstance(data["gate"], dict):
            raise UsageError(f"{path}: [gate] must be a table")
        beside = sorted(k for k in data if k != "gate")
        if beside:
            raise UsageError(f"{path}: key(s) {', '.join(beside)} at the top level beside a [gate] table would be "
                             "ignored; put them under [gate]")
        data = data["gate"]
    unknown = sorted(set(data) - TOML_KEYS)
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(TOML_KEYS))}")
    return data


def build_config(
    *,
    toml: dict[str, Any] | None = None,
    pair: str | None = None,
    flag_max: dict[str, float | None] | None = None,
    checks: Iterable[str] = (),
    allow_first_divergent: bool | None = None,
    first_divergent_kind: str | None = None,
    strict: bool | None = None,
) -> GateConfig:
    """Merge TOML settings and command-line flags (flags win for the same key)."""
    toml = dict(toml or {})
    cfg = GateConfig()
    cfg.pair = _check_pair(str(pair or toml.get("pair") or cfg.pair), "--pair")
    maxes: dict[str, float] = {}
    for key in MAX_FLAGS:
        if key in toml:
            maxes[key] = _threshold(toml[key], f"gate config {key}")
    for key, v in (flag_max or {}).items():
        if v is not None:
            maxes[key] = _threshold(v, "--" + key.replace("_", "-"))
    for key, v in maxes.items():
        cfg.checks.extend(max_checks(key, v, cfg.pair))
    toml_checks = toml.get("checks", [])
    if not isinstance(toml_checks, list) or not all(isinstance(c, str) for c in toml_checks):
        raise UsageError("gate config 'checks' must be a list of strings like \"k3 <= 1e-4\"")
    for spec in [*toml_checks, *checks]:
        cfg.checks.append(parse_check(spec, cfg.pair))
    afd = allow_first_divergent if allow_first_divergent is not None else toml.get("allow_first_divergent")
    if afd is not None and not isinstance(afd, bool):
        raise UsageError("gate config allow_first_divergent must be true or false")
    cfg.allow_first_divergent = afd
    kind = first_divergent_kind or toml.get("first_divergent_kind") or "bitwise"
    if kind not in ("bitwise", "tolerance"):
        raise UsageError(f"first divergent kind must be bitwise or tolerance, not {kind!r}")
    cfg.first_divergent_kind = kind
    st = strict if strict is not None else toml.get("strict", False)
    if not isinstance(st, bool):
        raise UsageError("gate config strict must be true or false")
    cfg.strict = st
    if not cfg.checks and cfg.allow_first_divergent is None:
        raise UsageError(
            "no checks given: pass thresholds such as --max-mean-abs-dlogp 1e-3, --check 'k3<=1e-4', "
            "--no-first-divergent, or --config gate.toml"
        )
    return cfg


def _compare(value: float, op: str, threshold: float) -> bool:
    if math.isnan(value):
        return False
    return {
        "<=": value <= threshold,
        "<": value < threshold,
        ">=": value >= threshold,
        ">": value > threshold,
        "==": value == threshold,
    }[op]


def _value(v: Any, where: str) -> float:
    """A metric value of summary.json: a number (JSON null: NaN); anything else is a corrupt run."""
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise corrupt(SUMMARY, f"{where} is {type(v).__name__} {v!r}, expected a number")
    return float(v)


def _lookup(summary: dict[str, Any], pair: str, metric: str) -> tuple[float | None, str]:
    block = summary["pairs"].get(pair)
    if not isinstance(block, dict):
        return None, f"pair {pair} not in {SUMMARY}"
    if metric.startswith("conventions."):
        _, fw, name = metric.split(".")
        conv = (block.get("conventions") or {}).get(fw)
        if not isinstance(conv, dict) or name not in conv:
            return None, f"{metric} not recorded for {pair} (a run made before framework conventions?)"
        return _value(conv[name], f"{pair}.{metric}"), ""
    metric = metric.removeprefix("full_vocab.")
    if metric in FULL_VOCAB_METRICS:
        fv = block.get("full_vocab")
        if not isinstance(fv, dict):
            return None, "top-K logprobs not captured in this run (compare --topk K)"
        if metric not in fv:
            return None, f"{metric} not in full_vocab"
        return _value(fv[metric], f"{pair}.full_vocab.{metric}"), ""
    if metric not in block:
        return None, f"{metric} not recorded for {pair}"
    return _value(block[metric], f"{pair}.{metric}"), ""


def evaluate(cfg: GateConfig, summary: dict[str, Any], run: Path | None = None) -> list[CheckResult]:
    """Evaluate every check of ``cfg`` on a run's summary (and bisect result, for that check)."""
    miss = "fail" if cfg.strict else "skip"
    out: list[CheckResult] = []
    for c in cfg.checks:
        value, why = _lookup(summary, c.pair, c.metric)
        thr = f"{c.op} {fmt_num(c.threshold)}"
        if value is None:
            out.append(CheckResult(c, c.metric, c.pair, None, thr, miss, why + (" (--strict)" if cfg.strict else "")))
            continue
        ok = _compare(value, c.op, c.threshold)
        detail = "" if ok else ("value is NaN" if math.isnan(value) else "threshold exceeded")
        out.append(CheckResult(c, c.metric, c.pair, value, thr, "pass" if ok else "fail", detail))
    if cfg.allow_first_divergent is not None:
        thr = "allowed" if cfg.allow_first_divergent else "none"
        name = f"{FIRST_DIVERGENT} ({cfg.first_divergent_kind})"
        known, fd, src = first_divergent_from_run(run, cfg.first_divergent_kind) if run else (False, None, "no run")
        if not known:
            out.append(CheckResult(None, name, "learner_vs_sampler", None, thr, miss, src))
        else:
            val = "none" if fd is None else f"{fd.get('op')} (layer {fd.get('layer')}, #{fd.get('exec_order')})"
            ok = cfg.allow_first_divergent or fd is None
            out.append(
                CheckResult(
                    None,
                    name,
                    "learner_vs_sampler",
                    val,
                    thr,
                    "pass" if ok else "fail",
                    f"from {src}" + ("" if ok else "; engines diverge"),
                )
            )
    return out


def overall(results: list[CheckResult]) -> str:
    return "fail" if any(r.verdict == "fail" for r in results) else "pass"


# --------------------------------------------------------------------------- outputs


def to_markdown(results: list[CheckResult], run: Path, manifest: dict[str, Any] | None = None) -> str:
    verdict = overall(results)
    icon = {"pass": "✅", "fail": "❌", "skip": "⚪"}
    n = {v: sum(r.verdict == v for r in results) for v in ("pass", "fail", "skip")}
    lines = [
        f"## mismatch-probe gate: {icon[verdict]} {verdict.upper()}",
        "",
        f"Run `{run}`"
        + (f", model `{(manifest or {}).get('config', {}).get('model', '?')}`" if manifest else "")
        + f": {n['pass']} passed, {n['fail']} failed, {n['skip']} skipped.",
        "",
        "| check | pair | value | threshold | verdict | detail |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [r.name, r.pair, fmt_num(r.value), r.threshold, f"{icon[r.verdict]} {r.verdict}", r.detail]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def to_junit(results: list[CheckResult], run: Path, elapsed_s: float = 0.0) -> bytes:
    n_fail = sum(r.verdict == "fail" for r in results)
    n_skip = sum(r.verdict == "skip" for r in results)
    counts = {
        "name": "mismatch-probe gate",
        "tests": str(len(results)),
        "failures": str(n_fail),
        "errors": "0",
        "skipped": str(n_skip),
        "time": f"{elapsed_s:.3f}",
    }
    suites = ET.Element("testsuites", counts)
    suite = ET.SubElement(suites, "testsuite", counts)
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="run", value=str(run))
    for r in results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"mismatch_probe.gate.{r.pair}",
            name=f"{r.name} {r.threshold}",
            time="0",
        )
        msg = f"{r.name} = {fmt_num(r.value)}, required {r.threshold}" + (f": {r.detail}" if r.detail else "")
        if r.verdict == "fail":
            f = ET.SubElement(case, "failure", message=msg, type="threshold")
            f.text = msg
        elif r.verdict == "skip":
            ET.SubElement(case, "skipped", message=r.detail or "not recorded")
        else:
            out = ET.SubElement(case, "system-out")
            out.text = msg
    ET.indent(suites)
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="utf-8") + b"\n"


def run_gate(run: Path, cfg: GateConfig) -> tuple[list[CheckResult], dict[str, Any]]:
    """Read the run and evaluate ``cfg``; SchemaError (exit 2) on missing or corrupt inputs that a
    check needs (never a pass)."""
    rd = RunDir(run).require_complete("the gate needs a finished compare")
    summary = rd.summary()
    return evaluate(cfg, summary, rd), rd.manifest
