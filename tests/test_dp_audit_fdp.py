"""The f-DP refinement of the one-run audit (issue 17): ``epsilon_lower_bound(...,
method="f-dp")``, which audits the Gaussian trade-off curve of an ``(epsilon, delta)`` claim
(Mahloujifar et al. 2024).

Checked against dp-accounting's Gaussian-mechanism calibration (an independent library), for
soundness by simulating the worst case the claim allows (each canary's score moved by exactly
the claim's ``mu``, Gaussian noise), and for power against the assumption-free one-run bound.
"""

from __future__ import annotations

import numpy as np
import pytest

dp_accounting = pytest.importorskip("dp_accounting", reason="the reference calibration")
pytest.importorskip("scipy", reason="the audit's binomial tails")

from pergrad import dp  # noqa: E402
from pergrad._src.dp.audit import gaussian_mu  # noqa: E402

DELTA = 1e-5


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 3.0, 8.0])
def test_gaussian_mu_matches_dp_accounting(epsilon):
    sigma = dp_accounting.get_sigma_gaussian(epsilon, DELTA)  # sensitivity 1
    assert gaussian_mu(epsilon, DELTA) == pytest.approx(1.0 / sigma, rel=1e-4)


def canary_scores(mu, seed, num_canaries=1000):
    """One run of the worst mechanism a mu-GDP claim allows: an included canary's score is
    shifted by mu, every score has unit Gaussian noise; fair coins."""
    rng = np.random.default_rng(seed)
    included = rng.random(num_canaries) < 0.5
    scores = rng.standard_normal(num_canaries) + mu * included
    return scores[included], scores[~included]


def test_sound_on_the_worst_mechanism_the_claim_allows():
    claim = 2.0
    mu = gaussian_mu(claim, DELTA)
    bounds = [
        dp.epsilon_lower_bound(*canary_scores(mu, seed), delta=DELTA, method="f-dp")
        for seed in range(30)
    ]
    # At significance 0.05 at most a few of 30 runs may exceed the claim (Binomial(30, 0.05)
    # exceeds 4 with probability 0.6%); the audit is conservative, so typically none does.
    assert sum(bound > claim for bound in bounds) <= 4
    assert max(bounds) > 0  # the attack is informative: the bounds are not all trivial


def test_more_powerful_than_the_one_run_bound_and_catches_a_leak():
    claim = 2.0
    leaky = 4 * gaussian_mu(claim, DELTA)  # trains with a quarter of the claimed noise
    one_run, f_dp = [], []
    for seed in range(5):
        in_scores, out_scores = canary_scores(leaky, seed)
        one_run.append(dp.epsilon_lower_bound(in_scores, out_scores, delta=DELTA))
        f_dp.append(dp.epsilon_lower_bound(in_scores, out_scores, delta=DELTA, method="f-dp"))
    assert np.mean(f_dp) > np.mean(one_run)
    assert min(f_dp) > claim  # every run refutes the claim


def test_bad_method_and_zero_delta_are_named():
    in_scores, out_scores = canary_scores(1.0, 0, num_canaries=100)
    with pytest.raises(ValueError, match="method must be 'one-run' or 'f-dp'"):
        dp.epsilon_lower_bound(in_scores, out_scores, delta=DELTA, method="fdp")
    with pytest.raises(ValueError, match="method='f-dp' needs delta > 0"):
        dp.epsilon_lower_bound(in_scores, out_scores, delta=0.0, method="f-dp")
