"""Results as text: markdown tables and headers, results.json, results.md and the plots.

Shared by the benchmark command and the scripts in ``benchmarks/``: ``markdown_table`` (one
writer of every table), ``fmt`` (a cell of a number that may be missing), ``titled`` and
``sentence_header`` (the two shapes of a results file's header, from the pieces in
``pergrad.bench.machine``), ``publish`` (print the results, write them under their header),
``error_summary`` (a failure in one line) and ``write_text``.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from pergrad.bench.machine import (
    cpu_and_cores,
    cpu_model,
    package_version,
    timestamp,
    today,
    versions,
)

PACKAGES = ("torch", "jax", "jaxlib", "numpy", "opacus", "backpack-for-pytorch", "pergrad")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A markdown table of ``header`` and ``rows`` (cells already text), one line a row.

    ``align``: one letter a column, ``l`` (the default for columns it does not reach) or ``r``
    (right-aligned, ``---:``). ``markdown_table(["B", "ms"], [["8", "1.5"]], "rr")`` is::

        | B | ms |
        | ---: | ---: |
        | 8 | 1.5 |
    """
    rule = ["---:" if align[i : i + 1] == "r" else "---" for i in range(len(header))]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def fmt(value: float | None, spec: str, suffix: str = "", missing: str = "-") -> str:
    """``value`` as text by the format ``spec``, then ``suffix``; ``missing`` when it is None
    (not measured): ``fmt(1.234, ".2f", "x") == "1.23x"``, ``fmt(None, ".2f") == "-"``."""
    return missing if value is None else f"{value:{spec}}{suffix}"


def titled(title: str, items: Sequence[str]) -> str:
    """A results file's header as a list: ``# title``, a blank line, one ``- item`` line each."""
    return "\n".join([f"# {title}", "", *(f"- {item}" for item in items)])


def machine_sentence(packages: Sequence[str], details: Sequence[str] = ()) -> str:
    """A results file's header as a sentence, without its full stop: ``"Machine: AMD EPYC, 2
    cores, Linux, torch 2.13.0+cpu, <details, ...>, 2026-11-24"``."""
    parts = [cpu_and_cores(), platform.system(), versions(*packages), *details, today()]
    return "Machine: " + ", ".join(parts)


def sentence_header(name: str, packages: Sequence[str], details: Sequence[str] = ()) -> str:
    """``# <name>``, a blank line and ``machine_sentence(packages, details)`` with its stop."""
    return f"# {name}\n\n{machine_sentence(packages, details)}."


def publish(text: str, out: str | os.PathLike | None, header: Callable[[], str]) -> None:
    """Print ``text``; when ``out`` is given, also write it there under ``header()``, a blank
    line between them (the header is made only then: it reads the date and the load)."""
    print(text)
    if out:
        write_text(out, header() + "\n\n" + text + "\n")


def error_summary(error: BaseException) -> str:
    """``"<class>: <first line of the message, at most 160 characters>"``."""
    message = (str(error).strip().splitlines() or [""])[0][:160]
    return f"{type(error).__name__}: {message}"


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path``, making its folder first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def gpu_name() -> str | None:
    """The name of the machine's first GPU, or None."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def device_slug(device="cpu") -> str:
    """A folder name for the results of a run on ``device``: ``cpu``, or the GPU's name
    (``nvidia-h100-80gb-hbm3``)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def describe_device(device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def machine_info(device=None, jax_device: str | None = None) -> dict:
    """The machine, the device the torch methods ran on (and JAX's), and package versions."""
    import torch

    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "versions": {name: package_version(name) for name in PACKAGES},
        "date": timestamp(),
    }
    if device is not None:
        info["device"] = describe_device(device)
        info["jax_device"] = jax_device
    return info


def summary_table(rows: list[dict]) -> str:
    header = ["workload", "B", "method", "median ms", "/ floor", "/ floor of its kind"]
    header += ["speed-up over loop", "max abs err vs loop", "peak MiB"]
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append([r["workload"], str(r["batch_size"]), r["method"], "unsupported"])
            lines[-1] += ["-"] * (len(header) - len(lines[-1]))
            continue
        lines.append(
            [
                r["workload"],
                str(r["batch_size"]),
                r["method"],
                fmt(r["median_ms"], ".2f"),
                fmt(r["ratio_to_floor"], ".2f", "x"),
                fmt(r.get("ratio_to_kind_floor"), ".2f", "x"),
                fmt(r["speedup_over_loop"], ".1f", "x"),
                fmt(r["max_abs_err"], ".1e"),
                fmt(r.get("peak_mib"), ".1f"),
            ]
        )
    return markdown_table(header, lines)


