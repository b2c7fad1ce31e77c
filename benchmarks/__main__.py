"""pergrad against the loop, the floor and the peers.

Run from the repository root:

    python -m benchmarks [--quick] [--out DIR] [--workloads cnn mlp ...] [--no-memory]

For each workload and batch size, every available method (see ``benchmarks/methods.py``) is
built, checked once against the per-example gradients of a Python loop (max abs error; norms for
norm-only methods, the batch mean for the floors), then timed: after warm-up, every round calls
each method of a framework once in a rotated order (torch and JAX methods in separate blocks, so
one framework's busy thread pool does not slow the other). Each framework's block also times
writing B x P numbers, for the floor of per-example gradients (batch gradient + write).
Peak memory comes from a fresh process per (workload, method), one per method for all the batch
sizes of the sweep: see ``benchmarks/memory.py``.

Writes ``results.json``, ``results.md`` and PNG plots under ``--out`` (default
``benchmarks/results/<device>/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.core_overhead import paired_ratio, time_interleaved
from benchmarks.machine import load_average
from benchmarks.memory import measure, measure_sizes
from benchmarks.methods import (
    FLOORS,
    LOOP,
    LOOPS,
    METHODS,
    METHODS_BY_NAME,
    WRITES,
    Method,
    max_abs_error,
)
from benchmarks.workloads import WORKLOADS, Workload, batch_sizes, build


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny batches, 2 rounds")
    parser.add_argument(
        "--out", type=Path, help="output folder (default benchmarks/results/<device>)"
    )
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, help="timed rounds (default 2 quick, 10 full)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's own, 1 with --quick: on a loaded machine "
        "a thread that waits for a descheduled one costs a whole time slice per op)",
    )
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure peak memory in a subprocess per (workload, method); default: on unless --quick",
    )
    return parser.parse_args(argv)


def available_methods() -> tuple[list, list[dict]]:
    methods, skipped = [], []
    for method in METHODS:
        missing = method.missing()
        if missing:
            print(f"note: skipping {method.name!r}: missing {', '.join(missing)}", file=sys.stderr)
            skipped.append({"method": method.name, "reason": f"missing {', '.join(missing)}"})
        else:
            methods.append(method)
    return methods, skipped


def build_calls(workload: Workload, batch_size: int, methods: list) -> tuple[dict, dict, dict]:
    """Build and check each method: ({name: call}, {name: max abs error}, {name: failure})."""
    model, x, y = build(workload, batch_size)
    loop_grads = METHODS_BY_NAME[LOOP].build(workload, model, x, y)()
    calls, errors, failures = {}, {}, {}
    for method in methods:
        try:
            call = method.build(workload, model, x, y)
            errors[method.name] = max_abs_error(method.kind, call(), loop_grads)
            calls[method.name] = call
        except Exception as e:  # a method that cannot handle this model: reported, not fatal
            failures[method.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"note: {method.name!r} unsupported on {workload.name}: {failures[method.name]}")
    return calls, errors, failures


def rows_for(workload, batch_size, calls, errors, failures, times, memory) -> list[dict]:
    rows = []
    for name in [m.name for m in METHODS if m.name in calls or m.name in failures]:
        method = METHODS_BY_NAME[name]
        row = {
            "workload": workload.name,
            "batch_size": batch_size,
            "method": name,
            "framework": method.framework,
            "kind": method.kind,
        }
        if name in failures:
            rows.append(row | {"status": "unsupported", "note": failures[name]})
            continue
        seconds = times[name]
        floor = times.get(FLOORS[method.framework])
        loop = times.get(LOOPS[method.framework])
        row |= {
            "status": "ok",
            "median_ms": 1e3 * statistics.median(seconds),
            "min_ms": 1e3 * min(seconds),
            "times_ms": [1e3 * s for s in seconds],
            "ratio_to_floor": paired_ratio(seconds, floor) if floor else None,
            "ratio_to_kind_floor": ratio_to_kind_floor(method, times),
            "speedup_over_loop": (
                paired_ratio(loop, seconds) if loop and method.kind != "write" else None
            ),
            "max_abs_err": errors[name],
        }
        row |= memory.get(name, {})
        rows.append(row)
    return rows


def ratio_to_kind_floor(method: Method, times: dict) -> float | None:
    """Method / the floor of what it computes, paired per round: per-example gradients against
    the batch gradient plus the write of their B x P numbers, norms against the batch gradient."""
    floor = times.get(FLOORS[method.framework])
    if not floor or method.kind not in ("grads", "norms"):
        return None
    if method.kind == "norms":
        return paired_ratio(times[method.name], floor)
    write = times.get(WRITES[method.framework])
    if not write:
        return None
    return paired_ratio(times[method.name], [b + w for b, w in zip(floor, write)])


def add_sweep_memory(workload: str, sizes: tuple[int, ...], rows: list[dict]) -> None:
    """Peak memory of every method at every batch size of a sweep: one process per method."""
    for method in dict.fromkeys(r["method"] for r in rows if r["status"] == "ok"):
        print(f"{workload}: peak memory of {method!r} at B={sizes}...", file=sys.stderr)
        by_size = measure_sizes(workload, method, sizes)
        for row in rows:
            if row["method"] == method and row["status"] == "ok":
                row |= by_size[row["batch_size"]]


def run(args: argparse.Namespace) -> dict:
    rounds = args.rounds or (2 if args.quick else 10)
    warmup = 1 if args.quick else 2
    memory_on = (not args.quick) if args.memory is None else args.memory
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    methods, skipped = available_methods()
    load_at_start = load_average()
    rows = []
    for name in args.workloads:
        workload = WORKLOADS[name]
        sizes = batch_sizes(workload, args.quick)
        workload_rows = []
        for batch_size in sizes:
            print(f"{name} (B={batch_size}, {rounds} rounds)...", file=sys.stderr)
            calls, errors, failures, times = {}, {}, {}, {}
            # One framework at a time, built and timed in one go: JAX's compile and thread pool
            # otherwise slow down the torch methods that run next.
            for framework in ("torch", "jax"):
                group = [m for m in methods if m.framework == framework]
                c, e, f = build_calls(workload, batch_size, group)
                calls, errors, failures = calls | c, errors | e, failures | f
                times |= time_interleaved(c, rounds, warmup) if c else {}
            memory = {}
            if memory_on and len(sizes) == 1:
                memory = {m: measure(name, m, batch_size) for m in calls}
            workload_rows += rows_for(workload, batch_size, calls, errors, failures, times, memory)
        if memory_on and len(sizes) > 1:
            add_sweep_memory(name, sizes, workload_rows)
        rows += workload_rows
    return {
        "machine": report.machine_info(),
        "run": {
            "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
            "mode": "quick" if args.quick else "full",
            "rounds": rounds,
            "warmup": warmup,
            "memory": memory_on,
            "load_average_start": load_at_start,
            "load_average_end": load_average(),
        },
        "skipped": skipped,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    args = parse_args(argv)
    start = time.perf_counter()
    results = run(args)
    results["run"]["wall_s"] = round(time.perf_counter() - start, 1)
    out = args.out or Path(__file__).parent / "results" / report.device_slug()
    os.makedirs(out, exist_ok=True)
    report.write(results, Path(out))
    print(report.summary_table(results["rows"]))
    print(f"\nwrote {out}/results.json, results.md and plots in {results['run']['wall_s']} s")


if __name__ == "__main__":
    main()
