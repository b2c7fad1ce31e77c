"""How does a jitted DP-SGD step scale when the batch is split over 1, 2 and 4 JAX devices?

Run:  python benchmarks/scaling_jax.py [--quick] [--out PATH]

The step: per-example gradients of an MLP 784-512-512-10 (cross-entropy, global batch 256),
``pergrad.dp.optax_aggregate`` (clip to 1.0, noise multiplier 1.0) and SGD, under ``jax.jit``
with the batch sharded by ``pergrad.dp.shard_batch`` over a 1-D mesh and the parameters
replicated. Each device count runs in its own subprocess, because the number of forced host
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``) must be set before JAX is
imported. Each child also reports the collectives in its compiled step, to show that only the
summed gradient (P numbers) crosses devices.

On a CPU, "devices" are XLA host devices that share the machine's cores, so this measures the
partitioning overhead and how far one process's cores are used, not a multi-accelerator
speed-up. ``--quick``: a small MLP and few rounds, for seconds (CI checks that it runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from pergrad.bench.machine import cpu_model, load_average

DEVICE_COUNTS = (1, 2, 4)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu" / "scaling_jax.md"

# The child: runs in a fresh interpreter with XLA_FLAGS set, prints one JSON line.
_CHILD = r"""
import json, re, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import pergrad

sizes, batch, rounds, steps = json.loads(sys.argv[1])
keys = jax.random.split(jax.random.key(0), len(sizes) + 1)
params = [(jax.random.normal(k, (a, b)) / a**0.5, jnp.zeros(b))
          for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
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
        r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(", hlo)
]
jax.block_until_ready(step(params, state, x, y))  # compile and warm up
times = []
for _ in range(rounds):
    start = time.perf_counter()
    current = params, state
    for _ in range(steps):
        current = step(*current, x, y)
    jax.block_until_ready(current)
    times.append((time.perf_counter() - start) / steps)
print(json.dumps({"devices": jax.device_count(), "times": times, "collectives": collectives,
                  "num_params": sum(p.size for p in jax.tree.leaves(params)),
                  "jax": jax.__version__}))
"""


def run_child(devices: int, sizes: list[int], batch: int, rounds: int, steps: int) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([sizes, batch, rounds, steps])],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the {devices}-device run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(args: argparse.Namespace, sizes: list[int], runs: list[dict]) -> str:
    single = statistics.median(runs[0]["times"])
    rows = [
        "| devices | median ms / step | min ms / step | vs 1 device | collectives in the step |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for run in runs:
        median = statistics.median(run["times"])
        listed = "; ".join(f"{op} {' '.join(shapes)}" for op, shapes in run["collectives"])
        rows.append(
            f"| {run['devices']} | {median * 1e3:.1f} | {min(run['times']) * 1e3:.1f} | "
            f"{single / median:.2f}x | {listed or 'none'} |"
        )
    load = load_average()
    header = [
        "# pergrad: DP-SGD step over sharded JAX devices (CPU)",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; forced XLA host devices "
        f"(`--xla_force_host_platform_device_count`), one subprocess per device count",
        f"- python {platform.python_version()}, jax {runs[0]['jax']}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; load average at the "
        f"end: {load}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- workload: MLP {'-'.join(map(str, sizes))} ({runs[0]['num_params']:,} parameters), "
        f"global batch {args.batch}, `per_example_grads` + `dp.dpsgd` (clip 1.0, noise 1.0) "
        f"under `jax.jit`, batch sharded with `dp.shard_batch`, parameters replicated; "
        f"{args.rounds} rounds of {args.steps} steps each",
        "",
    ]
    notes = [
        "",
        "The only collective is one all-reduce of the summed, clipped gradient (the P "
        "parameters, plus the example and clipped counts); the `B x P` per-example gradients "
        "stay on the device that holds their examples. Host devices share this machine's "
        "cores, so more devices cannot beat one device that already uses every core: the "
        "column shows the cost of partitioning, not an accelerator speed-up.",
    ]
    return "\n".join(header + rows + notes) + "\n"


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
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
