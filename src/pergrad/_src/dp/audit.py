"""Empirical privacy auditing: lower bounds on epsilon from the scores of canaries.

    bound = epsilon_lower_bound(in_scores, out_scores, delta=1e-5)   # one training run
    if bound > claimed_epsilon: ...                                  # the implementation leaks

A *canary* is an example (or a gradient) that the auditor may insert into training. An attack
gives each canary a *score*, higher when it looks included. ``in_scores`` are the scores of
the canaries that were included, ``out_scores`` of those that were not. If training is
``(epsilon, delta)``-DP, no attack can tell the two groups apart too well, and each function
here turns "too well" into a statistical statement, at a chosen ``significance``: with
probability at least ``1 - significance`` over the training randomness, the returned number is
below the true epsilon. A bound above the accountant's epsilon therefore says (at that
confidence) that the implementation is broken; a bound below it proves nothing about
correctness (the attack may be weak).

* :func:`epsilon_lower_bound`: the one-run audit of Steinke, Nasr & Jagielski (2023, "Privacy
  Auditing with One (1) Training Run", Theorem 3 with its delta term). ``m`` canaries, each
  included by an independent fair coin, one training run.
* :func:`epsilon_lower_bound_clopper_pearson`: the classic audit over many runs (Jagielski et
  al. 2020, Nasr et al. 2021): one target, included in some runs and excluded from others, one
  score per run; Clopper-Pearson intervals on the true- and false-positive rates.
* :func:`tpr_at_fpr` and :func:`auroc`: point estimates that describe an attack; they are
  not bounds on epsilon.

Everything here is numpy and scipy (``scipy.stats`` for binomial tails and beta quantiles,
imported when a function is called). Scores may be numpy arrays, lists, or JAX / torch arrays.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from pergrad._src.dp.accounting import check_count, check_real
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.norms import scores_to_numpy

# The default guesses, as fractions f of the m canaries: ceil(f * m) "included" guesses on the
# highest scores and as many "excluded" guesses on the lowest (two-sided), plus a few
# "included"-only choices for attacks that separate only the top. Few choices on purpose: the
# bound is taken at significance / (number of choices), and when delta > 0 the theorem's delta
# term grows with that number (the bound's ceiling is about ln(significance / (2 delta G)) for
# G choices and all canaries guessed): 9 choices keep it near 5 for delta 1e-5, where
# every pair of a 14 x 14 grid (195 choices) would cap it near 2.7.
_TWO_SIDED_FRACTIONS = (0.45, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02)
_ONE_SIDED_FRACTIONS = (0.1, 0.02)

# The bisection on epsilon stops at this width; results are reproducible to about this.
_EPSILON_TOLERANCE = 1e-9


def scipy_stats() -> Any:
    try:
        import scipy.stats
    except ImportError as err:
        raise ImportError(
            "pergrad's privacy auditing needs scipy, which is not installed. Install it with: "
            "pip install 'pergrad[dp]'"
        ) from err
    return scipy.stats


# --- validation -------------------------------------------------------------------------


def score_array(fn: str, name: str, scores: Any) -> np.ndarray:
    """A 1-D float64 numpy copy of ``scores`` (numpy, list, JAX or torch), checked."""
    if isinstance(scores, (list, tuple)) or np.isscalar(scores):
        values = np.asarray(scores)
    elif isinstance(scores, np.ndarray):
        values = scores
    else:
        values = scores_to_numpy(fn, scores, name)
    if values.dtype.kind not in "biuf":
        raise PergradTypeError(
            f"{fn}: {name} must be real numbers (one score per canary); got an array of "
            f"dtype {values.dtype}."
        )
    if values.ndim != 1:
        raise PergradValueError(
            f"{fn}: {name} must be 1-D, one score per canary; got shape {values.shape}."
        )
    if values.size == 0:
        raise PergradValueError(
            f"{fn}: {name} is empty; the audit needs at least one included and one excluded canary."
        )
    values = values.astype(np.float64)
    if np.isnan(values).any():
        raise PergradValueError(
            f"{fn}: {name} contains nan at index {int(np.flatnonzero(np.isnan(values))[0])}; "
            "scores must be comparable (replace a failed score by -inf, 'looks excluded')."
        )
    return values


def check_significance(fn: str, significance: Any) -> float:
    value = check_real(fn, "significance", significance)
    if not 0.0 < value < 1.0:
        raise PergradValueError(
            f"{fn}: significance must be in (0, 1) (the probability that the bound is wrong, "
            f"e.g. 0.05), got {significance!r}."
        )
    return value


def check_delta(fn: str, delta: Any) -> float:
    value = check_real(fn, "delta", delta)
    if not 0.0 <= value < 1.0:
        raise PergradValueError(
            f"{fn}: delta must be in [0, 1) (the delta of the (epsilon, delta) claim being "
            f"audited), got {delta!r}."
        )
    return value


def _guesses(fn: str, guesses: Any, num_canaries: int) -> list[tuple[int, int]]:
    """The list of ``(num_in_guesses, num_out_guesses)`` pairs to try, checked."""
    if guesses is None:
        return guess_grid(num_canaries)
    expected = (
        "a pair (num_in_guesses, num_out_guesses) of ints, or a list of such pairs, or None "
        "for the default grid"
    )
    if not isinstance(guesses, Sequence) or isinstance(guesses, str) or not guesses:
        raise PergradTypeError(f"{fn}: guesses must be {expected}; got {guesses!r}.")
    pairs = [guesses] if isinstance(guesses[0], numbers.Integral) else list(guesses)
    checked = []
    for pair in pairs:
        if (
            not isinstance(pair, Sequence)
            or len(pair) != 2
            or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in pair)
        ):
            raise PergradTypeError(f"{fn}: guesses must be {expected}; got {pair!r} in it.")
        num_in, num_out = int(pair[0]), int(pair[1])
        if num_in < 0 or num_out < 0 or num_in + num_out == 0 or num_in + num_out > num_canaries:
            raise PergradValueError(
                f"{fn}: each guesses pair must have counts >= 0 with 1 <= num_in_guesses + "
                f"num_out_guesses <= {num_canaries} (the number of canaries); got {pair!r}."
            )
        checked.append((num_in, num_out))
    return checked


# --- the one-run audit ------------------------------------------------------------------


def guess_grid(num_canaries: int) -> list[tuple[int, int]]:
    """The default choices of guesses that :func:`epsilon_lower_bound` searches over.

    Each pair ``(num_in_guesses, num_out_guesses)`` means: guess "included" for the
    ``num_in_guesses`` highest scores, "excluded" for the ``num_out_guesses`` lowest, abstain
    on the rest. The grid has ``(k, k)`` for ``k = ceil(f * m)``, ``f`` in 0.45, 0.4, 0.3,
    0.2, 0.1, 0.05, 0.02 (the top fraction is below 1/2 so that the fair coins, which include
    about half of the canaries give or take ``sqrt(m) / 2``, leave every guess of it
    possibly right), and ``(ceil(f * m), 0)`` for ``f`` in 0.1, 0.02 (attacks that only
    recognise the most exposed included canaries); duplicates are dropped. It depends on ``m``
    alone, never on the scores: that is what makes the Bonferroni correction over its length
    valid.

    Example::

        guess_grid(1000)   # [(20, 0), (20, 20), (50, 50), (100, 0), (100, 100), ..., (450, 450)]
    """
    num_canaries = check_count("guess_grid", "num_canaries", num_canaries, minimum=1)
    pairs = {(math.ceil(f * num_canaries),) * 2 for f in _TWO_SIDED_FRACTIONS}
    pairs.update((math.ceil(f * num_canaries), 0) for f in _ONE_SIDED_FRACTIONS)
    return sorted(pair for pair in pairs if sum(pair) <= num_canaries)


def _binomial_pmf_prefix(num_guesses: int, num_correct: int, q: float) -> np.ndarray:
    """P[Bin(r, q) = j] for j = 0 .. v - 1."""
    return scipy_stats().binom.pmf(np.arange(num_correct), num_guesses, q)


def one_run_p_value(
    num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float
) -> float:
    """The p-value of ``num_correct`` right guesses out of ``num_guesses`` under (eps, delta)-DP.

    Theorem 3 of Steinke, Nasr & Jagielski (2023): if training is ``(epsilon, delta)``-DP and
    each of the ``m`` canaries is included by an independent fair coin, the number ``W`` of
    right guesses among ``r`` guesses satisfies, for every ``v``,

        P[W >= v] <= f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i,
        f(v) = P[Bin(r, q) >= v],  q = e^epsilon / (1 + e^epsilon).

    (The maximum over ``i > v`` is never larger: ``f`` is 1 there and ``i`` grows.) The
    differences ``f(v - i) - f(v)`` are summed from the binomial's mass function rather than
    subtracted, so they stay accurate when both tails are close to 1.

    Args:
      num_canaries: ``m``, an int >= 1.
      num_guesses: ``r``, an int in ``[0, m]``.
      num_correct: ``v``, an int in ``[0, r]``.
      epsilon: the claim's epsilon, a real number.
      delta: the claim's delta, in ``[0, 1)``.

    Returns:
      the right-hand side, capped at 1.
    """
    fn = "one_run_p_value"
    num_canaries = check_count(fn, "num_canaries", num_canaries, minimum=1)
    num_guesses = check_count(fn, "num_guesses", num_guesses, minimum=0)
    num_correct = check_count(fn, "num_correct", num_correct, minimum=0)
    if not num_correct <= num_guesses <= num_canaries:
        raise PergradValueError(
            f"{fn}: need num_correct <= num_guesses <= num_canaries; got {num_correct}, "
            f"{num_guesses}, {num_canaries}."
        )
    epsilon = check_real(fn, "epsilon", epsilon)
    return _p_value(num_canaries, num_guesses, num_correct, epsilon, check_delta(fn, delta))


def _p_value(
    num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float
) -> float:
    """:func:`one_run_p_value` without the checks, for the searches."""
    if num_correct <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon > -700 else 0.0
    tail = float(scipy_stats().binom.sf(num_correct - 1, num_guesses, q))
    if delta == 0.0:
        return min(tail, 1.0)
    below = _binomial_pmf_prefix(num_guesses, num_correct, q)[::-1]  # j = v-1, v-2, ..., 0
    worst = float(np.max(np.cumsum(below) / np.arange(1, num_correct + 1)))
    return min(tail + 2.0 * num_canaries * delta * worst, 1.0)


def _largest_rejected_epsilon(
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    significance: float,
    delta: float,
    at_least: float = 0.0,
) -> float:
    """The largest epsilon whose p-value is at most ``significance``, or ``at_least`` when no
    epsilon above ``at_least`` is rejected.

    Any epsilon with a small p-value is a sound bound (a mechanism that is (eps', delta)-DP is
    (eps, delta)-DP for every eps >= eps', so the largest rejected value is sound even if the
    p-value were not monotone in epsilon). The binomial tail grows with epsilon; the delta
    term can shrink, but for ``2 m delta <= 1`` more slowly than the tail grows, so there is
    one crossing and bisection finds it. (With several crossings it would find one of them:
    a smaller bound, still sound.)
    """

    def rejected(epsilon: float) -> bool:
        return _p_value(num_canaries, num_guesses, num_correct, epsilon, delta) <= significance

    # The delta-free p-value is smaller, so if it does not reject, nothing above does either.
    if _p_value(num_canaries, num_guesses, num_correct, at_least, 0.0) > significance:
        return at_least
    return _largest_rejected(rejected, at_least, _EPSILON_TOLERANCE)


def _largest_rejected(rejected: Any, at_least: float, tolerance: float) -> float:
    """The largest epsilon ``>= at_least`` that ``rejected`` refutes, by doubling then
    bisection to ``tolerance`` (relative above 1); ``at_least`` if it refutes none."""
    if not rejected(at_least):
        return at_least
    low, high = at_least, max(1.0, 2.0 * at_least)
    while rejected(high):
        low, high = high, 2.0 * high
    while high - low > tolerance * max(1.0, low):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def _labels_in_score_order(in_scores: np.ndarray, out_scores: np.ndarray) -> np.ndarray:
    """1 for included, 0 for excluded canaries, in increasing order of score.

    Ties are broken against the auditor: among equal scores, excluded canaries rank higher
    (so "included" guesses on the top pick them first) and included canaries lower (so
    "excluded" guesses on the bottom pick them first). Any tie-break that does not look at
    membership (a fair one) gets at least as many guesses right, so the count stays sound.
    """
    scores = np.concatenate([in_scores, out_scores])
    labels = np.concatenate([np.ones(in_scores.size, int), np.zeros(out_scores.size, int)])
    order = np.lexsort((-labels, scores))  # by score; among ties, included first
    return labels[order]


def _correct_counts(
    in_scores: np.ndarray, out_scores: np.ndarray, pairs: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """``(num_guesses, num_correct)`` for each ``(num_in_guesses, num_out_guesses)`` pair."""
    labels = _labels_in_score_order(in_scores, out_scores)
    included_in_top = np.concatenate([[0], np.cumsum(labels[::-1])])  # [k]: among the top k
    included_in_bottom = np.concatenate([[0], np.cumsum(labels)])  # [k]: among the bottom k
    return [
        (
            num_in + num_out,
            int(included_in_top[num_in]) + num_out - int(included_in_bottom[num_out]),
        )
        for num_in, num_out in pairs
    ]


def epsilon_lower_bound(
    in_scores: Any,
    out_scores: Any,
    delta: float,
    significance: float = 0.05,
    *,
    guesses: Any = None,
    method: str = "one-run",
) -> float:
    """A lower bound on epsilon from one training run with canaries (Steinke et al. 2023).

    Example (1000 canaries, half of them included by fair coins)::

        bound = epsilon_lower_bound(in_scores, out_scores, delta=1e-5)
        # in_scores: (num_included,), out_scores: (num_excluded,); higher = "looks included"

    The audit: guess "included" for the highest scores, "excluded" for the lowest, abstain on
    the rest; from ``r`` guesses of which ``v`` are right, the bound is the largest epsilon
    whose p-value (Theorem 3 of the paper, delta term included; :func:`one_run_p_value`) is at
    most ``significance``. With probability at least ``1 - significance``, the bound is at most
    the true epsilon of any ``(epsilon, delta)`` guarantee that the training satisfies.

    How many to guess: with ``guesses=None`` the bound is the largest over the pairs of
    :func:`guess_grid` (9 pairs for 1000 canaries), each at ``significance / len(grid)``
    (a Bonferroni correction: the largest of many bounds is sound only if each is taken at a
    smaller significance). Pass ``guesses=(num_in, num_out)`` to use one choice made before
    seeing the scores (no correction: more power if the choice is good), or a list of pairs
    to search those (corrected by their number).

    Assumptions (the theorem's): each canary was included or excluded by an independent fair
    coin drawn before training and not otherwise used; the scores are computed from the
    training's output only (the final model, or every released intermediate model for a
    white-box audit), never from the coins; ``delta`` is the delta of the claim. Ties between
    scores are broken against the auditor, so they never help it.

    Ceiling: with ``r`` guesses, all right, the bound is at most
    ``ln(q / (1 - q))`` with ``q = (significance / len(grid)) ** (1 / r)``; to audit a claim
    of epsilon you need enough canaries to lift this above it
    (:func:`epsilon_lower_bound_ceiling`).

    ``method="f-dp"`` audits a stronger claim with more power (Mahloujifar et al. 2024,
    "Auditing f-Differential Privacy in One Run"): that training is as private as the
    Gaussian mechanism that is exactly ``(epsilon, delta)``-DP (its whole trade-off curve, not
    one point of it). DP-SGD's accountants describe a mechanism close to that (a composition of
    many subsampled Gaussians), which is why the refinement is used for it; for a mechanism of
    another shape a bound above the claim refutes the Gaussian curve, not ``(epsilon,
    delta)``. It needs ``delta > 0`` and costs up to ``v`` (right guesses) steps per bisection
    step: under a second for 1000 canaries.

    Args:
      in_scores: 1-D scores of the included canaries (numpy, list, JAX or torch), no nan.
      out_scores: 1-D scores of the excluded canaries.
      delta: the delta of the ``(epsilon, delta)`` claim, in ``[0, 1)``.
      significance: the probability, over the training run, that the bound is wrong; in
        ``(0, 1)``.
      guesses: None (the default grid), ``(num_in_guesses, num_out_guesses)``, or a list of
        such pairs; each with ``1 <= num_in + num_out <= len(in_scores) + len(out_scores)``.
      method: ``"one-run"`` (default; Steinke et al., any ``(epsilon, delta)`` mechanism) or
        ``"f-dp"`` (Gaussian trade-off curve, see above).

    Returns:
      the bound, a float ``>= 0`` (0 when the guesses beat no epsilon at this significance).

    Raises:
      ValueError, TypeError: a bad argument; the message names it.
      ImportError: scipy is not installed.
    """
    fn = "epsilon_lower_bound"
    if method not in ("one-run", "f-dp"):
        raise PergradValueError(f"{fn}: method must be 'one-run' or 'f-dp'; got {method!r}.")
    in_values = score_array(fn, "in_scores", in_scores)
    out_values = score_array(fn, "out_scores", out_scores)
    delta = check_delta(fn, delta)
    significance = check_significance(fn, significance)
    num_canaries = in_values.size + out_values.size
    pairs = _guesses(fn, guesses, num_canaries)
    corrected = significance / len(pairs)
    counts = _correct_counts(in_values, out_values, pairs)
    # Most precise first, so that later pairs are mostly ruled out by the cheap delta-free test.
    counts.sort(key=lambda count: -(count[1] + 1) / (count[0] + 2))
    best = 0.0
    if method == "f-dp" and delta == 0.0:
        raise PergradValueError(
            f"{fn}: method='f-dp' needs delta > 0 (no Gaussian mechanism is "
            f"(epsilon, 0)-DP); got delta={delta!r}."
        )
    largest = _largest_gaussian_rejected if method == "f-dp" else _largest_rejected_epsilon
    for num_guesses, num_correct in counts:
        best = largest(num_canaries, num_guesses, num_correct, corrected, delta, at_least=best)
    return best


def gaussian_mu(epsilon: float, delta: float) -> float:
    """The ``mu`` of the Gaussian mechanism (``mu``-GDP: sensitivity over noise std) that is
    exactly ``(epsilon, delta)``-DP: the root of Balle & Wang's (2018)
    ``Phi(-epsilon / mu + mu / 2) - e^epsilon Phi(-epsilon / mu - mu / 2) = delta``, whose left
    side grows with ``mu``; found by bisection in log space to relative ``1e-12``."""
    normal = statistics.NormalDist()

    def delta_of(mu: float) -> float:
        return normal.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * normal.cdf(
            -epsilon / mu - mu / 2
        )

    low, high = 1e-3 * delta, 1.0  # delta_of(mu) < mu / 2 for mu -> 0: low is below
    while delta_of(high) < delta:
        low, high = high, 2.0 * high
    while high - low > 1e-12 * high:
        middle = math.sqrt(low * high) if high / low > 2 else 0.5 * (low + high)
        low, high = (middle, high) if delta_of(middle) < delta else (low, middle)
    return high


def _gaussian_rejects(
    mu: float, num_canaries: int, num_guesses: int, num_correct: int, significance: float
) -> bool:
    """Whether ``num_correct`` right guesses of ``num_guesses`` refute ``mu``-GDP at
    ``significance`` (Mahloujifar et al. 2024, the one-run f-DP audit with the trade-off curve
    ``f(x) = Phi(Phi^-1(1 - x) - mu)``).

    The audit bounds the rates of right (``r``) and wrong (``h``) guesses that a ``mu``-GDP
    training could reach with probability ``significance``, starting from ``significance``
    times the observed counts over ``m`` and walking down the right guesses one at a time:
    each step, ``h`` must be at least the wrong-guess rate the curve forces for ``r``
    (``Phi(Phi^-1(r) - mu)``), and raising ``h`` raises ``r`` in proportion
    (``i / (k - i)`` for ``i`` right guesses left of ``k``). If the rates it ends with
    exceed the guesses made (``r + h > k / m``), observing the counts had probability below
    ``significance`` under the claim: refuted."""
    normal = statistics.NormalDist()
    right = significance * num_correct / num_canaries
    wrong = significance * (num_guesses - num_correct) / num_canaries
    for remaining in range(num_correct - 1, -1, -1):
        if right <= 0.0:
            forced = 0.0
        elif right >= 1.0:
            forced = 1.0
        else:
            forced = normal.cdf(normal.inv_cdf(right) - mu)
        if forced <= wrong:
            break  # neither rate moves again
        right = min(right + remaining / (num_guesses - remaining) * (forced - wrong), 1.0)
        wrong = forced
    return right + wrong > num_guesses / num_canaries


def _largest_gaussian_rejected(
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    significance: float,
    delta: float,
    at_least: float = 0.0,
) -> float:
    """The largest epsilon whose Gaussian claim (``gaussian_mu(epsilon, delta)``-GDP) the counts
    refute, or ``at_least``; the claim weakens as epsilon grows, so bisection finds it."""

    def rejected(epsilon: float) -> bool:
        mu = gaussian_mu(epsilon, delta)
        return _gaussian_rejects(mu, num_canaries, num_guesses, num_correct, significance)

    if num_correct == 0:
        return at_least
    return _largest_rejected(rejected, at_least, 1e-6)


def epsilon_lower_bound_ceiling(
    num_canaries: int,
    delta: float = 0.0,
    significance: float = 0.05,
    *,
    guesses: Any = None,
) -> float:
    """The largest value :func:`epsilon_lower_bound` can return for ``num_canaries`` canaries.

    It is the bound when every guess is right, at the same Bonferroni-corrected significance,
    for the best of the guess sets (with ``delta > 0`` the largest set is not always the best). An audit with fewer canaries cannot refute a claim
    above it, however badly the training leaks: size ``num_canaries`` so that the ceiling is
    well above the claimed epsilon. (Reaching the largest guess set also needs the coins to
    include at least as many canaries as it guesses "included": 45% of them for the default
    grid's largest set.) With ``delta > 0`` the ceiling stops growing with the number of
    canaries, and eventually falls: the theorem's delta term grows with ``m``.

    Example::

        epsilon_lower_bound_ceiling(1000, delta=1e-5)   # about 5.2
        epsilon_lower_bound_ceiling(100, delta=1e-5)    # about 2.8
    """
    fn = "epsilon_lower_bound_ceiling"
    num_canaries = check_count(fn, "num_canaries", num_canaries, minimum=1)
    delta = check_delta(fn, delta)
    significance = check_significance(fn, significance)
    pairs = _guesses(fn, guesses, num_canaries)
    corrected = significance / len(pairs)
    best = 0.0
    for num_guesses in sorted({num_in + num_out for num_in, num_out in pairs}, reverse=True):
        best = _largest_rejected_epsilon(
            num_canaries, num_guesses, num_guesses, corrected, delta, at_least=best
        )
    return best
