"""pergrad's JAX per-example gradients under jit against the hand-written ``jit(vmap(grad))``.

Run:  python benchmarks/jax_vmap_gap.py [--quick] [--workload NAME] [--blocks N]
                                      [--harness-runs N] [--harness-rounds N] [--out PATH]

The benchmark of 2026-11-23 (``benchmarks/results/cpu/results.md``, 10 rounds) had, on the
transformer at B=32, ``pergrad (jax, jit)`` at 5.98 ms and ``jax jit(vmap(grad))`` at 5.26 ms:
pergrad 14% slower than the transform it wraps (issue 36). This script looks for where that
came from, on one workload of ``pergrad.bench`` (the transformer by default):

1. The programs. Both calls are jitted as a whole by the benchmark (``build_pergrad_jax``,
   ``build_jax_vmap``); here both are traced and compiled on the same inputs, their jaxprs
   compared as text, and their compiled HLO compared instruction by instruction once the source
   metadata (file names, stack frames) is dropped: an extra transpose, copy, cast, check or a
   different layout or fusion would show as a differing instruction. Also the strategy that
   ``strategy="auto"`` took, and why.
2. The timing, as the benchmark times: the six JAX methods of ``pergrad.bench.methods`` built
   for the workload, each call blocking, ``time_interleaved`` over rounds, in two orders of the
   methods within a round, alternating blocks of rounds in one process: ``rotated`` (the
   harness before this change: each round the previous one shifted by one, so pergrad always
   ran right after the Python loop of single-example gradients and ``jit(vmap(grad))`` always
   right after pergrad's identical program) and ``balanced`` (a Williams design, now the
   default: each method follows each other equally often). Medians, ratios to the floor (the
   batch gradient) and the paired ratio pergrad / ``jit(vmap(grad))`` (median of per-round
   ratios) in each order.
3. The carry-over: the two calls' median times, and the voluntary context switches of the
   process during them, grouped by the method that ran just before (pooled over both orders;
   "first" is the first call of a round, after ``gc.collect``).
4. The benchmark command itself (``pergrad.bench.cli.run`` on the workload, torch methods then
   JAX ones, 10 rounds, as ``results.md`` is made), run several times with
   ``time_interleaved``'s order set to each: the ratio of pergrad's median to
   ``jit(vmap(grad))``'s that each run would publish.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import pergrad
from pergrad.bench import cli, workloads
from pergrad.bench.machine import load_average, load_span
from pergrad.bench.methods import METHODS, jax_setup
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.bench.timing import balanced_orders, median_ms, paired_ratio, time_interleaved

PERGRAD, VMAP, FLOOR = "pergrad (jax, jit)", "jax jit(vmap(grad))", "jax batch grad (floor)"
ORDERS = ("rotated", "balanced")

# --------------------------------------------------------------------------------------------
# 1. The programs.


def hlo_instructions(text: str) -> list[str]:
    """The instructions of a compiled HLO module's text, without their source metadata (which
    names the Python frames that traced them: pergrad's wrappers on one side, not the other)."""
    kept = []
    for line in text.splitlines():
        if not line.startswith("  %") and not line.startswith("  ROOT"):
            continue  # headers, file / frame tables, computation braces
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        kept.append(re.sub(r"stack_frame_id=\d+", "", line))
    return kept


