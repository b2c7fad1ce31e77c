"""pergrad.dp's audit statistics: the one-run bound against the paper's formula, its soundness
on mechanisms of known epsilon, the classic bounds against brute force, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pergrad import dp

pytest.importorskip("scipy", reason="the audit statistics use scipy.stats")

# --- an independent reference: Theorem 3 of Steinke, Nasr & Jagielski (2023) ----------------


def binomial_tail(num_guesses: int, num_correct: int, q: float) -> float:
    """P[Bin(r, q) >= v] summed term by term in log space (no scipy)."""
    if num_correct <= 0:
        return 1.0
    total = 0.0
    for j in range(num_correct, num_guesses + 1):
        log_term = (
            math.lgamma(num_guesses + 1)
            - math.lgamma(j + 1)
            - math.lgamma(num_guesses - j + 1)
            + (j * math.log(q) if j else 0.0)
            + ((num_guesses - j) * math.log1p(-q) if num_guesses - j else 0.0)
        )
        total += math.exp(log_term)
    return total


def paper_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """f(v) + 2 m delta max_{i in 1..m} (f(v - i) - f(v)) / i, f(v) = P[Bin(r, q) >= v]."""
    q = math.exp(epsilon) / (1.0 + math.exp(epsilon))
    tail = binomial_tail(r, v, q)
    worst = max((binomial_tail(r, v - i, q) - tail) / i for i in range(1, m + 1))
    return min(tail + 2 * m * delta * worst, 1.0)


def paper_bound(m: int, r: int, v: int, significance: float, delta: float) -> float:
    """The largest epsilon on a fine bisection whose p-value is <= significance (0 if none)."""
    if paper_p_value(m, r, v, 0.0, delta) > significance:
        return 0.0
    low, high = 0.0, 64.0
    for _ in range(80):
        middle = (low + high) / 2
        if paper_p_value(m, r, v, middle, delta) <= significance:
            low = middle
        else:
            high = middle
    return low


def guess_outcome(in_scores, out_scores, num_in: int, num_out: int) -> tuple[int, int]:
    """(guesses, right guesses) from a plain sort of distinct scores."""
    pooled = sorted([(s, 1) for s in in_scores] + [(s, 0) for s in out_scores])
    bottom, top = pooled[:num_out], pooled[len(pooled) - num_in :] if num_in else []
    right = sum(label for _, label in top) + sum(1 - label for _, label in bottom)
    return num_in + num_out, right


def shifted_scores(rng, m: int, shift: float):
    included = rng.random(m) < 0.5
    scores = rng.normal(size=m) + shift * included
    return scores[included], scores[~included]


# --- the one-run bound ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "m, shift, num_in, num_out, delta",
    [
        (60, 3.0, 20, 20, 0.0),
        (60, 3.0, 20, 20, 1e-3),
        (120, 1.5, 30, 0, 1e-4),
        (200, 4.0, 90, 90, 1e-5),
        (90, 0.5, 10, 40, 0.0),
    ],
)
def test_one_pair_matches_the_papers_formula(m, shift, num_in, num_out, delta):
    in_scores, out_scores = shifted_scores(np.random.default_rng(m), m, shift)
    r, v = guess_outcome(in_scores, out_scores, num_in, num_out)
    expected = paper_bound(m, r, v, 0.05, delta)
    bound = dp.epsilon_lower_bound(in_scores, out_scores, delta=delta, guesses=(num_in, num_out))
    assert bound == pytest.approx(expected, abs=1e-6)


def test_p_value_matches_the_papers_formula():
    for m, r, v, epsilon, delta in [(100, 50, 40, 1.0, 1e-3), (300, 300, 290, 3.0, 1e-5)]:
        expected = paper_p_value(m, r, v, epsilon, delta)
        assert dp.one_run_p_value(m, r, v, epsilon, delta) == pytest.approx(expected, rel=1e-9)


def test_default_grid_is_the_best_pair_at_bonferroni_corrected_significance():
    m = 150
    in_scores, out_scores = shifted_scores(np.random.default_rng(5), m, 2.5)
    grid = dp.guess_grid(m)
    expected = max(
        paper_bound(m, *guess_outcome(in_scores, out_scores, a, b), 0.05 / len(grid), 1e-5)
        for a, b in grid
    )
    assert expected > 0.5  # the test exercises a real bound
    assert dp.epsilon_lower_bound(in_scores, out_scores, delta=1e-5) == pytest.approx(
        expected, abs=1e-6
    )
    searched = dp.epsilon_lower_bound(in_scores, out_scores, delta=1e-5, guesses=grid)
    assert searched == pytest.approx(expected, abs=1e-9)


def test_guess_grid_depends_on_the_count_only():
    assert dp.guess_grid(1000) == [
        (20, 0),
        (20, 20),
        (50, 50),
        (100, 0),
        (100, 100),
        (200, 200),
        (300, 300),
        (400, 400),
        (450, 450),
    ]
    assert dp.guess_grid(1) == [(1, 0)]
    assert all(1 <= a + b <= 7 for a, b in dp.guess_grid(7))


def test_ties_are_broken_against_the_auditor():
    # Every score equal: no guess may count as right thanks to the tie-break.
    tied_in, tied_out = np.zeros(30), np.zeros(30)
    assert dp.epsilon_lower_bound(tied_in, tied_out, delta=0.0, guesses=(15, 15)) == 0.0
    # Reference: with ties the "in" guesses land on excluded canaries first.
    in_scores = np.array([1.0, 1.0, 1.0, 5.0])
    out_scores = np.array([1.0, 1.0, 0.0, 0.0])
    r, v = 4, 1 + 2  # top 2: 5.0 (in) and a tied 1.0 counted as excluded; bottom 2: both out
    expected = paper_bound(8, r, v, 0.5, 0.0)
    bound = dp.epsilon_lower_bound(
        in_scores, out_scores, delta=0.0, significance=0.5, guesses=(2, 2)
    )
    assert bound == pytest.approx(expected, abs=1e-6)


def scores_with_right_guesses(num_canaries: int, num_guesses: int, right: int):
    """Scores whose top ``num_guesses`` hold exactly ``right`` included canaries."""
    in_scores = np.concatenate([10.0 + np.arange(right), [-1e9]])  # one never guessed
    out_scores = np.concatenate(
        [5.0 + np.arange(num_guesses - right), -np.arange(num_canaries - num_guesses - 1.0)]
    )
    return in_scores, out_scores


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=10, max_value=120),
    st.data(),
    st.sampled_from([0.0, 1e-5, 1e-3]),
)
def test_more_right_guesses_never_lower_the_bound(num_guesses, data, delta):
    num_canaries = num_guesses + data.draw(st.integers(2, 50))
    fewer = data.draw(st.integers(0, num_guesses - 1))
    more = data.draw(st.integers(fewer + 1, num_guesses))
    for epsilon in (0.3, 1.0, 3.0):
        low = dp.one_run_p_value(num_canaries, num_guesses, fewer, epsilon, delta)
        high = dp.one_run_p_value(num_canaries, num_guesses, more, epsilon, delta)
        assert high <= low + 1e-12
    bounds = [
        dp.epsilon_lower_bound(
            *scores_with_right_guesses(num_canaries, num_guesses, right),
            delta=delta,
            guesses=(num_guesses, 0),
        )
        for right in (fewer, more)
    ]
    assert bounds[1] >= bounds[0] - 1e-9


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=2, max_value=400),
    st.floats(min_value=0.0, max_value=20.0),
    st.sampled_from([0.0, 1e-5, 1e-2]),
    st.sampled_from([0.01, 0.05, 0.3]),
    st.integers(0, 2**32 - 1),
)
def test_bound_never_exceeds_the_ceiling_of_the_guesses_made(m, shift, delta, significance, seed):
    rng = np.random.default_rng(seed)
    included = np.arange(m) < max(1, min(m - 1, rng.binomial(m, 0.5)))
    scores = rng.normal(size=m) + shift * included
    in_scores, out_scores = scores[included], scores[~included]
    grid = dp.guess_grid(m)
    bound = dp.epsilon_lower_bound(in_scores, out_scores, delta, significance)
    # All r guesses right and no delta term: q^r <= significance / G.
    largest = max(a + b for a, b in grid)
    q = (significance / len(grid)) ** (1 / largest)
    assert bound <= max(0.0, math.log(q / (1 - q))) + 1e-6
    assert bound <= dp.epsilon_lower_bound_ceiling(m, delta, significance) + 1e-6


def test_ceiling_is_reached_by_perfect_separation_and_grows_with_canaries():
    m = 1000
    in_scores, out_scores = 100.0 + np.arange(500), -np.arange(500.0)
    ceiling = dp.epsilon_lower_bound_ceiling(m, delta=1e-5)
    assert dp.epsilon_lower_bound(in_scores, out_scores, delta=1e-5) == pytest.approx(ceiling)
    assert 4.5 < ceiling < 5.5
    assert dp.epsilon_lower_bound_ceiling(100, delta=1e-5) < dp.epsilon_lower_bound_ceiling(
        200, delta=1e-5
    )


def test_no_signal_gives_no_bound_at_the_stated_rate():
    # Scores independent of membership: every epsilon >= 0 holds, so a bound above 0 is a
    # false alarm, which must happen in at most `significance` of the runs.
    rng = np.random.default_rng(0)
    false_alarms = sum(
        dp.epsilon_lower_bound(*shifted_scores(rng, 200, 0.0), delta=1e-5, significance=0.2) > 0
        for _ in range(200)
    )
    assert false_alarms <= 0.2 * 200


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_sound_and_nearly_tight_on_randomized_response(epsilon):
    # Each canary's score is its membership bit, flipped with probability 1 / (1 + e^eps):
    # exactly eps-DP per canary, the mechanism the theorem's binomial describes.
    rng = np.random.default_rng(int(epsilon * 10))
    bounds = []
    for _ in range(100):
        included = rng.random(1000) < 0.5
        flipped = rng.random(1000) < 1 / (1 + math.exp(epsilon))
        scores = (included ^ flipped) + 1e-3 * rng.random(1000)  # continuous, no ties
        bounds.append(dp.epsilon_lower_bound(scores[included], scores[~included], delta=0.0))
    bounds = np.array(bounds)
    assert (bounds > epsilon).mean() <= 0.05
    assert np.median(bounds) > 0.6 * epsilon  # and it is not vacuous


def test_accepts_lists_and_framework_arrays():
    in_scores, out_scores = shifted_scores(np.random.default_rng(3), 200, 3.0)
    expected = dp.epsilon_lower_bound(in_scores, out_scores, delta=1e-5)
    assert dp.epsilon_lower_bound(list(in_scores), list(out_scores), 1e-5) == expected
    torch = pytest.importorskip("torch", reason="torch tensors as scores")
    as_torch = dp.epsilon_lower_bound(
        torch.tensor(in_scores, requires_grad=True), torch.tensor(out_scores), delta=1e-5
    )
    assert as_torch == expected
    jnp = pytest.importorskip("jax.numpy", reason="JAX arrays as scores")
    as_jax = dp.epsilon_lower_bound(jnp.asarray(in_scores), jnp.asarray(out_scores), 1e-5)
    single = (in_scores.astype(np.float32), out_scores.astype(np.float32))  # JAX's default
    assert as_jax == dp.epsilon_lower_bound(*single, 1e-5)


# --- many runs: Clopper-Pearson --------------------------------------------------------------


def clopper_pearson_upper(successes: int, trials: int, alpha: float) -> float:
    """The p with P[Bin(trials, p) <= successes] = alpha, by bisection (no scipy)."""
    if successes >= trials:
        return 1.0
    low, high = successes / trials, 1.0
    for _ in range(100):
        middle = (low + high) / 2
        at_most = 1.0 - binomial_tail(trials, successes + 1, middle)
        low, high = (middle, high) if at_most > alpha else (low, middle)
    return low


def test_clopper_pearson_matches_a_direct_computation():
    rng = np.random.default_rng(4)
    in_scores, out_scores = rng.normal(size=80) + 2.5, rng.normal(size=70)
    threshold, delta = 1.2, 1e-5
    fn = int((in_scores < threshold).sum())
    fp = int((out_scores >= threshold).sum())
    fnr_up = clopper_pearson_upper(fn, 80, 0.025)
    fpr_up = clopper_pearson_upper(fp, 70, 0.025)
    expected = max(
        math.log((1 - fnr_up - delta) / fpr_up), math.log((1 - fpr_up - delta) / fnr_up), 0.0
    )
    bound = dp.epsilon_lower_bound_clopper_pearson(
        in_scores, out_scores, delta=delta, threshold=threshold
    )
    assert expected > 0.5
    assert bound == pytest.approx(expected, abs=1e-6)


def test_clopper_pearson_search_is_the_best_threshold_at_corrected_significance():
    rng = np.random.default_rng(6)
    in_scores, out_scores = rng.normal(size=40) + 3.0, rng.normal(size=40)
    thresholds = [*np.unique(np.concatenate([in_scores, out_scores])), math.inf]
    expected = max(
        dp.epsilon_lower_bound_clopper_pearson(
            in_scores, out_scores, significance=0.05 / len(thresholds), threshold=t
        )
        for t in thresholds
    )
    assert dp.epsilon_lower_bound_clopper_pearson(in_scores, out_scores) == pytest.approx(expected)


def test_clopper_pearson_is_sound_on_randomized_response():
    epsilon = 1.0
    rng = np.random.default_rng(7)
    alarms = 0
    for _ in range(100):
        flip = 1 / (1 + math.exp(epsilon))
        in_scores = (rng.random(500) >= flip) * 1.0
        out_scores = (rng.random(500) < flip) * 1.0
        alarms += dp.epsilon_lower_bound_clopper_pearson(in_scores, out_scores) > epsilon
    assert alarms <= 5


# --- descriptive statistics --------------------------------------------------------------------


def test_auroc_is_the_share_of_pairs_won():
    rng = np.random.default_rng(8)
    in_scores = np.round(rng.normal(size=50) + 1, 1)  # rounded: ties count one half
    out_scores = np.round(rng.normal(size=60), 1)
    won = sum((a > b) + 0.5 * (a == b) for a in in_scores for b in out_scores)
    assert dp.auroc(in_scores, out_scores) == pytest.approx(won / (50 * 60))
    assert dp.auroc([3.0, 2.0], [1.0, 2.0]) == 0.875


def test_tpr_at_fpr_is_the_best_threshold_within_the_fpr():
    rng = np.random.default_rng(9)
    in_scores, out_scores = rng.normal(size=100) + 1.5, rng.normal(size=200)
    for fpr in (0.0, 0.01, 0.1, 0.5, 1.0):
        best = max(
            (in_scores >= t).mean()
            for t in [*in_scores, *out_scores, math.inf]
            if (out_scores >= t).sum() <= fpr * 200
        )
        assert dp.tpr_at_fpr(in_scores, out_scores, fpr) == pytest.approx(best)


# --- bad input ---------------------------------------------------------------------------------

GOOD = (np.array([1.0, 2.0, 3.0]), np.array([0.0, 0.5]))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda: dp.epsilon_lower_bound(np.ones((2, 2)), GOOD[1], 1e-5),
            ValueError,
            "in_scores must be 1-D",
        ),
        (lambda: dp.epsilon_lower_bound(GOOD[0], [], 1e-5), ValueError, "out_scores is empty"),
        (
            lambda: dp.epsilon_lower_bound([1.0, math.nan], GOOD[1], 1e-5),
            ValueError,
            "nan at index 1",
        ),
        (
            lambda: dp.epsilon_lower_bound(["a"], GOOD[1], 1e-5),
            TypeError,
            "in_scores must be real numbers",
        ),
        (lambda: dp.epsilon_lower_bound(*GOOD, delta=1.0), ValueError, "delta must be in [0, 1)"),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, delta="0"),
            TypeError,
            "delta must be a real number, got str",
        ),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, 0.0, significance=0.0),
            ValueError,
            "significance must be in (0, 1)",
        ),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, 0.0, guesses=(3, 3)),
            ValueError,
            "<= 5 (the number of canaries); got (3, 3)",
        ),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, 0.0, guesses=(0, 0)),
            ValueError,
            "1 <= num_in_guesses",
        ),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, 0.0, guesses=[(1, 1), (1,)]),
            TypeError,
            "got (1,) in it",
        ),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, 0.0, guesses="all"),
            TypeError,
            "guesses must be a pair",
        ),
        (
            lambda: dp.epsilon_lower_bound(*GOOD, 0.0, guesses=(1.5, 1)),
            TypeError,
            "guesses must be a pair",
        ),
        (lambda: dp.epsilon_lower_bound(GOOD[0], object(), 0.0), TypeError, "out_scores"),
        (
            lambda: dp.one_run_p_value(10, 5, 6, 1.0, 0.0),
            ValueError,
            "need num_correct <= num_guesses <= num_canaries; got 6, 5, 10",
        ),
        (
            lambda: dp.one_run_p_value(10, 5, 2, None, 0.0),
            TypeError,
            "one_run_p_value: epsilon must be a real number, got NoneType",
        ),
        (lambda: dp.guess_grid(0), ValueError, "num_canaries must be >= 1, got 0"),
        (
            lambda: dp.epsilon_lower_bound_ceiling(10.0),
            TypeError,
            "num_canaries must be an int, got float",
        ),
        (
            lambda: dp.epsilon_lower_bound_clopper_pearson(*GOOD, threshold="x"),
            TypeError,
            "threshold must be a real number",
        ),
        (
            lambda: dp.epsilon_lower_bound_clopper_pearson(*GOOD, significance=2),
            ValueError,
            "significance must be in (0, 1)",
        ),
        (
            lambda: dp.tpr_at_fpr(*GOOD, fpr=1.5),
            ValueError,
            "tpr_at_fpr: fpr must be in [0, 1], got 1.5",
        ),
        (lambda: dp.auroc(GOOD[0], [[1.0]]), ValueError, "auroc: out_scores must be 1-D"),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)
