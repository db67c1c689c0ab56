"""Benchmarks and sweeps. Where they write, and what a saved result says about itself.

A run writes its JSON to ``bench/results/latest/`` (ignored by git), so a fresh checkout
stays clean; ``--save`` writes to ``bench/results/`` instead, the tracked files that the
README's figures come from. Every result carries :func:`provenance`: when, at which
commit, on what machine.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
UNSAVED = os.path.join(RESULTS, "latest")
SAVE_HELP = ("write results to bench/results/ (tracked: the README's figures) instead of bench/results/latest/ "
             "(ignored by git)")


def results_path(name: str, save: bool) -> str:
    """Where a result file named ``name`` goes: bench/results/ with --save, else latest/."""
    folder = RESULTS if save else UNSAVED
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def _git(*argv) -> str:
    try:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no git: no commit
        return ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict:
    """When a result was taken and on what: UTC time, commit (and whether the device or
    runtime had uncommitted changes), CPU, cores, memory, Python and torch."""
    import torch

    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    dirty = [line.split(maxsplit=1)[-1]
             for line in _git("status", "--porcelain", "--", "device", "fusion", "adaptive_eager").splitlines()]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "--short=10", "HEAD"),
        "uncommitted_device_runtime_files": dirty,
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib, "system": platform.system(),
                    "python": platform.python_version(), "torch": torch.__version__},
    }


def describe(info: dict) -> str:
    """One line for a figure's caption: "2026-12-01 10:00 UTC, commit abc1234, AMD EPYC ... (2 cores)"."""
    machine = info.get("machine", {})
    dirty = " (+ uncommitted changes)" if info.get("uncommitted_device_runtime_files") else ""
    return (f"{info.get('date', '?')}, commit {info.get('commit') or '?'}{dirty}, {machine.get('cpu', '?')} "
            f"({machine.get('cores', '?')} cores, {machine.get('memory_gib', '?')} GiB), Python {machine.get('python', '?')}, "
            f"torch {machine.get('torch', '?')}")
