"""User-level DP: each user's summed gradient clipped (``user_ids=`` on every DP path), users
Poisson-sampled, the accountant counting users.

The references are independent of pergrad: each user's gradient comes from the framework's
own autograd (``torch.autograd.grad`` / ``jax.grad``) on the user's summed loss, or from numpy
sums of given per-example gradients; clipped and summed by hand. The sampler's statistical
checks run with fixed seeds and thresholds at a false-alarm rate of about 1e-6 (normal
approximation to the binomial), as in tests/test_dp_sampling.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pergrad
from pergrad import dp
from pergrad._src.errors import PergradTypeError, PergradValueError

RNG = np.random.default_rng(33)
USERS = np.array([4, 0, 4, 7, 0, 4, 9, 7, 4, 12])  # not contiguous, unsorted, one singleton
FALSE_ALARM = 1e-6


def two_sided_z(alpha: float) -> float:
    """z with P(|N(0, 1)| > z) = alpha, by bisection on erfc."""
    low, high = 0.0, 40.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if math.erfc(middle / math.sqrt(2)) > alpha else (low, middle)
    return high


# --- references -------------------------------------------------------------------------------


def numpy_user_clipped_sum(grads, user_ids, max_norm, mask=None):
    """Sum over users of min(1, C / |user's summed gradient|) * that sum, in float64."""
    real = np.ones(len(user_ids), bool) if mask is None else np.asarray(mask, bool)
    total = {k: np.zeros(g.shape[1:]) for k, g in grads.items()}
    users = np.unique(user_ids[real])
    for user in users:
        rows = (user_ids == user) & real
        summed = {k: g[rows].astype(np.float64).sum(0) for k, g in grads.items()}
        norm = math.sqrt(sum(float((s**2).sum()) for s in summed.values()))
        factor = min(1.0, max_norm / max(norm, 1e-30))
        for k in total:
            total[k] += factor * summed[k]
    return total, len(users)


def data(batch_size=None):
    batch_size = len(USERS) if batch_size is None else batch_size
    return {
        "w": RNG.normal(size=(3, 2)).astype(np.float32),
        "b": RNG.normal(size=(2,)).astype(np.float32),
        "x": 2.0 * RNG.normal(size=(batch_size, 3)).astype(np.float32),
        "y": RNG.normal(size=(batch_size, 2)).astype(np.float32),
    }


def single_loss(fw):
    def loss(params, x, y):
        prediction = fw.tanh(fw.matmul(x, params["w"]) + params["b"])
        return fw.sum((prediction - y) ** 2)

    return loss


def autograd_user_reference(fw, d, user_ids, max_norm):
    """Each user's gradient from the framework's own autograd on its summed loss, clipped."""
    per_user = {user: _user_gradient(fw, d, user_ids == user) for user in np.unique(user_ids)}
    # one "example" per user: the user's summed gradient, clipped by the numpy reference
    stacked = {k: np.stack([per_user[u][k] for u in per_user]) for k in ("w", "b")}
    return numpy_user_clipped_sum(stacked, np.arange(len(per_user)), max_norm)


def _user_gradient(fw, d, rows):
    x, y = d["x"][rows], d["y"][rows]
    if fw.name == "jax":
        import jax
        import jax.numpy as jnp

        def summed(params):
            prediction = jnp.tanh(x @ params["w"] + params["b"])
            return jnp.sum((prediction - y) ** 2)

        grad = jax.grad(summed)({"w": jnp.asarray(d["w"]), "b": jnp.asarray(d["b"])})
        return {k: np.asarray(v, np.float64) for k, v in grad.items()}
    import torch

    w = torch.tensor(d["w"], requires_grad=True)
    b = torch.tensor(d["b"], requires_grad=True)
    prediction = torch.tanh(torch.from_numpy(x) @ w + b)
    gw, gb = torch.autograd.grad(((prediction - torch.from_numpy(y)) ** 2).sum(), (w, b))
    return {"w": gw.numpy().astype(np.float64), "b": gb.numpy().astype(np.float64)}


def assert_close(fw, got, expected, rtol=2e-4, atol=2e-5):
    for k in expected:
        np.testing.assert_allclose(fw.to_numpy(got[k]), expected[k], rtol=rtol, atol=atol)


# --- the clipped sum --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "materialize"])
def test_clipped_sum_of_equals_per_user_autograd_reference(fw, strategy):
    d = data()
    expected, num_users = autograd_user_reference(fw, d, USERS, max_norm=1.0)
    params = {"w": fw.array(d["w"]), "b": fw.array(d["b"])}
    result = dp.clipped_sum_of(
        single_loss(fw),
        params,
        fw.array(d["x"]),
        fw.array(d["y"]),
        max_norm=1.0,
        strategy=strategy,
        user_ids=fw.array(USERS),
    )
    assert_close(fw, result.sum, expected)
    assert float(result.count) == num_users
    assert float(result.clip_fraction) > 0  # the bound is met, or the test would be empty


@pytest.mark.parametrize("grads_strategy", ["vmap", "loop"])
def test_clipped_sum_of_given_per_example_grads_equals_reference(fw, grads_strategy):
    d = data()
    expected, _ = autograd_user_reference(fw, d, USERS, max_norm=0.7)
    params = {"w": fw.array(d["w"]), "b": fw.array(d["b"])}
    grads = pergrad.per_example_grads(single_loss(fw), strategy=grads_strategy)(
        params, fw.array(d["x"]), fw.array(d["y"])
    )
    result = dp.clipped_sum(grads, 0.7, user_ids=USERS)  # numpy ids are taken too
    assert_close(fw, result.sum, expected)


def test_clipped_sum_under_jit_with_traced_user_ids():
    jax = pytest.importorskip("jax")
    grads = {"w": RNG.normal(size=(len(USERS), 4, 3)), "b": RNG.normal(size=(len(USERS), 3))}
    expected, num_users = numpy_user_clipped_sum(grads, USERS, 1.5)
    run = jax.jit(lambda g, ids: dp.clipped_sum(g, 1.5, user_ids=ids))
    result = run({k: jax.numpy.asarray(v, "float32") for k, v in grads.items()}, USERS)
    for k in expected:
        np.testing.assert_allclose(np.asarray(result.sum[k]), expected[k], rtol=2e-5, atol=2e-6)
    assert float(result.count) == num_users


def test_mask_leaves_padding_out_of_every_user(fw):
    grads = {"w": RNG.normal(size=(len(USERS), 5))}
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 0, 1], bool)  # user 9's only example is padding
    expected, num_users = numpy_user_clipped_sum(grads, USERS, 2.0, mask)
    result = dp.clipped_sum(
        {"w": fw.array(grads["w"])}, 2.0, mask=fw.array(mask), user_ids=fw.array(USERS)
    )
    assert_close(fw, result.sum, expected)
    assert float(result.count) == num_users == len(np.unique(USERS)) - 1


