"""Automatic clipping (Bu et al. 2022) and accounted quantile-adaptive clipping (Andrew et al.
2021) on every DP path: ``clip`` / ``clipped_sum``, ``clipped_sum_of`` / ``private_grad_of`` on
each strategy, ``optax_aggregate`` and ``DPOptimizer``.

The references are independent: per-example gradients by a Python loop of single-example
gradients (``tests/_reference.py``), scaled and summed in float64 numpy; the adaptive bound's
closed-form geometric update on norms computed in numpy; the noise multiplier split checked
against its defining identity and against ``dp_accounting``'s epsilon.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pergrad
from _reference import jax_loop_grads, torch_module_loop_grads
from pergrad import dp

jax = pytest.importorskip("jax", reason="the JAX paths need jax")
jnp = pytest.importorskip("jax.numpy", reason="the JAX paths need jax")
torch = pytest.importorskip("torch", reason="the PyTorch paths need torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

GAMMA = 0.01


def flat_norms(grads: dict) -> np.ndarray:
    batch = len(next(iter(grads.values())))
    return np.linalg.norm(
        np.concatenate([np.asarray(g, np.float64).reshape(batch, -1) for g in grads.values()], 1),
        axis=1,
    )


def weighted_sum(grads: dict, weights: np.ndarray) -> dict:
    return {k: np.tensordot(weights, np.asarray(g, np.float64), axes=1) for k, g in grads.items()}


def automatic_sum(grads: dict, max_norm: float, gamma: float = GAMMA) -> dict:
    """sum_i g_i * max_norm / (|g_i| + gamma), by hand."""
    return weighted_sum(grads, max_norm / (flat_norms(grads) + gamma))


def standard_sum(grads: dict, max_norm: float) -> dict:
    norms = flat_norms(grads)
    return weighted_sum(grads, np.minimum(1.0, max_norm / np.maximum(norms, 1e-30)))


def assert_trees_close(actual: dict, expected: dict, rtol: float = 2e-5) -> None:
    for name, want in expected.items():
        got = np.asarray(to_numpy(actual[name]), np.float64)
        scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=name)


def to_numpy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def geometric_update(bound: float, norms: np.ndarray, quantile: float, rate: float) -> float:
    """Andrew et al. 2021, noise-free: C * exp(-rate * (fraction of norms <= C - quantile))."""
    return bound * math.exp(-rate * (float(np.mean(norms <= bound)) - quantile))


# --- problems: a small MLP in each framework ----------------------------------------------------


def torch_problem(batch: int = 7, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(batch, 5), torch.randint(0, 3, (batch,))
    reference = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    return model, x, y, {k: v.numpy() for k, v in reference.items()}


def jax_loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum((hidden @ params["w2"] + params["b2"] - y) ** 2)


def jax_problem(batch: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.normal(size=(5, 6)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(6,)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
        "b2": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(batch, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(batch, 3)), jnp.float32)
    reference = jax_loop_grads(jax_loss, params, x, y)
    return params, x, y, {k: np.asarray(v) for k, v in reference.items()}


def loss_and_args(framework: str):
    """(loss of one example, its arguments, loop-reference per-example gradients)."""
    if framework == "torch":
        model, x, y, reference = torch_problem()
        loss = pergrad.module_loss(model, F.cross_entropy)
        return loss, (loss.params(), x, y), reference
    params, x, y, reference = jax_problem()
    return jax_loss, (params, x, y), reference


def median_bound(reference: dict) -> float:
    """A bound between the norms, so that some examples are within it and some not."""
    return float(np.median(flat_norms(reference)))


# --- the DP guarantee: no example contributes more than the bound -------------------------------


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(["jax", "torch"]),
    st.integers(1, 6),
    st.floats(0.01, 10.0),
    st.floats(1e-4, 1e3),
    st.floats(1e-4, 1.0),
)
def test_automatic_contributions_never_exceed_the_bound(framework, batch, max_norm, scale, gamma):
    rng = np.random.default_rng(batch)
    raw = {"w": scale * rng.normal(size=(batch, 3, 2)), "b": scale * rng.normal(size=(batch, 2))}
    raw["b"][0] = 0.0  # an example with a zero gradient in one leaf
    convert = jnp.asarray if framework == "jax" else torch.from_numpy
    grads = {k: convert(v.astype(np.float32)) for k, v in raw.items()}
    clipped = dp.clip(grads, max_norm, clipping=dp.automatic(gamma))
    norms = flat_norms({k: to_numpy(v) for k, v in clipped.items()})
    assert np.all(norms <= max_norm * (1 + 1e-6))  # float32 rounding of C * n / (n + gamma)
    raw32 = {k: v.astype(np.float32) for k, v in raw.items()}
    expected = (max_norm / (flat_norms(raw32) + gamma))[:, None] * np.concatenate(
        [raw32[k].reshape(batch, -1) for k in sorted(raw32)], 1
    )
    got = np.concatenate([to_numpy(clipped[k]).reshape(batch, -1) for k in sorted(raw32)], 1)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7 * max_norm)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 6), st.floats(0.05, 5.0), st.floats(0.01, 100.0), st.integers(1, 4))
def test_adaptive_clips_each_step_at_the_states_bound(batch, max_norm, scale, steps):
    """Through optax_aggregate, noise-free: each step's sum is the clipped sum at the bound the
    state held before it, and every example's contribution is within that bound."""
    rng = np.random.default_rng(batch + steps)
    raw = {"w": scale * rng.normal(size=(batch, 3, 2)), "b": scale * rng.normal(size=(batch, 2))}
    raw = {k: v.astype(np.float32) for k, v in raw.items()}
    policy = dp.adaptive(count_noise_std=0.0, target_quantile=0.3, learning_rate=0.5)
    tx = dp.optax_aggregate(max_norm, 0.0, 0, expected_batch_size=batch, clipping=policy)
    state = tx.init(None)
    grads = {k: jnp.asarray(v) for k, v in raw.items()}
    for _ in range(steps):
        bound = float(state.max_norm)
        mean, state = tx.update(grads, state)
        contributions = dp.clip(grads, bound, clipping=policy)
        assert np.all(
            flat_norms({k: np.asarray(v) for k, v in contributions.items()}) <= bound * (1 + 1e-6)
        )
        assert_trees_close({k: v * batch for k, v in mean.items()}, standard_sum(raw, bound), 1e-4)


