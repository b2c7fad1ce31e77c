"""Flag and rank examples whose per-example score (gradient norm, cosine) stands out.

The scores are ``B`` numbers, so the statistics run in numpy whatever the framework; the
result's ``indices`` and ``scores`` are handed back as arrays of the framework they came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.backends import backend_of
from pergrad._src.errors import PergradValueError
from pergrad._src.norms import scores_to_numpy

# Default thresholds, each in the unit its method compares against.
DEFAULT_THRESHOLDS = {"zscore": 3.0, "mad": 3.5, "iqr": 1.5, "topk": 10}
_DIRECTIONS = ("high", "low", "both")
_NAN_POLICIES = ("raise", "flag")
# MAD of a normal distribution is 0.6745 σ: this makes the robust z comparable to a z-score.
_MAD_TO_SIGMA = 0.6744897501960817


@dataclass(frozen=True)
class OutlierResult:
    """What :func:`detect` found.

    Attributes:
      indices: flagged examples, most extreme first (non-finite ones, if flagged, lead).
      scores: the per-example statistic compared with the threshold, shape ``(B,)``: z-scores
        for ``"zscore"``, robust z-scores for ``"mad"``, the raw scores for ``"iqr"`` and
        ``"topk"``.
      threshold: the threshold used, in the units of ``scores`` (for ``"iqr"``: the fences
        ``(low, high)``; for ``"topk"``: k).
      method, direction: as asked.
      nonfinite: indices of NaN / infinite scores (empty unless ``nan_policy="flag"``).
    """

    indices: Any
    scores: Any
    threshold: Any
    method: str
    direction: str
    nonfinite: Any

    def __len__(self) -> int:
        return len(self.indices)


def detect(
    scores: Any,
    method: str = "mad",
    threshold: float | None = None,
    direction: str = "high",
    nan_policy: str = "raise",
) -> OutlierResult:
    """Flag examples whose score is extreme.

    Args:
      scores: ``(B,)`` per-example values from either framework or numpy, e.g.
        ``per_example_norms(grads)`` or ``cosine_to_mean(grads)``.
      method: ``"zscore"`` (|score - mean| / std > threshold, default 3), ``"mad"`` (robust
        z-score from median and MAD, default 3.5, Iglewicz & Hoaglin), ``"iqr"`` (outside the
        fences Q1 - t·IQR, Q3 + t·IQR, default t = 1.5) or ``"topk"`` (the ``threshold`` most
        extreme, default 10).
      threshold: in the method's units; None for the default above. Must be positive.
      direction: ``"high"`` (large scores are suspicious: norms), ``"low"`` (small scores:
        cosine with the mean gradient) or ``"both"``.
      nan_policy: ``"raise"`` (default): a NaN / infinite score is an error naming the
        examples, since it means their gradients blew up; ``"flag"``: such examples are
        reported as outliers (first in ``indices``, and in ``nonfinite``) and left out of the
        statistics.

    Returns:
      An :class:`OutlierResult`.
    """
    values = scores_to_numpy("detect", scores, "scores")
    _check_options(method, threshold, direction, nan_policy)
    threshold = DEFAULT_THRESHOLDS[method] if threshold is None else threshold
    finite = np.isfinite(values)
    nonfinite = np.flatnonzero(~finite)
    if len(nonfinite) and nan_policy == "raise":
        raise PergradValueError(
            f"detect: scores holds {len(nonfinite)} NaN or infinite value(s), at indices "
            f"{nonfinite[:10].tolist()}: those examples' gradients are not finite. Fix the "
            f"loss, or pass nan_policy='flag' to report them as outliers."
        )
    if not finite.any():
        raise PergradValueError("detect: every score is NaN or infinite; nothing to rank.")
    statistic, used_threshold, extremity, flagged = _METHODS[method](
        np.where(finite, values, np.nan), threshold, direction
    )
    flagged &= finite
    order = np.flatnonzero(flagged)
    order = order[np.argsort(-extremity[order], kind="stable")]
    indices = np.concatenate([nonfinite, order]).astype(np.int64)
    return _as_framework(scores, indices, statistic, used_threshold, method, direction, nonfinite)


def _check_options(method: str, threshold: Any, direction: str, nan_policy: str) -> None:
    if method not in DEFAULT_THRESHOLDS:
        raise PergradValueError(
            f"detect: method must be one of {list(DEFAULT_THRESHOLDS)}; got {method!r}."
        )
    if direction not in _DIRECTIONS:
        raise PergradValueError(
            f"detect: direction must be one of {list(_DIRECTIONS)}; got {direction!r}."
        )
    if nan_policy not in _NAN_POLICIES:
        raise PergradValueError(
            f"detect: nan_policy must be one of {list(_NAN_POLICIES)}; got {nan_policy!r}."
        )
    if threshold is None:
        return
    if method == "topk":
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, np.integer))
            or threshold <= 0
        ):
            raise PergradValueError(
                f"detect: with method='topk', threshold is k, a positive int; got {threshold!r}."
            )
    elif (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0
    ):
        raise PergradValueError(
            f"detect: threshold must be a positive number (or None for the default "
            f"{DEFAULT_THRESHOLDS[method]}); got {threshold!r}."
        )


def _signed(deviation: np.ndarray, direction: str) -> np.ndarray:
    """How far each example lies in the suspicious direction (NaN stays NaN)."""
    if direction == "high":
        return deviation
    if direction == "low":
        return -deviation
    return np.abs(deviation)


def _zscore(values, threshold, direction):
    z = (values - np.nanmean(values)) / _nonzero(np.nanstd(values, ddof=1))
    extremity = _signed(z, direction)
    return z, float(threshold), extremity, np.nan_to_num(extremity, nan=-np.inf) > threshold


def _mad(values, threshold, direction):
    median = np.nanmedian(values)
    mad = np.nanmedian(np.abs(values - median))
    if mad == 0:  # over half the scores are equal; fall back to the mean absolute deviation
        mad = np.nanmean(np.abs(values - median)) * _MAD_TO_SIGMA / 0.7978845608
    robust_z = _MAD_TO_SIGMA * (values - median) / _nonzero(mad)
    extremity = _signed(robust_z, direction)
    return robust_z, float(threshold), extremity, np.nan_to_num(extremity, nan=-np.inf) > threshold


def _iqr(values, threshold, direction):
    q1, q3 = np.nanquantile(values, [0.25, 0.75])
    low, high = q1 - threshold * (q3 - q1), q3 + threshold * (q3 - q1)
    above, below = values > high, values < low
    flagged = {"high": above, "low": below, "both": above | below}[direction]
    spread = _nonzero(q3 - q1)
    extremity = np.maximum((values - high) / spread, (low - values) / spread)
    return values, (float(low), float(high)), extremity, flagged


def _topk(values, k, direction):
    center = np.nanmedian(values)
    extremity = np.nan_to_num(_signed(values - center, direction), nan=-np.inf)
    flagged = np.zeros(len(values), dtype=bool)
    flagged[np.argsort(-extremity, kind="stable")[: int(k)]] = True
    return values, int(k), extremity, flagged


def _nonzero(x: float) -> float:
    return x if x > 0 else np.finfo(np.float64).tiny


_METHODS = {"zscore": _zscore, "mad": _mad, "iqr": _iqr, "topk": _topk}


def _as_framework(scores, indices, statistic, threshold, method, direction, nonfinite):
    if isinstance(scores, np.ndarray):
        return OutlierResult(indices, statistic, threshold, method, direction, nonfinite)
    bk = backend_of(scores, "detect", "scores")
    return OutlierResult(
        bk.from_numpy(indices, scores),
        bk.from_numpy(statistic.astype(np.float32), scores),
        threshold,
        method,
        direction,
        bk.from_numpy(nonfinite.astype(np.int64), scores),
    )
