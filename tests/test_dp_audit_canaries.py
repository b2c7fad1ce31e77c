"""pergrad.dp's canaries and auditor: the canaries do what they say, and audited DP-SGD runs on
digits pass when correct and are caught when broken: no noise, no clipping, noise per
micro-batch under gradient accumulation, noise scaled by the realised batch size (JAX and
PyTorch, materialised per-example gradients; 1000 white-box gradient canaries). pergrad's own
DP paths (DPOptimizer, optax_aggregate, private_grad_of) are audited in
test_dp_audit_paths.py."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from pergrad import dp

pytest.importorskip("scipy", reason="the audit statistics use scipy.stats")

# --- gradient canaries ------------------------------------------------------------------------


def template(fw):
    return {"w": fw.array(np.zeros((3, 4))), "b": fw.array(np.zeros(5))}  # 17 parameters


def test_coins_are_fair_and_follow_the_seed_only(fw):
    canaries = dp.GradientCanaries(template(fw), 17, sample_rate=0.5, seed=3)
    again = dp.GradientCanaries(template(fw), 17, sample_rate=0.1, seed=3, norm=9.0)
    assert np.array_equal(canaries.included, again.included)
    many = dp.GradientCanaries(
        {"w": fw.array(np.zeros(4000))}, 4000, sample_rate=0.5, seed=4
    ).num_included
    assert abs(many - 2000) < 4 * math.sqrt(4000) / 2  # Binomial(4000, 1/2)
    assert not np.array_equal(
        canaries.included, dp.GradientCanaries(template(fw), 17, sample_rate=0.5, seed=5).included
    )


def test_each_step_samples_included_canaries_at_the_sample_rate(fw):
    canaries = dp.GradientCanaries({"w": fw.array(np.zeros(400))}, 400, sample_rate=0.1, seed=1)
    joined = np.concatenate([canaries.sampled(step) for step in range(200)])
    assert set(joined) <= set(np.flatnonzero(canaries.included))
    expected = 200 * 0.1 * canaries.num_included
    assert abs(joined.size - expected) < 4 * math.sqrt(expected)
    assert np.array_equal(canaries.sampled(7), canaries.sampled(7))


@pytest.mark.parametrize("directions", ["dirac", "gaussian"])
def test_rows_are_the_sampled_canary_gradients_padded_and_masked(fw, directions):
    canaries = dp.GradientCanaries(
        template(fw), 12, sample_rate=0.5, seed=2, norm=3.0, directions=directions
    )
    step = next(step for step in range(100) if canaries.sampled(step).size)
    ids = canaries.sampled(step)
    rows, mask = canaries.rows(step, pad_to=ids.size + 2)
    w, b = fw.to_numpy(rows["w"]), fw.to_numpy(rows["b"])
    assert w.shape == (ids.size + 2, 3, 4) and b.shape == (ids.size + 2, 5)
    assert fw.to_numpy(mask).tolist() == [True] * ids.size + [False, False]
    flat = np.concatenate([b, w.reshape(len(w), -1)], axis=1)  # order does not matter here
    norms = np.linalg.norm(flat, axis=1)
    np.testing.assert_allclose(norms, [3.0] * ids.size + [0.0, 0.0], rtol=1e-6)
    if directions == "dirac":
        assert ((flat != 0).sum(axis=1) == [1] * ids.size + [0, 0]).all()
    with pytest.raises(ValueError, match=f"samples {ids.size} canaries, more than pad_to"):
        canaries.rows(step, pad_to=ids.size - 1)


def test_inject_appends_the_canaries_as_examples(fw):
    canaries = dp.GradientCanaries(template(fw), 12, sample_rate=0.5, seed=2)
    grads = {"w": fw.array(np.ones((6, 3, 4))), "b": fw.array(np.ones((6, 5)))}
    ids = canaries.sampled(0)
    joined, mask = canaries.inject(grads, np.array([True] * 5 + [False]), 0)
    assert fw.to_numpy(joined["w"]).shape == (6 + ids.size, 3, 4)
    assert fw.to_numpy(mask).tolist() == [True] * 5 + [False] + [True] * ids.size
    rows, _ = canaries.rows(0)
    np.testing.assert_array_equal(fw.to_numpy(joined["b"])[6:], fw.to_numpy(rows["b"]))
    _, no_mask = canaries.inject(grads, None, 0)
    assert fw.to_numpy(no_mask).all()


@pytest.mark.parametrize("directions", ["dirac", "gaussian"])
def test_scores_measure_the_movement_against_each_canary(fw, directions):
    # Plain SGD on the canary gradients alone: final = initial - lr * (sum of injected rows).
    initial = {"w": np.full((3, 4), 0.5), "b": np.full(5, -0.5)}
    params = {"w": fw.array(initial["w"]), "b": fw.array(initial["b"])}
    canaries = dp.GradientCanaries(params, 10, sample_rate=0.3, seed=6, directions=directions)
    times = np.zeros(10)
    moved = {"w": initial["w"].copy(), "b": initial["b"].copy()}
    for step in range(30):
        rows, _ = canaries.rows(step)
        for key in moved:
            moved[key] -= 0.1 * fw.to_numpy(rows[key]).sum(0)
        times[canaries.sampled(step)] += 1
    final = {key: fw.array(value) for key, value in moved.items()}
    units = canaries.unit_directions(np.arange(10))
    expected = 0.1 * units @ units.T @ times  # each canary's pull, seen along every direction
    np.testing.assert_allclose(canaries.scores(final), expected, atol=1e-5)
    assert (times[~canaries.included] == 0).all()
    # A reference run that moved the same way cancels the movement.
    np.testing.assert_allclose(canaries.scores(final, reference=final), 0.0, atol=1e-6)


def test_input_canaries_carry_wrong_labels_and_insert_only_the_included():
    rng = np.random.default_rng(0)
    inputs, labels = rng.normal(size=(3000, 4)), rng.integers(0, 5, 3000)
    canaries = dp.InputCanaries(inputs, labels, num_classes=5, seed=1)
    assert (canaries.labels != labels).all()
    shifts = (canaries.labels - labels) % 5
    assert np.bincount(shifts, minlength=5)[0] == 0
    assert np.bincount(shifts, minlength=5)[1:].min() > 3000 / 4 - 4 * math.sqrt(3000 * 3 / 16)
    x_train, y_train = rng.normal(size=(50, 4)), rng.integers(0, 5, 50)
    x2, y2 = canaries.insert(x_train, y_train)
    assert len(x2) == 50 + canaries.num_included
    np.testing.assert_array_equal(x2[50:], inputs[canaries.included])
    np.testing.assert_array_equal(y2[50:], canaries.labels[canaries.included])
    scores = np.arange(3000.0)
    in_scores, out_scores = canaries.split(scores)
    np.testing.assert_array_equal(in_scores, scores[canaries.included])
    np.testing.assert_array_equal(out_scores, scores[~canaries.included])


def test_audit_reports_the_claim_the_bound_and_the_verdict():
    logging.getLogger("absl").setLevel(logging.ERROR)
    pytest.importorskip("dp_accounting", reason="the claim comes from the accountant")
    canaries = dp.InputCanaries(np.zeros((1000, 2)), np.zeros(1000, int), num_classes=2, seed=0)
    separated = np.where(canaries.included, 10.0, 0.0) + np.arange(1000) * 1e-6
    report = dp.audit(
        lambda c: separated,
        canaries,
        noise_multiplier=2.0,
        sample_rate=0.05,
        steps=100,
        delta=1e-5,
    )
    claimed = dp.epsilon(noise_multiplier=2.0, sample_rate=0.05, steps=100, delta=1e-5)
    assert report.epsilon == pytest.approx(claimed)
    assert report.epsilon_lower_bound == pytest.approx(
        dp.epsilon_lower_bound(*canaries.split(separated), delta=1e-5)
    )
    assert report.violated and report.epsilon_lower_bound > claimed
    assert report.auroc == 1.0
    assert report.num_canaries == 1000 and report.num_included == canaries.num_included
    assert report.ceiling == pytest.approx(dp.epsilon_lower_bound_ceiling(1000, 1e-5))
    assert "VIOLATED" in str(report)
    unrelated = dp.audit(
        lambda c: np.arange(1000.0),
        canaries,
        noise_multiplier=2.0,
        sample_rate=0.05,
        steps=100,
        delta=1e-5,
    )
    assert not unrelated.violated and "not refuted" in str(unrelated)


# --- bad input ---------------------------------------------------------------------------------


def numpy_free_template():
    torch = pytest.importorskip("torch", reason="a torch template")
    return {"w": torch.zeros(4)}


@pytest.mark.parametrize(
    "call, error, words",
    [
        (
            lambda p: dp.GradientCanaries(p, 1, sample_rate=0.1, seed=0),
            ValueError,
            "count must be >= 2, got 1",
        ),
        (
            lambda p: dp.GradientCanaries(p, 5, sample_rate=0.1, seed=0),
            ValueError,
            "needs count <= the number of parameters (4)",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=0.0, seed=0),
            ValueError,
            "sample_rate must be in (0, 1]",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=0.1, seed=-1),
            ValueError,
            "seed must be >= 0",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=0.1, seed=1.5),
            TypeError,
            "seed must be an int, got float",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=0.1, seed=0, norm=0),
            ValueError,
            "norm must be a positive number",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=0.1, seed=0, directions="x"),
            ValueError,
            "directions must be 'dirac' or 'gaussian'",
        ),
        (
            lambda p: dp.GradientCanaries({"w": np.zeros(4)}, 3, sample_rate=0.1, seed=0),
            TypeError,
            "params",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=0.1, seed=0).scores({"w": p["w"][:2]}),
            ValueError,
            "4 numbers; got 2",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=1.0, seed=0).inject(
                {"w": p["w"][None, :2]}, None, 0
            ),
            ValueError,
            "leaf shapes [(4,)]",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=1.0, seed=0).inject(
                {"w": p["w"][None]}, np.ones(3, bool), 0
            ),
            ValueError,
            "mask must have shape (1,)",
        ),
        (
            lambda p: dp.GradientCanaries(p, 3, sample_rate=1.0, seed=0).split([1.0, 2.0]),
            ValueError,
            "shape (3,), in the canaries' order; got shape (2,)",
        ),
        (
            lambda p: dp.InputCanaries(np.zeros((3, 2)), np.zeros(2, int), num_classes=2, seed=0),
            ValueError,
            "true_labels must have shape (count,)",
        ),
        (
            lambda p: dp.InputCanaries(np.zeros((3, 2)), np.zeros(3), num_classes=2, seed=0),
            TypeError,
            "integer class ids",
        ),
        (
            lambda p: dp.InputCanaries(np.zeros((3, 2)), np.full(3, 2), num_classes=2, seed=0),
            ValueError,
            "true_labels must be in [0, 2)",
        ),
        (
            lambda p: dp.InputCanaries(np.zeros((3, 2)), np.zeros(3, int), num_classes=1, seed=0),
            ValueError,
            "num_classes must be >= 2",
        ),
        (
            lambda p: dp.InputCanaries(
                np.zeros((3, 2)), np.zeros(3, int), num_classes=2, seed=0
            ).insert(np.zeros((4, 3)), np.zeros(4)),
            ValueError,
            "x_train must be (N, 2)",
        ),
        (
            lambda p: dp.audit(
                lambda c: None, object(), noise_multiplier=1.0, sample_rate=0.1, steps=1, delta=1e-5
            ),
            TypeError,
            "canaries must be GradientCanaries or InputCanaries",
        ),
    ],
)
def test_bad_input_names_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call(numpy_free_template())
    assert words in str(info.value)


# --- evidence: audited DP-SGD runs on digits --------------------------------------------------
#
# A 64-32-10 MLP (2410 parameters) on scikit-learn's 1797 digits, Poisson sample rate 0.05,
# 100 steps, clip 1, delta 1e-5, DP-SGD written with pergrad's framework-free pieces
# (per-example gradients, ``dp.private_mean`` / ``clipped_sum`` / ``add_noise``). Each audit
# injects 1000 Dirac gradient canaries of norm 1 (100 to test clipping), whose ceiling,
# ``epsilon_lower_bound_ceiling(1000, 1e-5)`` = 5.06, is above every claim below, and scores
# them against one reference run per framework: no canaries, no noise, its own batches, shared
# by the module's audits. The bound only needs the reference to be independent of each audited
# run's coins, noise and batches, which it is; without noise it removes the data's movement
# along the canary directions and adds none of its own. One training run per audit, then.
# The correct runs must stay below their claims; each break must be caught.

SAMPLE_RATE, STEPS, MAX_NORM, LR, HIDDEN, NUM_CANARIES = 0.05, 100, 1.0, 0.5, 32, 1000
MICRO_BATCHES = 64  # the micro-batches of one logical step, for the accumulation break


def digits():
    sklearn_datasets = pytest.importorskip("sklearn.datasets", reason="digits ship with sklearn")
    data = sklearn_datasets.load_digits()
    return (data.data / 16.0).astype(np.float32), data.target


def initial_weights():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(0, 64**-0.5, (64, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, HIDDEN**-0.5, (HIDDEN, 10)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


# The implementations under audit: ``(grads, mask, noise_multiplier, rng, expected_batch_size)
# -> the step's private mean gradient``, for per-example gradients of either framework.


def correct(grads, mask, noise_multiplier, rng, expected_batch_size):
    return dp.private_mean(grads, MAX_NORM, noise_multiplier, rng, expected_batch_size, mask)[0]


def without_clipping(grads, mask, noise_multiplier, rng, expected_batch_size):
    """The break: no clipping, the noise still calibrated to the clipping bound."""
    summed = dp.clipped_sum(grads, 1e9, mask).sum  # a bound no gradient reaches
    noisy = dp.add_noise(summed, noise_multiplier * MAX_NORM, rng)
    return {name: value / expected_batch_size for name, value in noisy.items()}


def noise_over_batch_size(grads, mask, noise_multiplier, rng, expected_batch_size):
    """The break: noise calibrated to the MEAN over the realised batch, added to the SUM.

    The clipped mean over the batch actually drawn, ``sum / |B|``, changes by at most
    ``C / |B|`` when one example comes or goes, so this implementation draws noise of std
    ``sigma * C / |B|``, but adds it to the clipped sum (sensitivity ``C``) before dividing
    by ``q * N``: the noise is ``|B|`` times (here about 115 times) too small. (Dividing a
    correctly noised sum by ``|B|`` instead of ``q * N`` would also be a bug, but a tiny leak:
    it rescales the whole update by ``q * N / |B|``, close to 1, which this audit cannot see.)
    """
    clipped = dp.clipped_sum(grads, MAX_NORM, mask)
    unit = dp.add_noise({name: value * 0 for name, value in clipped.sum.items()}, 1.0, rng)
    std = noise_multiplier * MAX_NORM / clipped.count  # the realised |B|: a traced number
    return {
        name: (value + std * unit[name]) / expected_batch_size
        for name, value in clipped.sum.items()
    }


def noise_per_micro_batch(grads, mask, noise_multiplier, rng, expected_batch_size):
    """The break: gradient accumulation that noises every micro-batch with ``sigma / k``.

    One logical step of ``k = 64`` micro-batches (example ``i`` in micro-batch ``i mod k``);
    each micro-batch's clipped sum gets its own noise draw of std ``(sigma / k) * C`` before
    the sums are accumulated, "so that the k draws add up to the step's noise ``sigma * C``".
    Standard deviations do not add, variances do: the step's noise has std
    ``sigma * C / sqrt(k)``, 8 times too small. (Noising each micro-batch with the full
    ``sigma * C`` would over-noise, ``sqrt(k)`` times: private but wasteful.) All micro-batches
    are computed at once: each example clipped (``dp.clip``), summed by micro-batch, noised.
    """
    clipped = dp.clip(grads, MAX_NORM)
    batch_size = next(iter(grads.values())).shape[0]
    membership = np.arange(batch_size) % MICRO_BATCHES == np.arange(MICRO_BATCHES)[:, None]
    membership = like(membership.astype(np.float32), clipped)
    if mask is not None:  # padding rows belong to no micro-batch
        membership = membership * mask
    micro_sums = {
        name: (membership @ value.reshape(batch_size, -1)).reshape(-1, *value.shape[1:])
        for name, value in clipped.items()
    }  # leaves (k, *param_shape)
    noisy = dp.add_noise(micro_sums, noise_multiplier / MICRO_BATCHES * MAX_NORM, rng)
    return {name: value.sum(0) / expected_batch_size for name, value in noisy.items()}


def like(array, grads):
    """``array`` (numpy) in the framework of ``grads``."""
    leaf = next(iter(grads.values()))
    if type(leaf).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(array)
    import jax.numpy as jnp

    return jnp.asarray(array)


def audit_run(runner, reference, implementation, noise_multiplier, claimed_noise, norm=1.0):
    """``dp.audit`` of one run of ``implementation`` with 1000 canaries, against the shared
    reference (the audited run has its own seed: its own noise and batches)."""
    canaries = dp.GradientCanaries(
        runner.start, NUM_CANARIES, sample_rate=SAMPLE_RATE, seed=7, norm=norm
    )

    def train(canaries):
        final = runner.run(implementation, noise_multiplier, canaries, seed=202)
        return canaries.scores(final, reference=reference)

    return dp.audit(
        train,
        canaries,
        noise_multiplier=claimed_noise,
        sample_rate=SAMPLE_RATE,
        steps=STEPS,
        delta=1e-5,
    )


class JaxDPSGD:
    """DP-SGD in JAX with pergrad: per-example gradients under ``jax.jit``, canaries injected
    on the host, then one jitted step per (implementation, noise multiplier), compiled once
    for the module. Batches and canary rows are padded to one shape each, so nothing
    recompiles. The noise keys are ``rbg`` keys: they compile several times faster than the
    default threefry on the CPU, and are as good a noise source for an audit."""

    def __init__(self):
        jax = pytest.importorskip("jax", reason="the JAX path")
        import pergrad

        self.jax, jnp = jax, jax.numpy
        self.x, self.y = digits()
        self.n = len(self.x)
        self.size = dp.max_batch_size_for(self.n, SAMPLE_RATE)
        self.canary_rows = dp.max_batch_size_for(NUM_CANARIES, SAMPLE_RATE)

        def loss(params, xi, yi):
            hidden = jnp.tanh(xi @ params["w1"] + params["b1"])
            return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[yi]

        self.per_example = jax.jit(pergrad.per_example_grads(loss))
        self.start = self.params()
        self.steps = {}

    def params(self):
        return {k: self.jax.numpy.asarray(v) for k, v in initial_weights().items()}

    def step(self, implementation, noise_multiplier):
        jax = self.jax
        if (implementation, noise_multiplier) not in self.steps:

            @jax.jit
            def step(params, grads, mask, key):
                update = implementation(grads, mask, noise_multiplier, key, SAMPLE_RATE * self.n)
                return jax.tree.map(lambda p, u: p - LR * u, params, update)

            self.steps[implementation, noise_multiplier] = step
        return self.steps[implementation, noise_multiplier]

    def run(self, implementation, noise_multiplier, canaries, seed):
        jax, jnp = self.jax, self.jax.numpy
        step = self.step(implementation, noise_multiplier)
        params, key = self.params(), jax.random.key(seed, impl="rbg")
        for index, batch in enumerate(dp.poisson_batches(self.n, SAMPLE_RATE, STEPS, seed=seed)):
            padded, mask = dp.pad_batch(batch, self.size)
            grads = self.per_example(params, self.x[padded], self.y[padded])
            if canaries is not None:
                grads, mask = canaries.inject(grads, mask, index, pad_to=self.canary_rows)
            else:  # the same shape as with canaries: masked rows of zeros
                pad = self.canary_rows
                grads = {
                    k: jnp.concatenate([g, jnp.zeros((pad, *g.shape[1:]))])
                    for k, g in grads.items()
                }
                mask = np.concatenate([mask, np.zeros(pad, bool)])
            key, noise_key = jax.random.split(key)
            params = step(params, grads, jnp.asarray(mask), noise_key)
        return params


class TorchDPSGD:
    """The same DP-SGD in PyTorch (batches unpadded, noise from a seeded ``torch.Generator``)."""

    def __init__(self):
        torch = pytest.importorskip("torch", reason="the PyTorch path")
        import pergrad

        self.torch = torch
        x, y = digits()
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.n = len(x)

        def loss(params, xi, yi):
            hidden = torch.tanh(xi @ params["w1"] + params["b1"])
            logits = hidden @ params["w2"] + params["b2"]
            return torch.nn.functional.cross_entropy(logits[None], yi[None])

        self.per_example = pergrad.per_example_grads(loss)
        self.start = self.params()

    def params(self):
        return {k: self.torch.from_numpy(v) for k, v in initial_weights().items()}

    def run(self, implementation, noise_multiplier, canaries, seed):
        torch = self.torch
        params, generator = self.params(), torch.Generator().manual_seed(seed)
        for index, batch in enumerate(dp.poisson_batches(self.n, SAMPLE_RATE, STEPS, seed=seed)):
            batch = torch.as_tensor(batch)
            grads, mask = self.per_example(params, self.x[batch], self.y[batch]), None
            if canaries is not None:
                grads, mask = canaries.inject(grads, mask, index)
            update = implementation(grads, mask, noise_multiplier, generator, SAMPLE_RATE * self.n)
            params = {k: params[k] - LR * update[k] for k in params}
        return params


@pytest.fixture(autouse=True)
def _quiet_accounting():
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's skipped RDP orders
    pytest.importorskip("dp_accounting", reason="the claim comes from the accountant")


@pytest.fixture(scope="module")
def jax_dpsgd():
    """The JAX runner and its reference run (no canaries, no noise, seed 101)."""
    runner = JaxDPSGD()
    return runner, runner.run(correct, 0.0, None, seed=101)


@pytest.fixture(scope="module")
def torch_dpsgd():
    """The PyTorch runner and its reference run, on one thread: on a tiny model, torch's
    threads only contend with each other (on a busy 2-core machine, the runs took 5x longer)."""
    torch = pytest.importorskip("torch", reason="the PyTorch path")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = TorchDPSGD()
        yield runner, runner.run(correct, 0.0, None, seed=101)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(params=["jax", "torch"])
def dpsgd(request):
    return request.getfixturevalue(f"{request.param}_dpsgd")


def test_correct_dp_sgd_stays_below_its_claim(dpsgd):
    report = audit_run(*dpsgd, correct, noise_multiplier=1.0, claimed_noise=1.0)  # claim 4.04
    assert report.ceiling > report.epsilon  # 1000 canaries could have refuted the claim
    assert not report.violated, str(report)
    assert report.epsilon_lower_bound < report.epsilon


def test_dp_sgd_without_noise_is_caught(dpsgd):
    report = audit_run(*dpsgd, correct, noise_multiplier=0.0, claimed_noise=2.0)  # claim 1.22
    assert report.violated, str(report)


def test_jax_dp_sgd_without_clipping_is_caught_by_large_canaries(jax_dpsgd):
    report = audit_run(
        *jax_dpsgd, without_clipping, noise_multiplier=2.0, claimed_noise=2.0, norm=100.0
    )  # the noise is there (claim: epsilon 1.22), but a canary moves the model 100x too far
    assert report.violated, str(report)


def test_noise_per_micro_batch_is_caught(dpsgd):
    """Gradient accumulation over 64 micro-batches that noises each with sigma / 64 (see
    ``noise_per_micro_batch``): claimed sigma 2 (epsilon 1.22), actual sigma 2 / 8. Caught by
    1000 canaries (ceiling 5.06)."""
    report = audit_run(*dpsgd, noise_per_micro_batch, noise_multiplier=2.0, claimed_noise=2.0)
    assert report.violated, str(report)


def test_noise_over_the_realised_batch_size_is_caught(dpsgd):
    """Noise calibrated to the mean over the realised Poisson batch but added to the sum (see
    ``noise_over_batch_size``): claimed sigma 2 (epsilon 1.22), actual about 2 / 115. Caught
    by 1000 canaries (ceiling 5.06)."""
    report = audit_run(*dpsgd, noise_over_batch_size, noise_multiplier=2.0, claimed_noise=2.0)
    assert report.violated, str(report)
