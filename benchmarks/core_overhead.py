"""How much does pergrad cost over the hand-written per-example gradient transform?

Run:  python benchmarks/core_overhead.py [--quick] [--out PATH]

Two workloads, each in PyTorch and in JAX with the same architecture and the same weights:

* ``cnn``: the SimpleCNN of the PyTorch per-sample-gradients tutorial (batch 64, 1x28x28);
* ``mlp``: an MLP 784-512-512-10 with cross-entropy (batch 256).

For each, and each framework in turn, it times (interleaved within every round, in a balanced
order, each method after every other equally often, so that machine noise hits them equally):

* ``pergrad``: ``pergrad.per_example_grads(loss)`` (torch: eager; JAX: under ``jax.jit``);
* ``hand-written``: ``vmap(grad(loss), in_dims=(None, 0, 0))`` (JAX: under ``jax.jit``);
* ``loop``: a Python loop of single-example gradients, stacked;
* ``batch grad``: one backward of the mean loss over the batch (the floor);
* ``pergrad (module_loss)``, torch only: the loss made by ``pergrad.module_loss``.

It prints a markdown table (median times, paired ratios, and the max abs difference between
pergrad's gradients and the loop's); ``--out PATH`` also writes it with a machine header.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import pergrad
from pergrad.bench import machine
from pergrad.bench.methods import to_numpy
from pergrad.bench.report import markdown_table, publish, titled
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved
from pergrad.bench.workloads import MLP, SimpleCNN, jax_cnn_log_probs, jax_mlp_log_probs

Grads = dict[str, Any]  # parameter name -> per-example gradients, leading axis B
Methods = dict[tuple[str, str], Callable[[], Any]]  # (framework, method) -> one timed call
Timings = dict[tuple[str, str], list[float]]  # (framework, method) -> seconds of each round

PERGRAD, HAND_WRITTEN, LOOP, BATCH_GRAD = "pergrad", "hand-written", "loop", "batch grad"
PERGRAD_MODULE_LOSS = "pergrad (module_loss)"
FRAMEWORKS = ("torch", "jax")


@dataclass(frozen=True)
class Workload:
    name: str
    batch_size: int
    quick_batch_size: int
    example_shape: tuple[int, ...]
    num_classes: int
    make_torch_model: Callable[[], nn.Module]
    torch_batch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, y)
    jax_log_probs: Callable[[Grads, jax.Array], jax.Array]  # (params, x batch)


WORKLOADS = (
    Workload("cnn", 64, 16, (1, 28, 28), 10, SimpleCNN, F.nll_loss, jax_cnn_log_probs),
    Workload("mlp", 256, 64, (784,), 10, MLP, F.cross_entropy, jax_mlp_log_probs),
)


# --------------------------------------------------------------------------------------------
# The methods timed, for each framework. Each returns {(framework, method): call}.


def torch_methods(workload: Workload, model: nn.Module, x: np.ndarray, y: np.ndarray) -> Methods:
    model.eval()
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of_one(params: Grads, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        output = functional_call(model, params, (x.unsqueeze(0),))
        return workload.torch_batch_loss(output, y.unsqueeze(0))

    pergrad_fn = pergrad.per_example_grads(loss_of_one)
    module_loss = pergrad.module_loss(model, workload.torch_batch_loss)
    pergrad_module_fn = pergrad.per_example_grads(module_loss)
    hand_written_fn = torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0, 0))
    return {
        ("torch", PERGRAD): lambda: pergrad_fn(params, x_t, y_t),
        ("torch", PERGRAD_MODULE_LOSS): lambda: pergrad_module_fn(module_loss.params(), x_t, y_t),
        ("torch", HAND_WRITTEN): lambda: hand_written_fn(params, x_t, y_t),
        ("torch", LOOP): lambda: torch_loop_grads(workload, model, x_t, y_t),
        ("torch", BATCH_GRAD): lambda: torch_batch_grad(workload, model, x_t, y_t),
    }


def torch_loop_grads(
    workload: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Grads:
    names, weights = zip(*model.named_parameters())
    per_example = []
    for i in range(len(x)):
        loss = workload.torch_batch_loss(model(x[i : i + 1]), y[i : i + 1])
        per_example.append(torch.autograd.grad(loss, weights))
    return {name: torch.stack(column) for name, column in zip(names, zip(*per_example))}


def torch_batch_grad(
    workload: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> Grads:
    names, weights = zip(*model.named_parameters())
    loss = workload.torch_batch_loss(model(x), y)
    return dict(zip(names, torch.autograd.grad(loss, weights)))


def jax_methods(workload: Workload, weights: Grads, x: np.ndarray, y: np.ndarray) -> Methods:
    params = {name: jnp.asarray(w) for name, w in weights.items()}
    x_j, y_j = jnp.asarray(x), jnp.asarray(y)

    def batch_loss(params: Grads, x: jax.Array, y: jax.Array) -> jax.Array:
        log_probs = workload.jax_log_probs(params, x)
        return -jnp.take_along_axis(log_probs, y[:, None], axis=1).mean()

    def loss_of_one(params: Grads, x: jax.Array, y: jax.Array) -> jax.Array:
        return batch_loss(params, x[None], y[None])

    pergrad_fn = jax.jit(pergrad.per_example_grads(loss_of_one))
    hand_written_fn = jax.jit(jax.vmap(jax.grad(loss_of_one), in_axes=(None, 0, 0)))
    one_grad_fn = jax.jit(jax.grad(loss_of_one))
    batch_grad_fn = jax.jit(jax.grad(batch_loss))

    def loop() -> Grads:
        per_example = [one_grad_fn(params, x_j[i], y_j[i]) for i in range(len(x_j))]
        return jax.tree.map(lambda *column: jnp.stack(column), *per_example)

    def blocking(f: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: jax.block_until_ready(f())

    return {
        ("jax", PERGRAD): blocking(lambda: pergrad_fn(params, x_j, y_j)),
        ("jax", HAND_WRITTEN): blocking(lambda: hand_written_fn(params, x_j, y_j)),
        ("jax", LOOP): blocking(loop),
        ("jax", BATCH_GRAD): blocking(lambda: batch_grad_fn(params, x_j, y_j)),
    }


# --------------------------------------------------------------------------------------------
# Correctness and tables.


def max_abs_diff(a: Grads, b: Grads) -> float:
    return max(float(np.max(np.abs(to_numpy(a[k]) - to_numpy(b[k])))) for k in a)


@dataclass
class WorkloadResult:
    workload: Workload
    batch_size: int
    times: Timings
    pergrad_vs_loop: dict[str, float]  # framework -> max abs diff
    torch_vs_jax: float  # max abs diff between the two frameworks' pergrad gradients


def summary_table(results: list[WorkloadResult]) -> str:
    header = ["workload", "framework", "B", "pergrad ms", "hand-written ms", "loop ms"]
    header += ["batch grad ms", "pergrad / hand-written", "speed-up over loop"]
    header += ["pergrad / batch grad", "max abs diff vs loop"]
    rows = []
    for result in results:
        for fw in FRAMEWORKS:
            t = {method: result.times[(fw, method)] for method in (PERGRAD, HAND_WRITTEN, LOOP)}
            batch = result.times[(fw, BATCH_GRAD)]
            rows.append(
                [
                    result.workload.name,
                    fw,
                    str(result.batch_size),
                    *(f"{median_ms(seconds):.2f}" for seconds in (*t.values(), batch)),
                    f"{paired_ratio(t[PERGRAD], t[HAND_WRITTEN]):.3f}",
                    f"{paired_ratio(t[LOOP], t[PERGRAD]):.1f}x",
                    f"{paired_ratio(t[PERGRAD], batch):.1f}x",
                    f"{result.pergrad_vs_loop[fw]:.1e}",
                ]
            )
    return markdown_table(header, rows)


def detail_table(results: list[WorkloadResult]) -> str:
    header = ["workload", "framework", "method", "median ms", "min ms", "max ms"]
    header += ["/ hand-written"]
    rows = []
    for result in results:
        for (fw, method), seconds in result.times.items():
            ratio = paired_ratio(seconds, result.times[(fw, HAND_WRITTEN)])
            rows.append(
                [result.workload.name, fw, method, f"{median_ms(seconds):.2f}"]
                + [f"{1e3 * min(seconds):.2f}", f"{1e3 * max(seconds):.2f}", f"{ratio:.3f}"]
            )
    return markdown_table(header, rows)


def report(results: list[WorkloadResult], rounds: int) -> str:
    cross_checks = "; ".join(f"{r.workload.name}: {r.torch_vs_jax:.1e}" for r in results)
    return "\n".join(
        [
            summary_table(results),
            "",
            f"Times are medians over {rounds} interleaved rounds; ratios are medians of the "
            "per-round ratios. Speed-up over loop = loop / pergrad. Max abs diff: pergrad's "
            "per-example gradients against the loop's (float32).",
            f"Torch and JAX compute the same function: max abs diff between their pergrad "
            f"gradients {cross_checks}.",
            "",
            "All methods:",
            "",
            detail_table(results),
        ]
    )


def machine_header(args: argparse.Namespace, rounds: int, load_at_start: str) -> str:
    return titled(
        "pergrad core overhead (CPU)",
        [
            f"machine: {machine.cpu_and_cores()}; torch threads: {torch.get_num_threads()}",
            machine.software("torch", "jax", "numpy", "pergrad"),
            f"date: {machine.timestamp()}",
            f"load average (1, 5, 15 min): {machine.load_span(load_at_start)}",
            f"command: `{machine.command_line()}` ({'quick' if args.quick else 'full'} mode, "
            f"{rounds} rounds)",
        ],
    )


# --------------------------------------------------------------------------------------------


def run_workload(workload: Workload, batch_size: int, rounds: int, warmup: int) -> WorkloadResult:
    torch.manual_seed(0)
    model = workload.make_torch_model()
    weights = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, *workload.example_shape)).astype(np.float32)
    y = rng.integers(0, workload.num_classes, size=batch_size)
    # Each framework is timed on its own: a thread pool of one framework still spinning after
    # its call would slow down whichever method of the other framework ran next.
    torch_calls = torch_methods(workload, model, x, y)
    jax_calls = jax_methods(workload, weights, x, y)
    times = time_interleaved(torch_calls, rounds, warmup)
    times |= time_interleaved(jax_calls, rounds, warmup)
    methods = torch_calls | jax_calls
    pergrads = {fw: methods[(fw, PERGRAD)]() for fw in FRAMEWORKS}
    return WorkloadResult(
        workload,
        batch_size,
        times,
        {fw: max_abs_diff(pergrads[fw], methods[(fw, LOOP)]()) for fw in FRAMEWORKS},
        max_abs_diff(pergrads["torch"], pergrads["jax"]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, smaller batches")
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args()
    rounds, warmup = (3, 1) if args.quick else (15, 2)
    load_at_start = machine.load_average()
    results = []
    for workload in WORKLOADS:
        batch_size = workload.quick_batch_size if args.quick else workload.batch_size
        print(f"timing {workload.name} (B={batch_size}, {rounds} rounds)...", file=sys.stderr)
        results.append(run_workload(workload, batch_size, rounds, warmup))
    text = report(results, rounds)
    publish(text, args.out, lambda: machine_header(args, rounds, load_at_start))


if __name__ == "__main__":
    main()