def compare_programs(workload: workloads.Workload, batch_size: int) -> dict[str, Any]:
    model, x, y = workloads.build(workload, batch_size)
    params, x_j, y_j, _, one_loss = jax_setup(workload, model, x, y)
    wrapped = pergrad.per_example_grads(one_loss)
    fns = {
        PERGRAD: jax.jit(wrapped),
        VMAP: jax.jit(jax.vmap(jax.grad(one_loss), in_axes=(None, 0, 0))),
    }
    args = (params, x_j, y_j)
    out = {name: jax.block_until_ready(f(*args)) for name, f in fns.items()}
    jaxprs = {name: str(jax.make_jaxpr(f)(*args)) for name, f in fns.items()}
    hlo = {name: hlo_instructions(f.lower(*args).compile().as_text()) for name, f in fns.items()}
    ops = {
        name: Counter(re.findall(r" ([a-z][a-z0-9-]*)\(", " ".join(h))) for name, h in hlo.items()
    }
    differing = sum(
        (
            (Counter(hlo[PERGRAD]) - Counter(hlo[VMAP]))
            + (Counter(hlo[VMAP]) - Counter(hlo[PERGRAD]))
        ).values()
    )
    return {
        "strategy": f"{wrapped.last_strategy} ({wrapped.last_strategy.reason})",
        "jaxprs equal": jaxprs[PERGRAD] == jaxprs[VMAP],
        "instructions": {name: len(h) for name, h in hlo.items()},
        "differing": differing,
        "copies": {name: ops[name]["copy"] + ops[name]["transpose"] for name in ops},
        "max abs diff": max(
            float(np.max(np.abs(out[PERGRAD][k] - out[VMAP][k]))) for k in out[VMAP]
        ),
    }


def programs_table(found: dict[str, Any]) -> str:
    rows = [
        ["strategy taken by auto", found["strategy"]],
        ["jaxprs equal (as text)", str(found["jaxprs equal"])],
        *(
            [f"compiled HLO instructions, {name}", str(n)]
            for name, n in found["instructions"].items()
        ),
        *(
            [f"copy + transpose instructions, {name}", str(n)]
            for name, n in found["copies"].items()
        ),
        ["instructions that differ (metadata dropped)", str(found["differing"])],
        ["max abs diff of the gradients", f"{found['max abs diff']:.1e}"],
    ]
    return markdown_table(["what", "value"], rows)


# --------------------------------------------------------------------------------------------
# 2. and 3. The timing, in both orders, and the carry-over.


def round_orders(keys: list[str], rounds: int, order: str) -> list[list[str]]:
    """The methods of each round in the order ``time_interleaved`` ran them."""
    if order == "rotated":
        return [keys[r % len(keys) :] + keys[: r % len(keys)] for r in range(rounds)]
    rows = balanced_orders(len(keys))
    return [[keys[k] for k in rows[r % len(rows)]] for r in range(rounds)]


Times = dict[str, dict[str, list[float]]]  # measure -> method -> its value in each round
# time.perf_counter (wall), time.process_time (cpu: all threads of the process) and the
# process's voluntary context switches (csw: a thread blocking, as a parked worker thread of
# XLA's pool does until a call wakes it), per call.
MEASURES = ("wall", "cpu", "csw")


def cpu_seconds_and_switches() -> tuple[float, float]:
    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def with_process_counters(
    calls: dict[str, Callable[[], Any]], measured: dict[str, dict[str, list[float]]]
) -> dict[str, Callable[[], Any]]:
    """``calls``, each also appending its process CPU seconds to ``measured["cpu"][name]`` and
    its voluntary context switches to ``measured["csw"][name]``: neither counts the time other
    processes took the cores (the machine is shared), though their cache misses still count."""

    def counted(name: str, call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            cpu, csw = cpu_seconds_and_switches()
            out = call()
            cpu_after, csw_after = cpu_seconds_and_switches()
            measured["cpu"][name].append(cpu_after - cpu)
            measured["csw"][name].append(csw_after - csw)
            return out

        return run

    return {name: counted(name, call) for name, call in calls.items()}


def time_orders(
    calls: dict[str, Callable[[], Any]], blocks: int
) -> tuple[dict[str, Times], dict[tuple[str, str], Times]]:
    """``({order: times}, {(method, the one that ran just before it): times})``: ``blocks``
    blocks of ``len(balanced_orders(n))`` rounds per order, the orders alternating (and which
    goes first), so that a change of the machine's load hits both alike."""
    keys = list(calls)
    rounds = len(balanced_orders(len(keys)))
    measured: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in MEASURES}
    counted = with_process_counters(calls, measured)
    times = {o: {m: {k: [] for k in keys} for m in MEASURES} for o in ORDERS}
    after: dict[tuple[str, str], Times] = {}
    for block in range(blocks):
        for order in ORDERS if block % 2 == 0 else ORDERS[::-1]:
            warmup = 2 if block == 0 else 1
            for per_method in measured.values():
                for values in per_method.values():
                    values.clear()
            got = {"wall": time_interleaved(counted, rounds, warmup, order=order)}
            got |= {m: {k: measured[m][k][warmup:] for k in keys} for m in ("cpu", "csw")}
            for r, ran in enumerate(round_orders(keys, rounds, order)):
                for before, key in zip(["first", *ran], ran):
                    entry = after.setdefault((key, before), {m: [] for m in MEASURES})
                    for m in MEASURES:
                        entry[m].append(got[m][key][r])
            for m in MEASURES:
                for key in keys:
                    times[order][m][key] += got[m][key]
    return times, after


