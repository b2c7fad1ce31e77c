"""pergrad.outliers: planted outliers are found; clean data is flagged at the promised rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pergrad import outliers

RNG = np.random.default_rng(2)


def normal_tail(z: float) -> float:
    """P(Z > z) for a standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def planted(n=400, planted_at=(7, 123, 301), value=9.0):
    scores = RNG.normal(size=n)
    scores[list(planted_at)] = value + np.arange(len(planted_at))
    return scores, set(planted_at)


@pytest.mark.parametrize("method", ["zscore", "mad", "iqr"])
def test_planted_outliers_are_found(fw, method):
    scores, truth = planted()
    result = outliers.detect(fw.array(scores), method=method)
    found = fw.to_numpy(result.indices).tolist()
    assert truth <= set(found)
    assert found[:3] == [301, 123, 7]  # most extreme first
    assert result.method == method
    assert fw.to_numpy(result.scores).shape == (400,)


def test_topk_returns_exactly_k(fw):
    scores, truth = planted()
    result = outliers.detect(fw.array(scores), method="topk", threshold=3)
    assert fw.to_numpy(result.indices).tolist() == [301, 123, 7]
    assert result.threshold == 3


def test_low_direction_finds_disagreeing_examples(fw):
    cosines = 0.8 + 0.05 * RNG.normal(size=200)
    cosines[[4, 50]] = [-0.6, -0.9]
    result = outliers.detect(fw.array(cosines), method="mad", direction="low")
    assert fw.to_numpy(result.indices).tolist() == [50, 4]
    high = outliers.detect(fw.array(cosines), method="mad", direction="high")
    assert not {4, 50} & set(fw.to_numpy(high.indices).tolist())


@pytest.mark.parametrize(
    "method, threshold, rate",
    [
        ("zscore", 3.0, 2 * normal_tail(3.0)),
        ("mad", 3.0, 2 * normal_tail(3.0)),
        ("iqr", 1.5, 2 * normal_tail(0.6744897501960817 * 4)),  # fences at Q3 + 1.5 IQR = 2.698σ
    ],
)
def test_false_positive_rate_on_clean_normal_data(method, threshold, rate):
    n = 40_000
    scores = RNG.normal(size=n)
    flagged = len(outliers.detect(scores, method=method, threshold=threshold, direction="both"))
    sd = math.sqrt(n * rate * (1 - rate))
    # 5 binomial standard deviations (plus the estimation noise of mean/median/quartiles).
    assert abs(flagged - n * rate) < 5 * sd + 0.15 * n * rate, (flagged, n * rate)


def test_nan_is_an_error_by_default(fw):
    scores = RNG.normal(size=20)
    scores[[3, 9]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=r"2 NaN or infinite value\(s\), at indices \[3, 9\]"):
        outliers.detect(fw.array(scores))


def test_nan_flagged_on_request(fw):
    scores, truth = planted(n=100, planted_at=(10,))
    scores[40] = np.nan
    result = outliers.detect(fw.array(scores), nan_policy="flag")
    found = fw.to_numpy(result.indices).tolist()
    assert found[0] == 40 and 10 in found
    assert fw.to_numpy(result.nonfinite).tolist() == [40]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "dbscan"}, "method must be one of"),
        ({"threshold": 0}, "threshold must be a positive number"),
        ({"threshold": -1.0}, "threshold must be a positive number"),
        ({"method": "topk", "threshold": 2.5}, "threshold is k, a positive int"),
        ({"direction": "up"}, "direction must be one of"),
        ({"nan_policy": "omit"}, "nan_policy must be one of"),
    ],
)
def test_bad_options(fw, kwargs, match):
    with pytest.raises(ValueError, match=match):
        outliers.detect(fw.array(RNG.normal(size=10)), **kwargs)


def test_bad_scores(fw):
    with pytest.raises(ValueError, match="must be 1-D"):
        outliers.detect(fw.array(RNG.normal(size=(4, 2))))
    with pytest.raises(ValueError, match="empty"):
        outliers.detect(fw.array(np.zeros(0)))
    with pytest.raises(TypeError, match="scores must hold JAX arrays or torch tensors"):
        outliers.detect([1.0, 2.0])


def test_constant_scores_flag_nothing():
    result = outliers.detect(np.ones(50), method="mad")
    assert len(result) == 0
