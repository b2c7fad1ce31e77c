"""The machine a benchmark ran on, for the headers of its results (no framework imported)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        models = []
    return models[0] if models else platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, e.g. ``"0.52, 0.61, 0.70"`` ("n/a" on Windows)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"
