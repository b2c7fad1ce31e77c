"""Per-step time of data-parallel DP-SGD in PyTorch with 1, 2 and 4 gloo processes.

Run:  python benchmarks/scaling_torch.py [--quick] [--out PATH]

Workload: an MLP 784-512-512-10 (670 k parameters) with cross-entropy, a global batch of 256
examples split evenly over the processes, ``pergrad.dp.DPOptimizer`` around SGD with
``max_norm=1``, ``noise_multiplier=1`` and ``expected_batch_size=256`` (the clipped sums by the
ghost strategy). For each world size W it starts W fresh processes
(:func:`pergrad.bench.child.run_in_child`) joined by a gloo process group, each with
``cores // W`` torch threads (at least 1), and times ``optimizer.step(x, y)`` with
``distributed=True``: every round starts at a barrier, and the round's time is the slowest
process's. It also times the step's one all-reduce alone (the
``P + 2`` numbers of the clipped sum and counts). The baselines, the single-process
``DPOptimizer`` (no process group) with all cores' threads and with one thread, are timed in
this script's own process.

It prints a markdown table; ``--out PATH`` also writes it with a machine header.
``--quick`` (a smoke run of a few seconds, most of them starting processes): a 784-64-10 MLP,
batch 64, 2 processes, 3 rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pergrad import dp
from pergrad.bench import machine
from pergrad.bench.child import run_in_child
from pergrad.bench.report import markdown_table, publish, titled
from pergrad.bench.timing import median_ms

MAX_NORM, NOISE_MULTIPLIER, LR = 1.0, 1.0, 0.1


@dataclass(frozen=True)
class Setting:
    widths: tuple[int, ...]
    batch_size: int
    world_sizes: tuple[int, ...]
    rounds: int
    warmup: int


FULL = Setting((784, 512, 512, 10), 256, (1, 2, 4), rounds=30, warmup=3)
QUICK = Setting((784, 64, 10), 64, (2,), rounds=3, warmup=1)


def make_mlp(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def threads_per_process(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


# --------------------------------------------------------------------------------------------
# Worker: one process of a world of W.


def timed_rounds(call: Callable[[], object], setting: Setting, distributed: bool) -> list[float]:
    """Seconds of each round after the warm-up; distributed: the slowest process's."""
    seconds = []
    for round_index in range(setting.warmup + setting.rounds):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        call()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if distributed:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if round_index >= setting.warmup:
            seconds.append(float(elapsed))
    return seconds


def make_optimizer(model: nn.Module, setting: Setting, distributed: bool) -> dp.DPOptimizer:
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=NOISE_MULTIPLIER,
        expected_batch_size=setting.batch_size,
        generator=torch.Generator().manual_seed(0),
        distributed=distributed,
    )


def make_batch(setting: Setting) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(setting.batch_size, setting.widths[0], generator=generator)
    y = torch.randint(0, setting.widths[-1], (setting.batch_size,), generator=generator)
    return x, y


def time_single_process(setting: Setting, threads: int) -> list[float]:
    """A baseline: the plain DPOptimizer, no process group, ``threads`` torch threads."""
    torch.set_num_threads(threads)
    x, y = make_batch(setting)
    optimizer = make_optimizer(make_mlp(setting.widths), setting, distributed=False)
    return timed_rounds(lambda: optimizer.step(x, y), setting, False)


def worker(quick: bool, world_size: int, rank: int, store: str) -> dict[str, list[float]] | None:
    """Rank ``rank``'s part of the world: rank 0 returns the timings."""
    setting = QUICK if quick else FULL
    torch.set_num_threads(threads_per_process(world_size))
    x, y = make_batch(setting)
    results: dict[str, list[float]] = {}
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=world_size, rank=rank)
    model = make_mlp(setting.widths)
    optimizer = make_optimizer(model, setting, distributed=True)
    shard = slice(rank, None, world_size)
    results["distributed"] = timed_rounds(lambda: optimizer.step(x[shard], y[shard]), setting, True)
    buffer = torch.zeros(sum(p.numel() for p in model.parameters()) + 2)
    results["all_reduce"] = timed_rounds(lambda: dist.all_reduce(buffer), setting, True)
    # Leave together: a rank tearing gloo down while its peer is still in a collective aborts
    # the peer ("terminate called without an active exception", exit -6).
    dist.barrier()
    dist.destroy_process_group()
    return results if rank == 0 else None


