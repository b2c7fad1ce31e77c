"""What one metagradient target costs in JAX, in training runs (issue 34's goal: at most 4 after
compilation).

Run:  python -m benchmarks.metagradient_jax_cost [--steps N] [--out PATH.md]

A tanh MLP (64-64-10) on 1024 random examples, SGD with momentum 0.9, batches of 32 for
``--steps`` steps (default 320, the digits benchmark's length). The unit is one training run: a
jitted optax step per batch, the loop in Python as a user writes it, after a warm-up run. Then
``pergrad.influence.metagradient`` is called for one target at a time (a different example's
loss each call), as a user attributing one prediction does: the first call compiles, the later
ones reuse the compiled programs (``metagradient_jax._Program``: since the scan rewrite, one
scan for the replay and one for the reverse pass). Medians of 3 runs and of the
calls after the first, measured one after the other in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pergrad.bench.machine import load_average
from pergrad.bench.report import markdown_table, publish, sentence_header
from pergrad.influence import metagradient


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument(
        "--calls", type=int, default=5, help="one-target calls (the first compiles)"
    )
    parser.add_argument("--out", help="also write the markdown, with a machine header, here")
    args = parser.parse_args(argv)
    load = load_average()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1024, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, 1024))
    params = {
        "w1": jnp.asarray(rng.normal(size=(64, 64)) / 8, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(64, 10)) / 8, jnp.float32),
    }

    def loss(p, xi, yi):
        return -jax.nn.log_softmax(jnp.tanh(xi @ p["w1"]) @ p["w2"])[yi]

    batches = np.arange(32 * args.steps).reshape(-1, 32) % 1024
    optimizer = optax.sgd(0.03, momentum=0.9)

    @jax.jit
    def train_step(p, state, index):
        def batch_loss(q):
            return jnp.mean(jax.vmap(loss, (None, 0, 0))(q, x[index], y[index]))

        updates, state = optimizer.update(jax.grad(batch_loss)(p), state, p)
        return optax.apply_updates(p, updates), state

    def train() -> float:
        start = time.perf_counter()
        p, state = params, optimizer.init(params)
        for index in batches:
            p, state = train_step(p, state, index)
        jax.block_until_ready(p)
        return time.perf_counter() - start

    train()
    run = statistics.median(train() for _ in range(3))
    calls = []
    for i in range(args.calls):
        start = time.perf_counter()
        scores = metagradient(
            loss, params, (x, y), batches, optimizer, lambda p, i=i: loss(p, x[i], y[i])
        )
        jax.block_until_ready(scores)
        calls.append(time.perf_counter() - start)
    call = statistics.median(calls[1:])
    rows = [
        ["one training run", f"{run:.3f}", "1.00"],
        ["first one-target call (compiles)", f"{calls[0]:.3f}", f"{calls[0] / run:.2f}"],
        ["a later one-target call", f"{call:.3f}", f"{call / run:.2f}"],
    ]
    table = markdown_table(["what", "seconds", "training runs"], rows)
    text = (
        f"tanh MLP 64-64-10, 1024 examples, {args.steps} steps of 32, SGD momentum 0.9; load "
        f"average {load} at the start, {load_average()} at the end.\n\n{table}"
    )
    publish(text, args.out, lambda: sentence_header("metagradient_jax_cost.py", ["jax", "optax"]))


if __name__ == "__main__":
    main()
