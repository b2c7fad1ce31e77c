"""The machine a benchmark ran on, for the headers of its results (no framework imported).

The pieces a header is written from: ``cpu_and_cores()`` ("AMD EPYC, 2 cores"),
``software("torch", "jax")`` ("python 3.11.7, torch 2.13.0+cpu, jax 0.10.2"), ``timestamp()``,
``today()``, ``load_average()`` and ``load_span(at_start)``, ``command_line()``.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        models = []
    return models[0] if models else platform.processor() or platform.machine() or "unknown CPU"


def cpu_and_cores() -> str:
    """The CPU and its number of cores, e.g. ``"AMD EPYC, 2 cores"``."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, e.g. ``"0.52, 0.61, 0.70"`` ("n/a" on Windows)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def load_span(at_start: str) -> str:
    """``"<at_start> at the start, <now> at the end"``: the load averages around a run, read
    with ``load_average()`` before it and now."""
    return f"{at_start} at the start, {load_average()} at the end"


def package_version(name: str, missing: str = "missing") -> str:
    """The installed version of the distribution ``name``, or ``missing``."""
    try:
        return version(name)
    except PackageNotFoundError:
        return missing


def versions(*names: str) -> str:
    """``"torch 2.13.0+cpu, jax 0.10.2"`` for ``versions("torch", "jax")``."""
    return ", ".join(f"{name} {package_version(name, 'not installed')}" for name in names)


def software(*names: str) -> str:
    """Python's version, then the packages': ``"python 3.11.7, torch 2.13.0+cpu"``."""
    python = f"python {platform.python_version()}"
    return f"{python}, {versions(*names)}" if names else python


def timestamp() -> str:
    """Now, to the second: ``"2026-11-23T12:34:26"``."""
    return datetime.datetime.now().isoformat(timespec="seconds")


def today() -> str:
    """Today's date: ``"2026-11-23"``."""
    return datetime.date.today().isoformat()


def command_line() -> str:
    """The command that runs this process's script: ``"python benchmarks/x.py --quick"``."""
    return " ".join(["python", *sys.argv])
