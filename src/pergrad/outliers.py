"""Flag and rank suspicious examples by their per-example scores.

    norms = pergrad.norms.per_example_norms(grads)
    found = pergrad.outliers.detect(norms, method="mad")     # found.indices, most extreme first

Methods: ``"zscore"``, ``"mad"`` (robust z-score), ``"iqr"`` (Tukey fences), ``"topk"``.
"""

from pergrad._src.outliers import DEFAULT_THRESHOLDS, OutlierResult, detect

__all__ = ["DEFAULT_THRESHOLDS", "OutlierResult", "detect"]
