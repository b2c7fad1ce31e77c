"""The DP-SGD step on GPT-2 small on one device: pergrad against the non-private step and
Opacus, time and memory (issue 38).

Run:  python -m benchmarks.dp_device [--device cuda] [--quick] [--rounds N] [--out PATH.md]

GPT-2 small at its real size (12 layers, width 768, vocabulary 50257, its tied embedding and lm
head; nothing downloaded), causal LM loss, sequences of 128 and 512 tokens. The methods and their
settings are those of ``benchmarks/dp_transformers.py`` (its model, batch and step builders):
``non-private`` (forward, backward, SGD step: the unit of every ratio), ``pergrad DP``
(``DPOptimizer``, strategy "auto"), ``pergrad DP, per-layer reads`` (the same with
``capture/cost.DEFERRED_READS`` off: a host read per layer, as before issue 36), ``pergrad
low-memory`` (``strategy="ghost-lowmem"``),
``Opacus hooks`` and ``Opacus ghost`` (which refuses tied parameters: reported, not worked
around). Each method has its own copy of the model on the device.

Time: median of ``--rounds`` interleaved rounds after two warm-up steps, each step waited for
(``torch.cuda.synchronize``); the ratio is the median of the per-round ratios. Memory (CUDA):
for each method in turn, ``torch.cuda.max_memory_allocated`` during one step minus the memory
allocated just before it (after its warm-up steps), i.e. the step's working memory; the ratio is
to the non-private step's. On the CPU memory is not measured (``dp_transformers.py`` does).
Agreement: without noise, the first update of the untied GPT-2 by each private method against
pergrad's, relative difference (they compute the same clipped sum).
"""

from __future__ import annotations

import argparse
import gc
import math
import warnings

import torch

from benchmarks.dp_transformers import (
    BASE,
    GPT2_SMALL,
    METHODS,
    PRIVATE,
    QUICK,
    Config,
    Step,
    Workload,
    build_step,
    failure,
    with_cost_flag,
)
from pergrad.bench.methods import synced
from pergrad.bench.report import describe_device, markdown_table, publish, sentence_header
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved

# pergrad's DP step as before issue 36's deferred reads: each layer reads on the host which of
# its certified norms to tighten (capture/cost.DEFERRED_READS off during its steps), so that a
# GPU run measures what the one combined read saves there
PER_LAYER_READS = "pergrad DP, per-layer reads"
DEVICE_METHODS = (*METHODS[:2], PER_LAYER_READS, *METHODS[2:])


def build(method: str, workload: Workload, config: Config, device: torch.device, noise: float):
    """``dp_transformers.build_step`` on ``device``, each call waited for there."""
    if method == PER_LAYER_READS:
        step = build_step("pergrad DP", workload, config, noise, device)
        step.call = with_cost_flag(step.call, "DEFERRED_READS", False)
    else:
        step = build_step(method, workload, config, noise, device)
    step.call = synced(step.call, device)
    return step


def step_memory_mib(step: Step, device: torch.device) -> float:
    """The step's peak above what is allocated once the previous step's gradients are gone:
    ``.grad`` and Opacus's per-sample ``grad_sample`` / ``summed_grad`` are dropped first, so
    that every method's baseline is its model, optimizer state and batch alone (the first GPU
    run measured above the previous step's leftovers: Opacus's fell below the non-private
    step's)."""
    if device.type != "cuda":
        return math.nan
    for param in step.model.parameters():
        param.grad = None
        for leftover in ("grad_sample", "summed_grad"):
            if getattr(param, leftover, None) is not None:
                setattr(param, leftover, None)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step.call()
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def measure(workload: Workload, config: Config, device: torch.device, rounds: int) -> dict:
    steps, failed, memory = {}, {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in DEVICE_METHODS:
            try:
                step = build(method, workload, config, device, noise=1.0)
                step.call()
                step.call()
                memory[method] = step_memory_mib(step, device)
                steps[method] = step
            except Exception as error:  # a method that cannot take the model is a result
                failed[method] = failure(error)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        times = time_interleaved({m: s.call for m, s in steps.items()}, rounds, warmup=0)
    strategy = {m: s.strategy for m, s in steps.items() if s.strategy}
    return {"times": times, "memory": memory, "failed": failed, "strategy": strategy}


def rows_of(workload: Workload, result: dict) -> list[list[str]]:
    times, memory = result["times"], result["memory"]
    rows = []
    for method in DEVICE_METHODS:
        if method in result["failed"]:
            rows.append([workload.name, method, "-", "-", "-", "-", result["failed"][method]])
            continue
        if method not in times or BASE not in times:
            continue
        ratio = paired_ratio(times[method], times[BASE])
        mem_ratio = memory[method] / memory[BASE] if memory[BASE] > 0 else math.nan
        rows.append(
            [
                workload.name,
                method,
                f"{median_ms(times[method]):.1f}",
                f"{ratio:.2f}",
                "-" if math.isnan(memory[method]) else f"{memory[method]:.0f}",
                "-" if math.isnan(mem_ratio) else f"{mem_ratio:.2f}",
                result["strategy"].get(method, ""),
            ]
        )
    return rows


def agreement(config: Config, device: torch.device, length: int) -> list[list[str]]:
    """Without noise, each private method's first update of the untied GPT-2 against pergrad's."""
    workload = Workload("GPT-2 untied", length, 4)
    updates, rows = {}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in PRIVATE:
            try:
                step = build(method, workload, config, device, noise=0.0)
                before = [p.detach().clone() for p in step.model.parameters()]
                step.call()
            except Exception as error:
                rows.append([method, failure(error)])
                continue
            after = [p.detach() for p in step.model.parameters()]
            updates[method] = torch.cat([(a - b).flatten() for a, b in zip(after, before)])
            del step
    reference = updates.pop("pergrad DP", None)
    for method, update in updates.items():
        if reference is not None:
            relative = float((update - reference).norm() / reference.norm())
            rows.append([method, f"{relative:.1e}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, 2 rounds (smoke run)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = QUICK if args.quick else GPT2_SMALL
    rounds = 2 if args.quick else args.rounds
    chosen = (
        [Workload("GPT-2", 8, 2), Workload("GPT-2", 16, 2)]
        if args.quick
        else [
            Workload("GPT-2", 128, 16),
            Workload("GPT-2 untied", 128, 16),
            Workload("GPT-2", 512, 8),
        ]
    )
    rows = []
    for workload in chosen:
        print(f"{workload.name} ...", flush=True)
        rows += rows_of(workload, measure(workload, config, device, rounds))
    table = markdown_table(
        ["workload", "method", "step ms", "time ratio", "step memory MiB", "memory ratio", "note"],
        rows,
    )
    agree = markdown_table(
        ["method", "relative difference to pergrad DP"],
        agreement(config, device, chosen[0].length),
    )
    text = (
        f"Device: {describe_device(device)}. GPT-2 "
        f"{'(tiny config: smoke run)' if args.quick else 'small (124 M parameters, tied head)'}; "
        f"max_norm 1, noise multiplier 1, medians of {rounds} interleaved rounds. Ratios are to "
        "the non-private step; memory is the step's peak above what was allocated before it "
        "(torch.cuda.max_memory_allocated).\n\n"
        f"{table}\n\n## Agreement without noise (untied GPT-2, B=4, first update)\n\n{agree}"
    )
    publish(text, args.out, lambda: sentence_header("dp_device.py", ["torch", "opacus"]))


if __name__ == "__main__":
    main()
