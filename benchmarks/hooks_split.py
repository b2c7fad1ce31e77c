"""Where the time of the hooks strategy's steady-state call goes, against its cost floor.

Run:  python benchmarks/hooks_split.py [--workload NAME] [--batch B] [--threads N] [--rounds N]
                                       [--loss wrapped|direct] [--width D --seq T] [--out PATH]

``pergrad.per_example_grads(module_loss(model, loss), strategy="hooks")`` on one workload of
``pergrad.bench`` (the transformer, B=32, by default), after the first calls of its layout
(which run the checks). ``--loss wrapped`` (the default) passes the workload's loss in a
``lambda``, as the other benchmarks do (the per-example losses then go through ``vmap``);
``--loss direct`` passes ``F.cross_entropy`` (or ``F.mse_loss``) itself, as the README's
examples do (the engine takes those with ``reduction="none"`` in one call). ``--width D
--seq T``: the transformer with model width D (4 heads, feed-forward 2 D, vocabulary 1000)
on sequences of T tokens, a workload where the per-call overhead weighs less. Timed side by
side in interleaved rounds, each call's wall-clock time and its thread's CPU time (on a shared machine, the time other processes run is not counted
in the latter, what they do to the caches is), medians:

* ``batch grad``: ``loss.backward()`` of the batch's mean loss: the batch gradient;
* ``hooks``: the strategy's call;
* the floor's parts: ``forward + output backward`` (the model's forward pass and the gradient
  of the loss with respect to every parameterised layer's output: no weight gradient), the
  weight gradients' products (the batch gradient's time less that: the per-example
  gradients' FLOPs are the same) and ``write B x P`` (a fresh ``(B, P)`` tensor filled); the
  floor is the batch gradient plus ``write B x P``;
* ``hooks, records held``, in rounds of its own (with the batch gradient) after all the
  others: the call with the records holding their outputs after the pass, as before the fix
  (each output's hook held its record in a cycle the collector cannot see: the pass's graph
  and records were never freed, and every call paged in fresh memory). Only that is undone:
  the rules' other changes stay.

Then ``--rounds`` calls of the strategy with each phase's CPU time taken: the forward pass
with the layers hooked, the per-example losses, the backward pass, each layer's rule forming
its per-example gradients, and the rest (Python around them). Prints markdown tables;
``--out PATH`` also writes them with the machine named.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import pergrad
from pergrad._src.strategies import hooks_torch
from pergrad.bench import workloads
from pergrad.bench.machine import load_average
from pergrad.bench.report import fmt, markdown_table, publish, sentence_header
from pergrad.bench.timing import median_ms, time_interleaved

HELD = "hooks, records held"
WARMUP = 2  # calls of each method before the timed rounds (the first runs the checks)


@contextlib.contextmanager
def records_held() -> Iterator[None]:
    """The hooks strategy as before its records let go of their outputs after the pass (and
    on ``functional_call``, whose passes put the tensor hooks that close the cycle: a pass on
    the model's own parameters puts none)."""
    original = hooks_torch._let_go_of_outputs, hooks_torch._light_on_own_parameters
    hooks_torch._let_go_of_outputs = lambda records: None
    hooks_torch._light_on_own_parameters = lambda *args: False
    try:
        yield
    finally:
        hooks_torch._let_go_of_outputs, hooks_torch._light_on_own_parameters = original


class Phases:
    """Seconds spent in each phase of one call, filled by wrappers around the strategy's
    functions (:meth:`instrumented`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - start

        return run

    @contextlib.contextmanager
    def instrumented(self, loss: Any, names: dict[int, str]) -> Iterator[None]:
        """The strategy's forward pass, per-example losses, whole pass and each layer's rule
        timed while inside."""
        saved = (hooks_torch._batched_pass, hooks_torch.per_example_losses, hooks_torch.rule_for)
        phases = self

        class TimedRule:
            def __init__(self, rule: Any) -> None:
                self.rule = rule

            def __getattr__(self, attribute: str) -> Any:
                value = getattr(self.rule, attribute)
                if attribute != "per_example":
                    return value
                return lambda layer, calls: phases.timed(
                    f"rule: {names[id(layer)]} ({self.rule.name})", value
                )(layer, calls)

        hooks_torch._batched_pass = self.timed("forward + backward", saved[0])
        hooks_torch.per_example_losses = self.timed("per-example losses", saved[1])
        hooks_torch.rule_for = lambda layer: TimedRule(saved[2](layer))
        loss.forward = self.timed("forward (hooked)", loss.forward)
        try:
            yield
        finally:
            del loss.forward
            hooks_torch._batched_pass, hooks_torch.per_example_losses = saved[:2]
            hooks_torch.rule_for = saved[2]


def floor_parts(
    model: torch.nn.Module, loss_fn: Callable[..., Any], x: Any, y: Any
) -> dict[str, Callable[[], Any]]:
    """Two of the floor's parts as calls: the forward pass and the gradient with respect to
    every parameterised layer's output (no weight gradient); a fresh ``(B, P)`` tensor
    written. (The third, the weight gradients' products, is the batch gradient's time less
    the first.)"""
    modules = [m for m in model.modules() if list(m.parameters(recurse=False))]
    outputs: list[torch.Tensor] = []

    def forward_and_output_backward() -> None:
        handles = [m.register_forward_hook(lambda m, a, o: outputs.append(o)) for m in modules]
        try:
            total = loss_fn(model(x), y)
        finally:
            for handle in handles:
                handle.remove()
        torch.autograd.grad(total, outputs)
        outputs.clear()

    batch, size = len(y), sum(p.numel() for p in model.parameters())
    return {
        "forward + output backward": forward_and_output_backward,
        "write B x P": lambda: torch.zeros(batch, size),
    }


def model_and_data(
    name: str, batch: int, width: int | None, seq: int | None
) -> tuple[nn.Module, Any, Any, str]:
    """The workload's seeded model and data, or (``width``) the wider transformer; its name."""
    workload = workloads.WORKLOADS[name]
    if width is None:
        model, x, y = workloads.build(workload, batch)
        return model, torch.as_tensor(x), torch.as_tensor(y), f"{name} (B={batch})"
    torch.manual_seed(0)
    model = workloads.TinyTransformer(width, seq).eval()
    x, y = workloads.tokens(workloads.VOCAB, seq, workloads.CLASSES)(
        np.random.default_rng(0), batch
    )
    label = f"{name} at width {width}, T={seq} (B={batch})"
    return model, torch.as_tensor(x), torch.as_tensor(y), label


def measure(
    name: str, batch: int, rounds: int, loss_kind: str, width: int | None, seq: int | None
) -> dict[str, Any]:
    workload = workloads.WORKLOADS[name]
    model, x, y, label = model_and_data(name, batch, width, seq)

    def wrapped(out: Any, target: Any) -> Any:
        return workloads.torch_loss(workload, out, target)

    direct = F.mse_loss if workload.loss == "mse" else F.cross_entropy
    loss_fn = direct if loss_kind == "direct" else wrapped
    loss = pergrad.module_loss(model, loss_fn)
    params = loss.params()
    hooks = pergrad.per_example_grads(loss, strategy="hooks")

    def batch_grad() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def held() -> Any:
        with records_held():
            return hooks(params, x, y)

    methods = {"batch grad": batch_grad, "hooks": lambda: hooks(params, x, y)}
    methods.update(floor_parts(model, loss_fn, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wall, cpu = interleaved(methods, rounds)
        split = phases_of_calls(lambda: hooks(params, x, y), loss, model, rounds)
        # last: the records held are never freed, and the pages they take from the system
        # would slow down every call after them
        before_wall, before_cpu = interleaved({"batch grad": batch_grad, HELD: held}, rounds)
    return {
        "workload": f"{label}, loss {loss_kind}",
        "wall": wall,
        "cpu": cpu,
        "before_wall": before_wall,
        "before_cpu": before_cpu,
        "split": split,
    }


def interleaved(
    methods: dict[str, Callable[[], Any]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each call's wall-clock seconds (``time_interleaved``'s rounds) and the same calls'
    seconds of this thread's CPU time: less moved by the other processes of a shared machine
    (time they run is not counted; what they do to the caches is)."""
    cpu: dict[str, list[float]] = defaultdict(list)

    def on_cpu(name: str, call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            start = time.thread_time()
            try:
                return call()
            finally:
                cpu[name].append(time.thread_time() - start)

        return run

    wall = time_interleaved({k: on_cpu(k, call) for k, call in methods.items()}, rounds, WARMUP)
    return wall, {k: v[WARMUP:] for k, v in cpu.items()}


def phases_of_calls(
    call: Callable[[], Any], loss: Any, model: torch.nn.Module, rounds: int
) -> dict[str, list[float]]:
    """CPU seconds of each phase in each of ``rounds`` instrumented calls."""
    names = {id(m): n for n, m in model.named_modules()}
    split: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        phases = Phases()
        with phases.instrumented(loss, names):
            start = time.thread_time()
            call()
            total = time.thread_time() - start
        seconds = phases.seconds
        rules = sum(v for k, v in seconds.items() if k.startswith("rule: "))
        pass_seconds = seconds.pop("forward + backward")
        seconds["backward (outputs)"] = (
            pass_seconds - seconds["forward (hooked)"] - seconds["per-example losses"]
        )
        seconds["rest of the call (Python)"] = total - pass_seconds - rules
        seconds["whole call (instrumented)"] = total
        for key, value in seconds.items():
            split[key].append(value)
    return split


def tables(result: dict[str, Any]) -> str:
    wall, cpu, split = result["wall"], result["cpu"], result["split"]

    def ratio(method: str, rounds: dict[str, list[float]]) -> float:
        return statistics.median(a / b for a, b in zip(rounds[method], rounds["batch grad"]))

    rows = [
        [k, fmt(median_ms(wall[k]), ".2f"), fmt(median_ms(cpu[k]), ".2f")]
        + [fmt(ratio(k, wall), ".2f", "x"), fmt(ratio(k, cpu), ".2f", "x")]
        for k in wall
    ]
    rows.append(
        [f"{HELD} (own rounds, last)"]
        + [fmt(median_ms(result[f"before_{c}"][HELD]), ".2f") for c in ("wall", "cpu")]
        + [fmt(ratio(HELD, result[f"before_{c}"]), ".2f", "x") for c in ("wall", "cpu")]
    )
    ms = {k: median_ms(v) for k, v in cpu.items()}
    products = ms["batch grad"] - ms["forward + output backward"]
    floor = ms["batch grad"] + ms["write B x P"]
    for name, value in (
        ("weight-gradient products (batch grad less forward + output backward)", products),
        ("floor (batch grad + write B x P)", floor),
    ):
        rows.append([name, "", fmt(value, ".2f"), "", fmt(value / ms["batch grad"], ".2f", "x")])
    columns = ["call", "wall ms", "CPU ms", "wall / batch grad", "CPU / batch grad"]
    first = markdown_table(columns, rows, "lrrrr")
    summary = (
        f"{result['workload']}: hooks / batch grad {ratio('hooks', cpu):.2f}x in CPU time "
        f"({ratio('hooks', wall):.2f}x wall-clock; {ratio(HELD, result['before_cpu']):.2f}x "
        f"with the records held, as before), hooks / floor {ms['hooks'] / floor:.2f}x. Ratios: "
        f"medians of the per-round ratios (the derived rows': of the CPU medians)."
    )
    order = ["forward (hooked)", "per-example losses", "backward (outputs)"]
    order += sorted(k for k in split if k.startswith("rule: "))
    order += ["rest of the call (Python)", "whole call (instrumented)"]
    second = markdown_table(
        ["phase of one hooks call", "CPU ms"],
        [[k, fmt(median_ms(split[k]), ".3f")] for k in order],
        "lr",
    )
    return f"{summary}\n\n{first}\n\n{second}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--loss", choices=("wrapped", "direct"), default="wrapped")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.width is not None and args.workload != "transformer":
        parser.error("--width is for the transformer workload")
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    result = measure(args.workload, args.batch, args.rounds, args.loss, args.width, args.seq)

    def header() -> str:
        details = [f"torch threads {args.threads}", f"median of {args.rounds} rounds"]
        details.append(f"load average {load_at_start} at the start, {load_average()} at the end")
        return sentence_header("Split of the hooks strategy's call", ["torch"], details)

    publish(tables(result), args.out, header)


if __name__ == "__main__":
    main()
