"""pergrad's DP step on a ``torch.compile`` d model: compile time, steady-state ratios and graph
breaks, side by side with the eager model (issue 36).

Run:  python benchmarks/dp_compile.py [--quick] [--backend inductor] [--out PATH.md]

The committed results: ``python benchmarks/dp_compile.py --out
benchmarks/results/cpu/dp_compile_probes.md`` (about 5 minutes on 2 cores: most of it is
inductor compiling; ``dp_compile.md`` is the run before the whole-graph capture).
``--quick``: tiny models, the ``aot_eager`` backend (no C++ compiler needed), 2 rounds: about
30 s.

Models and batches are ``benchmarks/dp_transformers.py``'s (small Hugging Face configs, no
dropout, training mode), smaller here (2 layers, width 128, vocabulary 2048, 64 tokens) so that
compilation stays in minutes; ``Encoder`` is PyTorch's own ``nn.TransformerEncoder`` (its
attention an ``nn.MultiheadAttention``, called with ``need_weights=False``) between token and
position embeddings and a classifier over the mean token, at the same sizes. Six methods, each on its own copy of the model (same
initialisation, same batch):

* ``non-private``: forward, backward, ``torch.optim.SGD`` step on the eager model;
* ``non-private compiled``: the same on ``torch.compile(model, backend=...)``;
* ``pergrad DP``: ``pergrad.dp.DPOptimizer(SGD, model, ...).step(x, y)`` on the eager model
  (``strategy="auto"``, which may materialise per-example gradients of a small model);
* ``pergrad DP compiled``: the same with the compiled model;
* ``pergrad DP ghost`` / ``pergrad DP ghost compiled``: the same with ``strategy="ghost"``, the
  path with pergrad's forward hooks (where the graph breaks were, before the whole-graph
  capture).

Each compiled method runs in a process of its own (forked), next to the eager non-private step
and the eager twin it is compared with (see ``GROUPS``): ratios are paired within a process;
the compiled DP step's ratio to the compiled non-private step goes through the eager
non-private step of each process.

First and second step: the wall time of each method's first and second calls (for the compiled
methods, dynamo's tracing and the backend's compilation of the forward and backward graphs),
with dynamo's counters over each: graphs compiled, graph breaks (with their reasons) and
recompilations. pergrad's ghost step on a compiled model checks each new layout on its first
step eagerly (no compilation) and compiles its hot path, the norm pass with every layer's
records in one graph (``capture/torch_compiled.py``), on the second: the compile time is the
two steps' together, and the graphs of the hot path are the second step's. Each process compiles into a fresh inductor cache folder (a cold compile, as a new run's first
step). Steady state: median of ``--rounds`` interleaved rounds after one more warm-up step each
(:func:`pergrad.bench.timing.time_interleaved`); ratios are medians of per-round ratios. The
graphs compiled during the timed rounds are counted too (0: nothing recompiles once warm).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import re
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dp_transformers import (  # noqa: E402
    LEARNING_RATE,
    MAX_NORM,
    NOISE,
    QUICK,
    Config,
    Workload,
    batch,
    hf_model,
    loss_fn,
    small,
)
from pergrad.bench import machine  # noqa: E402
from pergrad.bench.child import ChildFailed, run_in_child  # noqa: E402
from pergrad.bench.report import error_summary, fmt, markdown_table, publish, titled  # noqa: E402
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved, timed  # noqa: E402

BASE, BASE_COMPILED = "non-private", "non-private compiled"
DP, DP_COMPILED = "pergrad DP", "pergrad DP compiled"
GHOST, GHOST_COMPILED = "pergrad DP ghost", "pergrad DP ghost compiled"
METHODS = (BASE, BASE_COMPILED, DP, DP_COMPILED, GHOST, GHOST_COMPILED)
STRATEGY = {DP: "auto", DP_COMPILED: "auto", GHOST: "ghost", GHOST_COMPILED: "ghost"}
EAGER_TWIN = {BASE: BASE, BASE_COMPILED: BASE, DP: DP, DP_COMPILED: DP, GHOST: GHOST}
EAGER_TWIN[GHOST_COMPILED] = GHOST
COMPILED = (BASE_COMPILED, DP_COMPILED, GHOST_COMPILED)
# Small enough that inductor compiles each workload in a minute or two on 2 cores.
FULL = Config(width=128, vit_width=128, layers=2, heads=4, vocab=2048)
FULL_LENGTH, FULL_BATCH = 64, 8


def workloads(quick: bool, models: list[str]) -> list[Workload]:
    if quick:
        return [small(model) for model in models]
    return [
        Workload(model, (FULL.image // FULL.patch) ** 2 + 1, 2 * FULL_BATCH)
        if model == "ViT"
        else Workload(model, FULL_LENGTH, FULL_BATCH)
        for model in models
    ]


class EncoderOutput(NamedTuple):
    logits: Any


def encoder(config: Config, length: int) -> Any:
    """``Encoder``: PyTorch's ``nn.TransformerEncoder`` (no dropout), token and position
    embeddings before it, a linear classifier (2 classes) over the mean token after it; called
    as the Hugging Face models are (``input_ids``, ``position_ids``; ``.logits``)."""
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width = config.width
            self.tokens = nn.Embedding(config.vocab, width)
            self.positions = nn.Embedding(length, width)
            layer = nn.TransformerEncoderLayer(
                width, config.heads, 4 * width, dropout=0.0, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, 2)

        def forward(self, input_ids: Any, position_ids: Any) -> EncoderOutput:
            hidden = self.tokens(input_ids) + self.positions(position_ids)
            return EncoderOutput(self.head(self.encoder(hidden).mean(1)))

    return Encoder()


def build_step(
    method: str, workload: Workload, config: Config, backend: str
) -> tuple[Callable[[], Any], dict[str, str]]:
    """``method``'s training step on its own model, and what it reports (pergrad's strategy)."""
    import torch

    import pergrad

    torch.manual_seed(0)
    make = encoder if workload.model == "Encoder" else functools.partial(hf_model, workload.model)
    model = make(config, workload.length).train()
    inputs, targets = batch(workload, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if method in COMPILED:
        model = torch.compile(model, backend=backend)
    info: dict[str, str] = {}
    if method in (BASE, BASE_COMPILED):

        def plain_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(**inputs), targets).backward()
            optimizer.step()

        return plain_step, info
    private = pergrad.dp.DPOptimizer(
        optimizer,
        model,
        loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=NOISE,
        expected_batch_size=workload.batch_size,
        strategy=STRATEGY[method],
    )

    def dp_step() -> None:
        info["strategy"] = private.step(inputs, targets).strategy

    return dp_step, info


def dynamo_counters() -> dict[str, Counter]:
    from torch._dynamo.utils import counters

    return {name: Counter(values) for name, values in counters.items()}


def counted_since(before: dict[str, Counter]) -> dict[str, Any]:
    """Dynamo's counts since ``before``: graphs compiled, graph breaks by reason, frames
    converted (each recompilation of a frame counts once more)."""
    after = dynamo_counters()

    def delta(name: str) -> Counter:
        return after.get(name, Counter()) - before.get(name, Counter())

    return {
        "graphs": delta("stats")["unique_graphs"],
        "breaks": delta("graph_break"),
        "frames": delta("frames")["total"],
    }


def short_reason(reason: str) -> str:
    """A graph break's reason in one line: its first line and dynamo's debug context."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    context = [line for line in lines if line.startswith("Developer debug context")]
    text = "; ".join(lines[:1] + [c.removeprefix("Developer debug context: ") for c in context])
    return re.sub(r" at 0x[0-9a-f]+", "", text).replace("|", "/")[:200]


