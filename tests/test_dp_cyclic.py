"""Cyclic Poisson sampling and the amplified accounting of banded Toeplitz noise:
``pergrad.dp.toeplitz(..., min_separation=, sample_rate=)``, ``cyclic_poisson_batches`` and
``CyclicPoissonBatchSampler``.

References, independent of the code under test:
- jax-privacy 2.0.0, live (``pytest.importorskip("jax_privacy")``): its training accountant
  for BandMF with cyclic Poisson sampling (``DpsgdTrainingAccountant`` with ``cycle_length``,
  RDP and PLD), its ``amplified_bandmf_event``, its BandMF execution plan (the noise multiplier
  it calibrates, the noise it adds) and its ``CyclicPoissonSampling`` batches (to show that the
  statistical checks below accept the reference sampler);
- closed forms: the sensitivity is the largest column norm of the dense strategy matrix; the
  DP event is DP-SGD's with ``ceil(steps / min_separation)`` steps, composed here by hand in
  ``dp_accounting``; ``toeplitz([1.0], min_separation=1, sample_rate=q)`` is DP-SGD;
- the sampler's statistics against the binomial laws of the sampling (fixed seeds; thresholds
  set so that each check would fail with probability below about 1e-6 over random seeds).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pergrad import dp
from pergrad._src.errors import PergradTypeError, PergradValueError

pytest.importorskip("scipy")

FALSE_ALARM = 1e-6


def two_sided_z(alpha: float) -> float:
    """z with P(|N(0, 1)| > z) = alpha."""
    from scipy.stats import norm

    return float(norm.isf(alpha / 2))


# --- the sampler's statistics ----------------------------------------------------------------


def groups_seen(batches, num_examples: int, min_separation: int) -> np.ndarray:
    """The group of each example read off the batches (the residue ``t % min_separation`` of
    the steps it is in; -1 if never sampled); fails if an example is in two residues."""
    group = np.full(num_examples, -1)
    for step, batch in enumerate(batches):
        residue = step % min_separation
        clash = batch[(group[batch] != -1) & (group[batch] != residue)]
        assert clash.size == 0, f"examples {clash[:5]} in steps of two groups"
        group[batch] = residue
    return group


def assert_cyclic_poisson(batches, num_examples: int, sample_rate: float, min_separation: int):
    """Checks cyclic Poisson sampling: each example only in the steps of one group, the groups
    a uniform independent split, and within its group's steps each example drawn
    independently with probability ``sample_rate``. ``len(batches)`` must be a multiple of
    ``min_separation`` and large enough that every example is drawn at least once.

    1. one residue per example (:func:`groups_seen`);
    2. the group sizes, Multinomial(N, 1/b): each within z sigma (Bonferroni over the b);
    3. each example's count, Binomial(T / b, q): max |z| (Bonferroni over N) and the
       chi-square of the z-scores (Wilson-Hilferty), as in test_dp_sampling;
    4. within a group, the batch size is Binomial(n_g, q): the pooled ratio of the sample
       variance to n_g q (1 - q) is 1 within z sqrt(2 / T) (fixed-size batches fail).
    """
    steps = len(batches)
    assert steps % min_separation == 0
    visits = steps // min_separation
    group = groups_seen(batches, num_examples, min_separation)
    assert np.all(group >= 0), "an example never drawn: raise steps"

    sizes = np.bincount(group, minlength=min_separation)
    mean, std = (
        num_examples / min_separation,
        math.sqrt(num_examples / min_separation * (1 - 1 / min_separation)),
    )
    if min_separation > 1:
        worst = np.abs(sizes - mean).max() / std
        assert worst < two_sided_z(FALSE_ALARM / min_separation), f"group sizes {sizes}"

    counts = np.bincount(np.concatenate(batches), minlength=num_examples)
    mean, std = visits * sample_rate, math.sqrt(visits * sample_rate * (1 - sample_rate))
    z_scores = (counts - mean) / std
    assert np.abs(z_scores).max() < two_sided_z(FALSE_ALARM / num_examples), "an example's rate"
    chi2 = float(np.sum(z_scores**2))
    wh_mean, wh_std = 1 - 2 / (9 * num_examples), math.sqrt(2 / (9 * num_examples))
    wh_z = ((chi2 / num_examples) ** (1 / 3) - wh_mean) / wh_std
    assert abs(wh_z) < two_sided_z(FALSE_ALARM), f"chi2 {chi2:.1f} with {num_examples} dof"

    batch_sizes = np.array([len(batch) for batch in batches]).reshape(visits, min_separation)
    ratios = batch_sizes.var(axis=0, ddof=1) / (sizes * sample_rate * (1 - sample_rate))
    ratio = float(ratios.mean())
    assert abs(ratio - 1) < two_sided_z(FALSE_ALARM) * math.sqrt(2 / steps), f"ratio {ratio}"


def numpy_batches(num_examples, sample_rate, min_separation, steps, seed):
    return list(dp.cyclic_poisson_batches(num_examples, sample_rate, min_separation, steps, seed))


def torch_batches(num_examples, sample_rate, min_separation, steps, seed):
    torch = pytest.importorskip("torch")
    sampler = dp.CyclicPoissonBatchSampler(
        num_examples, sample_rate, min_separation, steps, torch.Generator().manual_seed(seed)
    )
    return [np.asarray(batch, dtype=np.int64) for batch in sampler]


SAMPLERS = {"numpy": numpy_batches, "torch": torch_batches}


@pytest.mark.parametrize("framework", SAMPLERS)
def test_cyclic_batches_have_the_cyclic_poisson_law(framework):
    batches = SAMPLERS[framework](100, 0.25, 4, 1600, 0)
    assert len(batches) == 1600
    assert_cyclic_poisson(batches, 100, 0.25, 4)


def test_the_checks_catch_plain_poisson_and_fixed_size_batches():
    # the references that the checks can fail: Poisson batches of the whole dataset mix the
    # groups; fixed-size batches within each group have the right rate but no size variance
    plain = list(dp.poisson_batches(100, 0.0625, steps=1600, seed=0))
    with pytest.raises(AssertionError, match="two groups"):
        assert_cyclic_poisson(plain, 100, 0.25, 4)
    rng = np.random.default_rng(0)
    members = np.array_split(rng.permutation(100), 4)
    fixed = [np.sort(rng.choice(members[t % 4], 6, replace=False)) for t in range(1600)]
    with pytest.raises(AssertionError, match="ratio"):
        assert_cyclic_poisson(fixed, 100, 0.24, 4)


def test_jax_privacys_cyclic_poisson_sampling_passes_the_checks():
    pytest.importorskip("jax_privacy")
    from jax_privacy import batch_selection

    sampling = batch_selection.CyclicPoissonSampling(
        sampling_prob=0.25,
        iterations=1600,
        cycle_length=4,
        partition_type=batch_selection.PartitionType.INDEPENDENT,
    )
    batches = [np.sort(b).astype(np.int64) for b in sampling.batch_iterator(100, rng=0)]
    assert_cyclic_poisson(batches, 100, 0.25, 4)


@pytest.mark.parametrize("framework", SAMPLERS)
def test_the_batch_size_is_binomial_over_the_split(framework):
    # Over the split and the coins an example is in a batch with probability q / b: the mean
    # size over T batches is N q / b within z sqrt(N q / b (1 - q / b) / T) (fresh splits).
    num_examples, sample_rate, min_separation, steps = 400, 0.3, 3, 6
    sizes = [
        len(batch)
        for seed in range(200)
        for batch in SAMPLERS[framework](num_examples, sample_rate, min_separation, steps, seed)
    ]
    rate = sample_rate / min_separation
    mean = num_examples * rate
    std_of_mean = math.sqrt(num_examples * rate * (1 - rate) / len(sizes))
    assert abs(np.mean(sizes) - mean) < two_sided_z(FALSE_ALARM) * std_of_mean


@settings(max_examples=40, deadline=None)
@given(
    num_examples=st.integers(1, 40),
    sample_rate=st.floats(0.01, 1.0),
    min_separation=st.integers(1, 6),
    steps=st.integers(0, 15),
    seed=st.integers(0, 2**32),
)
@example(num_examples=17, sample_rate=1.0, min_separation=3, steps=7, seed=0)
@example(num_examples=1, sample_rate=0.01, min_separation=6, steps=15, seed=0)  # empty batches
def test_batches_are_in_range_sorted_and_in_one_group_each(
    num_examples, sample_rate, min_separation, steps, seed
):
    batches = numpy_batches(num_examples, sample_rate, min_separation, steps, seed)
    assert len(batches) == steps  # empty batches are yielded like any other
    for batch in batches:
        assert batch.dtype == np.int64 and batch.ndim == 1
        assert np.all(np.diff(batch) > 0)
        assert batch.size == 0 or (batch[0] >= 0 and batch[-1] < num_examples)
    groups_seen(batches, num_examples, min_separation)
    if sample_rate == 1.0 and steps >= min_separation:
        # every example in every step of its group: one round of steps is a partition
        one_round = np.concatenate(batches[:min_separation])
        assert np.array_equal(np.sort(one_round), np.arange(num_examples))


def test_torch_sampler_continues_the_cycle_over_passes_and_shards_partition_it():
    torch = pytest.importorskip("torch")
    # 5 steps a pass, 4 groups: a cycle restarted at each pass would put group 0 in steps 4
    # and 5, one apart
    sampler = dp.CyclicPoissonBatchSampler(60, 0.5, 4, 5, torch.Generator().manual_seed(1))
    passes = [np.asarray(b, dtype=np.int64) for _ in range(4) for b in sampler]
    assert len(sampler) == 5 and len(passes) == 20
    groups_seen(passes, 60, 4)
    # shards: disjoint, each example in the shard of its rank, the union the whole batch
    whole = list(dp.CyclicPoissonBatchSampler(60, 0.5, 4, 8, torch.Generator().manual_seed(2)))
    shards = [
        list(
            dp.CyclicPoissonBatchSampler(
                60, 0.5, 4, 8, torch.Generator().manual_seed(2), num_replicas=3, rank=rank
            )
        )
        for rank in range(3)
    ]
    for step, batch in enumerate(whole):
        parts = [shards[rank][step] for rank in range(3)]
        assert all(i % 3 == rank for rank, part in enumerate(parts) for i in part)
        assert sorted(i for part in parts for i in part) == batch


def test_samplers_take_the_run_from_the_mechanism():
    torch = pytest.importorskip("torch")
    mech = dp.toeplitz([1.0, 0.5], steps=9, min_separation=3, sample_rate=0.2)
    assert len(list(dp.cyclic_poisson_batches(50, noise=mech, seed=0))) == 9
    given_too = dp.cyclic_poisson_batches(50, 0.2, 3, 9, seed=0, noise=mech)
    assert len(list(given_too)) == 9
    sampler = dp.CyclicPoissonBatchSampler(50, noise=mech, generator=torch.Generator())
    assert (sampler.sample_rate, sampler.min_separation, len(sampler)) == (0.2, 3, 9)
    assert sampler.expected_batch_size == pytest.approx(50 * 0.2 / 3, rel=1e-15)


# --- the mechanism ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "coefs", [[1.0], [1.0, 0.6, 0.3], [2.0, 0.5], [1.0, 1.5, -0.2, 0.7]], ids=repr
)
def test_sensitivity_with_sample_rate_is_the_largest_column_norm(coefs):
    # one participation's column: any coefficients (rising or negative too), since the
    # participations touch disjoint rows and the accounting composes them
    mech = dp.toeplitz(coefs, steps=10, min_separation=4, sample_rate=0.1)
    columns = np.linalg.norm(mech.strategy_matrix(), axis=0)
    assert mech.sensitivity() == pytest.approx(columns.max(), rel=1e-14)
    assert mech.sensitivity() == pytest.approx(math.sqrt(sum(c * c for c in coefs)), rel=1e-14)
    assert mech.participations == 3  # ceil(10 / 4): group 0 in steps 0, 4, 8
    assert mech.sample_rate == 0.1 and mech.min_separation == 4


def test_streaming_noise_is_scaled_by_one_column_norm():
    torch = pytest.importorskip("torch")
    amplified = dp.toeplitz([1.0, 0.5], steps=6, min_separation=2, sample_rate=0.1)
    unamplified = dp.toeplitz([1.0, 0.5], steps=6)  # one participation: the same sensitivity
    zeros = torch.zeros(1000)
    outputs = []
    for mech in (amplified, unamplified):
        state, generator, noisy = mech.init(zeros), torch.Generator().manual_seed(0), []
        for _ in range(6):
            step_noise, state = mech.add(zeros.clone(), 2.0, generator, state)
            noisy.append(step_noise)
        outputs.append(torch.stack(noisy))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="steps=6, and step 7 was asked for"):
        amplified.add(zeros, 2.0, torch.Generator(), state)


def test_mechanisms_with_and_without_sample_rate_differ():
    run = {"steps": 8, "min_separation": 4}
    assert dp.toeplitz([1.0, 0.5], **run, sample_rate=0.1) == dp.toeplitz(
        [1.0, 0.5], **run, sample_rate=0.1
    )
    assert dp.toeplitz([1.0, 0.5], **run, sample_rate=0.1) != dp.toeplitz([1.0, 0.5], **run)
    assert dp.toeplitz([1.0, 0.5], **run, sample_rate=0.1) != dp.toeplitz(
        [1.0, 0.5], **run, sample_rate=0.2
    )
    assert "sample_rate=0.1" in repr(dp.toeplitz([1.0, 0.5], **run, sample_rate=0.1))


# --- the accounting: closed forms --------------------------------------------------------------


def _dp_sgd_epsilon(dpa, accountant, noise_multiplier, sample_rate, steps, delta):
    """DP-SGD's epsilon composed by hand in dp_accounting (add-or-remove-one neighbours)."""
    fresh = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    step = dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier))
    return fresh.compose(step, steps).get_epsilon(delta)


