"""The layer hooks against vmap for ``per_example_grads(module_loss(...))``: which "auto" takes.

Run:  python benchmarks/hooks_vs_vmap.py [--threads N] [--rounds N] [--out PATH]

Since issue 36, ``strategy="auto"`` tries the layer hooks first for a ``pergrad.module_loss``
whose every parameter is in a layer with a rule (``strategies/registry.py``), and vmap after
them. This times both, forced, side by side on the benchmark workloads of ``pergrad.bench``
(and the sweep's MLP at batches 8 and 1024), with the batch gradient (``loss.backward()``) as
the floor: interleaved rounds after two warm-up calls each (which run the hooks' first-call
checks), medians, and the median of per-round ratios hooks / vmap.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from pathlib import Path
from typing import Any

import torch

import pergrad
from pergrad.bench import workloads
from pergrad.bench.machine import load_average
from pergrad.bench.report import fmt, markdown_table, publish, sentence_header
from pergrad.bench.timing import median_ms, time_interleaved

CASES = (("linreg", 1024), ("mlp", 256), ("cnn", 64), ("transformer", 32), ("sweep", 8))
CASES += (("sweep", 1024),)


def measure(name: str, batch: int, rounds: int) -> dict[str, Any]:
    workload = workloads.WORKLOADS[name]
    model, x, y = workloads.build(workload, batch)
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    loss = pergrad.module_loss(model, lambda out, t: workloads.torch_loss(workload, out, t))
    params = loss.params()
    fns = {s: pergrad.per_example_grads(loss, strategy=s) for s in ("hooks", "vmap")}

    def floor() -> None:
        model.zero_grad(set_to_none=True)
        workloads.torch_loss(workload, model(x), y).backward()

    methods = {"batch grad": floor}
    methods.update({s: (lambda f=f: f(params, x, y)) for s, f in fns.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = time_interleaved(methods, rounds, warmup=2)
    ms = {k: median_ms(v) for k, v in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["hooks"], times["vmap"]))
    return {"workload": f"{name} (B={batch})", **ms, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="small batches, 2 rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = [(n, min(b, 8)) for n, b in CASES[:4]] if args.quick else list(CASES)
    rounds = 2 if args.quick else args.rounds
    rows = [measure(name, batch, rounds) for name, batch in cases]
    columns = ["workload", "batch grad ms", "hooks ms", "vmap ms", "hooks / vmap"]
    cells = [
        [r["workload"], fmt(r["batch grad"], ".2f"), fmt(r["hooks"], ".2f")]
        + [fmt(r["vmap"], ".2f"), fmt(r["ratio"], ".2f", "x")]
        for r in rows
    ]

    def header() -> str:
        details = [f"torch threads {args.threads}", f"median of {rounds} interleaved rounds"]
        details.append(f"load average {load_average()} at the end")
        return sentence_header("Layer hooks against vmap (per_example_grads)", ["torch"], details)

    publish(markdown_table(columns, cells), args.out, header)


if __name__ == "__main__":
    main()
