"""Diagnostics over training (issue 35): ``pergrad.norms.TrainingMonitor``'s running noise scale
is the ratio of the moving averages of the two unbiased estimates (computed here by hand from
the per-example gradients), never ``inf`` where single batches are; its history holds the
norms' quantiles and clipped fractions; ``pergrad.plotting.training_curves`` draws them, and
the norm histogram draws the detection's threshold in norm units for every method."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pergrad
import pergrad.plotting
from pergrad.norms import TrainingMonitor

torch = pytest.importorskip("torch")  # the monitor takes framework arrays (here torch's)


def fw(array):
    return torch.tensor(array, dtype=torch.float64)


def estimates(grads):
    """The unbiased ``(tr Sigma, |G|^2)`` of one batch, by hand (McCandlish et al. 2018)."""
    flat = grads.reshape(len(grads), -1).astype(np.float64)
    b = len(flat)
    trace = ((flat - flat.mean(0)) ** 2).sum() / (b - 1)
    return trace, (flat.mean(0) ** 2).sum() - trace / b


def test_running_noise_scale_is_the_ratio_of_averaged_estimates():
    rng = np.random.default_rng(0)
    monitor = TrainingMonitor(smoothing=0.8, quantiles=(0.5, 0.9))
    traces, signals = [], []
    for step in range(6):
        grads = {"w": rng.normal(0.3, 1.0, size=(8, 5)), "b": rng.normal(size=(8,))}
        monitor.update(grads={k: fw(v) for k, v in grads.items()}, max_norm=2.0)
        flat = np.concatenate([grads["b"][:, None], grads["w"]], 1)
        trace, signal = estimates(flat)
        traces.append(trace)
        signals.append(signal)
        weights = [0.2 * 0.8 ** (step - k) for k in range(step + 1)]
        expected = np.dot(weights, traces) / np.dot(weights, signals)
        assert monitor.noise_scale == pytest.approx(expected, rel=1e-9)
        norms = np.linalg.norm(flat, axis=1)
        assert monitor.history["q50"][-1] == pytest.approx(np.quantile(norms, 0.5))
        assert monitor.history["q90"][-1] == pytest.approx(np.quantile(norms, 0.9))
        assert monitor.history["clip_fraction"][-1] == pytest.approx(np.mean(norms > 2.0))
    assert monitor.history["step"] == list(range(6))


@settings(max_examples=30, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.integers(2, 6), st.floats(0.0, 2.0), st.integers(0, 2**16)),
        min_size=1,
        max_size=5,
    )
)
def test_the_running_noise_scale_is_never_inf(batches):
    """Pure noise (mean 0) makes single batches' |G|^2 estimates negative (their B_simple
    inf); the running estimate is a positive finite number or nan, never inf."""
    monitor = TrainingMonitor(smoothing=0.5)
    for size, signal, seed in batches:
        grads = np.random.default_rng(seed).normal(signal, 1.0, size=(size, 3))
        monitor.update(grads=fw(grads))
        value = monitor.noise_scale
        assert math.isnan(value) or (math.isfinite(value) and value >= 0)
        assert not math.isinf(monitor.history["batch_noise_scale"][-1])


def test_norms_alone_and_the_clip_fraction_of_a_dp_step():
    monitor = TrainingMonitor()
    monitor.update(norms=fw([0.5, 1.0, 3.0]), clip_fraction=1 / 3, step=10)
    assert math.isnan(monitor.noise_scale)  # no gradients, no noise scale
    assert monitor.history["step"] == [10] and monitor.history["clip_fraction"] == [1 / 3]
    assert monitor.history["q50"] == [1.0]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="smoothing must be in \\[0, 1\\); got 1.5"):
        TrainingMonitor(smoothing=1.5)
    with pytest.raises(ValueError, match="quantiles must be"):
        TrainingMonitor(quantiles=(0.5, 2.0))
    with pytest.raises(ValueError, match="exactly one of grads"):
        TrainingMonitor().update()
    with pytest.raises(TypeError, match="monitor must be a pergrad.norms.TrainingMonitor"):
        pergrad.plotting.training_curves({"step": [1]})
    with pytest.raises(ValueError, match="recorded no step"):
        pergrad.plotting.training_curves(TrainingMonitor())


def test_training_curves_and_the_histograms_threshold_in_norm_units(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    rng = np.random.default_rng(1)
    monitor = TrainingMonitor()
    for _ in range(5):
        monitor.update(grads=fw(rng.normal(0.5, 1.0, size=(16, 4))), max_norm=2.0)
    fig = pergrad.plotting.training_curves(monitor, path=tmp_path / "curves.png", max_norm=2.0)
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert len(fig.axes) == 3
    norms = np.abs(rng.standard_cauchy(200)) + 0.1
    for method in ("mad", "zscore", "iqr"):
        found = pergrad.outliers.detect(norms, method=method)
        fig = pergrad.plotting.norm_histogram(norms, outliers=found)
        lines = [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
        assert len(lines) == 1, method
        cutoff = lines[0].get_xdata()[0]
        # the line separates the flagged norms from the others
        flagged = np.zeros(len(norms), bool)
        flagged[np.asarray(found.indices)] = True
        assert norms[flagged].min() >= cutoff >= norms[~flagged].max() - 1e-9, method
