"""Privacy audits beyond the one-run bound: many runs against one target (Clopper-Pearson), and
descriptive statistics of a membership attack's scores (TPR at a fixed FPR, AUROC).

``audit.py`` has the one-run audit and the validation these share.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pergrad._src.dp.accounting import check_real
from pergrad._src.dp.audit import check_delta, check_significance, scipy_stats, score_array
from pergrad._src.errors import PergradValueError

# --- many runs, one target ----------------------------------------------------------------


def _clopper_pearson_upper(successes: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    """One-sided upper confidence bounds on binomial proportions, each failing w.p. <= alpha."""
    beta = scipy_stats().beta
    upper = beta.ppf(1.0 - alpha, successes + 1, np.maximum(trials - successes, 1))
    return np.where(successes < trials, upper, 1.0)


def epsilon_lower_bound_clopper_pearson(
    in_scores: Any,
    out_scores: Any,
    delta: float = 0.0,
    significance: float = 0.05,
    *,
    threshold: float | None = None,
) -> float:
    """A lower bound on epsilon from many runs: one target, Clopper-Pearson rates.

    Example (200 runs with the target, 200 without; one score per run)::

        bound = epsilon_lower_bound_clopper_pearson(scores_with, scores_without, delta=1e-5)

    The attack guesses "included" when a run's score is ``>= threshold``. ``(epsilon,
    delta)``-DP requires ``TPR <= e^eps FPR + delta`` and ``TNR <= e^eps FNR + delta``. With
    probability ``1 - significance`` the true FNR and FPR are below their one-sided
    Clopper-Pearson upper bounds (``significance / 2`` each), and then

        epsilon >= max(ln((1 - FNR_up - delta) / FPR_up), ln((1 - FPR_up - delta) / FNR_up)).

    This is the bound of Jagielski et al. (2020) and of TensorFlow Privacy's
    ``EpsilonLowerBound`` (Clopper-Pearson method) and jax-privacy's
    ``epsilon_clopper_pearson``.

    Assumptions: the runs are independent, each with the target included or excluded
    (``in_scores`` from the runs that included it); the rates are those of one fixed
    threshold. With ``threshold=None`` every observed score (and +inf) is tried and each
    is taken at ``significance / number of thresholds`` (Bonferroni), as jax-privacy does;
    strictly, those thresholds are chosen from the data, so for a bound without that caveat
    fix ``threshold`` in advance (e.g. from other runs). It costs one training run per score:
    hundreds of runs for a useful bound, which is what the one-run audit avoids.

    Args:
      in_scores: 1-D scores of the runs that included the target (no nan).
      out_scores: 1-D scores of the runs that excluded it.
      delta: the delta of the claim, in ``[0, 1)``.
      significance: in ``(0, 1)``.
      threshold: a score threshold fixed in advance, or None to search (see above).

    Returns:
      the bound, a float ``>= 0``.
    """
    fn = "epsilon_lower_bound_clopper_pearson"
    in_values = score_array(fn, "in_scores", in_scores)
    out_values = score_array(fn, "out_scores", out_scores)
    delta = check_delta(fn, delta)
    significance = check_significance(fn, significance)
    if threshold is None:
        thresholds = np.append(np.unique(np.concatenate([in_values, out_values])), np.inf)
    else:
        thresholds = np.array([check_real(fn, "threshold", threshold)])
    alpha = significance / thresholds.size / 2.0
    in_sorted, out_sorted = np.sort(in_values), np.sort(out_values)
    false_negatives = np.searchsorted(in_sorted, thresholds, side="left")  # in below threshold
    false_positives = out_values.size - np.searchsorted(out_sorted, thresholds, side="left")
    fnr_upper = _clopper_pearson_upper(false_negatives, in_values.size, alpha)
    fpr_upper = _clopper_pearson_upper(false_positives, out_values.size, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        bounds = np.concatenate(
            [
                np.log(np.maximum(1.0 - fnr_upper - delta, 0.0) / fpr_upper),
                np.log(np.maximum(1.0 - fpr_upper - delta, 0.0) / fnr_upper),
            ]
        )
    return float(max(0.0, np.nanmax(bounds)))


# --- descriptive statistics -------------------------------------------------------------


def tpr_at_fpr(in_scores: Any, out_scores: Any, fpr: float) -> float:
    """The attack's best true-positive rate among thresholds whose false-positive rate <= fpr.

    Example::

        tpr_at_fpr(in_scores, out_scores, 0.01)   # share of included canaries caught at 1% FPR

    The attack guesses "included" for scores ``>= t``; over every threshold ``t`` (each
    observed score and +inf) with at most ``fpr * len(out_scores)`` excluded canaries above it,
    the largest share of included canaries above it. A point estimate of how well the attack
    separates the two groups (Carlini et al. 2022's "TPR at low FPR"), with no confidence
    statement; no randomisation between thresholds. It is not a bound on epsilon.
    """
    fn = "tpr_at_fpr"
    in_values = score_array(fn, "in_scores", in_scores)
    out_values = score_array(fn, "out_scores", out_scores)
    fpr = check_real(fn, "fpr", fpr)
    if not 0.0 <= fpr <= 1.0:
        raise PergradValueError(f"{fn}: fpr must be in [0, 1], got {fpr!r}.")
    thresholds = np.append(np.unique(np.concatenate([in_values, out_values])), np.inf)
    false_positives = out_values.size - np.searchsorted(np.sort(out_values), thresholds, "left")
    true_positives = in_values.size - np.searchsorted(np.sort(in_values), thresholds, "left")
    allowed = false_positives <= fpr * out_values.size * (1 + 1e-12)
    return float(true_positives[allowed].max() / in_values.size)


def auroc(in_scores: Any, out_scores: Any) -> float:
    """The area under the attack's ROC curve: P[in score > out score] + P[tie] / 2.

    Example::

        auroc([3.0, 2.0], [1.0, 2.0])   # 0.875: 0.5 is chance, 1.0 perfect separation

    The Mann-Whitney statistic over every (included, excluded) pair, from average ranks. A
    threshold-free summary of the attack, with no confidence statement; not a bound on
    epsilon (an attack can have a high AUROC against a mechanism with a large epsilon and
    still show nothing at the low false-positive rates that matter for privacy).
    """
    fn = "auroc"
    in_values = score_array(fn, "in_scores", in_scores)
    out_values = score_array(fn, "out_scores", out_scores)
    ranks = scipy_stats().rankdata(np.concatenate([in_values, out_values]))
    rank_sum = ranks[: in_values.size].sum()
    pairs_won = rank_sum - in_values.size * (in_values.size + 1) / 2.0
    return float(pairs_won / (in_values.size * out_values.size))