def run_world(quick: bool, world_size: int) -> dict[str, list[float]]:
    """The ``world_size`` processes of a world, each a fresh interpreter: rank 0's timings."""
    env = {"OMP_NUM_THREADS": str(threads_per_process(world_size))}
    with tempfile.TemporaryDirectory() as directory, ThreadPoolExecutor(world_size) as pool:
        store = os.path.join(directory, "store")
        ranks = [
            pool.submit(run_in_child, worker, quick, world_size, rank, store, env=env, timeout=600)
            for rank in range(world_size)
        ]
        return [rank.result() for rank in ranks][0]


# --------------------------------------------------------------------------------------------
# Report.


def report(
    setting: Setting, single: dict[int, list[float]], timings: dict[int, dict[str, list[float]]]
) -> str:
    cores = threads_per_process(1)
    baseline = median_ms(single[cores])
    header = [
        "optimizer",
        "processes",
        "threads / process",
        "examples / process",
        "ms / step (median)",
        "ms / step (min)",
        f"speed-up vs one process, {cores} threads",
        "speed-up vs one process, 1 thread",
        "all-reduce ms",
    ]
    rows = []
    for threads, seconds in single.items():
        rows.append(
            ["DPOptimizer (one process)", "1", str(threads), str(setting.batch_size)]
            + [f"{median_ms(seconds):.2f}", f"{1000 * min(seconds):.2f}"]
            + [f"{baseline / median_ms(seconds):.2f}x"]
            + [f"{median_ms(single[1]) / median_ms(seconds):.2f}x", "-"]
        )
    for world_size, timing in timings.items():
        step = median_ms(timing["distributed"])
        rows.append(
            ["DPOptimizer(distributed=True)", str(world_size)]
            + [str(threads_per_process(world_size)), str(setting.batch_size // world_size)]
            + [f"{step:.2f}", f"{1000 * min(timing['distributed']):.2f}"]
            + [f"{baseline / step:.2f}x", f"{median_ms(single[1]) / step:.2f}x"]
            + [f"{median_ms(timing['all_reduce']):.2f}"]
        )
    params = sum(a * b + b for a, b in zip(setting.widths[:-1], setting.widths[1:]))
    widths = "-".join(map(str, setting.widths))
    return "\n".join(
        [
            f"DP-SGD step, MLP {widths} ({params:,} parameters), global batch "
            f"{setting.batch_size}, gloo; medians over {setting.rounds} rounds after "
            f"{setting.warmup} warm-up rounds (a round's time is its slowest process's).",
            "",
            markdown_table(header, rows),
            "",
            "Speed-up = the one-process median / this median. All-reduce: the step's one "
            f"all-reduce of {params + 2:,} float32 numbers, timed alone. Processes beyond the "
            "core count share cores.",
        ]
    )


def machine_header(quick: bool, load_at_start: str) -> str:
    return titled(
        "pergrad DP-SGD scaling over processes (PyTorch, CPU)",
        [
            f"machine: {machine.cpu_and_cores()}",
            machine.software("torch", "pergrad"),
            f"date: {machine.timestamp()}",
            f"load average (1, 5, 15 min): {machine.load_span(load_at_start)}",
            f"command: `{machine.command_line()}` ({'quick' if quick else 'full'} mode)",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    setting = QUICK if args.quick else FULL
    load_at_start = machine.load_average()
    print("timing one process without a process group...", file=sys.stderr)
    single = {
        threads: time_single_process(setting, threads)
        for threads in sorted({threads_per_process(1), 1}, reverse=True)
    }
    timings = {}
    for world_size in setting.world_sizes:
        print(f"timing {world_size} process(es)...", file=sys.stderr)
        timings[world_size] = run_world(args.quick, world_size)
    text = report(setting, single, timings)
    publish(text, args.out, lambda: machine_header(args.quick, load_at_start))


if __name__ == "__main__":
    main()