def header(results: dict) -> str:
    m, run = results["machine"], results["run"]
    packages = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    return titled(
        "pergrad benchmarks: against the loop, the floor and the peers",
        [
            f"machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}); "
            f"GPU: {m['gpu'] or 'none'}",
            f"device: torch on {m.get('device', 'cpu')}; "
            f"JAX on {m.get('jax_device') or 'none (JAX methods skipped)'}",
            f"python {m['python']}; {packages}",
            f"date: {m['date']}; load average (1, 5, 15 min): {run['load_average_start']} at "
            f"the start, {run['load_average_end']} at the end",
            f"command: `{run['command']}` ({run['mode']} mode, {run['rounds']} rounds after "
            f"{run['warmup']} warm-up call(s); {run.get('wall_s', '?')} s)",
        ],
    )


NOTES = """\
- median ms: median over the timed rounds. `/ floor`: median of the per-round ratio to the batch
  gradient of the same framework (torch or JAX). `/ floor of its kind`: the same against the floor
  of what the method computes: for per-example gradients the batch gradient plus writing their
  B x P numbers (the `write B×P` row: fresh float32 arrays of the gradients' shapes, filled,
  timed in the same rounds); for norms the batch gradient alone. Speed-up over loop: the same framework's loop
  (`torch loop`, `jax loop`: a Python loop of single-example gradients, stacked) / method, per
  round.
- max abs err vs loop: against the per-example gradients of the torch loop (float32); for norm
  methods against the loop's per-example norms; for the floors against the loop's mean.
- peak MiB: peak resident memory increase during one call (after a warm-up call, in a fresh
  process, one per method for all the batch sizes of the sweep; it includes the B x P result);
  on CUDA, torch methods report `torch.cuda.max_memory_allocated` instead and JAX methods are
  not measured; see `pergrad/bench/memory.py`. `-`: not measured.
- unsupported: the method raised on this model (reason in results.json)."""


def markdown(results: dict) -> str:
    skipped = "".join(f"\n- skipped {s['method']}: {s['reason']}" for s in results["skipped"])
    unsupported = "".join(
        f"\n- {r['method']} on {r['workload']}: {r['note']}"
        for r in results["rows"]
        if r["status"] != "ok" and r["batch_size"] == min_batch(results["rows"], r["workload"])
    )
    return "\n".join(
        [header(results), "", summary_table(results["rows"]), "", NOTES + skipped + unsupported]
    )


def min_batch(rows: list[dict], workload: str) -> int:
    return min(r["batch_size"] for r in rows if r["workload"] == workload)


def write(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed: no plots (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    plot_sweep(results["rows"], out / "time_vs_batch_size.png")
    plot_memory_sweep(results["rows"], out / "memory_vs_batch_size.png")
    plot_ratios(results["rows"], out / "ratio_to_floor.png")


def ok_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "ok"]


def plot_sweep(rows: list[dict], path: Path) -> None:
    """Median time of each method against the batch size of the sweep."""
    plot_against_batch_size(rows, "median_ms", "median time per call (ms)", "", path, "log")


def plot_memory_sweep(rows: list[dict], path: Path) -> None:
    """Peak memory of each method against the batch size of the sweep (if it was measured):
    linear below 1 MiB, where the floors sit (a few pages, or none), logarithmic above."""
    ylabel = "peak memory increase during a call (MiB)"
    plot_against_batch_size(rows, "peak_mib", ylabel, ": peak memory", path, "symlog")


def plot_against_batch_size(
    rows: list[dict], field: str, ylabel: str, title: str, path: Path, yscale: str
) -> None:
    import matplotlib.pyplot as plt

    sweep = [r for r in ok_rows(rows) if r["workload"] == "sweep" and r.get(field) is not None]
    if not sweep:
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    for method in dict.fromkeys(r["method"] for r in sweep):
        these = [r for r in sweep if r["method"] == method]
        points = sorted((r["batch_size"], r[field]) for r in these)
        line = "-" if these[0]["framework"] == "torch" else "--"  # 10 colours, more methods
        ax.plot(*zip(*points), line, marker="o", label=method)
    ax.set_xscale("log")
    if yscale == "symlog":
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=0)
    else:
        ax.set_yscale(yscale)
    ax.set(xlabel="batch size", ylabel=ylabel)
    ax.set_title(f"Batch-size sweep (MLP 256-128-10){title}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ratios(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fixed = [
        r for r in ok_rows(rows) if r["workload"] != "sweep" and r["kind"] in ("grads", "norms")
    ]
    workloads = list(dict.fromkeys(r["workload"] for r in fixed))
    if not workloads:
        return
    fig, axes = plt.subplots(len(workloads), 1, figsize=(8, 2.6 * len(workloads)), squeeze=False)
    for ax, workload in zip(axes[:, 0], workloads):
        these = [r for r in fixed if r["workload"] == workload]
        ratios = [r["ratio_to_floor"] for r in these]
        bars = ax.barh([r["method"] for r in these], ratios)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in ratios], fontsize=7, padding=2)
        ax.axvline(1.0, color="black", linewidth=0.8)  # the floor
        ax.set(xlim=(0, 1.15 * max(ratios)), xlabel="time / batch gradient of the same framework")
        ax.set_title(f"{workload} (B={these[0]['batch_size']})", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