def test_per_group_bounds_clip_each_users_groups(fw):
    grads = {"w": 3 * RNG.normal(size=(len(USERS), 4)), "b": 3 * RNG.normal(size=(len(USERS), 2))}
    bounds = {"w": 1.0, "b": 0.5}
    expected = {}
    for k in grads:  # each group clipped on its own: the reference of one group at a time
        expected[k] = numpy_user_clipped_sum({k: grads[k]}, USERS, bounds[k])[0][k]
    result = dp.clipped_sum({k: fw.array(v) for k, v in grads.items()}, bounds, user_ids=USERS)
    assert_close(fw, result.sum, expected)
    assert result.sensitivity == pytest.approx(math.sqrt(1.0 + 0.25))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
    st.floats(0.05, 5.0),
    st.floats(0.01, 50.0),
    st.integers(0, 2**31 - 1),
)
def test_removing_one_user_moves_the_sum_by_at_most_max_norm(ids, max_norm, scale, seed):
    """The neighbouring-datasets property user-level DP rests on: with or without all of one
    user's examples, the clipped sums differ by at most max_norm, however many they are."""
    ids = np.array(ids)
    rng = np.random.default_rng(seed)
    grads = {
        "w": scale * rng.normal(size=(len(ids), 3, 2)),
        "b": scale * rng.normal(size=(len(ids), 2)),
    }
    tree = _torch_tree(grads)
    whole = dp.clipped_sum(tree, max_norm, user_ids=ids)
    for user in np.unique(ids):
        without = dp.clipped_sum(tree, max_norm, mask=_torch_array(ids != user), user_ids=ids)
        moved = math.sqrt(sum(float(((whole.sum[k] - without.sum[k]) ** 2).sum()) for k in grads))
        assert moved <= max_norm * (1 + 1e-9) + 1e-12
        assert float(whole.count - without.count) == 1


