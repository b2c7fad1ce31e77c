"""Where the time of pergrad's DP step goes, phase by phase, against a non-private step.

Run:  python benchmarks/dp_time_split.py [--models BERT,ViT] [--rounds 7] [--out PATH]

Issue 36 asks, where the DP step misses 1.15x the non-private step's time, for the measured
split. On the small transformers of ``benchmarks/dp_transformers.py`` (its models, batches and
``DPOptimizer(strategy="auto")`` step, one torch thread), each phase of one step is timed by
wrapping the pergrad function that runs it (``time.perf_counter`` around each call, summed over
the step; CPU work is synchronous):

* ``forward``: the batched forward pass under the layer hooks (``torch_passes.forward``);
* ``backward``: the backward pass that fills the records, differentiating the layers' outputs,
  not their weights (``torch_passes._first_backward``); the layers held as their formed
  per-example gradients are formed in it (``capture/torch_held.py``);
* ``norms``: every other layer's certified squared norms from its records
  (``torch_passes._reduce_records``);
* ``clipped sum``: the weighted sums from the records and the held gradients
  (``torch_quantities.weighted_sums``);
* ``noise``: the Gaussian draw added to the sum (``DPOptimizer._noisy_totals``);
* ``optimizer``: ``.grad`` written and the SGD step (``DPOptimizer._update``);
* ``other``: the rest of the step (choosing the strategy, clip weights, host reads, Python).

The non-private step is split into its forward pass (model and loss), ``backward()`` and the
SGD step. After the timed rounds, one more step of each is run under
``torch.utils.flop_counter.FlopCounterMode`` (each DP phase under its own): the matrix
products' FLOPs (matrix multiplications, convolutions, attention) of the non-private step, of
the DP step and of its norms and clipped sum, and their rates over the phases' median times:
where the norms' products run as fast as the step's own, their time is their FLOPs, and only
fewer FLOPs would shorten it. ``--records-held`` adds the DP step with every layer's records held to the end of the
backward pass (``capture/cost.HOLD_FORMED`` off), as before the held gradients. Time: each
phase's median over interleaved rounds (every method once per round, after two warm-up steps).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import dp_transformers as dpt  # noqa: E402
from pergrad.bench.machine import cpu_and_cores, load_average, load_span, software  # noqa: E402
from pergrad.bench.report import markdown_table, publish, titled  # noqa: E402

PHASES = ("forward", "backward", "norms", "clipped sum", "noise", "optimizer", "other")
DP, HELD = "pergrad DP", "pergrad DP, records held"
WORKLOADS = {
    "GPT-2": [("GPT-2", 128, 16), ("GPT-2", 512, 4)],
    "GPT-2 untied": [("GPT-2 untied", 512, 4)],
    "BERT": [("BERT", 128, 16), ("BERT", 512, 4)],
    "Llama": [("Llama", 128, 16), ("Llama", 512, 4)],
    "ViT": [("ViT", 65, 32)],
}


@contextlib.contextmanager
def wrapped_phases(
    targets: list[tuple[Any, str, str]], wrap: Callable[[Callable[..., Any], str], Any]
) -> Iterator[None]:
    """Each ``(owner, name, phase)`` of ``targets``: ``owner.name`` replaced by
    ``wrap(original, phase)`` while inside, put back on the way out."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for (owner, name, phase), (_, _, original) in zip(targets, originals):
        setattr(owner, name, wrap(original, phase))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def timed_phases(spent: dict[str, float]) -> Any:
    """pergrad's phase functions wrapped to add their time (s) into ``spent`` while inside."""
    from pergrad._src.capture import torch_passes, torch_quantities
    from pergrad._src.torch.dp_optimizer import DPOptimizer

    def timing(function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        return timed

    targets = [
        (torch_passes, "forward", "forward"),
        (torch_passes, "_first_backward", "backward"),
        (torch_passes, "_reduce_records", "norms"),
        (torch_quantities, "weighted_sums", "clipped sum"),
        (DPOptimizer, "_noisy_totals", "noise"),
        (DPOptimizer, "_update", "optimizer"),
    ]
    return wrapped_phases(targets, timing)


def counted_phases(flops: dict[str, float]) -> Any:
    """The DP step's norms and clipped-sum functions wrapped to add the FLOPs of their matrix
    products into ``flops`` (each call under a ``FlopCounterMode`` of its own)."""
    from torch.utils.flop_counter import FlopCounterMode

    from pergrad._src.capture import torch_passes, torch_quantities

    def counting(function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with FlopCounterMode(display=False) as counter:
                result = function(*args, **kwargs)
            flops[phase] += counter.get_total_flops()
            return result

        return counted

    targets = [
        (torch_passes, "_reduce_records", "norms"),
        (torch_quantities, "weighted_sums", "clipped sum"),
    ]
    return wrapped_phases(targets, counting)


def step_flops(steps: dict[str, Callable[[], Any]]) -> dict[str, dict[str, float]]:
    """One more step of each method: the FLOPs of its matrix products, in all (``total``) and,
    for the DP step, of its norms and clipped sum."""
    from torch.utils.flop_counter import FlopCounterMode

    found: dict[str, dict[str, float]] = {}
    for name, run in steps.items():
        phases: dict[str, float] = defaultdict(float)
        with FlopCounterMode(display=False) as counter:
            run()
        phases["total"] = counter.get_total_flops()
        if name != "non-private":
            with counted_phases(phases):
                run()
        found[name] = dict(phases)
    return found


def flops_row(workload: Any, times: dict[str, dict[str, float]], flops: Any) -> list[str]:
    """GFLOP of the non-private step, the DP step, its norms and clipped sum; and GFLOP/s of
    the non-private step, the norms and the clipped sum over their median times."""
    plain, dp = flops["non-private"], flops[DP]
    plain_ms, dp_ms = times["non-private"], times[DP]

    def rate(gflop: float, ms: float) -> str:
        return f"{gflop / ms * 1e3:.0f}" if ms else ""

    g = {key: value / 1e9 for key, value in dp.items()}
    base = plain["total"] / 1e9
    return [
        workload.name,
        f"{base:.1f}",
        f"{g['total']:.1f} ({g['total'] / base:.2f}x)",
        f"{g.get('norms', 0.0):.1f} ({g.get('norms', 0.0) / base:.0%})",
        f"{g.get('clipped sum', 0.0):.1f}",
        rate(base, plain_ms["total"]),
        rate(g.get("norms", 0.0), dp_ms["norms"]),
        rate(g.get("clipped sum", 0.0), dp_ms["clipped sum"]),
    ]


def plain_phases(workload: Any) -> Callable[[], dict[str, float]]:
    """The non-private step, its forward pass, ``backward()`` and SGD step timed apart."""
    torch.manual_seed(0)
    model = dpt.hf_model(workload.model, dpt.FULL, workload.length).train()
    inputs, targets = dpt.batch(workload, dpt.FULL)
    optimizer = torch.optim.SGD(model.parameters(), lr=dpt.LEARNING_RATE)

    def step() -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = dpt.loss_fn(model(**inputs), targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "total": t3 - t0}

    return step


def dp_phases(workload: Any, held: bool) -> Callable[[], dict[str, float]]:
    """pergrad's DP step (``held``: as it is; else every layer's records held), by phase."""
    step = dpt.build_step("pergrad DP", workload, dpt.FULL)
    call = step.call if held else dpt.with_cost_flag(step.call, "HOLD_FORMED", False)

    def run() -> dict[str, float]:
        spent: dict[str, float] = defaultdict(float)
        with timed_phases(spent):
            start = time.perf_counter()
            call()
            total = time.perf_counter() - start
        spent["other"] = total - sum(spent.values())
        spent["total"] = total
        return dict(spent)

    return run


def measure(
    workload: Any, rounds: int, records_held: bool
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Each method's median ms per phase (and ``total``), interleaved rounds; and the FLOPs of
    one more step of each (:func:`step_flops`)."""
    steps = {"non-private": plain_phases(workload), DP: dp_phases(workload, True)}
    if records_held:
        steps[HELD] = dp_phases(workload, False)
    for run in steps.values():  # warm-up: the first call of the layout runs its checks
        run(), run()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, run in steps.items():
            samples[name].append(run())
    times = {
        name: {
            key: 1e3 * statistics.median(s.get(key, 0.0) for s in runs)
            for key in (*PHASES, "total")
        }
        for name, runs in samples.items()
    }
    return times, step_flops(steps)


def rows_of(workload: Any, found: dict[str, dict[str, float]]) -> list[list[str]]:
    base = found["non-private"]["total"]
    rows = []
    for method, phases in found.items():
        cells = [f"{phases[p]:.0f}" if phases[p] else "" for p in PHASES]
        rows.append(
            [workload.name, method, f"{phases['total']:.0f}", f"{phases['total'] / base:.2f}x"]
            + cells
        )
    return rows


def extra_sentence(workload: Any, found: dict[str, dict[str, float]]) -> str:
    """The DP step's time over the non-private one, as the phases' shares of it."""
    plain, dp = found["non-private"], found[DP]
    extra = dp["total"] - plain["total"]
    parts = {
        "forward and backward": dp["forward"]
        + dp["backward"]
        - plain["forward"]
        - plain["backward"],
        "norms": dp["norms"],
        "clipped sum": dp["clipped sum"],
        "noise": dp["noise"],
        "optimizer": dp["optimizer"] - plain["optimizer"],
        "other": dp["other"],
    }
    split = ", ".join(f"{name} {ms:+.0f} ms" for name, ms in parts.items())
    return (
        f"{workload.name}: {dp['total'] / plain['total']:.2f}x, {extra:+.0f} ms over the "
        f"non-private step ({split})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="GPT-2,BERT,Llama,ViT", help="of " + ", ".join(WORKLOADS)
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--records-held", action="store_true", help=f"also time {HELD!r}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    unknown = [m for m in args.models.split(",") if m not in WORKLOADS]
    if unknown:
        parser.error(f"--models: expected some of {', '.join(WORKLOADS)}, got {unknown}")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    start_load = load_average()
    rows, sentences, flop_rows = [], [], []
    for model in args.models.split(","):
        for name, length, size in WORKLOADS[model]:
            workload = dpt.Workload(name, length, size)
            found, flops = measure(workload, args.rounds, args.records_held)
            rows += rows_of(workload, found)
            flop_rows.append(flops_row(workload, found, flops))
            sentences.append(extra_sentence(workload, found))
            print(sentences[-1], flush=True)
    header = ["workload", "method", "step ms", "time / non-private", *(f"{p} ms" for p in PHASES)]
    text = "\n\n".join(
        [
            markdown_table(header, rows, "llrr" + "r" * len(PHASES)),
            "Where the DP step's extra time goes (its phases against the non-private step's):",
            "\n".join(f"- {s}" for s in sentences),
            "The matrix products' work (`FlopCounterMode`, one more step of each; GFLOP/s: "
            "over the phases' median times above):",
            markdown_table(
                [
                    "workload",
                    "non-private GFLOP",
                    "DP GFLOP",
                    "norms GFLOP (of non-private)",
                    "clipped sum GFLOP",
                    "GFLOP/s non-private step",
                    "GFLOP/s norms",
                    "GFLOP/s clipped sum",
                ],
                flop_rows,
                "lrrrrrrr",
            ),
        ]
    )
    publish(
        text,
        args.out,
        lambda: titled(
            "The DP step's time, phase by phase (CPU)",
            [
                f"machine: {cpu_and_cores()}; " + software("torch", "transformers"),
                f"one torch thread; {args.rounds} interleaved rounds after two warm-up steps; "
                "each phase's median (ms); load average " + load_span(start_load),
                "models: those of benchmarks/dp_transformers.py (4 layers, width 256, ViT "
                "128); DPOptimizer(strategy='auto'), max_norm 1, noise multiplier 1, SGD",
                "command: `python " + " ".join(sys.argv) + "`",
            ],
        ),
    )


if __name__ == "__main__":
    main()
