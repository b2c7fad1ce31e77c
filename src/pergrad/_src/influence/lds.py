"""The linear datamodeling score (LDS; Park et al. 2023, "TRAK"): how well attribution scores
predict what retraining on a subset of the training set does.

For ``m`` random subsets ``S_k`` of the training set (each a fraction ``alpha`` of it, drawn by
:func:`lds_subsets`), a model is retrained on each and evaluated on every target ``j``:
``outputs[k, j]``. The scores predict it linearly, ``sum_{i in S_k} scores[i, j]``; the LDS of
target ``j`` is the Spearman rank correlation over the ``m`` subsets between prediction and
output, and :func:`lds` reports its mean over the targets. Framework-free (numpy, scipy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError


def lds_subsets(
    num_train: int, num_subsets: int, fraction: float = 0.5, seed: int = 0
) -> np.ndarray:
    """``(num_subsets, num_train)`` boolean masks: each row a uniformly random subset of
    exactly ``round(fraction * num_train)`` training examples, reproducible from ``seed``.

    Retrain a model on ``train[mask]`` for each row, evaluate it on the targets, and pass the
    masks and those outputs to :func:`lds`. The TRAK paper uses ``fraction=0.5`` and 100 or
    more subsets; fewer than about 30 makes the score noisy.
    """
    for name, value in (("num_train", num_train), ("num_subsets", num_subsets)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise PergradValueError(f"lds_subsets: {name} must be a positive int; got {value!r}.")
    if not (isinstance(fraction, (int, float)) and 0 < fraction < 1):
        raise PergradValueError(
            f"lds_subsets: fraction must be a number strictly between 0 and 1; got {fraction!r}."
        )
    size = round(fraction * num_train)
    if not 0 < size < num_train:
        raise PergradValueError(
            f"lds_subsets: fraction={fraction} of num_train={num_train} gives subsets of "
            f"{size} examples; each subset needs at least one example in and one out."
        )
    rng = np.random.default_rng(seed)
    masks = np.zeros((num_subsets, num_train), dtype=bool)
    for row in masks:
        row[rng.choice(num_train, size, replace=False)] = True
    return masks


def lds(scores: Any, subsets: Any, outputs: Any, per_target: bool = False) -> Any:
    """The linear datamodeling score of attribution ``scores``.

    Args:
      scores: ``(n_train, n_targets)``, as every ``pergrad.influence`` method returns them
        (positive: the training example helps the target). Any array with ``__array__`` (torch
        tensors are moved to the CPU).
      subsets: ``(m, n_train)`` boolean masks of the training subsets (:func:`lds_subsets`).
      outputs: ``(m, n_targets)``, what the model retrained on subset ``k`` gives target ``j``,
        oriented like the scores: higher means helped (a margin, a log-probability, or the
        NEGATIVE of a loss). Average over several training seeds per subset to take out the
        training noise, as the TRAK paper does.
      per_target: return the ``(n_targets,)`` per-target scores instead of their mean.

    Returns:
      The mean over targets of the Spearman correlation (a float in [-1, 1]); with
      ``per_target``, each target's. A target whose predictions or outputs are constant over
      the subsets has no correlation: its entry is NaN and the mean skips it.

    Example::

        masks = pergrad.influence.lds_subsets(len(X_train), 64, seed=0)
        outputs = np.stack([margins(train(X_train[m], Y_train[m]), X_test) for m in masks])
        pergrad.influence.lds(scores, masks, outputs)   # ~0.8 for a good method on a small net

    Comparing estimators (:class:`pergrad.influence.Estimator`, built-in or your own) on the
    same retrainings::

        task = pergrad.influence.Task(loss, params)
        for name in ("dot", "cosine", "mine"):
            estimator = pergrad.influence.Estimator.registry[name]()
            scores = estimator.scores(task, (X_train, Y_train), (X_test, Y_test))
            print(name, pergrad.influence.lds(scores, masks, outputs))
    """
    stats = _scipy_stats()
    scores = _as_matrix("scores", scores)
    subsets = _as_matrix("subsets", subsets)
    outputs = _as_matrix("outputs", outputs)
    if subsets.dtype != bool:
        if not np.isin(subsets, (0, 1)).all():
            raise PergradValueError(
                "lds: subsets must be (m, n_train) boolean masks (lds_subsets draws them); got "
                "values other than 0 and 1."
            )
        subsets = subsets.astype(bool)
    n_train, n_targets = scores.shape
    if subsets.shape[1] != n_train:
        raise PergradValueError(
            f"lds: subsets must have one column per training example (scores has {n_train} "
            f"rows); got subsets of shape {subsets.shape}."
        )
    if outputs.shape != (subsets.shape[0], n_targets):
        raise PergradValueError(
            f"lds: outputs must be (m, n_targets) = ({subsets.shape[0]}, {n_targets}): one row "
            f"per subset, one column per target of scores; got {outputs.shape}."
        )
    if subsets.shape[0] < 3:
        raise PergradValueError(
            f"lds: a rank correlation needs at least 3 subsets; got {subsets.shape[0]}."
        )
    predicted = subsets.astype(np.float64) @ scores.astype(np.float64)  # (m, n_targets)
    per = np.full(n_targets, np.nan)
    for j in range(n_targets):
        if np.ptp(predicted[:, j]) > 0 and np.ptp(outputs[:, j]) > 0:
            per[j] = stats.spearmanr(predicted[:, j], outputs[:, j]).statistic
    if per_target:
        return per
    if np.isnan(per).all():
        raise PergradValueError(
            "lds: every target's predictions or outputs are constant over the subsets; there "
            "is no correlation to measure."
        )
    return float(np.nanmean(per))


def _as_matrix(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
    try:
        array = np.asarray(value)
    except Exception as err:
        raise PergradTypeError(
            f"lds: {name} must be an array; got {type(value).__name__}."
        ) from err
    if array.ndim != 2 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise PergradValueError(
            f"lds: {name} must be a 2-D numeric array; got shape {array.shape} of {array.dtype}."
        )
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise PergradValueError(f"lds: {name} holds NaN or infinite values.")
    return array


def _scipy_stats() -> Any:
    try:
        from scipy import stats
    except ImportError as err:  # pragma: no cover - scipy comes with the extra
        raise ImportError(
            "pergrad.influence.lds needs scipy for the rank correlation: "
            "pip install 'pergrad[influence]' (or scipy)."
        ) from err
    return stats
