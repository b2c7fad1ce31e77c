"""Fixed-size batches fed to a run accounted with Poisson sampling (issue 35): a plain
``DataLoader(batch_size=)`` with ``DPOptimizer`` / ``make_private``'s optimizer, or batches
without the loader's mask through ``make_private_optax``'s transformation, are said with a
``PrivacyWarning`` naming the Poisson sampler; the correct uses (the Poisson sampler,
``make_private``'s loader, the optax loader's mask) stay silent. The run length that warns
comes from the Binomial law of Poisson batch sizes, checked against scipy's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pergrad
from pergrad._src.dp.sampling import FixedSizeCheck

N, BATCH = 64, 8


def test_the_run_that_warns_is_improbable_under_poisson_sampling():
    stats = pytest.importorskip("scipy.stats")
    for expected, num_examples in [(8, 64), (64, 60000), (2, 1000)]:
        rate = expected / num_examples
        check = FixedSizeCheck("f", rate, expected)
        pmf = stats.binom.pmf(np.arange(num_examples + 1), num_examples, rate)
        run = check.run_needed
        assert np.sum(pmf**run) == pytest.approx(check.probability, rel=1e-6)
        assert np.sum(pmf**run) < 1e-9 <= np.sum(pmf ** (run - 1))
    # Poisson sizes themselves: 20000 steps, no warning
    sizes = np.random.default_rng(0).binomial(N, BATCH / N, size=20000)
    check = FixedSizeCheck("f", BATCH / N, BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.PrivacyWarning)
        for size in sizes:
            check.observe(int(size))
    assert FixedSizeCheck("f", 1.0, N).run_needed is None  # full batches never vary


torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def data():
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 3, generator=generator), torch.randint(0, 2, (N,)))


def dp_optimizer(model):
    accountant = pergrad.dp.Accountant(1.0, sample_rate=BATCH / N, delta=1e-5)
    return pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=BATCH,
        accountant=accountant,
    )


def run(optimizer, loader, epochs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for x, y in loader:
                optimizer.step(x, y)
    return [str(w.message) for w in record if issubclass(w.category, pergrad.PrivacyWarning)]


def test_dp_optimizer_says_fixed_size_batches_once_and_names_the_sampler():
    model = nn.Linear(3, 2)
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    messages = run(dp_optimizer(model), loader, epochs=3)
    assert len(messages) == 1
    message = messages[0]
    run_needed = FixedSizeCheck("f", BATCH / N, BATCH).run_needed
    assert f"the last {run_needed} steps all had exactly {BATCH} examples" in message
    assert "pergrad.dp.PoissonBatchSampler(len(dataset), sample_rate=0.125" in message
    assert "pergrad.dp.make_private" in message and 'sampling="fixed"' in message


def test_poisson_batches_do_not_warn():
    model = nn.Linear(3, 2)
    sampler = pergrad.dp.PoissonBatchSampler(
        N, BATCH / N, steps=60, generator=torch.Generator().manual_seed(1)
    )
    loader = DataLoader(
        data(),
        batch_sampler=sampler,
        collate_fn=pergrad.dp.collate_with_empty_batches(data()),
    )
    assert run(dp_optimizer(model), loader, epochs=1) == []


def test_make_private_its_loader_silent_a_plain_loader_warned():
    def setup():
        model = nn.Linear(3, 2)
        return pergrad.dp.make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data(),
            F.cross_entropy,
            batch_size=BATCH,
            epochs=3,
            noise_multiplier=1.0,
            delta=1e-5,
            max_norm=1.0,
            sampler_generator=torch.Generator().manual_seed(2),
        )

    optimizer, loader, _ = setup()
    assert run(optimizer, loader, epochs=1) == []
    optimizer, _, _ = setup()
    plain = DataLoader(data(), batch_size=BATCH, shuffle=True)
    (message,) = run(optimizer, plain, epochs=3)
    assert "PoissonBatchSampler" in message


def test_make_private_optax_wants_the_loaders_mask():
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax", reason="make_private_optax is JAX's")
    jnp = jax.numpy
    X = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
    Y = (X[:, 0] > 0).astype(np.int32)
    setup = pergrad.dp.make_private_optax(
        X, Y, batch_size=BATCH, epochs=1, noise_multiplier=1.0, delta=1e-5, max_norm=1.0, seed=0
    )
    tx, loader, _ = setup

    def loss(w, x, y):
        return -jax.nn.log_softmax(x @ w)[y]

    w = jnp.zeros((3, 2))
    state = tx.init(w)
    x, y, mask = next(iter(loader))
    grads = pergrad.per_example_grads(loss)(w, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.PrivacyWarning)
        tx.update(grads, state, w, mask=mask)  # the loader's batch: silent
    fixed = pergrad.per_example_grads(loss)(w, jnp.asarray(X[:BATCH]), jnp.asarray(Y[:BATCH]))
    with pytest.warns(pergrad.PrivacyWarning) as record:
        tx.update(fixed, state, w)
    assert len(record) == 1
    assert "for x, y, mask in loader" in str(record[0].message)
    with pytest.warns(pergrad.PrivacyWarning) as record:  # a padded batch, mask dropped: once
        tx.update(grads, state, w)
    assert len(record) == 1
