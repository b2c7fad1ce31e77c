"""pergrad against the loop, the floor and the peers, on a CPU or a GPU.

The command behind ``python -m pergrad.bench`` (and the repository's ``python -m benchmarks``)::

    python -m pergrad.bench [--device cpu|cuda] [--quick] [--out DIR] [--workloads cnn mlp ...]
                            [--no-memory]

For each workload and batch size, every available method (see ``pergrad/bench/methods.py``) is
built on the device, checked once against the per-example gradients of a Python loop (max abs
error; norms for norm-only methods, the batch mean for the floors), then timed: after warm-up,
every round calls each method of a framework once, in a balanced order (over the rounds each
method runs right after each other equally often: ``timing.time_interleaved``), torch and JAX
methods in separate blocks, so one framework's busy thread pool does not slow the other. Each
framework's block also times writing B x P numbers, for the floor of per-example gradients
(batch gradient + write). Peak memory comes from a fresh process per (workload, method), one
per method for all the batch sizes of the sweep: see ``pergrad/bench/memory.py``.

Torch models and data are placed on ``--device`` (default: cuda if torch sees a GPU, else cpu);
JAX arrays on JAX's device of the same kind. A peer that is not installed (Opacus, BackPACK,
JAX), or JAX without a device of that kind, is skipped with a note.

Writes ``results.json``, ``results.md`` and PNG plots (with matplotlib) under ``--out`` (default
``./pergrad-bench-results/<device>/``, relative to the working directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from pergrad.bench import report
from pergrad.bench.machine import load_average
from pergrad.bench.memory import measure, measure_sizes
from pergrad.bench.methods import (
    FLOORS,
    LOOP,
    LOOPS,
    METHODS,
    METHODS_BY_NAME,
    WRITES,
    Method,
    default_device,
    jax_device,
    max_abs_error,
)
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved
from pergrad.bench.workloads import WORKLOADS, Workload, batch_sizes, build

RESULTS_ROOT = Path("pergrad-bench-results")  # under the working directory, never site-packages


def parse_args(
    argv: list[str] | None = None,
    prog: str = "python -m pergrad.bench",
    results_root: Path = RESULTS_ROOT,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device",
        metavar="{cpu,cuda,cuda:N}",
        help="torch device of the models and data: cpu, cuda or cuda:N "
        "(default: cuda if torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny batches, 2 rounds, JAX compiled without XLA's backend optimisation",
    )
    parser.add_argument("--out", type=Path, help=f"output folder (default {results_root}/<device>)")
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
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device, parser)
    args.out = args.out or results_root / report.device_slug(args.device)
    args.command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    return args


def resolve_device(name: str | None, parser: argparse.ArgumentParser) -> torch.device:
    """``--device`` as a torch device that exists here, else a usage error that says why."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {name}: torch {torch.__version__} sees no GPU "
            "(torch.cuda.is_available() is False); install a CUDA build of torch, or run with "
            "--device cpu"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def available_methods(device: torch.device) -> tuple[list[Method], list[dict], str | None]:
    """The methods that can run on ``device``, those skipped (each with a printed note), and
    the JAX device the JAX methods run on (None when they are all skipped)."""
    jax_reason, jax_on = None, None
    if not METHODS_BY_NAME["jax batch grad (floor)"].missing():
        jax_on = jax_device(device)
        if jax_on is None:
            jax_reason = f"JAX has no {device.type} device (for a GPU: pip install 'jax[cuda12]')"
    methods, skipped = [], []
    for method in METHODS:
        missing = method.missing()
        reason = f"missing {', '.join(missing)}" if missing else None
        if not reason and method.framework == "jax":
            reason = jax_reason
        if reason:
            print(f"note: skipping {method.name!r}: {reason}", file=sys.stderr)
            skipped.append({"method": method.name, "reason": reason})
        else:
            methods.append(method)
    return methods, skipped, None if jax_on is None else str(jax_on)


def build_calls(
    workload: Workload, batch_size: int, device: torch.device, methods: list[Method]
) -> tuple[dict, dict, dict]:
    """Build and check each method: ({name: call}, {name: max abs error}, {name: failure})."""
    model, x, y = build(workload, batch_size, device)
    loop_grads = METHODS_BY_NAME[LOOP].build(workload, model, x, y)()
    calls, errors, failures = {}, {}, {}
    for method in methods:
        try:
            call = method.build(workload, model, x, y)
            errors[method.name] = max_abs_error(method.kind, call(), loop_grads)
            calls[method.name] = call
        except Exception as e:  # a method that cannot handle this model: reported, not fatal
            failures[method.name] = report.error_summary(e)
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
            "median_ms": median_ms(seconds),
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


def add_sweep_memory(
    workload: str, sizes: tuple[int, ...], device: torch.device, rows: list[dict]
) -> None:
    """Peak memory of every method at every batch size of a sweep: one process per method."""
    for method in dict.fromkeys(r["method"] for r in rows if r["status"] == "ok"):
        print(f"{workload}: peak memory of {method!r} at B={sizes}...", file=sys.stderr)
        by_size = measure_sizes(workload, method, sizes, str(device))
        for row in rows:
            if row["method"] == method and row["status"] == "ok":
                row |= by_size[row["batch_size"]]


def compile_for_speed_of_compilation() -> None:
    """XLA without its LLVM backend optimisation: JAX compiles about twice as fast, and its
    compiled calls run slower. For ``--quick``, a smoke run whose timings mean little and which
    compiling takes most of. Set before JAX starts its backend (this process's first JAX call),
    or it has no effect; subprocesses inherit it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        compile_for_speed_of_compilation()
    rounds = args.rounds or (2 if args.quick else 10)
    warmup = 1 if args.quick else 2
    memory_on = (not args.quick) if args.memory is None else args.memory
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    methods, skipped, jax_on = available_methods(args.device)
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
                c, e, f = build_calls(workload, batch_size, args.device, group)
                calls, errors, failures = calls | c, errors | e, failures | f
                times |= time_interleaved(c, rounds, warmup) if c else {}
            memory = {}
            if memory_on and len(sizes) == 1:
                memory = {m: measure(name, m, batch_size, str(args.device)) for m in calls}
            workload_rows += rows_for(workload, batch_size, calls, errors, failures, times, memory)
        if memory_on and len(sizes) > 1:
            add_sweep_memory(name, sizes, args.device, workload_rows)
        rows += workload_rows
    return {
        "machine": report.machine_info(args.device, jax_on),
        "run": {
            "command": args.command,
            "device": str(args.device),
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


def main(
    argv: list[str] | None = None,
    prog: str = "python -m pergrad.bench",
    results_root: Path = RESULTS_ROOT,
) -> None:
    """Parse ``argv`` (default: the command line), run, write the results, print the table."""
    warnings.filterwarnings("ignore", category=UserWarning)
    args = parse_args(argv, prog, results_root)
    start = time.perf_counter()
    results = run(args)
    results["run"]["wall_s"] = round(time.perf_counter() - start, 1)
    os.makedirs(args.out, exist_ok=True)
    report.write(results, Path(args.out))
    print(report.summary_table(results["rows"]))
    print(f"\nwrote {args.out}/results.json, results.md and plots in {results['run']['wall_s']} s")
