"""DP-SGD with the batch split over several devices, in the two JAX styles.

Run:  python examples/sharded_dp_jax.py

On a CPU-only machine it makes 4 host devices (``XLA_FLAGS=--xla_force_host_platform_device_count
=4``, set before JAX is imported, unless XLA_FLAGS is already set); on a multi-GPU machine the
same code uses the GPUs. It trains a small MLP on synthetic data:

1. ``jax.jit`` over sharded inputs: the batch split over a 1-D mesh with
   ``pergrad.dp.shard_batch``, the parameters and optimizer state replicated. The step is the
   one-device step; XLA keeps each device's per-example gradients on that device and
   all-reduces only the summed, clipped gradient.
2. ``jax.shard_map``: the step written per device; ``axis_name="batch"`` makes the optimizer
   add up the devices' clipped sums before adding the noise once.

Each style's first step is checked against the one-device step (same key, so same noise), and
the collectives of the compiled step are listed: an all-reduce of the P parameters, no gather.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pergrad  # noqa: E402

BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 256, 64, 128, 10, 12


def loss(params, x, y):
    """Cross-entropy of ONE example: x (FEATURES,), y ()."""
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[y]


def make_data(key):
    """Labels from a random linear teacher, so that training has something to learn."""
    x_key, teacher_key, init_key = jax.random.split(key, 3)
    x = jax.random.normal(x_key, (STEPS * BATCH, FEATURES))
    y = jnp.argmax(x @ jax.random.normal(teacher_key, (FEATURES, CLASSES)), axis=1)
    k1, k2 = jax.random.split(init_key)
    params = {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / FEATURES**0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / HIDDEN**0.5,
        "b2": jnp.zeros(CLASSES),
    }
    return x, y, params


def optimizer(axis_name=None):
    return pergrad.dp.dpsgd(
        learning_rate=2.0,
        max_norm=1.0,
        noise_multiplier=0.5,
        key=0,  # for real privacy: jax.random.key(secrets.randbits(63))
        expected_batch_size=BATCH,
        axis_name=axis_name,
    )


def jit_step(tx):
    """The one-device step; under jit with sharded inputs it runs sharded as it is."""

    def step(params, state, x, y):
        grads = pergrad.per_example_grads(loss)(params, x, y)  # leaves (B, ...), split by example
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


def shard_map_step(tx, mesh):
    """The step written per device: each sees BATCH / devices examples."""

    def local_step(params, state, x, y):
        # pergrad makes params per-device here, so no example's gradient is summed over devices
        grads = pergrad.per_example_grads(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)  # psum of clipped sums, noise once
        return optax.apply_updates(params, updates), state

    specs = dict(in_specs=(P(), P(), P("batch"), P("batch")), out_specs=(P(), P()))
    return jax.jit(jax.shard_map(local_step, mesh=mesh, **specs))


def collectives(step, *args):
    """``op: shapes`` of each cross-device collective in the compiled step."""
    hlo = step.lower(*args).compile().as_text()
    pattern = r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\("
    found = re.findall(pattern, hlo)
    shape = r"[a-z0-9]+\[[0-9,]*\]"
    return [op + " " + " ".join(re.findall(shape, shapes)) for shapes, op in found]


def accuracy(params, x, y):
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return float((jnp.argmax(hidden @ params["w2"] + params["b2"], 1) == y).mean())


def one_device_first_step(params, batches):
    """The parameters after the first step on one device: what both styles must give."""
    x0, y0 = batches[0]
    expected, _ = jit_step(optimizer())(
        params, optimizer().init(params), np.asarray(x0), np.asarray(y0)
    )
    return expected


def train(name, step, params, state, batches, expected):
    for index, (x, y) in enumerate(batches):
        params, state = step(params, state, x, y)
        if index == 0:
            leaves = zip(jax.tree.leaves(params), jax.tree.leaves(expected))
            gap = max(float(jnp.abs(a - b).max()) for a, b in leaves)
            print(f"{name}: first step, max |sharded - one device| = {gap:.2e}")
            start = time.perf_counter()  # compiled now: time the other steps
    jax.block_until_ready(params)
    per_step = (time.perf_counter() - start) / (len(batches) - 1)
    print(
        f"{name}: {len(batches)} steps, {per_step * 1e3:.1f} ms/step, clip fraction "
        f"{float(state[0].clip_fraction):.2f}"
    )
    return params


def main() -> None:
    devices = jax.devices()
    print(f"devices: {len(devices)} ({devices[0].platform})")
    # Auto axes: XLA's partitioner places the sums (Explicit axes, make_mesh's default, make
    # JAX ask for an output sharding of every sum over the batch).
    mesh = jax.make_mesh((len(devices),), ("batch",), axis_types=(AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    x, y, params = jax.jit(make_data)(jax.random.key(0))  # one compilation, not one per array
    batches = [
        pergrad.dp.shard_batch((x[i : i + BATCH], y[i : i + BATCH]), mesh)
        for i in range(0, len(x), BATCH)
    ]
    params = jax.device_put(params, replicated)
    print(f"accuracy before training: {accuracy(params, x, y):.2f}")
    expected = one_device_first_step(params, batches)

    tx = optimizer()
    step = jit_step(tx)
    state = jax.device_put(tx.init(params), replicated)
    print("jit step collectives:", collectives(step, params, state, *batches[0]))
    trained = train("jit + sharded batch", step, params, state, batches, expected)
    print(f"accuracy after training (jit): {accuracy(trained, x, y):.2f}")

    tx = optimizer(axis_name="batch")
    step = shard_map_step(tx, mesh)
    state = jax.device_put(tx.init(params), replicated)
    print("shard_map step collectives:", collectives(step, params, state, *batches[0]))
    trained = train("shard_map", step, params, state, batches, expected)
    print(f"accuracy after training (shard_map): {accuracy(trained, x, y):.2f}")


if __name__ == "__main__":
    main()
