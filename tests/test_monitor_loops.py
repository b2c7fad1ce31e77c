"""``TrainingMonitor`` in a plain JAX training loop, one call per step (issue 35), and its
ghost-path input (``norms`` with the summed gradient ``grad_sum``), which must give the same
numbers as the per-example gradients, on both frameworks. References by hand in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pergrad
from pergrad.norms import TrainingMonitor

SMOOTHING, MAX_NORM, NO_BOUND = 0.5, 1.0, 1e30


def hand_estimates(flat):
    batch = len(flat)
    trace = ((flat - flat.mean(0)) ** 2).sum() / (batch - 1)
    return trace, (flat.mean(0) ** 2).sum() - trace / batch


def test_a_jax_loop_feeds_the_monitor_in_one_call_per_step():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def loss(params, x, y):  # ONE example
        return (x @ params["w"] + params["b"] - y) ** 2

    rng = np.random.default_rng(0)
    X = rng.normal(size=(6, 16, 3)).astype(np.float32)  # 6 steps of 16 examples
    Y = (X @ np.array([1.0, -2.0, 0.5]) + rng.normal(0, 0.3, size=(6, 16))).astype(np.float32)
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    per_example = jax.jit(pergrad.per_example_grads(loss))
    monitor = TrainingMonitor(smoothing=SMOOTHING, quantiles=(0.5,))
    ghost = TrainingMonitor(smoothing=SMOOTHING, quantiles=(0.5,))
    traces, signals = [], []
    for step in range(6):
        x, y = jnp.asarray(X[step]), jnp.asarray(Y[step])
        grads = per_example(params, x, y)
        monitor.update(grads=grads, max_norm=MAX_NORM)  # the one call
        summed = pergrad.dp.clipped_sum_of(loss, params, x, y, max_norm=NO_BOUND)
        ghost.update(norms=summed.norms, grad_sum=summed.sum, max_norm=MAX_NORM)
        # by hand: the gradient of (x.w + b - y)^2 is 2 r (x, 1)
        w, b = np.asarray(params["w"], np.float64), float(params["b"])
        residual = X[step].astype(np.float64) @ w + b - Y[step]
        flat = 2 * residual[:, None] * np.concatenate([np.ones((16, 1)), X[step]], axis=1)
        norms = np.linalg.norm(flat, axis=1)
        assert monitor.history["q50"][-1] == pytest.approx(np.median(norms), rel=1e-5)
        assert monitor.history["clip_fraction"][-1] == pytest.approx(np.mean(norms > MAX_NORM))
        trace, signal = hand_estimates(flat)
        traces.append(trace)
        signals.append(signal)
        weights = [SMOOTHING ** (step - k) for k in range(step + 1)]
        average = np.dot(weights, signals)
        expected = np.dot(weights, traces) / average if average > 0 else math.nan
        assert monitor.noise_scale == pytest.approx(expected, rel=1e-4, nan_ok=True)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g.mean(0), params, grads)
    assert any(math.isfinite(v) for v in monitor.history["noise_scale"])
    for key, values in monitor.history.items():
        np.testing.assert_allclose(
            np.asarray(ghost.history[key], float), np.asarray(values, float), rtol=1e-4
        )


def test_norms_with_grad_sum_equal_the_per_example_gradients_in_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    by_grads, by_sum = TrainingMonitor(smoothing=0.8), TrainingMonitor(smoothing=0.8)
    for _ in range(4):
        grads = {
            "w": torch.tensor(rng.normal(0.4, 1.0, size=(8, 2, 3))),
            "b": torch.tensor(rng.normal(size=(8, 3))),
        }
        by_grads.update(grads=grads)
        norms = pergrad.norms.per_example_norms(grads)
        by_sum.update(norms=norms, grad_sum={name: g.sum(0) for name, g in grads.items()})
        assert by_sum.noise_scale == pytest.approx(by_grads.noise_scale, rel=1e-9, nan_ok=True)
    assert by_sum.history["batch_noise_scale"] == pytest.approx(
        by_grads.history["batch_noise_scale"], rel=1e-9, nan_ok=True
    )


def test_grad_sum_without_norms_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="grad_sum goes with norms"):
        TrainingMonitor().update(grads=torch.ones(3, 2), grad_sum=torch.ones(2))