# --- automatic clipping against the loop, on every path ----------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "ghost", "materialize", "chunked"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_automatic_clipped_sum_of_matches_the_loop(framework, strategy):
    loss, args, reference = loss_and_args(framework)
    bound = median_bound(reference)
    clipped = dp.clipped_sum_of(
        loss, *args, max_norm=bound, strategy=strategy, clipping=dp.automatic(GAMMA)
    )
    assert_trees_close(clipped.sum, automatic_sum(reference, bound))
    np.testing.assert_allclose(to_numpy(clipped.norms), flat_norms(reference), rtol=1e-5)
    assert clipped.sensitivity == pytest.approx(bound)


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_automatic_on_per_example_grads_of_each_strategy(framework, strategy):
    loss, args, reference = loss_and_args(framework)
    grads = pergrad.per_example_grads(loss, strategy=strategy)(*args)
    bound = median_bound(reference)
    clipped = dp.clipped_sum(grads, bound, clipping=dp.automatic(GAMMA))
    assert_trees_close(clipped.sum, automatic_sum(reference, bound))
    scaled = dp.clip(grads, bound, clipping=dp.automatic(GAMMA))
    weights = bound / (flat_norms(reference) + GAMMA)
    assert_trees_close(
        scaled,
        {k: weights.reshape(-1, *[1] * (v.ndim - 1)) * v for k, v in reference.items()},
    )