def timing_table(times: dict[str, Times]) -> str:
    keys = list(times[ORDERS[0]]["wall"])
    rows = []
    for key in keys:
        cells = [key]
        for order in ORDERS:
            wall, cpu = times[order]["wall"], times[order]["cpu"]
            cells += [f"{median_ms(wall[key]):.2f}", f"{paired_ratio(wall[key], wall[FLOOR]):.2f}x"]
            cells += [f"{median_ms(cpu[key]):.2f}"]
        rows.append(cells)
    cells = [f"**{PERGRAD} / {VMAP}** (paired; rounds pergrad faster)"]
    for order in ORDERS:
        for clock in ("wall", "cpu"):
            t = times[order][clock]
            faster = sum(a < b for a, b in zip(t[PERGRAD], t[VMAP]))
            cells.append(f"**{paired_ratio(t[PERGRAD], t[VMAP]):.3f}** ({faster}/{len(t[VMAP])})")
            if clock == "wall":
                cells.append("")
    rows.append(cells)
    header = ["method"]
    for order in ORDERS:
        header += [f"{order}: wall ms", f"{order}: / floor", f"{order}: cpu ms"]
    return markdown_table(header, rows, "l" + "r" * 6)


def carry_over_table(after: dict[tuple[str, str], Times], keys: list[str]) -> str:
    def cell(key: str, before: str, measure: str) -> str:
        values = after.get((key, before), {}).get(measure)
        if not values:
            return "-"
        if measure == "csw":
            return f"{statistics.median(values):.0f}"
        return (
            f"{median_ms(values):.2f} ({len(values)})"
            if measure == "wall"
            else f"{median_ms(values):.2f}"
        )

    rows = [
        [before, *(cell(key, before, m) for m in MEASURES for key in (PERGRAD, VMAP))]
        for before in ["first", *keys]
    ]
    names = {"wall": "wall ms (rounds)", "cpu": "cpu ms", "csw": "context switches"}
    header = ["ran just before"]
    header += [f"{key}: {names[m]}" for m in MEASURES for key in (PERGRAD, VMAP)]
    return markdown_table(header, rows, "l" + "r" * 6)