# Two compiled copies of one model in one process share dynamo's caches (the same forward code
# objects): the DP step's calls, with pergrad's hooks and parameters passed as plain tensors,
# then make the plain compiled model recompile in the timed rounds. So each compiled step is
# timed in a process of its own, forked from this one, next to the eager step(s) it is
# compared with; every ratio is a paired ratio within one process.
GROUPS = ((BASE, BASE_COMPILED), (BASE, DP, DP_COMPILED), (BASE, GHOST, GHOST_COMPILED))
JOB_TIMEOUT_S = 1800


def time_group(
    methods: tuple[str, ...], workload: Workload, config: Config, args: argparse.Namespace
) -> dict[str, Any]:
    """``methods`` timed side by side (interleaved rounds), after a first and a second step
    each; dynamo's counts over each first step and over the timed rounds."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    # A cold compile: inductor's on-disk caches (kernels, graphs) of earlier runs would make
    # the first step a cache lookup. Read when inductor first compiles, in this process.
    with tempfile.TemporaryDirectory(prefix="dp_compile_", ignore_cleanup_errors=True) as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        result = time_steps(methods, workload, config, args.backend, args.rounds)
        torch._inductor.async_compile.shutdown_compile_workers()
    return result


def time_steps(
    methods: tuple[str, ...], workload: Workload, config: Config, backend: str, rounds: int
) -> dict[str, Any]:
    steps: dict[str, Any] = {}
    result: dict[str, Any] = {"first_s": {}, "first": {}, "second_s": {}, "second": {}}
    result.update(failed={}, info={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in methods:
            try:
                call, info = build_step(method, workload, config, backend)
                before = dynamo_counters()
                _, result["first_s"][method] = timed(call)
                result["first"][method] = counted_since(before)
                # the second step: the compiled ghost step's hot path compiles here, and a
                # recompilation for new guards shows here
                before = dynamo_counters()
                _, result["second_s"][method] = timed(call)
                result["second"][method] = counted_since(before)
                steps[method], result["info"][method] = call, info
            except Exception as error:  # a method that fails is a result
                result["failed"][method] = error_summary(error)
        before = dynamo_counters()
        result["times_s"] = time_interleaved(steps, rounds, warmup=0)
        result["steady"] = counted_since(before)
    return result


def time_workload(workload: Workload, config: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Every method, each group in its own forked process: ms, ratios, first steps, counts."""
    merged: dict[str, Any] = {"first_s": {}, "first": {}, "second_s": {}, "second": {}}
    merged.update(failed={}, info={})
    merged.update(ms={}, base_ms={}, to_eager_base={}, steady={})
    for methods in GROUPS:
        try:
            job = functools.partial(time_group, methods, workload, config, args)
            group = run_in_child(job, fork=True, timeout=JOB_TIMEOUT_S)
        except ChildFailed as error:
            merged["failed"].update({m: f"fails: {error.reason}" for m in methods})
            continue
        for key in ("first_s", "first", "second_s", "second", "failed", "info"):
            merged[key].update(
                {m: v for m, v in group[key].items() if m != BASE or m not in merged[key]}
            )
        times = group["times_s"]
        for method in methods:
            if method in times and BASE in times:
                merged["ms"].setdefault(method, median_ms(times[method]))
                merged["base_ms"].setdefault(method, median_ms(times[BASE]))
                merged["to_eager_base"].setdefault(method, paired_ratio(times[method], times[BASE]))
        merged["steady"][methods[-1]] = group["steady"]
    return merged