def test_automatic_on_the_torch_only_strategies():
    """ghost-lowmem (clipped sum) and hooks (per-example gradients) are PyTorch's."""
    loss, args, reference = loss_and_args("torch")
    bound = median_bound(reference)
    clipped = dp.clipped_sum_of(
        loss, *args, max_norm=bound, strategy="ghost-lowmem", clipping=dp.automatic(GAMMA)
    )
    assert_trees_close(clipped.sum, automatic_sum(reference, bound))
    grads = pergrad.per_example_grads(loss, strategy="hooks")(*args)
    clipped = dp.clipped_sum(grads, bound, clipping=dp.automatic(GAMMA))
    assert_trees_close(clipped.sum, automatic_sum(reference, bound))


@pytest.mark.parametrize("strategy", ["ghost", "chunked"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_automatic_per_group_bounds(framework, strategy):
    """A bound per parameter (a dict prefix: one group each), each group normalised to its
    own bound: C_k / (|g_ik| + gamma)."""
    loss, args, reference = loss_and_args(framework)
    bounds = {name: 0.2 * (i + 1) for i, name in enumerate(sorted(reference))}
    clipped = dp.clipped_sum_of(
        loss, *args, max_norm=bounds, strategy=strategy, clipping=dp.automatic(GAMMA)
    )
    expected = {}
    for name, bound in bounds.items():
        expected.update(automatic_sum({name: reference[name]}, bound))
    assert_trees_close(clipped.sum, expected)
    assert clipped.sensitivity == pytest.approx(math.sqrt(sum(b * b for b in bounds.values())))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_per_group_bounds_match_by_key_not_by_position(framework):
    """A dict of bounds in another key order than the gradients' gives each group its own
    bound (torch's pytree matched dicts by position and swapped them)."""
    convert = jnp.asarray if framework == "jax" else torch.from_numpy
    grads = {
        "a": convert(np.full((3, 1), 3.0, np.float32)),
        "b": convert(np.full((3, 1), 4.0, np.float32)),
    }
    for clipping, factor in (
        (None, lambda n, c: min(1.0, c / n)),
        (dp.automatic(GAMMA), lambda n, c: c / (n + GAMMA)),
    ):
        clipped = dp.clipped_sum(grads, {"b": 1.0, "a": 100.0}, clipping=clipping)
        assert float(clipped.sum["a"][0]) == pytest.approx(3 * 3.0 * factor(3.0, 100.0), rel=1e-6)
        assert float(clipped.sum["b"][0]) == pytest.approx(3 * 4.0 * factor(4.0, 1.0), rel=1e-6)


def test_dp_optimizer_automatic_zero_noise_step_matches_the_loop():
    model, x, y, reference = torch_problem(batch=9)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    bound = median_bound(reference)
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model,
        F.cross_entropy,
        max_norm=bound,
        noise_multiplier=0.0,
        expected_batch_size=8,
        clipping=dp.automatic(GAMMA),
    )
    stats = optimizer.step(x, y)
    expected = automatic_sum(reference, bound)
    for name, param in model.named_parameters():
        want = before[name].numpy() - 0.5 * expected[name] / 8
        np.testing.assert_allclose(param.detach().numpy(), want, rtol=1e-5, atol=1e-6)
    assert stats.strategy == "ghost" and stats.max_norm == bound


def test_optax_automatic_zero_noise_matches_the_loop():
    params, x, y, reference = jax_problem()
    grads = pergrad.per_example_grads(jax_loss)(params, x, y)
    bound = median_bound(reference)
    tx = dp.optax_aggregate(bound, 0.0, 0, expected_batch_size=5, clipping=dp.automatic(GAMMA))
    mean, _ = jax.jit(tx.update)(grads, tx.init(params))
    assert_trees_close({k: v * 5 for k, v in mean.items()}, automatic_sum(reference, bound))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_private_grad_of_automatic_noise_is_scaled_by_max_norm(framework):
    """The noise of automatic clipping is that of the bound: the same draw as flat clipping's,
    added to the automatic sum (same seed, noise_multiplier * max_norm)."""
    loss, args, reference = loss_and_args(framework)

    def rng():
        return jax.random.key(3) if framework == "jax" else torch.Generator().manual_seed(3)

    auto, _ = dp.private_grad_of(
        loss, *args, max_norm=0.5, noise_multiplier=2.0, rng=rng(), clipping=dp.automatic()
    )
    noise_only, _ = dp.private_grad_of(
        loss, *args, max_norm=0.5, noise_multiplier=2.0, rng=rng(), strategy="materialize"
    )
    flat_sum, batch = standard_sum(reference, 0.5), len(next(iter(reference.values())))
    expected = automatic_sum(reference, 0.5)
    for name in reference:
        noise = to_numpy(noise_only[name]) * batch - flat_sum[name]
        assert np.abs(noise).max() > 0.1  # there is noise, of scale 2 * 0.5
        np.testing.assert_allclose(
            to_numpy(auto[name]) * batch, expected[name] + noise, rtol=1e-4, atol=1e-4
        )


# --- adaptive clipping: the bound's trajectory, the noise split, the count noise ----------------


@pytest.mark.parametrize("expected_batch_size", [None, 7])
def test_optax_adaptive_bound_follows_the_geometric_update(expected_batch_size):
    params, x, y, reference = jax_problem(batch=7)
    grads = pergrad.per_example_grads(jax_loss)(params, x, y)
    norms = flat_norms(reference)
    policy = dp.adaptive(count_noise_std=0.0, target_quantile=0.7, learning_rate=0.3)
    tx = dp.optax_aggregate(
        float(norms.min()) / 2, 0.0, 0, expected_batch_size=expected_batch_size, clipping=policy
    )
    state, update = tx.init(params), jax.jit(tx.update)
    bound = float(norms.min()) / 2
    for _ in range(12):
        mean, state = update(grads, state)
        assert_trees_close(
            {k: v * 7 for k, v in mean.items()}, standard_sum(reference, bound), 1e-4
        )
        bound = geometric_update(bound, norms, 0.7, 0.3)
        assert float(state.max_norm) == pytest.approx(bound, rel=1e-5)
    # after twelve steps the bound has climbed past most norms, towards their 0.7 quantile
    assert np.mean(norms <= bound) >= 0.5


def test_optax_adaptive_padding_is_not_counted():
    """Padding (mask False) neither counts as within the bound nor enters the fraction's
    denominator: the update is that of the real examples alone."""
    params, x, y, reference = jax_problem(batch=7)
    grads = pergrad.per_example_grads(jax_loss)(params, x, y)
    mask = np.array([True, True, False, True, False, True, True])
    norms = flat_norms(reference)[mask]
    start = float(np.max(norms)) * 2  # every real example within the bound
    policy = dp.adaptive(count_noise_std=0.0, target_quantile=0.5, learning_rate=0.2)
    tx = dp.optax_aggregate(start, 0.0, 0, clipping=policy)
    _, state = jax.jit(tx.update)(grads, tx.init(params), mask=jnp.asarray(mask))
    assert float(state.max_norm) == pytest.approx(geometric_update(start, norms, 0.5, 0.2), 1e-5)


def test_optax_adaptive_per_group_bounds_follow_their_own_norms():
    """Per-group bounds (here one per parameter): each follows the quantile of its own
    norms, with its own count."""
    params, x, y, reference = jax_problem(batch=8)
    grads = pergrad.per_example_grads(jax_loss)(params, x, y)
    policy = dp.adaptive(count_noise_std=0.0, target_quantile=0.5, learning_rate=0.4)
    norms = {name: flat_norms({name: reference[name]}) for name in params}
    bounds = {name: float(np.median(norms[name])) for name in params}
    tx = dp.optax_aggregate(dict(bounds), 0.0, 0, expected_batch_size=8, clipping=policy)
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(5):
        _, state = update(grads, state)
        for name in params:
            bounds[name] = geometric_update(bounds[name], norms[name], 0.5, 0.4)
            assert float(state.max_norm[name]) == pytest.approx(bounds[name], rel=1e-5)


def test_dp_optimizer_adaptive_bound_follows_the_geometric_update():
    """lr 0 keeps the model and so the norms fixed; each step's private gradient (.grad) is
    the clipped sum at the bound it reports, and the bound moves by the closed form."""
    model, x, y, reference = torch_problem(batch=10)
    norms = flat_norms(reference)
    policy = dp.adaptive(count_noise_std=0.0, target_quantile=0.4, learning_rate=0.25)
    bound = float(norms.max()) * 1.5
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        F.cross_entropy,
        max_norm=bound,
        noise_multiplier=0.0,
        expected_batch_size=10,
        clipping=policy,
    )
    for _ in range(6):
        stats = optimizer.step(x, y)
        assert stats.max_norm == pytest.approx(bound, rel=1e-6)
        grads = {name: p.grad for name, p in model.named_parameters()}
        assert_trees_close({k: v * 10 for k, v in grads.items()}, standard_sum(reference, bound))
        bound = geometric_update(bound, norms, 0.4, 0.25)
        assert optimizer.max_norm == pytest.approx(bound, rel=1e-5)
    state = optimizer.state_dict()
    fresh = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=0.0,
        clipping=policy,
    )
    fresh.load_state_dict(state)
    assert fresh.max_norm == optimizer.max_norm


