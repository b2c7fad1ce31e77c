"""The numbers of lower-triangular Toeplitz strategies (numpy, float64): the matrices, a BLT's
coefficients and generating function, power series, sensitivity and error.

Pure functions of coefficient vectors, shared by the mechanisms
(:mod:`pergrad._src.dp.correlated`) and the BLT optimiser
(:mod:`pergrad._src.dp.strategy_optimization`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def lower_triangular_toeplitz(first_column: np.ndarray) -> np.ndarray:
    """The ``(n, n)`` lower-triangular Toeplitz matrix with this first column."""
    from scipy.linalg import toeplitz as dense_toeplitz

    return dense_toeplitz(first_column, np.zeros_like(first_column))


def blt_strategy_coefs(decays: np.ndarray, scales: np.ndarray, steps: int) -> np.ndarray:
    """The first column of a BLT's ``C``: ``1, t_1, ..., t_{steps-1}``."""
    powers = decays[None, :] ** np.arange(steps - 1)[:, None]  # 0 ** 0 is 1
    return np.concatenate([[1.0], powers @ scales])


def blt_rational(decays: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(numerator, denominator)`` polynomial coefficients, increasing powers of ``x``, of the
    generating function of a BLT's first column: ``1 + x sum_j s_j / (1 - d_j x) = (P + x Q) /
    P`` with ``P = prod_j (1 - d_j x)`` and ``Q = sum_j s_j prod_{k != j} (1 - d_k x)``."""
    denominator = np.ones(1)
    for decay in decays:
        denominator = np.convolve(denominator, [1.0, -decay])
    numerator = np.concatenate([denominator, [0.0]])
    for j, scale in enumerate(scales):
        others = np.ones(1)
        for k, decay in enumerate(decays):
            if k != j:
                others = np.convolve(others, [1.0, -decay])
        numerator[1 : others.size + 1] += scale * others
    return numerator, denominator


def rational_coefs(numerator: Any, denominator: Any, steps: int) -> np.ndarray:
    """The first ``steps`` power-series coefficients of ``numerator(x) / denominator(x)``."""
    try:
        from scipy.signal import lfilter
    except ImportError as err:
        raise ImportError(
            "pergrad's correlated noise needs scipy, which is not installed. Install it "
            "with: pip install 'pergrad[dp]'"
        ) from err
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    return lfilter(np.asarray(numerator, float), np.asarray(denominator, float), impulse)


def earliest_pattern_sensitivity_squared(
    strategy_coefs: np.ndarray, participations: int, min_separation: int
) -> float:
    """``||C u||^2`` for ``u`` the indicator of steps ``0, b, ..., (k - 1) b`` (``k``
    participations, ``b`` the separation), ``C`` lower-triangular Toeplitz with first column
    ``strategy_coefs``: the sum of the first column shifted down by ``p b``."""
    steps = strategy_coefs.size
    column_sum = np.zeros(steps)
    for p in range(participations):
        start = p * min_separation
        column_sum[start:] += strategy_coefs[: steps - start]
    return float(column_sum @ column_sum)


def prefix_sum_max_error(noising_coefs: np.ndarray) -> float:
    """The largest squared row norm of ``A M``, ``M`` lower-triangular Toeplitz with first
    column ``noising_coefs``, ``A`` lower-triangular ones (so ``A M`` is Toeplitz with first
    column ``cumsum(noising_coefs)``; row ``t``'s squared norm is the sum of its first ``t + 1``
    squares)."""
    prefix = np.cumsum(noising_coefs)
    return float(np.max(np.cumsum(prefix * prefix)))
