"""User-level DP step cost: the ghost strategy's users' norms against forming the per-example
gradients, as ratios to a non-private step (issue 33).

Run:  python benchmarks/dp_user_level.py [--quick] [--out PATH.md]

The committed results: ``python benchmarks/dp_user_level.py --out
benchmarks/results/cpu/dp_user_level.md`` (a few minutes on 2 idle cores).

The models and batches of ``benchmarks/dp_transformers.py`` (small Hugging Face configs: GPT-2
with its tied embedding / lm-head, BERT; 4 layers, width 256, 128 tokens, batch 16). The batch's
examples belong to users in two ways: 4 users of 4 examples each ("even"), and one user with
half the batch and the other half single examples ("skewed": 9 users, the padding the
regrouping adds is largest here). Methods, each on its own copy of the model:

* ``non-private``: forward, backward, ``torch.optim.SGD`` step: the unit of every ratio;
* ``example-level``: ``pergrad.dp.DPOptimizer(...).step(x, y)`` (the ghost strategy);
* ``user-level ghost``: ``step(x, y, user_ids=ids)``: each user's norm from its examples'
  layer records side by side (``capture/torch_users.py``), nothing formed for a layer with a
  rule;
* ``user-level formed``: the same with ``strategy="materialize"``: the per-example gradients
  formed (``B x P``), summed per user, then clipped (what every user-level step did before).

Time: median of ``--rounds`` interleaved rounds after a warm-up step; memory: each (workload,
method) in its own forked process, peak RSS above the RSS after building the model, batch and
optimizer, over the first step and one more (the larger), as in ``dp_transformers.py``.
``--quick``: tiny models, 2 rounds, a smoke test of seconds.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.dp_transformers import (  # noqa: E402
    FULL,
    QUICK,
    Config,
    Workload,
    batch,
    failure,
    hf_model,
    in_child,
    loss_fn,
    preload,
)
from pergrad.bench import machine  # noqa: E402
from pergrad.bench.memory import free_buffers_to_the_os, peak_rss_over, status_mib  # noqa: E402
from pergrad.bench.report import fmt, markdown_table, publish, titled  # noqa: E402
from pergrad.bench.timing import paired_ratio, time_interleaved  # noqa: E402

BASE = "non-private"
METHODS = (BASE, "example-level", "user-level ghost", "user-level formed")
MAX_NORM, NOISE, LEARNING_RATE = 1.0, 1.0, 1e-3


def user_ids(grouping: str, size: int) -> Any:
    """``even``: users of 4 examples; ``skewed``: one user with half the batch, the rest alone."""
    import torch

    if grouping == "even":
        return torch.arange(size) // min(4, size)
    half = size // 2
    return torch.cat([torch.zeros(half, dtype=torch.long), torch.arange(1, size - half + 1)])


@dataclass
class Step:
    call: Any
    strategy: str = ""


def build_step(method: str, workload: Workload, config: Config, grouping: str) -> Step:
    import torch

    import pergrad

    torch.manual_seed(0)
    model = hf_model(workload.model, config, workload.length).train()
    inputs, targets = batch(workload, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if method == BASE:

        def plain() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(**inputs), targets).backward()
            optimizer.step()

        return Step(plain)
    ids = user_ids(grouping, workload.batch_size)
    users = None if method == "example-level" else ids
    private = pergrad.dp.DPOptimizer(
        optimizer,
        model,
        loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=NOISE,
        expected_batch_size=float(len(ids.unique()) if users is not None else len(ids)),
        strategy="materialize" if method == "user-level formed" else "auto",
    )
    step = Step(lambda: None)

    def dp_step() -> None:
        step.strategy = private.step(inputs, targets, user_ids=users).strategy

    step.call = dp_step
    return step


def time_workload(workload: Workload, config: Config, grouping: str, rounds: int) -> dict:
    steps, result = {}, {"failed": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in METHODS:
            try:
                steps[method] = build_step(method, workload, config, grouping)
                steps[method].call()
            except Exception as error:  # a method that cannot take the model is a result
                steps.pop(method, None)
                result["failed"][method] = failure(error)
        times = time_interleaved({m: s.call for m, s in steps.items()}, rounds, warmup=0)
    result["times_s"] = times
    result["strategy"] = {m: s.strategy for m, s in steps.items() if s.strategy}
    return result


def memory_of(workload: Workload, config: Config, grouping: str, method: str) -> dict:
    if not os.path.exists("/proc/self/clear_refs"):
        return {"failed": "not measured: needs Linux's /proc/self/clear_refs"}
    free_buffers_to_the_os()
    warnings.simplefilter("ignore")
    try:
        step = build_step(method, workload, config, grouping)
        gc.collect()
        baseline = status_mib("VmRSS")
        first = peak_rss_over(step.call) - baseline
        gc.collect()
        later = peak_rss_over(step.call) - baseline
    except Exception as error:
        return {"failed": failure(error)}
    return {"mib": max(first, later)}


def rows_for(workload: Workload, config: Config, grouping: str, args: Any) -> list[dict]:
    timed = in_child(time_workload, workload, config, grouping, args.rounds, threads=args.threads)
    memory = {
        m: in_child(memory_of, workload, config, grouping, m, threads=args.threads) for m in METHODS
    }
    times = timed.get("times_s", {})
    rows = []
    for method in METHODS:
        row = {"workload": workload.name, "users": grouping, "method": method}
        if method in timed.get("failed", {}) or method not in times:
            row["time"] = timed.get("failed", {}).get(method, timed.get("failed", "-"))
        else:
            median = sorted(times[method])[len(times[method]) // 2]
            row["time"] = f"{median * 1e3:.0f} ms"
            if BASE in times:
                row["time ratio"] = fmt(paired_ratio(times[method], times[BASE]), ".2f", "x")
        row["strategy"] = timed.get("strategy", {}).get(method, "")
        mem, base = memory[method], memory[BASE]
        if "mib" in mem:
            row["extra memory"] = f"{mem['mib']:.0f} MiB"
            if "mib" in base and base["mib"] > 0:
                row["memory ratio"] = f"{mem['mib'] / base['mib']:.2f}x"
        else:
            row["extra memory"] = mem.get("failed", "-")
        rows.append(row)
    return rows


def header(args: argparse.Namespace, config: Config) -> str:
    import torch

    return titled(
        "User-level DP step cost: users' norms by the ghost strategy vs formed (CPU)",
        [
            f"machine: {machine.cpu_and_cores()}, torch threads "
            f"{args.threads or torch.get_num_threads()}; "
            + machine.software("torch", "transformers", "pergrad"),
            f"date: {machine.timestamp()}; load average {machine.load_average()} at the end",
            f"models: {config.layers} layers, width {config.width}, vocabulary {config.vocab}; "
            f"max_norm {MAX_NORM}, noise_multiplier {NOISE}, torch.optim.SGD",
            f"time: median of {args.rounds} interleaved rounds after a warm-up step; ratio: "
            f"median of per-round ratios to the non-private step. Memory: peak RSS above the "
            f"RSS after building, each method in its own process",
            f"command: `{machine.command_line()}`",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="write the markdown here")
    args = parser.parse_args()
    config = QUICK if args.quick else FULL
    if args.quick:
        args.rounds, args.threads = 2, args.threads or 1
        chosen = [Workload("GPT-2", 8, 4)]
    else:
        chosen = [Workload("GPT-2", 128, 16), Workload("BERT", 128, 16)]
    preload()
    rows = []
    for workload in chosen:
        for grouping in ("even", "skewed"):
            rows += rows_for(workload, config, grouping, args)
            print(table(rows[-len(METHODS) :]), flush=True)
    publish(table(rows), args.out, lambda: header(args, config))


COLUMNS = (
    "workload",
    "users",
    "method",
    "strategy",
    "time",
    "time ratio",
    "extra memory",
    "memory ratio",
)


def table(rows: list[dict]) -> str:
    return markdown_table(COLUMNS, [[str(r.get(c, "")) for c in COLUMNS] for r in rows])


if __name__ == "__main__":
    main()
