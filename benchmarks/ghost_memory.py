"""Memory and time of per-example norms and clipped sums, with and without per-example gradients.

Run:  python benchmarks/ghost_memory.py [--quick] [--batch-size B] [--out PATH]

Workload: an MLP 1024-2048-2048-10 (6.3 M parameters) with cross-entropy, batch 192 by default,
so that the materialised per-example gradients take B x P x 4 bytes = 4.5 GiB. For each framework
and method it starts a FRESH Python process (:func:`pergrad.bench.child.run_in_child`: the peak
resident memory, ``ru_maxrss``, is that method's alone), builds the model and the batch, reads
the resident memory (the baseline: Python, the framework, parameters and data), runs the method
once to warm up and then ``--repeats`` times, and reports the median time and the peak resident
memory. Methods:

* ``batch grad``: one gradient of the summed loss over the batch: the floor, in time and memory;
* ``<task> / <strategy>`` for task ``norms`` (:func:`per_example_norms_of`) and ``clipped sum``
  (:func:`clipped_sum_of`, ``max_norm=1``), and strategy ``materialize`` (per-example gradients
  then reduce, the reference), ``chunked`` (default chunk size: ``chunk x P <= 2**25`` numbers,
  here 5 examples) and ``ghost`` (torch: layer hooks on one forward pass; JAX: the traced loss's
  contractions, see ``pergrad/_src/strategies/ghost_jax.py``).

Materialising is skipped, with a note, when ``B x P x 4`` bytes exceeds ``--max-materialize-gb``.
JAX methods run under ``jax.jit``. Extra memory = peak - baseline; its ratio is to the floor's.
It prints a markdown table; ``--out PATH`` also writes it with a machine header.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pergrad.bench import machine
from pergrad.bench.child import run_in_child
from pergrad.bench.memory import max_rss_mib
from pergrad.bench.report import markdown_table, publish, titled
from pergrad.bench.timing import median_ms, time_interleaved

WIDTHS = (1024, 2048, 2048, 10)
STRATEGIES = ("materialize", "chunked", "ghost")
TASKS = ("norms", "clipped sum")
BATCH_GRAD = "batch grad"


def methods(framework: str) -> list[str]:
    del framework  # both frameworks have every strategy
    return [BATCH_GRAD] + [f"{task} / {s}" for task in TASKS for s in STRATEGIES]


def num_params(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


# --------------------------------------------------------------------------------------------
# Workers: one method in this process.


def torch_method(method: str, batch_size: int) -> Callable[[], Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import pergrad
    from pergrad.dp import clipped_sum_of
    from pergrad.norms import per_example_norms_of

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    x = torch.randn(batch_size, WIDTHS[0])
    y = torch.randint(0, WIDTHS[-1], (batch_size,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = loss.params()
    if method == BATCH_GRAD:
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}

        def batch_grad() -> Any:
            out = torch.func.functional_call(model, leaves, (x,))
            total = F.cross_entropy(out, y, reduction="sum")
            return torch.autograd.grad(total, list(leaves.values()))

        return batch_grad
    task, strategy = method.split(" / ")
    if task == "norms":
        return lambda: per_example_norms_of(loss, params, x, y, strategy=strategy)
    return lambda: clipped_sum_of(loss, params, x, y, max_norm=1.0, strategy=strategy)


def jax_method(method: str, batch_size: int) -> Callable[[], Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pergrad.dp import clipped_sum_of
    from pergrad.norms import per_example_norms_of

    rng = np.random.default_rng(0)
    params = [
        {
            "w": jnp.asarray(rng.normal(0, a**-0.5, (a, b)), jnp.float32),
            "b": jnp.zeros(b, jnp.float32),
        }
        for a, b in zip(WIDTHS[:-1], WIDTHS[1:])
    ]
    x = jnp.asarray(rng.normal(size=(batch_size, WIDTHS[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, WIDTHS[-1], batch_size))

    def logits(p: Any, features: Any) -> Any:
        for layer in p[:-1]:
            features = jax.nn.relu(features @ layer["w"] + layer["b"])
        return features @ p[-1]["w"] + p[-1]["b"]

    def loss(p: Any, example: Any, label: Any) -> Any:  # one example
        return -jax.nn.log_softmax(logits(p, example))[label]

    if method == BATCH_GRAD:

        def total(p: Any) -> Any:
            return -jnp.take_along_axis(jax.nn.log_softmax(logits(p, x)), y[:, None], 1).sum()

        compiled = jax.jit(jax.grad(total))
        return lambda: jax.block_until_ready(compiled(params))
    task, strategy = method.split(" / ")
    if task == "norms":
        compiled = jax.jit(lambda p, a, b: per_example_norms_of(loss, p, a, b, strategy=strategy))
    else:
        compiled = jax.jit(
            lambda p, a, b: clipped_sum_of(loss, p, a, b, max_norm=1.0, strategy=strategy)
        )
    return lambda: jax.block_until_ready(compiled(params, x, y))


def worker(framework: str, method: str, batch_size: int, repeats: int) -> dict[str, float]:
    """One method in this process: its median and min ms, the process's peak resident memory
    (MB) and that before the first call (the baseline)."""
    make = torch_method if framework == "torch" else jax_method
    run = make(method, batch_size)
    baseline = max_rss_mib()
    times = time_interleaved({method: run}, repeats, warmup=1)[method]  # JAX compiles in warm-up
    return {
        "median_ms": median_ms(times),
        "min_ms": 1e3 * min(times),
        "peak_mb": max_rss_mib(),
        "baseline_mb": baseline,
    }


# --------------------------------------------------------------------------------------------
# Driver: one subprocess per method, then the table.


def measure(
    framework: str, method: str, batch_size: int, repeats: int, threads: int
) -> dict[str, Any]:
    """``worker`` in a fresh process on ``threads`` threads: its peak memory is its own."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if threads == 1:
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    return run_in_child(worker, framework, method, batch_size, repeats, env=env)