@pytest.mark.parametrize(
    ("accountant", "steps", "min_separation"),
    [("rdp", 200, 1), ("rdp", 200, 4), ("rdp", 203, 4), ("rdp", 3, 5), ("pld", 203, 4)],
)
def test_epsilon_is_dp_sgds_with_one_step_per_round(accountant, steps, min_separation):
    dpa = pytest.importorskip("dp_accounting")
    coefs = [1.0, 0.5, 0.25][:min_separation]
    mech = dp.toeplitz(coefs, steps=steps, min_separation=min_separation, sample_rate=0.05)
    got = dp.epsilon(noise_multiplier=1.2, delta=1e-6, noise=mech, accountant=accountant)
    rounds = -(-steps // min_separation)
    want = _dp_sgd_epsilon(dpa, accountant, 1.2, 0.05, rounds, 1e-6)
    assert got == pytest.approx(want, rel=1e-12)
    if min_separation == 1:  # toeplitz([1.0], min_separation=1, sample_rate=q) is DP-SGD
        dp_sgd = dp.epsilon(1.2, 0.05, steps, 1e-6, accountant=accountant)
        assert got == pytest.approx(dp_sgd, rel=1e-12)


def test_accountant_counts_the_rounds_so_far():
    dpa = pytest.importorskip("dp_accounting")
    mech = dp.toeplitz([1.0, 0.5], steps=10, min_separation=3, sample_rate=0.1)
    accountant = dp.Accountant(2.0, delta=1e-5, noise=mech)
    assert accountant.sample_rate == 0.1 and accountant.epsilon() == 0.0
    for steps, rounds in [(1, 1), (3, 1), (4, 2), (10, 4)]:
        accountant.step(steps - accountant.steps)
        want = _dp_sgd_epsilon(dpa, "rdp", 2.0, 0.1, rounds, 1e-5)
        assert accountant.epsilon() == pytest.approx(want, rel=1e-12)
    with pytest.raises(PergradValueError, match="Accountant.step: .*steps=10, and 10 \\+ 1"):
        accountant.step()


def test_noise_multiplier_for_inverts_the_amplified_epsilon():
    pytest.importorskip("dp_accounting")
    mech = dp.toeplitz([1.0, 0.5], steps=400, min_separation=4, sample_rate=0.05)
    sigma = dp.noise_multiplier_for(target_epsilon=2.0, delta=1e-5, noise=mech)
    assert dp.epsilon(noise_multiplier=sigma, delta=1e-5, noise=mech) <= 2.0
    assert dp.epsilon(noise_multiplier=sigma - 1e-3, delta=1e-5, noise=mech) > 2.0
    # amplification: the same strategy and participations without sampling need more noise
    plain = dp.toeplitz([1.0, 0.5], steps=400, participations=100, min_separation=4)
    assert dp.noise_multiplier_for(target_epsilon=2.0, delta=1e-5, noise=plain) > sigma


# --- the accounting: jax-privacy 2.0.0 ---------------------------------------------------------

JAX_PRIVACY_RUNS = [
    # (strategy_coefs, steps, min_separation (= jax-privacy's cycle_length), sample_rate, sigma)
    ([1.0, 0.6, 0.3, 0.1], 1000, 4, 0.01, 1.5),
    ([1.0, 0.5], 1001, 2, 0.02, 0.9),
    ([1.0], 500, 1, 0.005, 0.7),
    ([1.0, 0.4, 0.2], 250, 8, 0.1, 2.5),
]


@pytest.fixture(scope="module")
def jax_privacy():
    pytest.importorskip("jax_privacy")
    from jax_privacy.accounting import accountants, analysis
    from jax_privacy.experimental import accounting

    return accountants, analysis, accounting


@pytest.mark.parametrize(
    ("accountant", "run"),
    # PLD takes seconds at small noise multipliers: the two runs of larger ones
    [("rdp", run) for run in JAX_PRIVACY_RUNS] + [("pld", JAX_PRIVACY_RUNS[i]) for i in (0, 3)],
    ids=lambda value: value if isinstance(value, str) else f"{len(value[0])}bands",
)
def test_epsilon_matches_jax_privacys_training_accountant(jax_privacy, accountant, run):
    coefs, steps, min_separation, rate, sigma = run
    dpa = pytest.importorskip("dp_accounting")
    accountants, analysis, accounting = jax_privacy
    mech = dp.toeplitz(coefs, steps=steps, min_separation=min_separation, sample_rate=rate)
    got = dp.epsilon(noise_multiplier=sigma, delta=1e-6, noise=mech, accountant=accountant)
    # jax-privacy's training accountant: q = batch_size / (num_samples // cycle_length)
    group_size = 10_000
    params = analysis.DpParams(
        noise_multipliers=sigma,
        num_samples=group_size * min_separation,
        delta=1e-6,
        batch_size=round(rate * group_size),
        cycle_length=min_separation,
    )
    config = {"rdp": accountants.RdpAccountantConfig, "pld": accountants.PldAccountantConfig}
    theirs = analysis.DpsgdTrainingAccountant(config[accountant]()).compute_epsilon(steps, params)
    # PLD: the same event and discretisation, so equal up to rounding; RDP: jax-privacy's
    # own grid of orders, a different minimum over orders (agreeing to 1% on these runs)
    assert got == pytest.approx(theirs, rel=1e-9 if accountant == "pld" else 1e-2)
    if accountant == "rdp":  # jax-privacy's event, in dp_accounting's default orders: exact
        event = accounting.amplified_bandmf_event(
            sigma, steps, num_bands=min_separation, sampling_prob=rate
        )
        assert got == pytest.approx(dpa.rdp.RdpAccountant().compose(event).get_epsilon(1e-6))


def _band_mf_plan(coefs, steps, sampling_prob, **kwargs):
    import dp_accounting as dpa
    from jax_privacy import batch_selection
    from jax_privacy.experimental import execution_plan

    config = execution_plan.BandMFExecutionPlanConfig(
        iterations=steps,
        strategy=np.asarray(coefs),
        sampling_prob=sampling_prob,
        partition_type=batch_selection.PartitionType.INDEPENDENT,  # add-or-remove neighbours
        accountant=dpa.rdp.RdpAccountant(),
        **kwargs,
    )
    return config.plan


def test_noise_multiplier_for_matches_jax_privacys_band_mf_plan(jax_privacy):
    coefs, steps, rate = [1.0, 0.6, 0.3], 100, 0.05
    plan = _band_mf_plan(coefs, steps, rate, epsilon=1.0, delta=1e-5)
    theirs = plan.dp_event.event.event.noise_multiplier
    mech = dp.toeplitz(coefs, steps=steps, min_separation=len(coefs), sample_rate=rate)
    ours = dp.noise_multiplier_for(target_epsilon=1.0, delta=1e-5, noise=mech)
    # both calibrate to 1e-4; ours errs on the side of more noise
    assert ours == pytest.approx(theirs, abs=2e-4)
    assert dp.epsilon(noise_multiplier=ours, delta=1e-5, noise=mech) <= 1.0


@pytest.mark.slow(reason="jax-privacy's BandMF plan builds its JAX noise transform: about 3 s")
def test_noise_scale_matches_jax_privacys_band_mf_plan(jax_privacy):
    # jax-privacy adds noise_multiplier * ||strategy|| * M z (unit clipping): at step 0,
    # with strategy_coefs[0] = 1, z0 scaled by noise_multiplier * ||strategy||, our
    # noise_multiplier * sensitivity(). Its empirical std over n coordinates is within
    # z sqrt(1 / (2 n)) of the truth (relative).
    import jax.numpy as jnp

    coefs, sigma, size = [1.0, 0.6, 0.3], 1.5, 200_000
    plan = _band_mf_plan(coefs, 10, 0.05, epsilon=None, delta=None, noise_multiplier=sigma)
    transform = plan.noise_addition_transform
    noisy, _ = transform.update(jnp.zeros(size), transform.init(jnp.zeros(size)))
    mech = dp.toeplitz(coefs, steps=10, min_separation=3, sample_rate=0.05)
    want = sigma * mech.sensitivity()
    got = float(np.std(np.asarray(noisy, dtype=np.float64)))
    assert abs(got / want - 1) < two_sided_z(FALSE_ALARM) * math.sqrt(1 / (2 * size))


# --- misuse and bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: dp.toeplitz([1.0, 0.5], steps=10, sample_rate=0.1),
         "toeplitz: sample_rate=0.1 .*needs min_separation.*got None"),
        (lambda: dp.toeplitz([1.0, 0.5, 0.2], steps=10, min_separation=2, sample_rate=0.1),
         "toeplitz: sample_rate .*at most min_separation=2 coefficients.*strategy_coefs has 3"),
        (lambda: dp.toeplitz([1.0], steps=10, min_separation=4, sample_rate=0.0),
         "toeplitz: sample_rate must be in \\(0, 1\\]"),
        (lambda: dp.toeplitz([1.0], steps=10, min_separation=4, sample_rate=1.5),
         "toeplitz: sample_rate must be in \\(0, 1\\]"),
        (lambda: dp.toeplitz([1.0], steps=10, participations=2, min_separation=4,
                             sample_rate=0.1),
         "= 3; participations=2 says otherwise"),
        (lambda: dp.toeplitz([1.0], steps=10, min_separation=0, sample_rate=0.1),
         "min_separation must be >= 1"),
    ],
)  # fmt: skip
def test_bad_mechanisms_name_the_argument(make, message):
    with pytest.raises(PergradValueError, match=message):
        make()