def harness_runs(workload: str, runs: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    """The benchmark command itself (``pergrad.bench.cli.run``: the torch methods, then the JAX
    ones, ``rounds`` rounds, no memory), ``runs`` times in each order, alternating: per run,
    the median ms of pergrad and of ``jit(vmap(grad))`` and their "/ floor of its kind" as
    ``results.md`` shows them."""
    out: dict[str, list[dict[str, float]]] = {o: [] for o in ORDERS}
    argv = ["--workloads", workload, "--rounds", str(rounds), "--no-memory", "--out", "unused"]
    args = cli.parse_args(argv)
    for run in range(runs):
        for order in ORDERS if run % 2 == 0 else ORDERS[::-1]:
            cli.time_interleaved = functools.partial(time_interleaved, order=order)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    rows = {r["method"]: r for r in cli.run(args)["rows"]}
            finally:
                cli.time_interleaved = time_interleaved
            out[order].append(
                {
                    "pergrad ms": rows[PERGRAD]["median_ms"],
                    "vmap ms": rows[VMAP]["median_ms"],
                    "pergrad / kind floor": rows[PERGRAD]["ratio_to_kind_floor"],
                    "vmap / kind floor": rows[VMAP]["ratio_to_kind_floor"],
                }
            )
    return out


def harness_table(found: dict[str, list[dict[str, float]]]) -> str:
    rows = []
    for order in ORDERS:
        runs = found[order]
        ratios = [r["pergrad ms"] / r["vmap ms"] for r in runs]
        rows.append(
            [
                order,
                " ".join(f"{r:.2f}" for r in ratios),
                f"**{statistics.median(ratios):.3f}**",
                f"{min(ratios):.2f} to {max(ratios):.2f}",
                f"{statistics.median(r['pergrad / kind floor'] for r in runs):.2f}x",
                f"{statistics.median(r['vmap / kind floor'] for r in runs):.2f}x",
            ]
        )
    header = ["order", "pergrad ms / vmap ms, each run", "median", "range"]
    header += ["pergrad / floor of its kind (median)", "vmap / floor of its kind (median)"]
    return markdown_table(header, rows, "llrrrr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", default="transformer", choices=sorted(set(workloads.WORKLOADS) - {"sweep"})
    )
    parser.add_argument(
        "--blocks", type=int, help="blocks of rounds per order (default 1 quick, 20 full)"
    )
    parser.add_argument(
        "--harness-runs",
        type=int,
        help="runs of the benchmark command per order (default 0 quick, 4 full)",
    )
    parser.add_argument("--harness-rounds", type=int, default=10, help="its rounds (default 10)")
    parser.add_argument(
        "--quick", action="store_true", help="the workload's quick batch, 1 block, no command runs"
    )
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    workload = workloads.WORKLOADS[args.workload]
    batch_size = workload.quick_batch_size if args.quick else workload.batch_size
    blocks = args.blocks or (1 if args.quick else 20)
    load_at_start = load_average()
    print(f"{workload.name} (B={batch_size}): comparing the programs...", file=sys.stderr)
    found = compare_programs(workload, batch_size)
    model, x, y = workloads.build(workload, batch_size)
    calls = {m.name: m.build(workload, model, x, y) for m in METHODS if m.framework == "jax"}
    rounds = blocks * len(balanced_orders(len(calls)))
    print(f"timing {len(calls)} methods, {rounds} rounds per order...", file=sys.stderr)
    times, after = time_orders(calls, blocks)
    n_runs = args.harness_runs if args.harness_runs is not None else 0 if args.quick else 4
    harness = []
    if n_runs:
        print(f"the benchmark command, {n_runs} runs per order...", file=sys.stderr)
        found_runs = harness_runs(workload.name, n_runs, args.harness_rounds)
        harness = [
            "",
            f"## The benchmark command: `python -m pergrad.bench --workloads {workload.name} "
            f"--rounds {args.harness_rounds} --no-memory`, {n_runs} runs per order",
            "",
            harness_table(found_runs),
            "",
            "Each run as results.md is made (the torch methods first, then the JAX ones), with "
            "time_interleaved's order set to rotated (as before) or balanced (now); a run's "
            "ratio is that of the two medians in its table.",
        ]
    text = "\n".join(
        [
            f"## {workload.name}, B={batch_size}: the two programs",
            "",
            programs_table(found),
            "",
            f"## Timing: {rounds} rounds per order, in blocks of "
            f"{len(balanced_orders(len(calls)))} alternating between the orders",
            "",
            timing_table(times),
            "",
            "rotated: the benchmark's order before this change (pergrad always right after the "
            "jax loop, jit(vmap(grad)) always right after pergrad); balanced: a Williams design, "
            "now time_interleaved's default. Medians over the rounds; / floor and the last row: "
            "medians of per-round ratios.",
            "",
            "## Carry-over: by the method that ran just before (both orders pooled)",
            "",
            "Medians of the wall and CPU time of the call and of the voluntary context "
            "switches of the process during it (threads blocking and waking: a count, not a "
            "time, less sensitive to the machine's load).",
            "",
            carry_over_table(after, list(calls)),
            *harness,
        ]
    )

    def header() -> str:
        details = [
            f"load average {load_span(load_at_start)}",
            f"command `python {' '.join(sys.argv)}`",
        ]
        return sentence_header(
            "pergrad (jax, jit) against jit(vmap(grad))", ("jax", "jaxlib", "pergrad"), details
        )

    publish(text, args.out, header)


if __name__ == "__main__":
    main()
