"""Wrapping is free in JAX: under ``jax.jit``, pergrad's per-example gradients compile to the
program of the hand-written ``jax.vmap(jax.grad(fn))`` (no extra transpose, copy, cast, check or
layout), and the benchmark harness times methods in an order that favours none of them."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import pergrad  # noqa: E402
from pergrad.bench.timing import balanced_orders, time_interleaved  # noqa: E402

_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%\S+ = (\S+) ([a-z][a-z0-9-]*)\(")


def compiled_ops(fn, *args) -> Counter:
    """``{(result shape, opcode): count}`` over the compiled HLO of ``jax.jit(fn)`` on ``args``:
    the instructions that run, without their names and source metadata (which name pergrad's
    wrappers on one side only)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return Counter(m.groups() for line in text.splitlines() if (m := _INSTRUCTION.match(line)))


def loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return -jax.nn.log_softmax(hidden @ params["w2"])[y]


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
    }
    return params, jnp.asarray(rng.normal(size=(5, 8)), jnp.float32), jnp.arange(5) % 3


def test_jitted_per_example_grads_compile_to_the_hand_written_vmap(batch) -> None:
    """The same instructions, of the same shapes, hence the same time on any machine (the
    values are checked against closed forms in test_api.py)."""
    ops = compiled_ops(pergrad.per_example_grads(loss), *batch)
    theirs = compiled_ops(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)), *batch)
    assert sum(ops.values()) > 10 and ops == theirs


@pytest.mark.parametrize("methods", [5, 6])
def test_balanced_timing_order_puts_every_method_after_every_other_equally_often(methods):
    """Over ``len(balanced_orders(n))`` rounds each method runs right after each other, and at
    each position, equally often (a rotated order always puts the same method before it)."""
    ran: list[int] = []
    calls = {k: (lambda k=k: ran.append(k)) for k in range(methods)}
    rounds = len(balanced_orders(methods))
    time_interleaved(calls, rounds, warmup=0)
    orders = [ran[r * methods : (r + 1) * methods] for r in range(rounds)]
    after = Counter(pair for order in orders for pair in pairwise(order))
    assert set(after) == {(a, b) for a in range(methods) for b in range(methods) if a != b}
    assert len(set(after.values())) == 1
    positions = Counter((k, i) for order in orders for i, k in enumerate(order))
    assert len(positions) == methods**2 and len(set(positions.values())) == 1


@pytest.mark.slow(reason="a subprocess quick run that compiles the JAX transformer: ~15 s")
def test_jax_vmap_gap_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/jax_vmap_gap.py --quick: the two programs compare equal, both orders timed."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "gap.md"
    command = [sys.executable, "benchmarks/jax_vmap_gap.py", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=root, check=True, capture_output=True, timeout=600)
    text = out.read_text()
    assert "| instructions that differ (metadata dropped) | 0 |" in text
    assert "| strategy taken by auto | vmap (" in text
    assert "rotated: wall ms" in text and "balanced: wall ms" in text