def test_bad_sample_rate_type_names_the_argument():
    with pytest.raises(PergradTypeError, match="toeplitz: sample_rate must be a real number"):
        dp.toeplitz([1.0], steps=10, min_separation=4, sample_rate="0.1")


def test_accounting_refuses_a_run_that_disagrees_with_the_mechanism():
    pytest.importorskip("dp_accounting")
    mech = dp.toeplitz([1.0, 0.5], steps=100, min_separation=2, sample_rate=0.05)
    with pytest.raises(PergradValueError, match="epsilon: steps=50 disagrees .*steps=100"):
        dp.epsilon(noise_multiplier=1.0, delta=1e-5, noise=mech, steps=50)
    with pytest.raises(PergradValueError, match="sample_rate=0.1 disagrees .*is 0.05"):
        dp.noise_multiplier_for(target_epsilon=1.0, delta=1e-5, noise=mech, sample_rate=0.1)
    with pytest.raises(PergradValueError, match="sampling='fixed' does not apply"):
        dp.epsilon(1.0, delta=1e-5, noise=mech, sampling="fixed", num_examples=1000)
    # the same values as the mechanism's are accepted
    assert dp.epsilon(1.0, 0.05, 100, 1e-5, noise=mech) == dp.epsilon(1.0, delta=1e-5, noise=mech)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: dp.cyclic_poisson_batches(10, 0.1, 2), PergradTypeError,
         "cyclic_poisson_batches: steps must be an int, got NoneType"),
        (lambda: dp.cyclic_poisson_batches(10, 0.1, steps=5), PergradTypeError,
         "cyclic_poisson_batches: min_separation must be an int, got NoneType"),
        (lambda: dp.cyclic_poisson_batches(10, min_separation=2, steps=5), PergradTypeError,
         "cyclic_poisson_batches: sample_rate must be a real number, got NoneType"),
        (lambda: dp.cyclic_poisson_batches(0, 0.1, 2, 5), PergradValueError,
         "cyclic_poisson_batches: num_examples must be >= 1"),
        (lambda: dp.cyclic_poisson_batches(10, 0.1, 0, 5), PergradValueError,
         "cyclic_poisson_batches: min_separation must be >= 1"),
        (lambda: dp.cyclic_poisson_batches(10, 1.2, 2, 5), PergradValueError,
         "cyclic_poisson_batches: sample_rate must be in"),
        (lambda: dp.cyclic_poisson_batches(10, 0.1, 2, 5, seed=1.5), PergradTypeError,
         "cyclic_poisson_batches: seed must be an int or None"),
        (lambda: dp.cyclic_poisson_batches(10, noise=dp.toeplitz([1.0], steps=5)),
         PergradValueError, "noise=ToeplitzNoise.* is not accounted for cyclic Poisson"),
        (lambda: dp.cyclic_poisson_batches(10, noise=dp.gaussian()), PergradValueError,
         "noise=GaussianNoise.* is not accounted for cyclic Poisson"),
        (lambda: dp.cyclic_poisson_batches(10, noise="toeplitz"), PergradTypeError,
         "cyclic_poisson_batches: noise must be a noise mechanism"),
        (lambda: dp.cyclic_poisson_batches(
            10, steps=6, noise=dp.toeplitz([1.0], steps=5, min_separation=2, sample_rate=0.1)),
         PergradValueError, "steps=6 disagrees with noise=.*whose steps is 5"),
        (lambda: dp.cyclic_poisson_batches(
            10, 0.2, noise=dp.toeplitz([1.0], steps=5, min_separation=2, sample_rate=0.1)),
         PergradValueError, "sample_rate=0.2 disagrees with noise="),
        (lambda: dp.cyclic_poisson_batches(
            10, min_separation=3,
            noise=dp.toeplitz([1.0], steps=5, min_separation=2, sample_rate=0.1)),
         PergradValueError, "min_separation=3 disagrees with noise="),
    ],
)  # fmt: skip
def test_bad_sampler_input_names_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_bad_torch_sampler_input_names_the_argument():
    torch = pytest.importorskip("torch")
    fn = "CyclicPoissonBatchSampler"
    with pytest.raises(PergradValueError, match=f"{fn}: rank must be in \\[0, num_replicas=2\\)"):
        dp.CyclicPoissonBatchSampler(10, 0.1, 2, 5, num_replicas=2, rank=2)
    with pytest.raises(PergradTypeError, match=f"{fn}: generator must be a torch.Generator"):
        dp.CyclicPoissonBatchSampler(10, 0.1, 2, 5, generator=0)
    with pytest.raises(PergradTypeError, match=f"{fn}: min_separation must be an int, got Non"):
        dp.CyclicPoissonBatchSampler(10, 0.1, steps=5, generator=torch.Generator())
    with pytest.raises(PergradValueError, match=f"{fn}: noise=ToeplitzNoise.* is not accounted"):
        dp.CyclicPoissonBatchSampler(10, noise=dp.toeplitz([1.0, 0.5], steps=5))
