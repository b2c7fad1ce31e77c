"""The optimal buffered linear Toeplitz (BLT) strategy for a run: :func:`optimal_blt`.

The loss is jax-privacy's (``buffered_toeplitz.LossFn``): ``sensitivity ** 2 * max_error``,
the largest expected squared error of a prefix sum of the noisy sums, per unit of
``noise_multiplier * max_norm``, at a fixed privacy (the DP event is one Gaussian release at
``noise_multiplier`` for any strategy). It is minimised with ``scipy.optimize`` over BLTs whose
first column is positive and decreasing, parameterised without constraints:

    buffer_decays[j] = sigmoid(a[j])                         in (0, 1)
    output_scales[j] = exp(b[j]) / (1 + sum_k exp(b[k]))     > 0, sum < 1

so ``t_1 = sum(output_scales) < 1 = t_0`` and every ``t_i`` decreases: the earliest
participation pattern is the worst one and the sensitivity is exact (see
:mod:`pergrad._src.dp.correlated`). jax-privacy (``buffered_toeplitz.optimize``) runs L-BFGS in
JAX with barrier penalties that keep the same region and the inverse's parameters in range;
here the region is built into the parameters and the loss is evaluated in float64 numpy (an IIR
filter for ``M``'s coefficients), which costs ``O(steps * (num_buffers + participations))`` per
evaluation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pergrad._src.dp.accounting import check_count
from pergrad._src.dp.correlated import BLTNoise, check_run
from pergrad._src.dp.toeplitz_algebra import (
    blt_rational,
    blt_strategy_coefs,
    earliest_pattern_sensitivity_squared,
    prefix_sum_max_error,
    rational_coefs,
)
from pergrad._src.errors import PergradValueError

MAX_BUFFERS = 10  # more buffers improve little and make the optimisation ill-conditioned
# num_buffers=None adds buffers while one more lowers the loss by more than this factor
# (jax-privacy's ``rtol`` in ``buffered_toeplitz.optimize``).
_IMPROVEMENT = 1.01


def optimal_blt(
    *,
    steps: int,
    participations: int = 1,
    min_separation: int | None = None,
    num_buffers: int | None = None,
) -> BLTNoise:
    """The BLT correlated noise that minimises ``sensitivity() ** 2 * max_error()`` for a run.

    Example (one epoch of 1000 steps; then 4 epochs of 250 steps in the same order)::

        mech = pergrad.dp.optimal_blt(steps=1000)
        mech = pergrad.dp.optimal_blt(steps=1000, participations=4, min_separation=250)
        mech.buffer_decays, mech.output_scales   # the BLT found

    Compared with DP-SGD's noise accounted the same way (``toeplitz([1.0], ...)``, loss
    ``participations * steps``), the loss falls to a few times ``log(steps) ** 2`` for one
    participation. Takes well under a second for a few thousand steps (each buffer count is one
    L-BFGS run from a few starting points).

    Args:
      steps, participations, min_separation: the run, as for :func:`pergrad.dp.toeplitz`.
      num_buffers: the number of buffers (model-sized arrays the noise keeps), 0 to 10; None
        adds buffers from 0 while one more lowers the loss by more than 1%.

    Raises:
      ValueError: an argument out of range (the message names it).
    """
    fn = "optimal_blt"
    steps, participations, min_separation = check_run(fn, steps, participations, min_separation)
    if num_buffers is not None:
        num_buffers = check_count(fn, "num_buffers", num_buffers, minimum=0)
        if num_buffers > MAX_BUFFERS:
            raise PergradValueError(
                f"{fn}: num_buffers must be at most {MAX_BUFFERS} (3 to 7 give the best "
                f"strategies in practice); got {num_buffers}."
            )
    loss = _Loss(steps, participations, min_separation or 1)
    if num_buffers is not None:
        decays, scales = _best_blt(loss, num_buffers)
    else:
        decays, scales = _best_blt(loss, 0)
        best = loss.value(decays, scales)
        for count in range(1, MAX_BUFFERS + 1):
            more_decays, more_scales = _best_blt(loss, count)
            value = loss.value(more_decays, more_scales)
            if _IMPROVEMENT * value >= best:
                break
            decays, scales, best = more_decays, more_scales, value
    return BLTNoise(decays, scales, steps, participations, min_separation)


class _Loss:
    """``sensitivity ** 2 * max_error`` of a BLT for one run."""

    def __init__(self, steps: int, participations: int, min_separation: int) -> None:
        self.steps = steps
        self.participations = participations
        self.min_separation = min_separation

    def value(self, decays: np.ndarray, scales: np.ndarray) -> float:
        strategy = blt_strategy_coefs(decays, scales, self.steps)
        numerator, denominator = blt_rational(decays, scales)
        noising = rational_coefs(denominator, numerator, self.steps)
        sensitivity_squared = earliest_pattern_sensitivity_squared(
            strategy, self.participations, self.min_separation
        )
        value = sensitivity_squared * prefix_sum_max_error(noising)
        return value if math.isfinite(value) else math.inf

    def of_parameters(self, parameters: np.ndarray) -> float:
        """The log of the loss at unconstrained parameters ``(a, b)`` (see the module
        docstring): logs keep L-BFGS's steps in scale from 10 steps to millions."""
        decays, scales = blt_of_parameters(parameters)
        with np.errstate(over="ignore", invalid="ignore"):
            value = self.value(decays, scales)
        return math.log(value) if 0 < value < math.inf else 1e6


def blt_of_parameters(parameters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(buffer_decays, output_scales)`` of the unconstrained parameters ``(a, b)``."""
    a, b = np.split(np.asarray(parameters, dtype=np.float64), 2)
    decays = 1.0 / (1.0 + np.exp(-a))
    shift = max(0.0, float(np.max(b, initial=0.0)))  # a stable softmax with a zero logit
    weights = np.exp(b - shift)
    scales = weights / (math.exp(-shift) + np.sum(weights))
    return decays, scales


def _starting_points(steps: int, num_buffers: int) -> list[np.ndarray]:
    """Decays spread geometrically in ``1 - decay`` between ``1 / steps`` and 1/2 (memory from
    the whole run to a few steps), the second coefficient 1/2 (the optimum of the square-root
    factorisation) split over the buffers, at two spreads."""
    points = []
    for spread in (1.0, 0.5):
        gaps = np.geomspace(0.5, min(0.5, spread * 4.0 / steps) / 2, num_buffers)
        a = np.log((1.0 - gaps) / gaps)
        scales = np.full(num_buffers, 0.5 / num_buffers)
        b = np.log(scales / (1.0 - np.sum(scales)))
        points.append(np.concatenate([a, b]))
    return points


def _best_blt(loss: _Loss, num_buffers: int) -> tuple[np.ndarray, np.ndarray]:
    if num_buffers == 0 or loss.steps == 1:
        return np.zeros(0), np.zeros(0)
    from scipy.optimize import minimize

    best: Any = None
    for start in _starting_points(loss.steps, num_buffers):
        result = minimize(loss.of_parameters, start, method="L-BFGS-B")
        if best is None or result.fun < best.fun:
            best = result
    decays, scales = blt_of_parameters(best.x)
    order = np.argsort(-decays)  # jax-privacy's canonical order: decreasing decays
    return decays[order], scales[order]