def table(workload: Workload, result: dict[str, Any]) -> str:
    """Each method's first step and steady state; ratios to the non-private step (eager, or
    compiled for the compiled DP step) and to the same step on the eager model."""
    rows = []
    ratio = result["to_eager_base"]
    versus = {m: BASE_COMPILED if m in COMPILED[1:] else BASE for m in METHODS}
    for method in METHODS:
        if method in result["failed"] or method not in ratio:
            failure = result["failed"].get(method, "not timed")
            rows.append([workload.name, method, failure] + [""] * 9)
            continue
        first, second = result["first"][method], result["second"][method]

        def over(other: str, method: str = method) -> str:
            return f"{ratio[method] / ratio[other]:.2f}x" if other in ratio else "-"

        rows.append(
            [
                workload.name,
                method,
                fmt(1e3 * result["first_s"][method], ".0f", " ms"),
                fmt(1e3 * result["second_s"][method], ".0f", " ms"),
                fmt(result["ms"][method], ".1f"),
                fmt(result["base_ms"][method], ".1f"),
                f"{over(versus[method])} ({versus[method]})",
                over(EAGER_TWIN[method]),
                f"{first['graphs']} / {second['graphs']}",
                f"{sum(first['breaks'].values())} / {sum(second['breaks'].values())}",
                result["info"][method].get("strategy", ""),
            ]
        )
    return markdown_table(
        [
            "workload",
            "method",
            "first step",
            "second step",
            "steady ms",
            "non-private ms, same process",
            "ratio to its non-private step",
            "ratio to the eager same step",
            "graphs (1st / 2nd step)",
            "graph breaks (1st / 2nd step)",
            "strategy",
        ],
        rows,
    )