def test_dp_optimizer_adaptive_accumulation_counts_every_micro_batch():
    model, x, y, reference = torch_problem(batch=10)
    norms = flat_norms(reference)
    policy = dp.adaptive(count_noise_std=0.0, target_quantile=0.5, learning_rate=0.2)
    start = float(np.median(norms))

    def optimizer():
        return dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            model,
            F.cross_entropy,
            max_norm=start,
            noise_multiplier=0.0,
            expected_batch_size=10,
            clipping=policy,
        )

    accumulated = optimizer()
    accumulated.accumulate(x[:4], y[:4])
    accumulated.step(x[4:], y[4:])
    assert accumulated.max_norm == pytest.approx(geometric_update(start, norms, 0.5, 0.2), 1e-6)


@pytest.mark.parametrize(("sigma", "count_std", "groups"), [(1.1, 12.8, 1), (0.8, 3.0, 3)])
def test_gradient_noise_multiplier_satisfies_the_split(sigma, count_std, groups):
    """sigma_grad^-2 + groups * (2 sigma_b)^-2 = sigma^-2 (Andrew et al. 2021, Theorem 1), and
    dp_accounting finds one Gaussian release of sigma and the composed pair equally private."""
    dpa = pytest.importorskip("dp_accounting", reason="the accounting cross-check")
    policy = dp.adaptive(count_noise_std=count_std)
    sigma_grad = policy.gradient_noise_multiplier(sigma, groups)
    assert sigma_grad > sigma
    assert sigma_grad**-2 + groups / (2 * count_std) ** 2 == pytest.approx(sigma**-2, rel=1e-12)

    def epsilon(event):
        accountant = dpa.rdp.RdpAccountant()
        accountant.compose(event, 100)
        return accountant.get_epsilon(1e-5)

    pair = dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(sigma_grad)] + [dpa.GaussianDpEvent(2 * count_std)] * groups
    )
    assert epsilon(pair) == pytest.approx(epsilon(dpa.GaussianDpEvent(sigma)), rel=1e-6)