def _torch_tree(tree):
    torch = pytest.importorskip("torch")
    return {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in tree.items()}


def _torch_array(x):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.asarray(x))


def test_a_user_with_many_examples_contributes_no_more_than_one_with_one(fw):
    """User 0 has 50 copies of a large gradient, user 1 one copy: each moves the sum by
    exactly max_norm; example-level clipping would let user 0 move it by 50 * max_norm."""
    grads = {"w": np.tile(np.array([[3.0, 4.0]]), (51, 1))}
    ids = np.array([0] * 50 + [1])
    result = dp.clipped_sum({"w": fw.array(grads["w"])}, 1.0, user_ids=ids)
    np.testing.assert_allclose(fw.to_numpy(result.sum["w"]), [1.2, 1.6], rtol=1e-5)
    example_level = dp.clipped_sum({"w": fw.array(grads["w"])}, 1.0)
    np.testing.assert_allclose(fw.to_numpy(example_level.sum["w"]), [30.6, 40.8], rtol=1e-5)


def test_a_user_with_a_nonfinite_example_contributes_nothing(fw):
    grads = {"w": RNG.normal(size=(len(USERS), 3))}
    grads["w"][3, 1] = np.nan  # user 7
    expected, num_users = numpy_user_clipped_sum(grads, USERS, 1.0, USERS != 7)
    result = dp.clipped_sum({"w": fw.array(grads["w"])}, 1.0, user_ids=fw.array(USERS))
    assert_close(fw, result.sum, expected)
    assert float(result.nonfinite) == 1
    assert float(result.count) == num_users + 1  # still counted: 0 is within the bound


def test_empty_batch_is_ordinary(fw):
    result = dp.clipped_sum({"w": fw.array(np.zeros((0, 3)))}, 1.0, user_ids=np.zeros(0, int))
    np.testing.assert_array_equal(fw.to_numpy(result.sum["w"]), np.zeros(3))
    assert float(result.count) == 0
    d = data(batch_size=0)
    params = {"w": fw.array(d["w"]), "b": fw.array(d["b"])}
    from_loss = dp.clipped_sum_of(
        single_loss(fw),
        params,
        fw.array(d["x"]),
        fw.array(d["y"]),
        max_norm=1.0,
        user_ids=np.zeros(0, np.int64),
    )
    assert float(from_loss.count) == 0


def test_nothing_is_mutated(fw):
    grads = {"w": RNG.normal(size=(len(USERS), 3))}
    tree, ids = {"w": fw.array(grads["w"])}, fw.array(USERS)
    ids_numpy = USERS.copy()
    dp.clipped_sum(tree, 0.5, user_ids=ids)
    dp.clipped_sum(tree, 0.5, user_ids=ids_numpy)
    np.testing.assert_array_equal(fw.to_numpy(tree["w"]), grads["w"].astype(np.float32))
    np.testing.assert_array_equal(fw.to_numpy(ids), USERS)
    np.testing.assert_array_equal(ids_numpy, USERS)


