"""pergrad.dp's canaries and auditor: the canaries do what they say, and one audited DP-SGD run
on digits passes when correct and is caught when broken (JAX and PyTorch, materialised
per-example gradients; 1000 white-box gradient canaries)."""

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


# --- evidence: one audited DP-SGD run on digits ---------------------------------------------
#
# A 64-32-10 MLP (2410 parameters) on scikit-learn's 1797 digits, Poisson sample rate 0.05,
# 100 steps, clip 1, delta 1e-5; 1000 Dirac gradient canaries of norm 1 (100 to test
# clipping), scored against a reference run without canaries (independent noise and batches).
# The correct run must stay below its claim; each break must be caught.

SAMPLE_RATE, STEPS, MAX_NORM, LR, HIDDEN, NUM_CANARIES = 0.05, 100, 1.0, 0.5, 32, 1000


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


def audit_with_reference(run, start, claimed_noise, canary_norm=1.0):
    """``dp.audit`` of ``run(canaries, seed) -> final params``, scored against a reference
    run without canaries (its own seed: independent noise and batches)."""
    canaries = dp.GradientCanaries(
        start, NUM_CANARIES, sample_rate=SAMPLE_RATE, seed=7, norm=canary_norm
    )

    def train(canaries):
        reference = run(None, seed=101)
        return canaries.scores(run(canaries, seed=202), reference=reference)

    return dp.audit(
        train,
        canaries,
        noise_multiplier=claimed_noise,
        sample_rate=SAMPLE_RATE,
        steps=STEPS,
        delta=1e-5,
    )


def jax_audit(noise_multiplier, claimed_noise, clipping=True, canary_norm=1.0):
    """One audit of DP-SGD written with pergrad in JAX (two training runs)."""
    jax = pytest.importorskip("jax", reason="the JAX path")
    jnp = jax.numpy
    import pergrad

    x, y = digits()
    n = len(x)

    def loss(params, xi, yi):
        hidden = jnp.tanh(xi @ params["w1"] + params["b1"])
        return -jax.nn.log_softmax(hidden @ params["w2"] + params["b2"])[yi]

    per_example = jax.jit(pergrad.per_example_grads(loss))

    @jax.jit
    def step(params, grads, mask, key):
        if clipping:
            update, _ = dp.private_mean(
                grads, MAX_NORM, noise_multiplier, key, SAMPLE_RATE * n, mask
            )
        else:  # the break: no clipping, noise still calibrated to the clipping bound
            summed = dp.clipped_sum(grads, 1e9, mask).sum
            noisy = dp.add_noise(summed, noise_multiplier * MAX_NORM, key)
            update = jax.tree.map(lambda v: v / (SAMPLE_RATE * n), noisy)
        return jax.tree.map(lambda p, u: p - LR * u, params, update)

    def run(canaries, seed):
        params = {k: jnp.asarray(v) for k, v in initial_weights().items()}
        key = jax.random.key(seed)
        size = dp.max_batch_size_for(n, SAMPLE_RATE)
        for index, batch in enumerate(dp.poisson_batches(n, SAMPLE_RATE, STEPS, seed=seed)):
            padded, mask = dp.pad_batch(batch, size)
            grads, mask = per_example(params, x[padded], y[padded]), jnp.asarray(mask)
            if canaries is not None:  # padded: one shape, so jax.jit compiles once
                pad = dp.max_batch_size_for(canaries.num_included, SAMPLE_RATE)
                grads, mask = canaries.inject(grads, mask, index, pad_to=pad)
            key, noise_key = jax.random.split(key)
            params = step(params, grads, mask, noise_key)
        return params

    start = {k: jnp.asarray(v) for k, v in initial_weights().items()}
    return audit_with_reference(run, start, claimed_noise, canary_norm)


def torch_audit(noise_multiplier, claimed_noise):
    """The same audit with DP-SGD written with pergrad in PyTorch."""
    torch = pytest.importorskip("torch", reason="the PyTorch path")
    import pergrad

    x_numpy, y_numpy = digits()
    x, y = torch.from_numpy(x_numpy), torch.from_numpy(y_numpy)
    n = len(x)

    def loss(params, xi, yi):
        hidden = torch.tanh(xi @ params["w1"] + params["b1"])
        logits = hidden @ params["w2"] + params["b2"]
        return torch.nn.functional.cross_entropy(logits[None], yi[None])

    per_example = pergrad.per_example_grads(loss)

    def run(canaries, seed):
        params = {k: torch.from_numpy(v) for k, v in initial_weights().items()}
        generator = torch.Generator().manual_seed(seed)
        for index, batch in enumerate(dp.poisson_batches(n, SAMPLE_RATE, STEPS, seed=seed)):
            batch = torch.as_tensor(batch)
            grads, mask = per_example(params, x[batch], y[batch]), None
            if canaries is not None:
                grads, mask = canaries.inject(grads, mask, index)
            update, _ = dp.private_mean(
                grads, MAX_NORM, noise_multiplier, generator, SAMPLE_RATE * n, mask
            )
            params = {k: params[k] - LR * update[k] for k in params}
        return params

    start = {k: torch.from_numpy(v) for k, v in initial_weights().items()}
    return audit_with_reference(run, start, claimed_noise)


@pytest.fixture(autouse=True)
def _quiet_accounting():
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's skipped RDP orders
    pytest.importorskip("dp_accounting", reason="the claim comes from the accountant")


def test_jax_correct_dp_sgd_stays_below_its_claim():
    report = jax_audit(noise_multiplier=1.0, claimed_noise=1.0)  # claim: epsilon 4.04
    assert not report.violated
    assert report.epsilon_lower_bound < report.epsilon


def test_jax_dp_sgd_without_noise_is_caught():
    report = jax_audit(noise_multiplier=0.0, claimed_noise=2.0)  # claim: epsilon 1.22
    assert report.violated, str(report)


def test_jax_dp_sgd_without_clipping_is_caught_by_large_canaries():
    report = jax_audit(
        noise_multiplier=2.0, claimed_noise=2.0, clipping=False, canary_norm=100.0
    )  # the noise is there (claim: epsilon 1.22), but a canary moves the model 100x too far
    assert report.violated, str(report)


def test_torch_correct_dp_sgd_stays_below_its_claim():
    report = torch_audit(noise_multiplier=1.0, claimed_noise=1.0)
    assert not report.violated
    assert report.epsilon_lower_bound < report.epsilon


def test_torch_dp_sgd_without_noise_is_caught():
    report = torch_audit(noise_multiplier=0.0, claimed_noise=2.0)
    assert report.violated, str(report)
