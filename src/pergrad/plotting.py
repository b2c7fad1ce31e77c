"""Plots of per-example gradient diagnostics (matplotlib, the ``plot`` extra).

norms = pergrad.norms.per_example_norms(grads)
found = pergrad.outliers.detect(norms)
pergrad.plotting.norm_histogram(norms, outliers=found, path="norms.png", log_scale=True)
pergrad.plotting.training_curves(monitor, path="training.png")   # a norms.TrainingMonitor
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.monitor import TrainingMonitor, quantile_key
from pergrad._src.norms import scores_to_numpy
from pergrad._src.outliers import OutlierResult


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "pergrad.plotting needs matplotlib: pip install 'pergrad[plot]' "
            "(or pip install matplotlib)."
        ) from err
    return plt


def norm_histogram(
    norms: Any,
    outliers: OutlierResult | None = None,
    path: str | Path | None = None,
    log_scale: bool = False,
    bins: int = 50,
    title: str = "Per-example gradient norms",
) -> Any:
    """Histogram of per-example gradient norms, with flagged examples marked.

    Args:
      norms: ``(B,)`` norms from either framework or numpy.
      outliers: a :func:`pergrad.outliers.detect` result on these norms; its examples are drawn
        as red ticks under the histogram and its threshold (when in norm units) as a line.
      path: where to save the figure (PNG, PDF, SVG by extension); None to only return it.
      log_scale: log-spaced bins and a log x axis (norms often span orders of magnitude).
      bins: number of bins.

    Returns:
      The matplotlib ``Figure``.
    """
    values = scores_to_numpy("norm_histogram", norms, "norms")
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        raise PergradValueError("norm_histogram: norms holds no finite value to plot.")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
        raise PergradValueError(f"norm_histogram: bins must be a positive int; got {bins!r}.")
    if outliers is not None and not isinstance(outliers, OutlierResult):
        raise PergradTypeError(
            f"norm_histogram: outliers must be a pergrad.outliers.detect result or None; got "
            f"{type(outliers).__name__}."
        )
    if log_scale and (finite <= 0).any():
        raise PergradValueError(
            "norm_histogram: log_scale=True needs positive norms; some are zero or negative."
        )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.geomspace(finite.min(), finite.max() * 1.0001, bins + 1) if log_scale else bins
    ax.hist(finite, bins=edges, color="#4c72b0", alpha=0.85, label=f"{finite.size} examples")
    if log_scale:
        ax.set_xscale("log")
    if outliers is not None:
        _mark_outliers(ax, values, outliers)
    ax.set_xlabel("gradient L2 norm")
    ax.set_ylabel("examples")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _mark_outliers(ax: Any, values: np.ndarray, outliers: OutlierResult) -> None:
    indices = np.asarray(
        outliers.indices.cpu() if hasattr(outliers.indices, "cpu") else outliers.indices
    )
    flagged = values[indices]
    flagged = flagged[np.isfinite(flagged)]
    ax.plot(
        flagged,
        np.zeros_like(flagged),
        "|",
        color="#c44e52",
        markersize=18,
        markeredgewidth=2,
        label=f"{len(indices)} flagged ({outliers.method})",
    )
    for cutoff in _cutoffs(values, outliers):
        ax.axvline(cutoff, color="#c44e52", linestyle="--", label=f"threshold {cutoff:.4g}")


def _cutoffs(values: np.ndarray, outliers: OutlierResult) -> list[float]:
    """The detection's thresholds in norm units: the fences of ``"iqr"``; for ``"zscore"`` and
    ``"mad"``, whose scores are an increasing affine map of the norms, the norms at which the
    score crosses the threshold (solved from two examples' norms and scores); none for
    ``"topk"``."""
    if outliers.method == "topk":
        return []
    if outliers.method == "iqr":
        low, high = (float(t) for t in outliers.threshold)
    else:
        scores = np.asarray(
            outliers.scores.cpu() if hasattr(outliers.scores, "cpu") else outliers.scores,
            dtype=np.float64,
        )
        ok = np.isfinite(values) & np.isfinite(scores)
        x, z = values[ok].astype(np.float64), scores[ok]
        if x.size < 2 or np.ptp(x) == 0:
            return []
        i, j = int(np.argmin(x)), int(np.argmax(x))
        slope = (z[j] - z[i]) / (x[j] - x[i])
        if slope <= 0:
            return []
        threshold = float(outliers.threshold)
        high = x[i] + (threshold - z[i]) / slope
        low = x[i] + (-threshold - z[i]) / slope
    found = []
    if outliers.direction in ("high", "both"):
        found.append(high)
    if outliers.direction in ("low", "both"):
        found.append(low)
    return found


def training_curves(
    monitor: TrainingMonitor,
    path: str | Path | None = None,
    max_norm: float | None = None,
    title: str = "Gradient diagnostics over training",
) -> Any:
    """The running gradient noise scale, the clipped fraction and the norms' quantiles over
    the steps a :class:`pergrad.norms.TrainingMonitor` recorded, one panel each.

    Args:
      monitor: the monitor.
      path: where to save the figure (PNG, PDF, SVG by extension); None to only return it.
      max_norm: a clipping bound to draw on the norms' panel (a dashed line).
      title: the figure's title.

    Returns:
      The matplotlib ``Figure``.
    """
    if not isinstance(monitor, TrainingMonitor):
        raise PergradTypeError(
            f"training_curves: monitor must be a pergrad.norms.TrainingMonitor; got "
            f"{type(monitor).__name__}."
        )
    history = monitor.history
    if not history["step"]:
        raise PergradValueError("training_curves: the monitor has recorded no step yet.")
    plt = _pyplot()
    fig, (noise, clipped, norms) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    steps = np.asarray(history["step"])
    running = np.asarray(history["noise_scale"], dtype=float)
    single = np.asarray(history["batch_noise_scale"], dtype=float)
    noise.plot(steps, single, ".", color="#8c8c8c", alpha=0.5, label="one batch")
    noise.plot(steps, running, color="#4c72b0", label="running (averaged estimates)")
    noise.set_ylabel("noise scale B_simple")
    if np.isfinite(np.concatenate([running, single])).any():
        noise.set_yscale("log")
    noise.legend()
    fractions = np.asarray(
        [np.nan if f is None else f for f in history["clip_fraction"]], dtype=float
    )
    clipped.plot(steps, fractions, color="#c44e52")
    clipped.set_ylabel("clipped fraction")
    clipped.set_ylim(-0.02, 1.02)
    for q in monitor.quantiles:
        norms.plot(steps, history[quantile_key(q)], label=f"quantile {q:g}")
    if max_norm is not None:
        norms.axhline(max_norm, color="#c44e52", linestyle="--", label=f"max_norm {max_norm:g}")
    norms.set_ylabel("per-example gradient norm")
    norms.set_xlabel("step")
    norms.legend()
    fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