def test_private_mean_and_private_grad_of_divide_by_the_expected_number_of_users(fw):
    d = data()
    expected, _ = autograd_user_reference(fw, d, USERS, max_norm=1.0)
    params = {"w": fw.array(d["w"]), "b": fw.array(d["b"])}
    rng = _rng(fw)
    grad, stats = dp.private_grad_of(
        single_loss(fw),
        params,
        fw.array(d["x"]),
        fw.array(d["y"]),
        max_norm=1.0,
        noise_multiplier=0.0,
        rng=rng,
        expected_batch_size=4.0,
        user_ids=fw.array(USERS),
    )
    assert_close(fw, grad, {k: v / 4.0 for k, v in expected.items()})
    per_example = pergrad.per_example_grads(single_loss(fw))(
        params, fw.array(d["x"]), fw.array(d["y"])
    )
    mean, _ = dp.private_mean(per_example, 1.0, 0.0, rng, user_ids=USERS)  # / number of users
    assert_close(fw, mean, {k: v / float(stats.count) for k, v in expected.items()})


def _rng(fw):
    if fw.name == "jax":
        import jax

        return jax.random.key(0)
    import torch

    return torch.Generator().manual_seed(0)


# --- the framework integrations ----------------------------------------------------------------


def test_dp_optimizer_steps_on_the_users_clipped_sum():
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(len(USERS), 3), torch.randn(len(USERS), 2)

    def batch_loss(output, target):
        return ((output - target) ** 2).sum(1).mean()

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    per_user = []
    for user in np.unique(USERS):
        rows = torch.from_numpy(np.equal(USERS, user))
        model.zero_grad()
        ((model(x[rows]) - y[rows]) ** 2).sum().backward()  # the user's summed loss
        per_user.append({n: p.grad.detach().double().numpy() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    stacked = {n: np.stack([g[n] for g in per_user]) for n in before}
    expected, num_users = numpy_user_clipped_sum(stacked, np.arange(len(per_user)), 0.5)

    opt = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        batch_loss,
        max_norm=0.5,
        noise_multiplier=0.0,
        expected_batch_size=3.0,
    )
    stats = opt.step(x, y, user_ids=torch.from_numpy(USERS))  # the ghost strategy
    assert stats.batch_size == num_users
    for n, p in model.named_parameters():
        np.testing.assert_allclose(
            (before[n] - p.detach()).double().numpy(), expected[n] / 3.0, rtol=1e-4, atol=1e-6
        )
    with pytest.raises(PergradValueError, match="taken with user_ids, this one without"):
        opt.step(x, y)  # a user-level run stays user-level


def test_dp_optimizer_refuses_a_user_split_across_micro_batches():
    torch = pytest.importorskip("torch")
    from torch import nn

    model = nn.Linear(3, 2)
    opt = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        nn.functional.mse_loss,
        max_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=2.0,
        strategy="materialize",
    )
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    opt.accumulate(x[:2], y[:2], user_ids=np.array([1, 2]))
    with pytest.raises(PergradValueError, match=r"user ids \[2\].*one micro-batch"):
        opt.step(x[2:], y[2:], user_ids=np.array([2, 3]))


def test_optax_aggregate_takes_user_ids_under_jit():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    grads = {"w": RNG.normal(size=(len(USERS), 4)).astype(np.float32)}
    mask = np.ones(len(USERS), bool)
    mask[-1] = False
    expected, num_users = numpy_user_clipped_sum(grads, USERS, 1.0, mask)
    tx = optax.chain(dp.optax_aggregate(1.0, 0.0, key=0, expected_batch_size=5.0))
    params = {"w": jax.numpy.zeros(4)}
    state = tx.init(params)
    update = jax.jit(lambda g, s, ids, m: tx.update(g, s, params, user_ids=ids, mask=m))
    updates, state = update(
        {"w": jax.numpy.asarray(grads["w"])}, state, jax.numpy.asarray(USERS), mask
    )
    np.testing.assert_allclose(np.asarray(updates["w"]), expected["w"] / 5.0, rtol=2e-5, atol=2e-6)
    assert float(state[0].count) == num_users