def test_dp_paths_add_the_raised_gradient_noise():
    """DPOptimizer under adaptive clipping draws the same gradient noise as a flat-clipping
    DPOptimizer with noise_multiplier = the closed-form sigma_grad (same generator seed)."""
    sigma, count_std = 1.3, 2.0
    sigma_grad = (sigma**-2 - (2 * count_std) ** -2) ** -0.5
    updates = []
    for clipping, multiplier in (
        (dp.adaptive(count_noise_std=count_std), sigma),
        (None, sigma_grad),
    ):
        model, x, y, _ = torch_problem(batch=6)
        optimizer = dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            model,
            F.cross_entropy,
            max_norm=0.3,
            noise_multiplier=multiplier,
            expected_batch_size=6,
            generator=torch.Generator().manual_seed(11),
            clipping=clipping,
        )
        optimizer.step(x, y)
        updates.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in updates[0]:
        torch.testing.assert_close(updates[0][name], updates[1][name], rtol=1e-5, atol=1e-6)
    assert optimizer.gradient_noise_multiplier == sigma_grad  # the flat one reports sigma_grad


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_private_grad_of_adaptive_uses_the_raised_noise(framework):
    """The stateless path: private_grad_of(clipping=adaptive) adds the noise of sigma_grad;
    next_max_norm moves the bound by the closed form (count noise 0)."""
    loss, args, reference = loss_and_args(framework)
    sigma, count_std = 1.0, 0.9
    policy = dp.adaptive(count_noise_std=count_std, target_quantile=0.5, learning_rate=0.3)

    def rng():
        return jax.random.key(5) if framework == "jax" else torch.Generator().manual_seed(5)

    adaptive, clipped = dp.private_grad_of(
        loss, *args, max_norm=0.4, noise_multiplier=sigma, rng=rng(), clipping=policy
    )
    flat, _ = dp.private_grad_of(
        loss,
        *args,
        max_norm=0.4,
        noise_multiplier=policy.gradient_noise_multiplier(sigma),
        rng=rng(),
    )
    for name in reference:
        np.testing.assert_allclose(
            to_numpy(adaptive[name]), to_numpy(flat[name]), rtol=1e-5, atol=1e-6
        )
    silent = dp.adaptive(count_noise_std=0.0, target_quantile=0.5, learning_rate=0.3)
    bound = silent.next_max_norm(0.4, clipped, rng())
    expected = geometric_update(0.4, flat_norms(reference), 0.5, 0.3)
    assert float(bound) == pytest.approx(expected, rel=1e-5)


