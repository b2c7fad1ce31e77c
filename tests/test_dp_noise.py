"""The noise-mechanism protocol (``pergrad.dp.NoiseMechanism``): every DP path adds the noise of
the mechanism it is given, threads its state from step to step, and the accounting reads its DP
event.

Two toy mechanisms, written here as a user would, against independent references:
``ScaledGaussian(k)`` is Gaussian noise of ``k`` times the scale, which must equal the default
mechanism at ``k`` times the noise multiplier (the same draws, the same epsilon); ``Growing``
keeps a step counter in its state and scales step ``t``'s draw by ``t + 1``, which shows the
state is threaded.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest

import pergrad
from pergrad import dp


class ScaledGaussian(dp.NoiseMechanism):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def add(self, summed, std, rng, state, *, owned=False):
        return dp.gaussian().add(summed, std * self.factor, rng, state, owned=owned)

    def dp_event(self, dpa, noise_multiplier, steps, sampled):
        release = dpa.GaussianDpEvent(noise_multiplier * self.factor)
        return dpa.SelfComposedDpEvent(sampled(release), steps)

    def __eq__(self, other):
        return isinstance(other, ScaledGaussian) and other.factor == self.factor

    def __hash__(self):
        return hash(self.factor)


class Growing(dp.NoiseMechanism):
    """Step t adds (t + 1) * std * z; the state is t."""

    def init(self, template):
        return 0

    def add(self, summed, std, rng, state, *, owned=False):
        noisy, _ = dp.gaussian().add(summed, std * (state + 1), rng, (), owned=owned)
        return noisy, state + 1

    def dp_event(self, dpa, noise_multiplier, steps, sampled):
        raise NotImplementedError  # not accounted in these tests


# --- accounting ------------------------------------------------------------------------------


def test_epsilon_reads_the_mechanisms_event():
    pytest.importorskip("dp_accounting")
    setting = {"sample_rate": 0.01, "steps": 100, "delta": 1e-5}
    scaled = dp.epsilon(noise_multiplier=0.5, noise=ScaledGaussian(2.0), **setting)
    assert scaled == pytest.approx(dp.epsilon(noise_multiplier=1.0, **setting), rel=1e-12)
    assert dp.epsilon(noise_multiplier=1.0, noise=dp.gaussian(), **setting) == dp.epsilon(
        noise_multiplier=1.0, **setting
    )


def test_noise_multiplier_for_calibrates_the_mechanism():
    pytest.importorskip("dp_accounting")
    setting = {"target_epsilon": 2.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 100}
    plain = dp.noise_multiplier_for(**setting)
    scaled = dp.noise_multiplier_for(noise=ScaledGaussian(2.0), **setting)
    assert scaled == pytest.approx(plain / 2, abs=1e-4)


def test_accountant_keeps_its_mechanism():
    pytest.importorskip("dp_accounting")
    accountant = dp.Accountant(0.5, 0.01, 1e-5, noise=ScaledGaussian(2.0))
    reference = dp.Accountant(1.0, 0.01, 1e-5)
    accountant.step(50)
    reference.step(50)
    assert accountant.noise == ScaledGaussian(2.0)
    assert accountant.epsilon() == pytest.approx(reference.epsilon(), rel=1e-12)


@pytest.mark.parametrize("call", ["epsilon", "Accountant"])
def test_noise_that_is_not_a_mechanism_is_refused(call):
    pytest.importorskip("dp_accounting")
    with pytest.raises(TypeError, match=f"{call}: noise must be a noise mechanism.*got str"):
        if call == "epsilon":
            dp.epsilon(noise_multiplier=1.0, sample_rate=0.1, steps=1, delta=1e-5, noise="blt")
        else:
            dp.Accountant(1.0, 0.1, 1e-5, noise="blt")


# --- PyTorch ---------------------------------------------------------------------------------


def _torch_problem():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    return torch, model, x, y


def _dp_step_params(torch, model, x, y, steps=1, **kwargs):
    model = copy.deepcopy(model)
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        torch.nn.functional.mse_loss,
        max_norm=1.0,
        generator=torch.Generator().manual_seed(7),
        **kwargs,
    )
    for _ in range(steps):
        optimizer.step(x, y)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_dp_optimizer_adds_the_mechanisms_noise():
    torch, model, x, y = _torch_problem()
    got = _dp_step_params(torch, model, x, y, noise_multiplier=0.5, noise=ScaledGaussian(2.0))
    want = _dp_step_params(torch, model, x, y, noise_multiplier=1.0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_dp_optimizer_threads_the_mechanisms_state():
    """Two SGD steps (learning rate 1, divided by 1): step t moves the parameters by its
    clipped sum plus (t + 1) * z_t, z drawn from the same generator in the same order."""
    torch, model, x, y = _torch_problem()
    got = _dp_step_params(
        torch, model, x, y, steps=2, noise_multiplier=1.0, noise=Growing(), expected_batch_size=1
    )
    clipped = dp.clipped_sum_of(
        pergrad.module_loss(model, torch.nn.functional.mse_loss),
        {k: v.detach() for k, v in model.named_parameters()},
        x,
        y,
        max_norm=1.0,
    )
    generator = torch.Generator().manual_seed(7)
    first = {k: torch.randn(v.shape, generator=generator) for k, v in clipped.sum.items()}
    model_after_one = {
        k: v.detach() - (clipped.sum[k] + 1.0 * first[k]) for k, v in model.named_parameters()
    }
    clipped_two = dp.clipped_sum_of(
        pergrad.module_loss(model, torch.nn.functional.mse_loss),
        model_after_one,
        x,
        y,
        max_norm=1.0,
    )
    second = {k: torch.randn(v.shape, generator=generator) for k, v in clipped.sum.items()}
    for name, value in model_after_one.items():
        want = value - (clipped_two.sum[name] + 2.0 * second[name])
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5)


def test_dp_optimizer_refuses_an_accountant_of_another_mechanism():
    pytest.importorskip("dp_accounting")
    torch, model, _, _ = _torch_problem()
    accountant = dp.Accountant(1.0, 0.01, 1e-5)
    with pytest.raises(ValueError, match="accountant accounts for GaussianNoise"):
        dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            model,
            torch.nn.functional.mse_loss,
            max_norm=1.0,
            noise_multiplier=0.5,
            noise=ScaledGaussian(2.0),
            accountant=accountant,
        )


def test_dp_optimizer_refuses_noise_that_is_not_a_mechanism():
    torch, model, _, _ = _torch_problem()
    with pytest.raises(TypeError, match="DPOptimizer: noise must be a noise mechanism"):
        dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            model,
            torch.nn.functional.mse_loss,
            max_norm=1.0,
            noise_multiplier=1.0,
            noise=1.0,
        )


# --- JAX / optax -----------------------------------------------------------------------------


def _jax_problem():
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    import jax.numpy as jnp

    grads = {"w": jax.random.normal(jax.random.key(0), (5, 3))}  # per-example, B = 5
    return jax, jnp, grads


def test_optax_aggregate_adds_the_mechanisms_noise():
    jax, jnp, grads = _jax_problem()
    params = {"w": jnp.zeros(3)}
    scaled = dp.optax_aggregate(1.0, 0.5, 3, noise=ScaledGaussian(2.0))
    plain = dp.optax_aggregate(1.0, 1.0, 3)
    got, _ = jax.jit(scaled.update)(grads, scaled.init(params))
    want, _ = jax.jit(plain.update)(grads, plain.init(params))
    assert bool(jnp.all(got["w"] == want["w"]))


def test_optax_aggregate_threads_the_mechanisms_state():
    jax, jnp, grads = _jax_problem()
    params = {"w": jnp.zeros(3)}
    growing = dp.optax_aggregate(1.0, 1.0, 3, expected_batch_size=1.0, noise=Growing())
    state = growing.init(params)
    assert state.noise_state == 0
    first, state = growing.update(grads, state)
    second, state = growing.update(grads, state)
    assert state.noise_state == 2
    # the same keys as the aggregate splits them; the clipped sum by pergrad.dp.clipped_sum
    summed = dp.clipped_sum(grads, 1.0).sum["w"]
    key = jax.random.key(3)
    for step, got in enumerate([first, second]):
        key, noise_key = jax.random.split(key)
        (leaf_key,) = jax.random.split(noise_key, 1)
        draw = jax.random.normal(leaf_key, (3,))
        assert bool(jnp.allclose(got["w"], summed + (step + 1.0) * draw, atol=1e-6))


def test_optax_aggregate_refuses_noise_that_is_not_a_mechanism():
    _jax_problem()
    with pytest.raises(TypeError, match="optax_aggregate: noise must be a noise mechanism"):
        dp.optax_aggregate(1.0, 1.0, 0, noise=math.pi)


# --- the realised batch size under Poisson sampling -------------------------------------------


def test_dp_optimizer_warns_when_a_poisson_accountant_meets_the_realised_batch_size():
    """Dividing by the realised batch size releases it, which the Poisson accounting does not
    cover: said once, with the fix; not said when expected_batch_size is given."""
    pytest.importorskip("dp_accounting")
    torch, model, _, _ = _torch_problem()
    accountant = dp.Accountant(1.0, 0.01, 1e-5)

    def make(**kwargs):
        return dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            model,
            torch.nn.functional.mse_loss,
            max_norm=1.0,
            noise_multiplier=1.0,
            accountant=accountant,
            **kwargs,
        )

    with pytest.warns(pergrad.PrivacyWarning, match=r"expected_batch_size=sample_rate \* len"):
        make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.PrivacyWarning)
        make(expected_batch_size=4.0)


# --- the draws: what the accountant assumes ---------------------------------------------------


def reference_noise(leaves, std, seed):
    """``std * z`` for each leaf, ``z`` drawn leaf by leaf in flat order from a generator of
    ``seed``, one ``torch.randn`` of the leaf's shape and dtype each: the draws of one Gaussian
    mechanism per leaf that the accountant composes."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [std * torch.randn(x.shape, generator=generator, dtype=x.dtype) for x in leaves]


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("group_numbers", [1, 50, 2**24])
def test_gaussian_noise_is_a_draw_per_leaf_in_order(monkeypatch, owned, group_numbers):
    torch = pytest.importorskip("torch")
    from pergrad._src.dp import noise as noise_module

    monkeypatch.setattr(noise_module, "GROUP_NUMBERS", group_numbers)  # groups of leaves
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(3, generator=generator)
    leaves = [
        torch.randn(4, 5, generator=generator),
        torch.randn((), generator=generator, dtype=torch.float64),
        shared,
        torch.randn(33, generator=generator),
        shared,  # the same array twice: two draws, both added
        torch.randn(7, 129, generator=generator),  # vectorised draws at an odd offset of a buffer
    ]
    expected = [x.clone() for x in leaves]
    for k, drawn in enumerate(reference_noise(leaves, 0.7, seed=5)):
        expected[k] = (expected[2] if k == 4 and owned else expected[k]) + drawn
    noisy, _ = dp.gaussian().add(
        list(leaves), 0.7, torch.Generator().manual_seed(5), (), owned=owned
    )
    for got, want in zip(noisy, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def chunked_reference(size: int, chunk: int, generator):
    """A large CPU draw as documented (``torch_backend.NOISE_CHUNK_NUMBERS``): one seed a
    chunk from ``generator`` (``torch.randint`` below ``2**62``), then each chunk
    ``torch.randn`` from a generator of its seed, one after another."""
    import torch

    count = -(-size // chunk)
    seeds = torch.randint(2**62, (count,), generator=generator, dtype=torch.int64).tolist()
    sizes = [min(chunk, size - k * chunk) for k in range(count)]
    return torch.cat(
        [
            torch.randn(n, generator=torch.Generator().manual_seed(seed))
            for n, seed in zip(sizes, seeds)
        ]
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_large_cpu_draws_are_chunks_of_seeded_generators_whatever_the_threads(monkeypatch, threads):
    """A leaf of more than NOISE_CHUNK_NUMBERS numbers is drawn in chunks, side by side on
    torch's threads: the documented numbers (one seed a chunk from the generator, in order),
    the same on one thread as on two, and the leaves after it drawn from the generator where
    the seeds left it."""
    torch = pytest.importorskip("torch")
    from pergrad._src.backends import torch_backend

    monkeypatch.setattr(torch_backend, "NOISE_CHUNK_NUMBERS", 64)
    leaves = [torch.zeros(10, 100), torch.zeros(30), torch.zeros(7, 9, 3)]  # 1000, 30, 189
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        noisy, _ = dp.gaussian().add(leaves, 1.0, torch.Generator().manual_seed(7), ())
    finally:
        torch.set_num_threads(before)
    generator = torch.Generator().manual_seed(7)
    first = chunked_reference(1000, 64, generator).reshape(10, 100)
    second = torch.randn(30, generator=generator)  # 30 numbers: torch.randn's own draw
    third = chunked_reference(189, 64, generator).reshape(7, 9, 3)
    for got, want in zip(noisy, (first, second, third)):
        assert torch.equal(got, want)


def test_chunked_draws_are_standard_normal_and_independent(monkeypatch):
    """The chunks' numbers are standard normal (mean, variance, a tail) and the chunks do not
    repeat one another (each its own seed): 2**18 numbers in chunks of 2**12."""
    torch = pytest.importorskip("torch")
    from pergrad._src.backends import torch_backend

    monkeypatch.setattr(torch_backend, "NOISE_CHUNK_NUMBERS", 2**12)
    size = 2**18
    (z,), _ = dp.gaussian().add(
        [torch.zeros(size, dtype=torch.float64)], 1.0, torch.Generator().manual_seed(1), ()
    )
    assert abs(float(z.mean())) < 5 / math.sqrt(size)
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2 / size)
    beyond = float((z.abs() > 3).double().mean())  # P(|Z| > 3) = 0.0027
    assert abs(beyond - math.erfc(3 / math.sqrt(2))) < 5 * math.sqrt(0.0027 / size)
    chunks = z.reshape(-1, 2**12)
    correlation = torch.corrcoef(chunks[:8])  # 8 chunks against each other
    off_diagonal = correlation - torch.eye(8, dtype=correlation.dtype)
    assert float(off_diagonal.abs().max()) < 5 / math.sqrt(2**12)


def test_dp_optimizer_noise_is_the_reference_draws():
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    std, batch_size, lr = 0.3, 5, 0.1
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        model,
        lambda out, y: 0.0 * (out * y).sum(),  # zero gradients: the update is the noise alone
        max_norm=1.0,
        noise_multiplier=std,
        expected_batch_size=batch_size,
        generator=torch.Generator().manual_seed(11),
    )
    optimizer.step(torch.randn(batch_size, 3), torch.randn(batch_size, 2))
    for p, p0, drawn in zip(model.parameters(), before, reference_noise(before, std, seed=11)):
        assert torch.equal(p.detach(), p0 - lr * (drawn / batch_size))
