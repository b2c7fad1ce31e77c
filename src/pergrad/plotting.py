"""Plots of per-example gradient diagnostics (matplotlib, the ``plot`` extra).

norms = pergrad.norms.per_example_norms(grads)
found = pergrad.outliers.detect(norms)
pergrad.plotting.norm_histogram(norms, outliers=found, path="norms.png", log_scale=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError
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
    if outliers.method in ("iqr",) and outliers.direction != "low":
        ax.axvline(outliers.threshold[1], color="#c44e52", linestyle="--", label="upper fence")