def count_noise_samples_jax(count_std: float, samples: int) -> np.ndarray:
    """The count noise of many independent optax steps (vmapped over keys), recovered from the
    bound each moved to: z = m * (-log(C'/C) / rate + q - 1/2) - unclipped + count / 2."""
    params, x, y, reference = jax_problem(batch=6)
    grads = pergrad.per_example_grads(jax_loss)(params, x, y)
    norms = flat_norms(reference)
    policy = dp.adaptive(count_noise_std=count_std, target_quantile=0.5, learning_rate=0.1)
    tx = dp.optax_aggregate(1.0, 0.0, 0, expected_batch_size=20.0, clipping=policy)
    state = tx.init(params)

    def moved(key):
        return tx.update(grads, state._replace(key=key))[1].max_norm

    keys = jax.random.split(jax.random.key(0), samples)
    bounds = np.asarray(jax.jit(jax.vmap(moved))(keys), np.float64)
    unclipped = float(np.sum(norms <= 1.0))
    return 20.0 * (-np.log(bounds) / 0.1 + 0.5 - 0.5) - unclipped + 6 / 2


def count_noise_samples_torch(count_std: float, samples: int) -> np.ndarray:
    """The same through next_max_norm with a torch.Generator (the draws DPOptimizer makes)."""
    policy = dp.adaptive(count_noise_std=count_std, target_quantile=0.5, learning_rate=0.1)
    norms = torch.tensor([0.5, 2.0, 0.7, 3.0])
    clipped = dp.ClippedSum({}, norms, 0.5, 1.0, torch.tensor(4.0), torch.tensor(0.0))
    generator = torch.Generator().manual_seed(0)
    bounds = np.array(
        [float(policy.next_max_norm(1.0, clipped, generator, 20.0)) for _ in range(samples)]
    )
    return 20.0 * (-np.log(bounds) / 0.1) - 2.0 + 4 / 2


@pytest.mark.parametrize(("framework", "samples"), [("jax", 4000), ("torch", 2000)])
def test_count_noise_has_the_claimed_std(framework, samples):
    """Mean 0 and std count_noise_std, within 5 standard errors of the sample size."""
    count_std = 3.0
    draw = count_noise_samples_jax if framework == "jax" else count_noise_samples_torch
    noise = draw(count_std, samples)
    assert abs(noise.mean()) < 5 * count_std / math.sqrt(samples)
    # the sample std's standard error is about std / sqrt(2 n)
    assert abs(noise.std(ddof=1) - count_std) < 5 * count_std / math.sqrt(2 * samples)