def table(results: dict[tuple[str, str], dict[str, Any]], notes: list[str]) -> str:
    header = ["framework", "method", "median ms", "/ batch grad", "peak RSS MB"]
    header += ["peak / batch grad's", "extra MB (peak - baseline)", "extra / batch grad's"]
    rows = []
    for (framework, method), r in results.items():
        floor = results[(framework, BATCH_GRAD)]
        extra = r["peak_mb"] - r["baseline_mb"]
        floor_extra = max(floor["peak_mb"] - floor["baseline_mb"], 1.0)
        rows.append(
            [framework, method, f"{r['median_ms']:.1f}"]
            + [f"{r['median_ms'] / floor['median_ms']:.2f}x", f"{r['peak_mb']:.0f}"]
            + [f"{r['peak_mb'] / floor['peak_mb']:.2f}x", f"{extra:.0f}"]
            + [f"{extra / floor_extra:.1f}x"]
        )
    notes = notes + [
        "Peak RSS: the process's maximum resident memory (ru_maxrss); baseline: after building "
        "the model and the batch, before the first call. Extra = peak - baseline: what the "
        "method needs on top of its inputs. Ghost and chunked never hold B x P numbers; "
        "materialize does (torch.func also keeps a second copy while it reduces)."
    ]
    return "\n".join([markdown_table(header, rows), "", *notes])


def machine_header(args: argparse.Namespace, params: int) -> str:
    return titled(
        "Per-example norms and clipped sums: memory and time by strategy (CPU)",
        [
            f"machine: {machine.cpu_and_cores()}; threads per framework: {args.threads}",
            machine.software("torch", "jax"),
            f"date: {machine.timestamp()}; load average {machine.load_average()} at the end",
            f"workload: MLP {'-'.join(map(str, WIDTHS))} ({params / 1e6:.1f} M parameters), "
            f"cross-entropy, batch {args.batch_size}; B x P x 4 bytes = "
            f"{args.batch_size * params * 4 / 2**30:.1f} GiB; {args.repeats} timed runs after "
            f"one warm-up, each method in a fresh process",
            f"command: `{machine.command_line()}`",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--max-materialize-gb", type=float, default=6.0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads per framework (default 1: on a shared machine, 2 threads made small ops "
        "wait on each other and the times 3-6x noisier)",
    )
    parser.add_argument("--quick", action="store_true", help="batch 8, one run: a smoke test")
    parser.add_argument("--out", help="also write the table, with a machine header, here")
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.repeats = 8, 1
    params = num_params(WIDTHS)
    materialized_gb = args.batch_size * params * 4 / 2**30
    results, notes = {}, []
    for framework in args.frameworks.split(","):
        for method in methods(framework):
            if "materialize" in method and materialized_gb > args.max_materialize_gb:
                notes.append(
                    f"{framework} {method}: skipped, B x P x 4 bytes = {materialized_gb:.1f} GiB "
                    f"> --max-materialize-gb {args.max_materialize_gb}."
                )
                continue
            results[(framework, method)] = measure(
                framework, method, args.batch_size, args.repeats, args.threads
            )
            print(framework, method, results[(framework, method)], flush=True)
    text = table(results, notes)
    publish(text, args.out, lambda: machine_header(args, params))


if __name__ == "__main__":
    main()