def breaks_summary(workload: Workload, result: dict[str, Any]) -> list[str]:
    lines = []
    for method in COMPILED:
        for step, which in (("first", "first"), ("second", "second")):
            counted = result[which].get(method)
            if counted is None:
                continue
            reasons: Counter = Counter()
            for reason, count in counted["breaks"].items():
                reasons[short_reason(reason)] += count
            listed = "; ".join(f"{count}x {reason}" for reason, count in reasons.most_common())
            lines.append(
                f"- {workload.name} / {method}: {counted['graphs']} graphs, "
                f"{sum(reasons.values())} graph breaks, {counted['frames']} frames converted in "
                f"the {step} step" + (f": {listed}" if listed else "")
            )
    for method, steady in result["steady"].items():
        lines.append(
            f"- {workload.name} / {method}, timed rounds: {steady['graphs']} graphs compiled, "
            f"{sum(steady['breaks'].values())} graph breaks, {steady['frames']} frames converted"
        )
    return lines


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return f"load average {machine.load_average()}"


def header(args: argparse.Namespace, config: Config, load_before: str) -> str:
    import torch

    return titled(
        f"pergrad's DP step on a torch.compile'd model (backend {args.backend!r}, CPU)",
        [
            f"machine: {machine.cpu_and_cores()}, torch threads {torch.get_num_threads()}; "
            f"{platform.system()}, " + machine.software("torch", "transformers", "pergrad"),
            f"date: {machine.timestamp()}; `uptime` at the start: {load_before}; at the end: "
            f"{uptime()} (the 2 cores are shared with other sessions)",
            f"models: benchmarks/dp_transformers.py's, {config.layers} layers, width "
            f"{config.width}, {config.heads} heads, vocabulary {config.vocab}; no dropout; "
            f"max_norm {MAX_NORM}, noise_multiplier {NOISE}, torch.optim.SGD",
            f"time: median of {args.rounds} interleaved rounds after the first step and one "
            f"more; first and second step: one wall-clock measurement each (compilation "
            f"included)",
            f"command: `{machine.command_line()}`",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, aot_eager, 2 rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--backend", help="torch.compile backend (default inductor; quick: aot_eager)"
    )
    parser.add_argument(
        "--models",
        help="comma-separated, as dp_transformers, and Encoder (PyTorch's own; default "
        "GPT-2,BERT,Llama,Encoder,ViT; quick: GPT-2)",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; quick: 1)")
    parser.add_argument("--out", type=Path, help="write the markdown here")
    args = parser.parse_args()

    if args.quick:
        args.rounds, args.threads = 2, args.threads or 1
    args.models = args.models or ("GPT-2" if args.quick else "GPT-2,BERT,Llama,Encoder,ViT")
    args.backend = args.backend or ("aot_eager" if args.quick else "inductor")
    config = QUICK if args.quick else FULL
    load_before = uptime()
    tables, breaks = [], []
    for workload in workloads(args.quick, args.models.split(",")):
        result = time_workload(workload, config, args)
        tables.append(table(workload, result))
        breaks += breaks_summary(workload, result)
        print(tables[-1], flush=True)
    text = "\n\n".join(
        [
            "\n\n".join(tables),
            "Graph breaks (dynamo's counters; a break splits the forward into separately "
            "compiled graphs with Python in between), in the first step, the second (where "
            "the compiled ghost step compiles its hot path) and the timed rounds:",
            "\n".join(breaks),
        ]
    )
    publish(text, args.out, lambda: header(args, config, load_before))


if __name__ == "__main__":
    main()