def test_optax_adaptive_gradient_noise_has_the_raised_std():
    """Zero gradients, one step: the update times m is pure noise of std sigma_grad * C."""
    sigma, count_std, bound = 1.0, 1.5, 0.7
    zeros = {"w": jnp.zeros((3, 100, 100))}
    tx = dp.optax_aggregate(
        bound, sigma, 1, expected_batch_size=4.0, clipping=dp.adaptive(count_noise_std=count_std)
    )
    mean, _ = jax.jit(tx.update)(zeros, tx.init(None))
    noise = np.asarray(mean["w"], np.float64).ravel() * 4.0
    expected = (sigma**-2 - (2 * count_std) ** -2) ** -0.5 * bound
    assert abs(noise.std() - expected) < 5 * expected / math.sqrt(2 * noise.size)


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: dp.automatic(gamma=0.0),
            ValueError,
            r"gamma must be a positive number; got 0\.0",
        ),
        (
            lambda: dp.automatic(gamma="0.1"),
            ValueError,
            r"gamma must be a positive number; got '0\.1'",
        ),
        (
            lambda: dp.adaptive(count_noise_std=1.0, target_quantile=1.0),
            ValueError,
            r"target_quantile must be in \(0, 1\); got 1\.0",
        ),
        (
            lambda: dp.adaptive(count_noise_std=1.0, target_quantile=0),
            ValueError,
            r"target_quantile must be a positive number; got 0",
        ),
        (
            lambda: dp.adaptive(count_noise_std=1.0, learning_rate=-0.1),
            ValueError,
            r"learning_rate must be a positive number; got -0\.1",
        ),
        (
            lambda: dp.adaptive(count_noise_std=-1.0),
            ValueError,
            r"count_noise_std must be a number >= 0; got -1\.0",
        ),
        (
            lambda: dp.adaptive(count_noise_std=0.4).gradient_noise_multiplier(1.0),
            ValueError,
            r"count_noise_std must exceed .* = 0\.5.*got count_noise_std=0\.4",
        ),
        (
            lambda: dp.adaptive(count_noise_std=1.0).gradient_noise_multiplier(1.0, num_groups=4),
            ValueError,
            r"sqrt\(4\) \* 1 / 2 = 1",
        ),
        (
            lambda: dp.clipped_sum({"w": jnp.ones((2, 3))}, 1.0, clipping="automatic"),
            TypeError,
            r"clipped_sum: clipping must be None .* got str",
        ),
        (
            lambda: dp.clip({"w": torch.ones(2, 3)}, 1.0, clipping=0.01),
            TypeError,
            r"clip: clipping must be .* got float",
        ),
        (
            lambda: dp.clipped_sum({"w": jnp.ones((2, 3))}, jnp.asarray(-1.0)),
            ValueError,
            r"clipped_sum: max_norm must be positive; got the 0-d array",
        ),
        (
            lambda: dp.optax_aggregate(1.0, 2.0, 0, clipping=dp.adaptive(count_noise_std=0.5)),
            ValueError,
            r"count_noise_std must exceed",
        ),
        (
            lambda: dp.optax_aggregate(
                1.0,
                1.0,
                0,
                clipping=dp.adaptive(count_noise_std=5.0),
                noise=dp.toeplitz([1.0, 0.5], steps=10),
            ),
            ValueError,
            r"optax_aggregate: adaptive clipping needs independent Gaussian noise",
        ),
        (
            lambda: dp.private_mean(
                {"w": jnp.ones((2, 3))},
                {"w": 1.0},
                1.0,
                jax.random.key(0),
                clipping=dp.adaptive(count_noise_std=0.5),
            ),
            ValueError,
            r"sqrt\(1\) \* 1 / 2 = 0\.5",
        ),
    ],
)
def test_bad_input(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_dp_optimizer_bad_clipping_arguments():
    model, _, _, _ = torch_problem()

    def build(**kw):
        return dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, F.cross_entropy, max_norm=1.0, **kw
        )

    with pytest.raises(TypeError, match=r"DPOptimizer: clipping must be .* got str"):
        build(noise_multiplier=1.0, clipping="adaptive")
    with pytest.raises(ValueError, match=r"count_noise_std must exceed .* = 0\.6"):
        build(noise_multiplier=1.2, clipping=dp.adaptive(count_noise_std=0.6))
    with pytest.raises(ValueError, match=r"DPOptimizer: adaptive clipping needs"):
        build(
            noise_multiplier=1.0,
            clipping=dp.adaptive(count_noise_std=5.0),
            noise=dp.toeplitz([1.0, 0.3], steps=5),
        )


