"""How does a jitted DP-SGD step scale when the batch is split over 1, 2 and 4 JAX devices?

Run:  python benchmarks/scaling_jax.py [--quick] [--out PATH]

The step: per-example gradients of an MLP 784-512-512-10 (cross-entropy, global batch 256),
``pergrad.dp.optax_aggregate`` (clip to 1.0, noise multiplier 1.0) and SGD, under ``jax.jit``
with the batch sharded by ``pergrad.dp.shard_batch`` over a 1-D mesh and the parameters
replicated. Each device count runs in its own subprocess
(:func:`pergrad.bench.child.run_in_child`), because the number of forced host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) must be set before JAX is imported.
Each child also reports the collectives in its compiled step, to show that only the
summed gradient (P numbers) crosses devices.

On a CPU, "devices" are XLA host devices that share the machine's cores, so this measures the
partitioning overhead and how far one process's cores are used, not a multi-accelerator
speed-up. ``--quick``: a small MLP and few rounds, for seconds (CI checks that it runs).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from pergrad.bench import machine
from pergrad.bench.child import run_in_child
from pergrad.bench.report import markdown_table, titled, write_text

DEVICE_COUNTS = (1, 2, 4)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu" / "scaling_jax.md"


def sharded_steps(sizes: list[int], batch: int, rounds: int, steps: int) -> dict:
    """In a child whose ``XLA_FLAGS`` force the device count: the seconds per step of each
    round (``steps`` steps a round, after one to compile), and the collectives of the step."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pergrad
    from pergrad.bench.timing import time_interleaved

    keys = jax.random.split(jax.random.key(0), len(sizes) + 1)
    params = [
        (jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]
    x = jax.random.normal(keys[-1], (batch, sizes[0]))
    y = jnp.arange(batch) % sizes[-1]

    def loss(params, x, y):
        for index, (w, b) in enumerate(params):
            x = x @ w + b
            x = jax.nn.relu(x) if index < len(params) - 1 else x
        return -jax.nn.log_softmax(x)[y]

    tx = pergrad.dp.dpsgd(0.1, 1.0, 1.0, 0, expected_batch_size=batch)

    @jax.jit
    def step(params, state, x, y):
        grads = pergrad.per_example_grads(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
    x, y = pergrad.dp.shard_batch((x, y), mesh)
    hlo = step.lower(params, state, x, y).compile().as_text()
    collectives = [
        [op, re.findall(r"[a-z0-9]+\[[0-9,]*\]", shapes)]
        for shapes, op in re.findall(
            r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(", hlo
        )
    ]
    jax.block_until_ready(step(params, state, x, y))  # compile and warm up

    def round_of_steps() -> None:
        current = params, state
        for _ in range(steps):
            current = step(*current, x, y)
        jax.block_until_ready(current)

    seconds = time_interleaved({"steps": round_of_steps}, rounds, warmup=0)["steps"]
    return {
        "devices": jax.device_count(),
        "times": [t / steps for t in seconds],
        "collectives": collectives,
        "num_params": sum(p.size for p in jax.tree.leaves(params)),
    }


def run_child(devices: int, sizes: list[int], batch: int, rounds: int, steps: int) -> dict:
    """``sharded_steps`` in a fresh process: the device count is set before JAX starts."""
    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    return run_in_child(sharded_steps, sizes, batch, rounds, steps, env=env, timeout=1200)


def report(args: argparse.Namespace, sizes: list[int], runs: list[dict]) -> str:
    single = statistics.median(runs[0]["times"])
    header = ["devices", "median ms / step", "min ms / step", "vs 1 device"]
    header.append("collectives in the step")
    rows = []
    for run in runs:
        median = statistics.median(run["times"])
        listed = "; ".join(f"{op} {' '.join(shapes)}" for op, shapes in run["collectives"])
        rows.append(
            [str(run["devices"]), f"{median * 1e3:.1f}", f"{min(run['times']) * 1e3:.1f}"]
            + [f"{single / median:.2f}x", listed or "none"]
        )
    machine_text = titled(
        "pergrad: DP-SGD step over sharded JAX devices (CPU)",
        [
            f"machine: {machine.cpu_and_cores()}; forced XLA host devices "
            f"(`--xla_force_host_platform_device_count`), one subprocess per device count",
            machine.software("jax"),
            f"date: {machine.timestamp()}; load average at the end: {machine.load_average()}",
            f"command: `{machine.command_line()}`",
            f"workload: MLP {'-'.join(map(str, sizes))} ({runs[0]['num_params']:,} parameters), "
            f"global batch {args.batch}, `per_example_grads` + `dp.dpsgd` (clip 1.0, noise 1.0) "
            f"under `jax.jit`, batch sharded with `dp.shard_batch`, parameters replicated; "
            f"{args.rounds} rounds of {args.steps} steps each",
        ],
    )
    notes = (
        "The only collective is one all-reduce of the summed, clipped gradient (the P "
        "parameters, plus the example and clipped counts); the `B x P` per-example gradients "
        "stay on the device that holds their examples. Host devices share this machine's "
        "cores, so more devices cannot beat one device that already uses every core: the "
        "column shows the cost of partitioning, not an accelerator speed-up."
    )
    return "\n\n".join([machine_text, markdown_table(header, rows, align="rrrr"), notes]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small MLP, few rounds")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    sizes = [64, 64, 10] if args.quick else [784, 512, 512, 10]
    args.rounds, args.steps = (3, 3) if args.quick else (15, 10)
    runs = [run_child(n, sizes, args.batch, args.rounds, args.steps) for n in DEVICE_COUNTS]
    text = report(args, sizes, runs)
    print(text)
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    if out is not None:
        write_text(out, text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
