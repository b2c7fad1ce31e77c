"""Correlated noise (matrix-factorisation DP-FTRL): ``pergrad.dp.toeplitz``, ``blt`` and
``optimal_blt``.

References, independent of the code under test:
- closed forms: DP-SGD is ``toeplitz([1.0])`` (``M = I``, sensitivity ``sqrt(participations)``,
  max error ``steps``); ``M C = I``; the errors from dense matrices; the sensitivity by brute
  force over every participation pattern of small runs;
- jax-privacy 2.0.0, live (``pytest.importorskip("jax_privacy")``; it is in the ``dev`` extra):
  its Toeplitz inverse, min-sep sensitivity and per-query error, its BLT coefficients, inverse,
  closed-form sensitivity and max error, and its streaming noising matrices run on our draws.
  Its BLT optimiser takes 25-45 s per run, so the tests compare with numbers it printed
  (labelled below; one of them is rerun live, for one buffer count, in about 9 s);
- the streaming noise a training loop adds, DPOptimizer (torch) and optax_aggregate under
  ``jax.jit``, equals ``M @ z`` computed densely from the same draws, and its empirical
  covariance over many coordinates is ``(noise_multiplier * max_norm * sensitivity)^2 M M^T``;
- accounting: one ``dp_accounting.GaussianDpEvent`` and the analytic Gaussian mechanism.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pergrad import dp

pytest.importorskip("scipy")

# A BLT that jax-privacy 2.0.0's optimiser returned for 64 steps (see JAX_PRIVACY_OPTIMA).
BLT64 = ([0.9842298634927619, 0.7270931425682697], [0.1706081571013166, 0.3102560932438474])


def _mechanisms(steps, participations=1, min_separation=None):
    run = {"steps": steps, "participations": participations, "min_separation": min_separation}
    return [
        dp.toeplitz([1.0, 0.6, 0.3, 0.1], **run),
        dp.toeplitz([2.0, 0.5], **run),
        dp.blt(*BLT64, **run),
        dp.blt([0.9, 0.5, 0.0], [0.2, 0.15, 0.1], **run),
    ]


# --- closed forms ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "participations", "min_separation"), [(1, 1, None), (7, 1, None), (12, 3, 4)]
)
def test_dp_sgd_is_toeplitz_one(steps, participations, min_separation):
    mech = dp.toeplitz(
        [1.0], steps=steps, participations=participations, min_separation=min_separation
    )
    assert mech.num_buffers == 0
    np.testing.assert_array_equal(mech.noising_matrix(), np.eye(steps))
    assert mech.sensitivity() == pytest.approx(math.sqrt(participations), rel=1e-15)
    assert mech.max_error() == pytest.approx(steps, rel=1e-15)
    assert dp.blt([], [], steps=steps).noising_matrix() == pytest.approx(np.eye(steps))


@pytest.mark.parametrize("mech", _mechanisms(9), ids=repr)
def test_noising_matrix_is_the_inverse_of_the_strategy(mech):
    strategy, noising = mech.strategy_matrix(), mech.noising_matrix()
    np.testing.assert_allclose(noising @ strategy, np.eye(9), atol=1e-12)
    np.testing.assert_array_equal(noising, np.tril(noising))


def test_blt_strategy_is_the_stated_toeplitz():
    decays, scales = [0.9, 0.5, 0.0], [0.2, 0.15, 0.1]
    first = [1.0] + [
        sum(s * d ** (i - 1) for d, s in zip(decays, scales, strict=True)) for i in range(1, 8)
    ]
    want = np.array([[first[i - j] if i >= j else 0.0 for j in range(8)] for i in range(8)])
    got = dp.blt(decays, scales, steps=8).strategy_matrix()
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_banded_toeplitz_is_banded():
    strategy = dp.toeplitz([1.0, 0.5, 0.25], steps=6).strategy_matrix()
    assert np.count_nonzero(np.tril(strategy, -3)) == 0
    assert np.count_nonzero(np.tril(strategy)) == 6 + 5 + 4


@pytest.mark.parametrize("mech", _mechanisms(8), ids=repr)
def test_max_error_is_the_largest_prefix_sum_row_norm(mech):
    prefix_sums = np.tril(np.ones((8, 8))) @ mech.noising_matrix()
    assert mech.max_error() == pytest.approx(np.max(np.sum(prefix_sums**2, axis=1)), rel=1e-12)


def _patterns(steps, participations, min_separation):
    """Every set of at most ``participations`` steps, pairwise at least ``min_separation``
    apart."""
    for count in range(1, participations + 1):
        for steps_taken in itertools.combinations(range(steps), count):
            if all(b - a >= min_separation for a, b in itertools.pairwise(steps_taken)):
                yield steps_taken


def _brute_force_sensitivity(strategy, participations, min_separation):
    best = 0.0
    for pattern in _patterns(strategy.shape[0], participations, min_separation):
        best = max(best, np.linalg.norm(strategy[:, list(pattern)].sum(axis=1)))
    return best


@pytest.mark.parametrize(
    ("participations", "min_separation"), [(1, None), (2, None), (2, 3), (3, 2), (3, 3)]
)
def test_sensitivity_is_the_worst_participation_pattern(participations, min_separation):
    rng = np.random.default_rng(0)
    random_decreasing = np.sort(rng.uniform(0, 1, 5))[::-1] * np.array([3, 1, 1, 1, 1])
    for mech in [
        *_mechanisms(9, participations, min_separation),
        dp.toeplitz(random_decreasing, steps=9, participations=participations,
                    min_separation=min_separation),
    ]:  # fmt: skip
        want = _brute_force_sensitivity(mech.strategy_matrix(), participations, min_separation or 1)
        assert mech.sensitivity() == pytest.approx(want, rel=1e-12), mech


def test_one_participation_takes_any_coefficients():
    mech = dp.toeplitz([1.0, -2.0, 0.5, 3.0], steps=6)
    want = np.max(np.linalg.norm(mech.strategy_matrix(), axis=0))
    assert mech.sensitivity() == pytest.approx(want, rel=1e-15)


def test_rising_coefficients_are_refused_with_several_participations():
    # Why the check: for C's first column (1, 0, 1) the earliest pattern {0, 1} gives
    # ||C u||^2 = 3, but {0, 2} gives 5.
    strategy = dp.toeplitz([1.0, 0.0, 1.0], steps=3).strategy_matrix()
    assert _brute_force_sensitivity(strategy, 2, 1) ** 2 == pytest.approx(5.0)
    with pytest.raises(ValueError, match=r"toeplitz: .*strategy_coefs give coefficients"):
        dp.toeplitz([1.0, 0.0, 1.0], steps=3, participations=2)
    with pytest.raises(ValueError, match=r"blt: .*buffer_decays and output_scales"):
        dp.blt([0.5], [-0.3], steps=5, participations=2)


# --- jax-privacy 2.0.0, live -------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_privacy():
    pytest.importorskip("jax_privacy")
    from jax_privacy import matrix_factorization

    return matrix_factorization


@pytest.mark.parametrize(
    ("coefs", "steps", "participations", "min_separation"),
    [([1.0, 0.6, 0.3, 0.1], 20, 1, None), ([1.0, 0.6, 0.3, 0.1], 20, 4, 5),
     ([1.0, 0.5], 30, 3, 1), ([0.9, 0.8, 0.7, 0.2, 0.1], 24, 3, 8)],
)  # fmt: skip
def test_toeplitz_matches_jax_privacy(jax_privacy, coefs, steps, participations, min_separation):
    import jax.numpy as jnp

    toeplitz = jax_privacy.toeplitz
    mech = dp.toeplitz(
        coefs, steps=steps, participations=participations, min_separation=min_separation
    )
    coefs32 = jnp.asarray(coefs)  # jax-privacy computes in float32 here
    np.testing.assert_allclose(
        mech.noising_coefs(), toeplitz.inverse_coef(coefs32, steps), rtol=2e-5, atol=1e-6
    )
    sensitivity_squared = toeplitz.minsep_sensitivity_squared(
        coefs32, min_separation or 1, participations, n=steps
    )
    assert mech.sensitivity() ** 2 == pytest.approx(float(sensitivity_squared), rel=1e-6)
    error = jnp.max(toeplitz.per_query_error(strategy_coef=coefs32, n=steps))
    assert mech.max_error() == pytest.approx(float(error), rel=1e-5)


@pytest.mark.parametrize(
    ("decays", "scales"), [BLT64, ([0.9, 0.5, 0.2], [0.2, 0.15, 0.1]), ([0.99], [0.4])]
)
def test_blt_matches_jax_privacy(jax_privacy, decays, scales):
    import jax

    bt = jax_privacy.buffered_toeplitz
    steps = 64
    mech = dp.blt(decays, scales, steps=steps)
    with jax.enable_x64(True):
        theirs = bt.BufferedToeplitz.build(buf_decay=decays, output_scale=scales)
        strategy = np.asarray(theirs.toeplitz_coefs(steps))
        noising = np.asarray(theirs.inverse().toeplitz_coefs(steps))
        sensitivity_squared = float(bt.sensitivity_squared(theirs, steps))  # closed form
        error = float(bt.max_error(theirs.inverse(), steps))  # closed form
    np.testing.assert_allclose(mech.strategy_coefs(), strategy, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(mech.noising_coefs(), noising, rtol=1e-9, atol=1e-12)
    assert mech.sensitivity() ** 2 == pytest.approx(sensitivity_squared, rel=1e-10)
    assert mech.max_error() == pytest.approx(error, rel=1e-9)


def _unit_noise_jax(mech, steps, shape, seed):
    """Our streamed noise per unit of std * sensitivity, and the draws z it came from."""
    import jax
    import jax.numpy as jnp

    state = mech.init(jnp.zeros(shape))
    key = jax.random.key(seed)
    noise, draws = [], []
    for _ in range(steps):
        key, step_key = jax.random.split(key)
        noisy, state = mech.add(jnp.zeros(shape), 1.0 / mech.sensitivity(), step_key, state)
        noise.append(np.asarray(noisy))
        draws.append(np.asarray(jax.random.normal(jax.random.split(step_key, 1)[0], shape)))
    return np.stack(noise), np.stack(draws)


def test_streaming_matches_jax_privacys_streaming_matrices(jax_privacy):
    import jax
    import jax.numpy as jnp

    streaming = jax_privacy.streaming_matrix
    steps, shape = 16, (3, 2)
    cases = [
        (dp.toeplitz([1.0, 0.6, 0.3], steps=steps),
         lambda: jax_privacy.toeplitz.inverse_as_streaming_matrix(jnp.asarray([1.0, 0.6, 0.3]))),
        (dp.blt(*BLT64, steps=steps),
         lambda: jax_privacy.buffered_toeplitz.BufferedToeplitz.build(
             buf_decay=BLT64[0], output_scale=BLT64[1]).inverse_as_streaming_matrix()),
    ]  # fmt: skip
    for mech, theirs in cases:
        ours, draws = _unit_noise_jax(mech, steps, shape, seed=3)
        with jax.enable_x64(True):
            want = streaming.multiply_array(theirs(), jnp.asarray(draws, jnp.float64))
        np.testing.assert_allclose(ours, np.asarray(want), rtol=1e-5, atol=1e-5)


# jax-privacy 2.0.0's output, not ours: buffered_toeplitz.optimize(n=..., min_sep=...,
# max_participations=...) under jax.enable_x64() (25-45 s each on 2 CPU cores; it chose 2
# buffers every time), its loss by LossFn.loss (the closed form for one participation,
# build_min_sep otherwise). test_optimal_blt_matches_jax_privacy_live reruns the second with
# its 2 buffers.
JAX_PRIVACY_OPTIMA = {
    (64, 1, None): 5.718498701755307,  # buf_decay [0.98423, 0.72709]
    (60, 3, 20): 22.828145161347333,  # buf_decay [0.99999998, 0.86896]
    (200, 1, None): 7.6467701175226,  # buf_decay [0.99346, 0.82871]
}


@pytest.mark.parametrize(("steps", "participations", "min_separation"), list(JAX_PRIVACY_OPTIMA))
def test_optimal_blt_reaches_jax_privacys_optimum(steps, participations, min_separation):
    mech = dp.optimal_blt(
        steps=steps, participations=participations, min_separation=min_separation, num_buffers=2
    )
    loss = mech.sensitivity() ** 2 * mech.max_error()
    assert loss <= JAX_PRIVACY_OPTIMA[steps, participations, min_separation] * (1 + 1e-5)
    assert np.all(np.diff(mech.strategy_coefs()) <= 0) and np.all(mech.strategy_coefs() > 0)


def test_optimal_blt_loss_is_jax_privacys_loss_of_it(jax_privacy):
    import jax

    bt = jax_privacy.buffered_toeplitz
    mech = dp.optimal_blt(steps=60, participations=3, min_separation=20, num_buffers=2)
    with jax.enable_x64(True):
        theirs = bt.BufferedToeplitz.build(
            buf_decay=mech.buffer_decays, output_scale=mech.output_scales
        )
        loss = bt.LossFn.build_min_sep(n=60, min_sep=20, max_participations=3).loss(theirs)
    assert mech.sensitivity() ** 2 * mech.max_error() == pytest.approx(float(loss), rel=1e-9)


def test_optimal_blt_chooses_its_buffers():
    chosen = dp.optimal_blt(steps=64)
    loss = chosen.sensitivity() ** 2 * chosen.max_error()
    assert loss <= JAX_PRIVACY_OPTIMA[64, 1, None] * (1 + 1e-5)
    dp_sgd = dp.optimal_blt(steps=64, num_buffers=0)
    assert dp_sgd.num_buffers == 0 and dp_sgd.max_error() == pytest.approx(64)


@pytest.mark.slow(reason="jax-privacy's optimiser, one buffer count: about 9 s on 2 CPU cores")
def test_optimal_blt_matches_jax_privacy_live(jax_privacy):
    import jax

    bt = jax_privacy.buffered_toeplitz
    with jax.enable_x64(True):
        loss_fn = bt.LossFn.build_min_sep(n=60, min_sep=20, max_participations=3)
        _, their_loss = bt.optimize_loss(loss_fn, num_buffers=2)
    assert float(their_loss) == pytest.approx(JAX_PRIVACY_OPTIMA[60, 3, 20], rel=1e-9)
    mech = dp.optimal_blt(steps=60, participations=3, min_separation=20, num_buffers=2)
    assert mech.sensitivity() ** 2 * mech.max_error() <= float(their_loss) * (1 + 1e-5)


def test_jax_privacys_column_normalised_plan_scales_by_the_wrong_norm(jax_privacy):
    """jax-privacy's BandMFExecutionPlanConfig(column_normalize=True) noises with
    ``stddev = noise_multiplier * ||strategy||`` although column normalisation makes every
    column of C of norm 1 (sensitivity 1 for one participation): right only when the given
    coefficients have norm 1 (as its optimiser returns them), too little noise when their norm
    is below 1. pergrad does not column-normalise: the sensitivity is computed from C as
    given."""
    import jax.numpy as jnp

    coefs = jnp.asarray([0.5, 0.25])  # norm 0.56
    normalised_inverse = jax_privacy.toeplitz.inverse_as_streaming_matrix(
        coefs, column_normalize_for_n=8
    ).materialize(8)
    column_norms = np.linalg.norm(np.linalg.inv(np.asarray(normalised_inverse)), axis=0)
    np.testing.assert_allclose(column_norms, 1.0, rtol=1e-5)  # sensitivity 1, not 0.56
    mech = dp.toeplitz([0.5, 0.25], steps=8)
    assert mech.sensitivity() == pytest.approx(float(np.linalg.norm(coefs)), rel=1e-6)


# --- the streaming noise of a training loop ---------------------------------------------------


def _torch_zero_gradient_loop(mech, steps, shape, noise_multiplier=0.7, max_norm=2.0, seed=5):
    """The gradients DPOptimizer hands SGD in each of ``steps`` steps on a loss whose gradient
    is zero (so they are pure noise, divided by expected_batch_size=1), and the draws z of
    its generator, in the same order."""
    torch = pytest.importorskip("torch")

    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Parameter(torch.zeros(shape))
            self.second = torch.nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return x * 0 * (self.first.sum() + self.second.sum())

    model = Bias()
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        lambda output, target: (output * target).sum(),
        max_norm=max_norm,
        noise_multiplier=noise_multiplier,
        expected_batch_size=1,
        generator=torch.Generator().manual_seed(seed),
        strategy="chunked",  # no ghost rule for this toy module
        noise=mech,
    )
    x, y = torch.ones(2, 1), torch.ones(2, 1)
    noise = {"first": [], "second": []}
    for _ in range(steps):
        optimizer.step(x, y)
        for name, param in model.named_parameters():
            noise[name].append(param.grad.detach().clone().numpy())
    generator = torch.Generator().manual_seed(seed)
    draws = {"first": [], "second": []}
    for _ in range(steps):
        for name, param in model.named_parameters():  # the clipped sums' order
            draws[name].append(torch.randn(param.shape, generator=generator).numpy())
    return optimizer, {k: np.stack(v) for k, v in noise.items()}, draws


@pytest.mark.parametrize("mech", _mechanisms(6)[::2] + _mechanisms(6)[3:], ids=repr)
def test_dp_optimizer_adds_m_times_z(mech):
    _, noise, draws = _torch_zero_gradient_loop(mech, 6, (4, 2))
    scale = 0.7 * 2.0 * mech.sensitivity()
    for name in noise:
        z = np.stack(draws[name]).reshape(6, -1)
        want = scale * mech.noising_matrix() @ z
        np.testing.assert_allclose(noise[name].reshape(6, -1), want, rtol=1e-5, atol=1e-5)


def test_dp_optimizer_refuses_a_step_past_the_run():
    torch = pytest.importorskip("torch")
    optimizer, _, _ = _torch_zero_gradient_loop(dp.blt(*BLT64, steps=3), 3, (2,))
    before = {k: v.detach().clone() for k, v in optimizer.model.named_parameters()}
    with pytest.raises(ValueError, match="BLTNoise.add: .*steps=3, and step 4"):
        optimizer.step(torch.ones(2, 1), torch.ones(2, 1))
    for name, value in optimizer.model.named_parameters():
        torch.testing.assert_close(value.detach(), before[name], rtol=0, atol=0)


def test_toeplitz_one_draws_what_gaussian_draws():
    torch = pytest.importorskip("torch")
    summed = {"a": torch.zeros(5), "b": torch.zeros(2, 3)}
    mech = dp.toeplitz([1.0], steps=2)
    got, _ = mech.add(summed, 1.5, torch.Generator().manual_seed(1), mech.init(summed))
    want, _ = dp.gaussian().add(summed, 1.5, torch.Generator().manual_seed(1), ())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert float(summed["a"].abs().sum()) == 0.0  # not owned: not written


def test_noise_covariance_is_sigma_squared_m_m_transpose():
    """Over 20000 zero-gradient coordinates, the empirical covariance of the steps' noise is
    ``(noise_multiplier * max_norm * sensitivity)^2 M M^T`` within 5 standard errors of each
    entry (the seeds are fixed, so the check is deterministic)."""
    mech = dp.optimal_blt(steps=5, participations=2, min_separation=2, num_buffers=2)
    _, noise, _ = _torch_zero_gradient_loop(mech, 5, (100, 200), noise_multiplier=1.3)
    samples = noise["first"].reshape(5, -1)
    count = samples.shape[1]
    empirical = samples @ samples.T / count
    noising = mech.noising_matrix()
    want = (1.3 * 2.0 * mech.sensitivity()) ** 2 * noising @ noising.T
    standard_error = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / count)
    assert np.all(np.abs(empirical - want) <= 5 * standard_error), (empirical, want)
    assert np.abs(want[np.triu_indices(5, 1)]).max() > 10 * standard_error.max()  # correlated


def _optax_loop(mech, steps, seed=11, noise_multiplier=0.6, max_norm=1.5):
    import jax
    import jax.numpy as jnp

    params = {"b": jnp.zeros(3), "w": jnp.zeros((4, 2))}
    tx = dp.optax_aggregate(max_norm, noise_multiplier, seed, expected_batch_size=1, noise=mech)
    state = tx.init(params)
    zero_grads = jax.tree.map(lambda p: jnp.zeros((2, *p.shape)), params)
    update = jax.jit(tx.update)
    noise = []
    for _ in range(steps):
        updates, state = update(zero_grads, state)
        noise.append(jax.tree.map(np.asarray, updates))
    key, draws = jax.random.key(seed), []
    for _ in range(steps):
        key, noise_key = jax.random.split(key)
        leaf_keys = jax.random.split(noise_key, 2)  # the leaves in jax.tree order: b, w
        draws.append(
            {
                name: np.asarray(jax.random.normal(leaf_key, params[name].shape))
                for name, leaf_key in zip(("b", "w"), leaf_keys, strict=True)
            }
        )
    return noise, draws, state


@pytest.mark.parametrize("mech", _mechanisms(5)[1:3], ids=repr)
def test_optax_aggregate_under_jit_adds_m_times_z(mech):
    pytest.importorskip("optax")
    noise, draws, state = _optax_loop(mech, 5)
    assert int(state.noise_state.step) == 5
    scale = 0.6 * 1.5 * mech.sensitivity()
    for name in ("b", "w"):
        z = np.stack([d[name] for d in draws]).reshape(5, -1)
        got = np.stack([n[name] for n in noise]).reshape(5, -1)
        np.testing.assert_allclose(got, scale * mech.noising_matrix() @ z, rtol=1e-5, atol=1e-5)


def test_optax_aggregate_under_jit_makes_a_step_past_the_run_nan():
    pytest.importorskip("optax")
    noise, _, state = _optax_loop(dp.toeplitz([1.0, 0.5], steps=2), 3)
    assert all(np.all(np.isfinite(leaf)) for step in noise[:2] for leaf in step.values())
    assert all(np.all(np.isnan(leaf)) for leaf in noise[2].values())
    assert int(state.noise_state.step) == 3


def test_jax_outside_jit_refuses_a_step_past_the_run():
    jax = pytest.importorskip("jax")

    mech = dp.toeplitz([1.0], steps=1)
    summed = {"w": jax.numpy.zeros(3)}
    _, state = mech.add(summed, 1.0, jax.random.key(0), mech.init(summed))
    with pytest.raises(ValueError, match="ToeplitzNoise.add: .*steps=1, and step 2"):
        mech.add(summed, 1.0, jax.random.key(1), state)


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: dp.blt([0.9, -0.1], [0.1, 0.1], steps=5), "buffer_decays must be in"),
        (lambda: dp.blt([1.5], [0.1], steps=5), "buffer_decays must be in"),
        (lambda: dp.blt([0.9, 0.5], [0.1], steps=5), "buffer_decays and output_scales must"),
        (lambda: dp.blt([0.9], [math.nan], steps=5), "output_scales must be finite"),
        (lambda: dp.toeplitz([1.0, 0.5, 0.2], steps=2), "strategy_coefs must have between"),
        (lambda: dp.toeplitz([], steps=2), "strategy_coefs must have between"),
        (lambda: dp.toeplitz([[1.0]], steps=2), "strategy_coefs must be 1-D"),
        (lambda: dp.toeplitz([0.0, 1.0], steps=2), r"strategy_coefs\[0\] must be > 0"),
        (lambda: dp.toeplitz([1.0], steps=0), "steps must be >= 1"),
        (lambda: dp.blt([0.5], [0.1], steps=0), "steps must be >= 1"),
        (lambda: dp.optimal_blt(steps=0), "steps must be >= 1"),
        (lambda: dp.toeplitz([1.0], steps=5, participations=0), "participations must be >= 1"),
        (lambda: dp.toeplitz([1.0], steps=5, participations=6), "participations=6 steps"),
        (lambda: dp.blt([], [], steps=9, participations=3, min_separation=5),
         "participations=3 steps at least min_separation=5 apart do not fit in steps=9"),
        (lambda: dp.toeplitz([1.0], steps=5, min_separation=0), "min_separation must be >= 1"),
        (lambda: dp.optimal_blt(steps=9, participations=4, min_separation=3), "participations"),
        (lambda: dp.optimal_blt(steps=9, num_buffers=11), "num_buffers must be at most 10"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(make, argument):
    with pytest.raises(ValueError, match=argument):
        make()


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: dp.toeplitz("1.0", steps=2), "strategy_coefs must be a sequence"),
        (lambda: dp.blt([0.5], ["x"], steps=2), "output_scales must be a sequence"),
        (lambda: dp.toeplitz([1.0], steps=2.5), "steps must be an int"),
    ],
)
def test_bad_types_name_the_argument(make, argument):
    with pytest.raises(TypeError, match=argument):
        make()


def test_mechanisms_compare_by_value():
    assert dp.toeplitz([1.0, 0.5], steps=4) == dp.toeplitz(np.array([1.0, 0.5]), steps=4)
    assert dp.toeplitz([1.0, 0.5], steps=4) != dp.toeplitz([1.0, 0.5], steps=5)
    assert dp.blt(*BLT64, steps=4) != dp.toeplitz([1.0], steps=4)
    assert hash(dp.blt(*BLT64, steps=4)) == hash(dp.blt(*BLT64, steps=4))
    assert "participations=2, min_separation=3" in repr(
        dp.blt(*BLT64, steps=9, participations=2, min_separation=3)
    )


# --- accounting ----------------------------------------------------------------------------------


def _analytic_gaussian_delta(epsilon, noise_multiplier):
    """delta(epsilon) of the Gaussian mechanism with sensitivity 1 (Balle & Wang 2018)."""
    from scipy.stats import norm

    a = 1 / (2 * noise_multiplier)
    b = epsilon * noise_multiplier
    return norm.cdf(a - b) - math.exp(epsilon) * norm.cdf(-a - b)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_of_a_mechanism_is_one_gaussian_release(accountant):
    dpa = pytest.importorskip("dp_accounting")
    mech = dp.blt(*BLT64, steps=64, participations=2, min_separation=32)
    got = dp.epsilon(noise_multiplier=3.0, delta=1e-5, noise=mech, accountant=accountant)
    fresh = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    assert got == fresh.compose(dpa.GaussianDpEvent(3.0)).get_epsilon(1e-5)
    if accountant == "pld":  # the exact curve: delta at this epsilon is 1e-5
        assert _analytic_gaussian_delta(got, 3.0) == pytest.approx(1e-5, rel=0.02)
    # the same whatever the strategy and the run: the sensitivity is in the noise
    assert got == dp.epsilon(3.0, delta=1e-5, noise=dp.toeplitz([1.0], steps=3),
                             accountant=accountant)  # fmt: skip


def test_noise_multiplier_for_a_mechanism_inverts_epsilon():
    pytest.importorskip("dp_accounting")
    mech = dp.toeplitz([1.0, 0.5], steps=100)
    sigma = dp.noise_multiplier_for(target_epsilon=2.0, delta=1e-5, noise=mech)
    assert dp.epsilon(noise_multiplier=sigma, delta=1e-5, noise=mech) <= 2.0
    assert dp.epsilon(noise_multiplier=sigma - 1e-3, delta=1e-5, noise=mech) > 2.0
    same = dp.noise_multiplier_for(target_epsilon=2.0, delta=1e-5, steps=100, noise=mech)
    assert same == sigma


@pytest.mark.parametrize("call", ["epsilon", "noise_multiplier_for", "Accountant"])
def test_accounting_refuses_a_run_that_disagrees_with_the_mechanism(call):
    pytest.importorskip("dp_accounting")
    mech = dp.toeplitz([1.0, 0.5], steps=100)
    functions = {
        "epsilon": lambda **kw: dp.epsilon(noise_multiplier=1.0, delta=1e-5, noise=mech, **kw),
        "noise_multiplier_for": lambda **kw: dp.noise_multiplier_for(
            target_epsilon=1.0, delta=1e-5, noise=mech, **kw
        ),
        "Accountant": lambda **kw: dp.Accountant(1.0, delta=1e-5, noise=mech, **kw),
    }
    with pytest.raises(ValueError, match=f"{call}: sample_rate=0.01 disagrees with noise="):
        functions[call](sample_rate=0.01)
    if call != "Accountant":
        with pytest.raises(ValueError, match=f"{call}: steps=50 disagrees .*steps=100"):
            functions[call](steps=50)
    with pytest.raises(ValueError, match=f"{call}: sampling='fixed' does not apply"):
        functions[call](sampling="fixed", num_examples=1000)


def test_accounting_without_a_mechanism_still_needs_the_run():
    pytest.importorskip("dp_accounting")
    with pytest.raises(TypeError, match="epsilon: sample_rate must be .*NoneType.* required"):
        dp.epsilon(noise_multiplier=1.0, steps=10, delta=1e-5)
    with pytest.raises(TypeError, match="epsilon: steps must be an int.* required with noise"):
        dp.epsilon(noise_multiplier=1.0, sample_rate=0.1, delta=1e-5)
    with pytest.raises(TypeError, match="Accountant: delta is required"):
        dp.Accountant(1.0, 0.1)
    # the positional calls of before are unchanged
    assert dp.epsilon(1.1, 0.01, 100, 1e-5) == dp.epsilon(
        noise_multiplier=1.1, sample_rate=0.01, steps=100, delta=1e-5
    )


def test_accountant_of_a_mechanism_covers_its_run():
    pytest.importorskip("dp_accounting")
    mech = dp.optimal_blt(steps=4, num_buffers=1)
    accountant = dp.Accountant(2.0, delta=1e-5, noise=mech)
    assert accountant.sample_rate is None and accountant.epsilon() == 0.0
    accountant.step()
    whole_run = dp.epsilon(noise_multiplier=2.0, delta=1e-5, noise=mech)
    assert accountant.epsilon() == whole_run
    accountant.step(3)
    assert accountant.epsilon() == whole_run
    with pytest.raises(ValueError, match="Accountant.step: .*steps=4, and 4 \\+ 1 steps"):
        accountant.step()


def test_dp_optimizer_takes_the_accountant_of_an_equal_mechanism():
    torch = pytest.importorskip("torch")
    pytest.importorskip("dp_accounting")
    model = torch.nn.Linear(2, 1)
    accountant = dp.Accountant(1.0, delta=1e-5, noise=dp.toeplitz([1.0, 0.5], steps=10))
    dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, torch.nn.functional.mse_loss,
        max_norm=1.0, noise_multiplier=1.0, accountant=accountant,
        noise=dp.toeplitz([1.0, 0.5], steps=10),
    )  # fmt: skip
    with pytest.raises(ValueError, match="the accountant accounts for"):
        dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, torch.nn.functional.mse_loss,
            max_norm=1.0, noise_multiplier=1.0, accountant=accountant,
            noise=dp.toeplitz([1.0, 0.5], steps=11),
        )  # fmt: skip