def test_nothing_is_mutated():
    model, x, y, _ = torch_problem()
    model.eval()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    x_before, y_before = x.clone(), y.clone()
    for clipping in (dp.automatic(), dp.adaptive(count_noise_std=2.0)):
        optimizer = dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            model,
            F.cross_entropy,
            max_norm=1.0,
            noise_multiplier=1.0,
            clipping=clipping,
        )
        optimizer.step(x, y)
    assert not model.training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert not model._forward_hooks and not model[0]._backward_hooks
    assert torch.equal(x, x_before) and torch.equal(y, y_before)
    raw = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    grads = {"w": torch.from_numpy(raw.copy())}
    dp.clip(grads, 0.1, clipping=dp.automatic())
    dp.clipped_sum(grads, 0.1, clipping=dp.automatic())
    np.testing.assert_array_equal(grads["w"].numpy(), raw)


# --- the privacy audit --------------------------------------------------------------------------


@pytest.mark.slow(reason="two 50-step DP-SGD runs on digits with 1000 canaries, about 20 s")
def test_optax_adaptive_clipping_stays_below_its_claim():
    """An optax run with adaptive clipping, audited with gradient canaries (the machinery of
    tests/test_dp_audit_paths.py): the empirical lower bound stays below the epsilon of the
    noise_multiplier passed, which the gradient noise and the noisy counts share."""
    import logging

    import optax

    pytest.importorskip("scipy", reason="the audit statistics use scipy.stats")
    pytest.importorskip("sklearn", reason="digits ship with sklearn")
    import test_dp_audit_paths as paths

    logging.getLogger("absl").setLevel(logging.ERROR)
    runner = paths.JaxRunner()
    reference = runner.run_private_grad(None, 0.0, seed=101)
    expected_batch_size = paths.SAMPLE_RATE * runner.n
    policy = dp.adaptive(count_noise_std=expected_batch_size / 20)

    def run_adaptive(canaries, noise_multiplier, seed=202):
        tx = optax.chain(
            dp.optax_aggregate(
                paths.MAX_NORM,
                noise_multiplier,
                jax.random.key(seed, impl="rbg"),
                expected_batch_size=expected_batch_size,
                clipping=policy,
            ),
            optax.sgd(paths.LR),
        )

        @jax.jit
        def step(params, state, grads, mask):
            updates, state = tx.update(grads, state, params, mask=mask)
            return optax.apply_updates(params, updates), state

        params = runner.params()
        state = tx.init(params)
        no_u = jnp.zeros((runner.size, paths.HIDDEN))
        for index, indices, mask, _ in runner.batches(canaries, seed, False):
            grads = runner.per_example(params, runner.x[indices], runner.y[indices], no_u)
            grads, mask = canaries.inject(grads, mask, index, pad_to=runner.canary_rows)
            params, state = step(params, state, grads, mask)
        assert float(state[0].max_norm) != paths.MAX_NORM  # the bound moved
        return params

    canaries = dp.GradientCanaries(
        runner.params(), paths.NUM_CANARIES, sample_rate=paths.SAMPLE_RATE, seed=7
    )
    every = ("w1", "w2", "b2")
    report = paths.audit(canaries, run_adaptive, reference, 1.0, claimed_noise=1.0, keys=every)
    assert report.ceiling > report.epsilon  # the canaries could have refuted the claim
    assert not report.violated and report.epsilon_lower_bound < report.epsilon, str(report)
