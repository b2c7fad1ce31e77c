"""``pergrad.dp.SecureRandom`` (issue 17): Gaussian noise from the OS's cryptographic source.
Its draws are standard normal (moments and a Kolmogorov-Smirnov test against scipy's normal),
fresh on every call, also inside ``jax.jit`` (where a host draw at trace time would silently be
one constant reused by every step), and placed in the gradients' dtype."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad import dp


def test_draws_are_standard_normal_and_fresh():
    stats = pytest.importorskip("scipy.stats")
    source = dp.SecureRandom()
    first, second = source.normal((200_000,)), source.normal((200_000,))
    assert abs(first.mean()) < 0.01 and abs(first.var() - 1) < 0.02
    assert stats.kstest(first, "norm").pvalue > 1e-4
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.01
    assert source.normal((3, 4)).shape == (3, 4)
    single = dp.SecureRandom(terms=1).normal((100_000,))
    assert abs(single.var() - 1) < 0.03


def test_torch_noise_has_the_gradients_dtype_and_the_std_asked_for():
    torch = pytest.importorskip("torch")
    summed = {
        "w": torch.zeros(400, 500, dtype=torch.float32),
        "b": torch.zeros(3, dtype=torch.float64),
    }
    noisy = dp.add_noise(summed, 2.5, dp.SecureRandom())
    assert noisy["w"].dtype == torch.float32 and noisy["b"].dtype == torch.float64
    assert noisy["w"].std().item() == pytest.approx(2.5, rel=0.02)
    again = dp.add_noise(summed, 2.5, dp.SecureRandom())
    assert not torch.equal(noisy["w"], again["w"])


def test_jax_noise_is_fresh_on_every_jitted_call():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    source = dp.SecureRandom()

    @jax.jit
    def step(grads):
        return dp.add_noise(grads, 1.0, source)

    grads = {"w": jnp.zeros((300, 300))}
    first, second = step(grads)["w"], step(grads)["w"]
    assert not np.array_equal(np.asarray(first), np.asarray(second))
    assert float(first.std()) == pytest.approx(1.0, rel=0.02)
    assert first.dtype == jnp.float32
    eager = dp.add_noise(grads, 1.0, source)["w"]
    assert float(eager.std()) == pytest.approx(1.0, rel=0.02)


def test_dp_optimizer_takes_it_as_its_generator():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch import nn

    model = nn.Linear(64, 32)  # 2048 noised weights: their spread is 100 to within 2% (one sd)
    start = model.weight.detach().clone()
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=100.0,
        expected_batch_size=1,
        generator=dp.SecureRandom(),
    )
    optimizer.step(torch.randn(2, 64), torch.tensor([0, 1]))
    assert (model.weight.detach() - start).std().item() == pytest.approx(100.0, rel=0.15)
    with pytest.raises(
        TypeError, match="generator must be a torch.Generator, a pergrad.dp.SecureRandom"
    ):
        dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            model,
            F.cross_entropy,
            max_norm=1.0,
            noise_multiplier=1.0,
            generator=123,
        )


def test_terms_must_be_a_positive_int():
    with pytest.raises(ValueError, match="terms must be an int >= 1"):
        dp.SecureRandom(terms=0)
