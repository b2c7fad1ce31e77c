"""The DP step on Poisson batches: a new batch size every step, against fixed-size batches.

Run:  python benchmarks/dp_poisson.py [--quick] [--out PATH]

DP-SGD's accounting assumes Poisson sampling (``pergrad.dp.PoissonBatchSampler``): each step's
batch size is drawn anew (Binomial(N, q)). pergrad's capture checks each layout once (a
weighted backward pass, examples run alone, the sums against the batch gradient:
``capture/torch_checks.py``); before, a layout included the batch size, so every Poisson step
paid those checks again. Side by side in one run, on the Hugging Face GPT-2 and BERT of
``benchmarks/strategies.py`` (4 layers, width 128, sequence 32, expected batch 32):

* ``non-private``: ``loss.backward()`` and an SGD step on the Poisson batches;
* ``DP fixed size``: ``DPOptimizer.step`` (``strategy="auto"``) on batches of the expected size;
* ``DP Poisson``: the same on the Poisson batches;
* ``DP Poisson, before``: the same with the layout keyed by the exact batch size as before
  (``torch_checks.layout_key`` patched to add it), so the checks run at each new size.

Each method steps on its own copy of the model with the learning rate 0 (the models stay
equal). Time: median over the steps of interleaved rounds (each round runs every method once
on the same batch). FLOP column: FLOPs per example of a step (``FlopCounterMode``,
over three batch sizes no step drew, after the timed steps), against the non-private step's;
it does not depend on the load. The last column counts the timed steps that ran the capture's
first-call checks (a new layout: with sequence 32, a batch of 32 marks the sequence axis as
the batch too, so 32 and the other sizes are two layouts).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pergrad
from pergrad._src.capture import torch_checks
from pergrad.bench.machine import load_average
from pergrad.bench.report import fmt, markdown_table, publish, sentence_header

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import build  # noqa: E402

METHODS = ("non-private", "DP fixed size", "DP Poisson", "DP Poisson, before")


@contextlib.contextmanager
def keyed_by_batch_size() -> Any:
    """The layouts as before: the exact batch size in the key, so every size is checked."""
    original = torch_checks.layout_key

    def old_key(params: Any, arguments: Any, batch_size: int) -> Any:
        return (original(params, arguments, batch_size), batch_size)

    torch_checks.layout_key = old_key
    try:
        yield
    finally:
        torch_checks.layout_key = original


def rows_of(inputs: dict, target: Any, size: int) -> tuple[dict, Any]:
    """The first ``size`` examples, repeating the batch where it is shorter."""
    reps = -(-size // len(target))
    take = {k: v.repeat(reps, *([1] * (v.dim() - 1)))[:size] for k, v in inputs.items()}
    return take, target.repeat(reps, *([1] * (target.dim() - 1)))[:size]


def run_model(kind: str, steps: int, quick: bool, seed: int) -> list[dict]:
    model, loss_fn, (inputs, target) = build(kind, False, quick)
    expected = len(target)
    rng = np.random.default_rng(seed)
    # Binomial(N, q) with N q = expected, N = 50 x expected (a dataset of that size)
    sizes = [int(s) for s in rng.binomial(50 * expected, 1 / 50, size=steps)]

    def dp(models: list, batch_of: Any, before: bool = False) -> Any:
        wrapped = copy.deepcopy(model)  # (a dict batch is passed as keyword arguments)
        optimizer = pergrad.dp.DPOptimizer(
            torch.optim.SGD(wrapped.parameters(), lr=0.0),
            wrapped,
            loss_fn,
            max_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=expected,
        )
        models.append(optimizer)

        def step(size: int) -> None:
            x, y = batch_of(size)
            with keyed_by_batch_size() if before else contextlib.nullcontext():
                optimizer.step(x, y)

        return step

    plain = copy.deepcopy(model)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.0)

    def non_private(size: int) -> None:
        x, y = rows_of(inputs, target, size)
        sgd.zero_grad(set_to_none=True)
        loss_fn(plain(**x), y).backward()
        sgd.step()

    keep: list = []
    methods = {
        "non-private": non_private,
        "DP fixed size": (lambda step: lambda size: step(expected))(
            dp(keep, lambda s: rows_of(inputs, target, s))
        ),
        "DP Poisson": dp(keep, lambda s: rows_of(inputs, target, s)),
        "DP Poisson, before": dp(keep, lambda s: rows_of(inputs, target, s), before=True),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in methods.values():  # warm-up at the expected size: its layout checked
            call(expected)
        times: dict[str, list[float]] = {name: [] for name in methods}
        checks = dict.fromkeys(methods, 0)
        names = list(methods)
        with _counting_checks() as counted:
            for r, size in enumerate(sizes):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    before = counted[0]
                    start = time.perf_counter()
                    methods[name](size)
                    times[name].append(time.perf_counter() - start)
                    checks[name] += counted[0] > before
        # three sizes no step drew (before the fix, each was a new layout)
        unseen = [n for n in range(expected + 1, 4 * expected) if n not in sizes][:3]
        flops = {
            name: _flops_per_example(call, unseen, fixed=expected if i == 1 else 0)
            for i, (name, call) in enumerate(methods.items())
        }
    fixed = statistics.median(times["DP fixed size"])
    rows = []
    for name in METHODS:
        ms = 1e3 * statistics.median(times[name])
        rows.append(
            {
                "model": kind,
                "method": name,
                "ms": ms,
                "vs fixed": ms / (1e3 * fixed),
                "vs non-private": ms / (1e3 * statistics.median(times["non-private"])),
                "flops": flops[name] / flops["non-private"],
                "checks": checks[name],
                "steps": len(sizes),
            }
        )
    rows[0]["sizes"] = sizes
    return rows


@contextlib.contextmanager
def _counting_checks() -> Any:
    """``[n]``: how many times the capture's first-call checks ran (examples alone)."""
    counted = [0]
    original = torch_checks.check_losses_alone

    def counting(*args: Any) -> Any:
        counted[0] += 1
        return original(*args)

    torch_checks.check_losses_alone = counting
    try:
        yield counted
    finally:
        torch_checks.check_losses_alone = original


