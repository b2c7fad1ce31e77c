"""When to trust metagradients: how far a training run is from its linearisation in the
examples' weights.

:func:`~pergrad._src.influence.metagradient.metagradient` is the exact first derivative of the
run; how well it predicts what dropping many examples does depends on how linear the run is
over that distance, which the learning rate governs (measured on the digits MLP in
``benchmarks/metagradient_lds.py``: the same-seed LDS at 10% dropped is 0.99 with SGD at
learning rate 0.01, 0.98 at 0.03 and 0.84 at 0.1, momentum 0.9). :func:`linearity_check`
measures it on the user's own run with a few replays: it drops a few random subsets, replays,
and compares the targets' change with the scores' linear prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.lds import lds_subsets
from pergrad._src.influence.metagradient import check_run, replay_for, replay_run


@dataclass(frozen=True)
class LinearityCheck:
    """What :func:`linearity_check` measured.

    Attributes:
      relative_error: ``|actual - predicted| / |actual|`` (Frobenius norms over every drop and
        target): 0 for a run linear in the weights. On the digits MLP (50 targets, 4 drops;
        ``benchmarks/metagradient_lds.py``) 0.05-0.24 where the same-seed LDS at the same
        fraction was 0.98-1.0, 0.27-0.29 at 0.92-0.96, 0.34-0.47 at 0.74-0.87, 0.67 at 0.58.
      correlation: the Pearson correlation of ``actual`` and ``predicted`` over all their
        entries (NaN if either is constant).
      actual: ``(num_drops, k)``: each target after replaying without the dropped examples,
        minus its value after the full run.
      predicted: ``(num_drops, k)``: the scores' prediction, ``-sum_{i dropped} scores[i, j]``.
      dropped: ``(num_drops, n_train)`` boolean masks, True for the examples dropped.
    """

    relative_error: float
    correlation: float
    actual: np.ndarray
    predicted: np.ndarray
    dropped: np.ndarray


def linearity_check(
    loss: Callable[..., Any],
    params0: Any,
    data: Sequence[Any],
    batches: Any,
    optimizer: Any,
    target: Callable[[Any], Any],
    scores: Any,
    *,
    dropped: float = 0.1,
    num_drops: int = 4,
    seed: int = 0,
    normalize: str = "batch",
) -> LinearityCheck:
    """How well ``scores`` (from :func:`metagradient` on this run) predict dropping examples.

    Drops ``num_drops`` random subsets of ``round(dropped * n_train)`` examples (weights 0,
    the same initialisation, order and batch sizes, as :func:`replay`), replays the run for
    each, and compares the targets' change with the linear prediction ``-sum_{i dropped}
    scores[i, j]``. Cost: ``num_drops + 1`` training runs.

    A small ``relative_error`` means the run is close to its linearisation over such drops,
    so the scores rank subsets as retraining would (a high same-seed LDS at that fraction); a
    large one means the run is far from linear (typically a learning rate near the edge of
    stability) and the scores predict small removals only. With few targets the estimate is
    noisy: pass a ``(k,)`` target of several test points, or more drops.

    Args:
      loss, params0, data, batches, optimizer, target, normalize: the run and the targets, as
        for :func:`metagradient`.
      scores: ``(n_train, k)``, what :func:`metagradient` returned for this run and ``target``
        (an array of either framework, or numpy).
      dropped: the fraction of the training set each drop removes, in (0, 1).
      num_drops: how many random drops to replay.
      seed: seeds the drops (:func:`lds_subsets`).

    Returns:
      A :class:`LinearityCheck` (``relative_error``, ``correlation``, and the arrays behind them).

    Example::

        scores = metagradient(loss, params0, (X, Y), batches, opt, target)
        check = pergrad.influence.linearity_check(loss, params0, (X, Y), batches, opt,
                                                  target, scores, dropped=0.1)
        check.relative_error   # e.g. 0.2: the scores are to be trusted at 10% dropped
    """
    caller = "linearity_check"
    run = check_run(caller, loss, params0, data, batches, optimizer, normalize)
    if not callable(target):
        raise PergradTypeError(
            f"{caller}: target must be a function target(params) -> scalar or (k,); got "
            f"{type(target).__name__}."
        )
    _check_fraction(caller, dropped)
    if isinstance(num_drops, bool) or not isinstance(num_drops, (int, np.integer)):
        raise PergradValueError(f"{caller}: num_drops must be a positive int; got {num_drops!r}.")
    if num_drops < 1:
        raise PergradValueError(f"{caller}: num_drops must be a positive int; got {num_drops!r}.")
    matrix = _scores_matrix(caller, scores, run.num_train)
    if not 0 < round((1.0 - dropped) * run.num_train) < run.num_train:
        raise PergradValueError(
            f"{caller}: dropped={dropped} of {run.num_train} training examples drops none or "
            f"all of them; pick a fraction that drops at least one and keeps at least one."
        )
    masks = ~lds_subsets(run.num_train, int(num_drops), fraction=1.0 - dropped, seed=seed)
    machine = replay_for(run)

    def targets_after(weights: np.ndarray) -> np.ndarray:
        value = target(replay_run(run, machine, weights))
        return np.asarray(run.backend.to_numpy(value), dtype=np.float64).reshape(-1)

    full = targets_after(np.ones(run.num_train))
    if full.shape != (matrix.shape[1],):
        raise PergradValueError(
            f"{caller}: scores must have one column per target: target(params) gives "
            f"{full.size} value(s), scores has shape {matrix.shape}."
        )
    actual = np.stack([targets_after((~mask).astype(np.float64)) - full for mask in masks])
    predicted = -(masks.astype(np.float64) @ matrix)
    return LinearityCheck(
        relative_error=_relative_error(actual, predicted),
        correlation=_correlation(actual, predicted),
        actual=actual,
        predicted=predicted,
        dropped=masks,
    )


def _check_fraction(caller: str, dropped: Any) -> None:
    number = isinstance(dropped, (int, float, np.floating)) and not isinstance(dropped, bool)
    if not (number and 0.0 < dropped < 1.0):
        raise PergradValueError(
            f"{caller}: dropped must be the fraction of the training set each drop removes, a "
            f"number strictly between 0 and 1; got {dropped!r}."
        )


def _scores_matrix(caller: str, scores: Any, num_train: int) -> np.ndarray:
    if hasattr(scores, "detach"):
        scores = scores.detach().cpu()
    try:
        matrix = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise PergradTypeError(
            f"{caller}: scores must be the (n_train, k) array metagradient returned; got "
            f"{type(scores).__name__}."
        ) from err
    if matrix.ndim != 2 or matrix.shape[0] != num_train:
        raise PergradValueError(
            f"{caller}: scores must be (n_train, k) = ({num_train}, k), as metagradient "
            f"returns them; got shape {matrix.shape}."
        )
    if not np.isfinite(matrix).all():
        raise PergradValueError(f"{caller}: scores hold NaN or infinite values.")
    return matrix


def _relative_error(actual: np.ndarray, predicted: np.ndarray) -> float:
    scale = float(np.linalg.norm(actual))
    error = float(np.linalg.norm(actual - predicted))
    if scale == 0.0:
        return 0.0 if error == 0.0 else float("inf")
    return error / scale


def _correlation(actual: np.ndarray, predicted: np.ndarray) -> float:
    if actual.size < 2 or np.ptp(actual) == 0 or np.ptp(predicted) == 0:
        return float("nan")
    return float(np.corrcoef(actual.ravel(), predicted.ravel())[0, 1])