# --- sampling users --------------------------------------------------------------------------


def dataset_users(num_users=40, seed=1):
    """Each of num_users users with 1 to 6 examples, shuffled, ids spread out."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 7, size=num_users)
    ids = np.repeat(np.arange(num_users) * 3 + 1, counts)
    return rng.permutation(ids)


def batches_as_users(batches, ids):
    return [np.unique(ids[b]) for b in batches]


def test_poisson_user_batches_sample_whole_users_at_the_rate():
    ids = dataset_users()
    rate, steps = 0.2, 2000
    batches = list(dp.poisson_user_batches(ids, rate, steps, seed=7))
    users = np.unique(ids)
    counts = np.zeros(len(users))
    for batch in batches:
        present = np.unique(ids[batch])
        for user in present:  # whole users: all of a sampled user's examples
            assert np.isin(np.flatnonzero(ids == user), batch).all()
        counts += np.isin(users, present)
    z = (counts - steps * rate) / math.sqrt(steps * rate * (1 - rate))
    assert np.abs(z).max() < two_sided_z(FALSE_ALARM / len(users))
    sizes = np.array([len(np.unique(ids[b])) for b in batches])
    mean_z = (sizes.mean() - len(users) * rate) / math.sqrt(len(users) * rate * (1 - rate) / steps)
    assert abs(mean_z) < two_sided_z(FALSE_ALARM)


def test_poisson_user_batches_are_reproducible_from_a_seed():
    ids = dataset_users()
    first = list(dp.poisson_user_batches(ids, 0.3, 5, seed=3))
    again = list(dp.poisson_user_batches(ids, 0.3, 5, seed=3))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=60),
    st.floats(0.05, 1.0),
    st.one_of(st.none(), st.integers(1, 4)),
    st.integers(0, 2**32 - 1),
)
def test_poisson_user_batches_invariants(ids, rate, cap, seed):
    ids = np.array(ids)
    for batch in dp.poisson_user_batches(ids, rate, 3, seed=seed, max_examples_per_user=cap):
        assert batch.dtype == np.int64 and (np.diff(batch) > 0).all()
        assert ((batch >= 0) & (batch < len(ids))).all()
        for user in np.unique(ids[batch]):
            expected = (ids == user).sum() if cap is None else min(cap, (ids == user).sum())
            assert (ids[batch] == user).sum() == expected


def test_user_poisson_batch_sampler_samples_whole_users_at_the_rate():
    torch = pytest.importorskip("torch")
    ids = dataset_users()
    rate, steps = 0.25, 1500
    sampler = dp.UserPoissonBatchSampler(
        torch.from_numpy(ids), rate, steps, torch.Generator().manual_seed(5)
    )
    assert len(sampler) == steps
    assert sampler.expected_batch_size == pytest.approx(rate * len(np.unique(ids)))
    users = np.unique(ids)
    counts = np.zeros(len(users))
    for batch in sampler:
        batch = np.array(batch, dtype=np.int64)
        present = np.unique(ids[batch])
        assert all((ids[batch] == u).sum() == (ids == u).sum() for u in present)
        counts += np.isin(users, present)
    z = (counts - steps * rate) / math.sqrt(steps * rate * (1 - rate))
    assert np.abs(z).max() < two_sided_z(FALSE_ALARM / len(users))


def test_user_poisson_batch_sampler_caps_each_users_examples():
    torch = pytest.importorskip("torch")
    ids = np.array([0] * 10 + [1] * 2 + [2])
    sampler = dp.UserPoissonBatchSampler(
        ids, 1.0, 3, torch.Generator().manual_seed(0), max_examples_per_user=3
    )
    for batch in sampler:
        assert np.bincount(ids[batch], minlength=3).tolist() == [3, 2, 1]
    assert "max_examples_per_user=3" in repr(sampler)


def test_the_accountant_counts_users():
    """epsilon takes the user-level sample rate unchanged: a run over users is accounted as a
    run over examples with that rate, and grouping examples into users costs more privacy
    than treating them as examples would claim."""
    ids = dataset_users()
    num_users, num_examples = len(np.unique(ids)), len(ids)
    expected_users = 8
    user_level = dp.epsilon(
        noise_multiplier=1.0, sample_rate=expected_users / num_users, steps=100, delta=1e-5
    )
    example_level = dp.epsilon(
        noise_multiplier=1.0, sample_rate=expected_users / num_examples, steps=100, delta=1e-5
    )
    assert user_level > example_level


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user_ids", "error", "message"),
    [
        (
            np.array([0, 1, 2]),
            PergradValueError,
            r"user_ids must have shape \(4,\).*got shape \(3,\)",
        ),
        (np.array([0.0, 1.0, 2.0, 3.0]), PergradTypeError, "user_ids must be integers.*float64"),
        (np.array([True, False, True, True]), PergradTypeError, "user_ids must be integers.*bool"),
        (np.array([0, -1, 2, 3]), PergradValueError, "user_ids must be >= 0.*-1"),
        ("abcd", PergradTypeError, "user_ids must be a \\(4,\\) integer array.*str"),
    ],
)
def test_bad_user_ids_are_refused_with_the_argument_named(fw, user_ids, error, message):
    grads = {"w": fw.array(RNG.normal(size=(4, 3)))}
    with pytest.raises(error, match=message):
        dp.clipped_sum(grads, 1.0, user_ids=user_ids)


def test_bad_user_ids_of_the_framework_are_refused(fw):
    grads = {"w": fw.array(RNG.normal(size=(4, 3)))}
    with pytest.raises(PergradTypeError, match="user_ids must be integers.*float32"):
        dp.clipped_sum(grads, 1.0, user_ids=fw.array(np.zeros(4)))
    with pytest.raises(PergradValueError, match=r"must have shape \(4,\).*\(2, 2\)"):
        dp.clipped_sum(grads, 1.0, user_ids=fw.array(np.zeros((2, 2), np.int32)))
    with pytest.raises(PergradValueError, match="must be >= 0"):
        dp.clipped_sum(grads, 1.0, user_ids=fw.array(np.array([0, 1, -3, 2], np.int32)))


def test_strategies_that_clip_examples_are_refused_by_name(fw):
    d = data()
    params = {"w": fw.array(d["w"]), "b": fw.array(d["b"])}
    # (a function loss: on PyTorch the ghost strategy takes only a module_loss, so "ghost" is
    # refused too; JAX's takes it: tests/test_dp_user_level_ghost*.py)
    named = (
        ("chunked", "ghost-lowmem", "ghost") if fw.name == "torch" else ("chunked", "ghost-lowmem")
    )
    for strategy in named:
        with pytest.raises(PergradValueError, match=f"strategy='{strategy}' cannot clip by user"):
            dp.clipped_sum_of(
                single_loss(fw),
                params,
                fw.array(d["x"]),
                fw.array(d["y"]),
                max_norm=1.0,
                strategy=strategy,
                user_ids=USERS,
            )


def test_user_ids_with_axis_name_is_refused():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(PergradValueError, match="user_ids cannot be combined with axis_name"):
        dp.clipped_sum({"w": jnp.zeros((2, 3))}, 1.0, axis_name="data", user_ids=np.array([0, 1]))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"user_ids": np.array([[0, 1]])}, PergradValueError, r"user_ids must be 1-D.*\(1, 2\)"),
        ({"user_ids": np.array([0.5, 1.0])}, PergradTypeError, "user_ids must be integers"),
        ({"user_ids": np.array([0, -2])}, PergradValueError, "user_ids must be >= 0; got -2"),
        ({"sample_rate": 0.0}, PergradValueError, r"sample_rate must be in \(0, 1\]"),
        ({"max_examples_per_user": 0}, PergradValueError, "max_examples_per_user must be >= 1"),
        ({"max_examples_per_user": 2.5}, PergradTypeError, "max_examples_per_user must be an int"),
    ],
)
def test_bad_sampler_arguments_are_refused(kwargs, error, message):
    arguments = {"user_ids": np.array([0, 1, 1]), "sample_rate": 0.5, "steps": 2, **kwargs}
    with pytest.raises(error, match=message):
        dp.poisson_user_batches(**arguments)
    torch = pytest.importorskip("torch")
    with pytest.raises(error, match=message):
        dp.UserPoissonBatchSampler(**arguments, generator=torch.Generator())


# --- the privacy audit ------------------------------------------------------------------------

COPIES = 8  # examples per canary user


def user_level_run(runner, canaries, noise_multiplier, clip_users=True, seed=202):
    """DPOptimizer on digits (test_dp_audit_paths.py's setting) where every canary is a USER
    with COPIES identical examples and every data example a user of its own. ``clip_users``
    False is the broken run: each example its own user, so a canary user moves the update by
    COPIES bounds, which the noise of one bound does not cover."""
    torch = runner.torch
    from test_dp_audit_paths import HIDDEN, LR, MAX_NORM, SAMPLE_RATE, STEPS, canary_examples

    model = runner.model()
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        runner.loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=noise_multiplier,
        expected_batch_size=SAMPLE_RATE * runner.n,
        generator=torch.Generator().manual_seed(seed),
        strategy="materialize",
    )
    for step, batch in enumerate(dp.poisson_batches(runner.n, SAMPLE_RATE, STEPS, seed=seed)):
        x, y = runner.x[torch.as_tensor(batch)], runner.y[torch.as_tensor(batch)]
        u = torch.zeros(len(batch), HIDDEN)
        users = np.asarray(batch)
        if canaries is not None:
            x_canary, u_canary = canary_examples(canaries, step)
            ids = runner.n + canaries.sampled(step)
            x = torch.cat([x, torch.from_numpy(np.repeat(x_canary, COPIES, 0))])
            u = torch.cat([u, torch.from_numpy(np.repeat(u_canary, COPIES, 0))])
            y = torch.cat([y, torch.zeros(len(ids) * COPIES, dtype=y.dtype)])
            users = np.concatenate([users, np.repeat(ids, COPIES)])
        if not clip_users:
            users = np.arange(len(users))
        optimizer.step(x, y, u, user_ids=users)
    return {
        "w1": model.fc1.weight.detach().clone(),
        "w2": model.fc2.weight.detach().clone(),
        "b2": model.fc2.bias.detach().clone(),
    }


@pytest.mark.slow(reason="three DP-SGD runs of 50 steps with 1000 canaries: about a minute")
@pytest.mark.filterwarnings("ignore::pergrad.FallbackWarning")
def test_audit_user_level_run_holds_its_claim_and_example_clipping_is_caught():
    pytest.importorskip("scipy", reason="the audit statistics use scipy.stats")
    pytest.importorskip("sklearn", reason="digits ship with sklearn")
    torch = pytest.importorskip("torch")
    from test_dp_audit_paths import TorchRunner, audit, w1_canaries

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = TorchRunner()
        reference = user_level_run(runner, None, 0.0, seed=101)
        canaries = w1_canaries(runner.model().fc1.weight.detach())
        correct = audit(
            canaries,
            lambda c, s: user_level_run(runner, c, s),
            reference,
            2.0,
            claimed_noise=2.0,
        )
        assert not correct.violated, str(correct)
        broken = audit(
            canaries,
            lambda c, s: user_level_run(runner, c, s, clip_users=False),
            reference,
            2.0,
            claimed_noise=2.0,
        )
        assert broken.violated, str(broken)
    finally:
        torch.set_num_threads(threads)