def _flops_per_example(call: Any, sizes: list[int], fixed: int) -> float:
    """FLOPs per example of ``call`` over ``sizes`` (``fixed``: it runs that many examples
    whatever the size asked)."""
    from torch.utils.flop_counter import FlopCounterMode

    total = 0.0
    for size in sizes:
        with FlopCounterMode(display=False) as counter:
            call(size)
        total += counter.get_total_flops()
    return total / (fixed * len(sizes) if fixed else sum(sizes))


def table(rows: list[dict]) -> str:
    columns = [
        "model",
        "method",
        "ms / step",
        "/ DP fixed size",
        "/ non-private",
        "FLOP per example / non-private",
        "steps that ran the checks",
    ]
    cells = [
        [r["model"], r["method"], fmt(r["ms"], ".1f")]
        + [fmt(r["vs fixed"], ".2f", "x"), fmt(r["vs non-private"], ".2f", "x")]
        + [fmt(r["flops"], ".2f", "x"), f"{r['checks']} of {r['steps']}"]
        for r in rows
    ]
    return markdown_table(columns, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, three steps")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    rows = []
    for seed, kind in enumerate(("GPT-2", "BERT")):
        rows += run_model(kind, steps, args.quick, seed)
    sizes = {r["model"]: r["sizes"] for r in rows if "sizes" in r}

    def header() -> str:
        drawn = "; ".join(f"{k}: {v}" for k, v in sizes.items())
        return sentence_header(
            "The DP step on Poisson batches",
            ["torch", "transformers"],
            [f"{steps} steps, batch sizes drawn {drawn}", f"load average {load_average()}"],
        )

    publish(table(rows), args.out, header)


if __name__ == "__main__":
    main()
