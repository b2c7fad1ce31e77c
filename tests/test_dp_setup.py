"""The one-call DP setup (issue 35): ``plan``, ``make_private`` (PyTorch) and
``make_private_optax`` (JAX) derive the sample rate, the steps, the noise, the expected batch
size, the sampler and the accountant together; ``DPStep.loss`` carries the step's loss."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad import dp
from pergrad._src.errors import PergradTypeError, PergradValueError

dpa = pytest.importorskip("dp_accounting", reason="the plans are accounted")


def pld_epsilon(noise_multiplier, sample_rate, steps, delta, rounds=None):
    """dp_accounting's own PLD epsilon of Poisson-sampled Gaussian steps (the reference)."""
    event = dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier))
    accountant = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return accountant.compose(event, rounds or steps).get_epsilon(delta)


def test_plan_derives_rate_steps_and_batch_size_from_the_dataset_and_epochs():
    run = dp.plan(1000, batch_size=64, epochs=3, noise_multiplier=1.3, delta=1e-5)
    assert run.sample_rate == 64 / 1000 and run.expected_batch_size == 64
    assert run.steps_per_epoch == 16 and run.steps == 3 * 16  # ceil(1000 / 64) per epoch
    assert run.epochs == pytest.approx(3 * 16 * 64 / 1000)
    assert run.accountant == "pld" and run.noise == dp.gaussian()
    assert run.epsilon() == pytest.approx(pld_epsilon(1.3, 0.064, 48, 1e-5), rel=1e-9)
    for shown in ("num_examples=1000", "sample_rate=0.064", "steps=48", "noise_multiplier=1.3"):
        assert shown in repr(run)


def test_plan_calibrates_the_noise_to_the_target_with_the_same_steps_and_rate():
    run = dp.plan(400, batch_size=40, steps=30, target_epsilon=4.0, delta=1e-5, accountant="rdp")
    rdp = dpa.rdp.RdpAccountant()
    event = dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(run.noise_multiplier))
    spent = rdp.compose(event, 30).get_epsilon(1e-5)
    looser = dpa.rdp.RdpAccountant().compose(
        dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(0.99 * run.noise_multiplier)), 30
    )
    assert spent <= 4.0 < looser.get_epsilon(1e-5)  # the smallest noise within the target
    assert run.target_epsilon == 4.0 and run.epsilon() == pytest.approx(spent, rel=1e-9)


def test_plan_takes_a_cyclic_poisson_toeplitz_run_from_its_mechanism():
    mech = dp.toeplitz([1.0, 0.5], steps=12, min_separation=3, sample_rate=0.3)
    run = dp.plan(600, noise_multiplier=2.0, delta=1e-5, noise=mech)
    assert (run.steps, run.sample_rate, run.min_separation) == (12, 0.3, 3)
    assert run.expected_batch_size == pytest.approx(600 * 0.3 / 3)
    # amplified banded accounting (Choquette-Choo et al. 2023, Theorem 4): ceil(12 / 3)
    # Poisson-sampled Gaussian releases, the noise scaled to one column's sensitivity
    reference = pld_epsilon(2.0, 0.3, 12, 1e-5, rounds=4)
    assert run.epsilon() == pytest.approx(reference, rel=1e-9)
    batches = list(run.batches(seed=0))
    assert len(batches) == 12
    groups = [set(np.concatenate(batches[g::3]).tolist()) for g in range(3)]
    assert not (groups[0] & groups[1] or groups[1] & groups[2] or groups[0] & groups[2])


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(epochs=1, target_epsilon=1.0, noise_multiplier=1.0), PergradTypeError,
         "exactly one of target_epsilon= and noise_multiplier="),
        (dict(noise_multiplier=1.0), PergradTypeError, "exactly one of epochs= and steps="),
        (dict(epochs=1, noise_multiplier=1.0, batch_size=200), PergradValueError,
         "batch_size must be in (0, num_examples=100]"),
        (dict(epochs=1, noise_multiplier=1.0, delta=0.5 + 0.5), PergradValueError,
         "delta must be in (0, 1)"),
        (dict(noise_multiplier=1.0, noise="optimal"), PergradTypeError, "noise must be"),
        (dict(epochs=1, noise_multiplier=1.0, accountant="prv"), PergradValueError,
         "accountant must be one of ['rdp', 'pld']"),
    ],
)  # fmt: skip
def test_plan_refuses_bad_or_clashing_arguments_by_name(kwargs, error, words):
    arguments = dict(batch_size=10, delta=1e-5) | kwargs
    with pytest.raises(error, match=r"^plan: ") as raised:
        dp.plan(100, **arguments)
    assert words in str(raised.value)


def test_plan_refuses_a_mechanism_its_samplers_cannot_serve():
    with pytest.raises(PergradValueError, match="accounted without sampling"):
        dp.plan(100, batch_size=10, noise_multiplier=1.0, delta=1e-5,
                noise=dp.toeplitz([1.0, 0.5], steps=10))  # fmt: skip
    mech = dp.toeplitz([1.0], steps=10, min_separation=2, sample_rate=0.2)
    with pytest.raises(PergradValueError, match=r"batch_size=30 disagrees .* 10 examples"):
        dp.plan(100, batch_size=30, noise_multiplier=1.0, delta=1e-5, noise=mech)
    with pytest.raises(PergradValueError, match="leave epochs out"):
        dp.plan(100, epochs=2, noise_multiplier=1.0, delta=1e-5, noise=mech)


# --- PyTorch -------------------------------------------------------------------------------


def torch_setup(**kwargs):
    torch = pytest.importorskip("torch", reason="make_private is PyTorch's")
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(90, 4), torch.randint(0, 3, (90,)))
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    arguments = dict(batch_size=20, epochs=2, noise_multiplier=0.8, delta=1e-5, max_norm=1.0,
                     sampler_generator=torch.Generator().manual_seed(0)) | kwargs  # fmt: skip
    setup = dp.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data,
        torch.nn.functional.cross_entropy, **arguments,
    )  # fmt: skip
    return setup, model, data


def test_make_private_wires_optimizer_loader_and_accountant_to_one_plan():
    setup, model, data = torch_setup()
    optimizer, loader, accountant = setup
    assert isinstance(optimizer, dp.DPOptimizer) and optimizer.model is model
    assert optimizer.expected_batch_size == 20 and optimizer.noise_multiplier == 0.8
    assert optimizer.accountant is accountant and accountant.sample_rate == 20 / 90
    assert accountant.noise_multiplier == 0.8 and accountant.accountant == "pld"
    assert setup.steps == 2 * 5 and setup.sample_rate == 20 / 90
    sizes = []
    for _epoch in range(2):
        assert len(loader) == 5
        for x, y in loader:
            sizes.append(len(y))
            optimizer.step(x, y)
    assert len(sizes) == 10 and accountant.steps == 10
    with pytest.raises(PergradValueError, match="the planned run of 10 steps is spent"):
        next(iter(loader))
    assert "steps taken=10" in repr(setup) and "DPOptimizer" in repr(setup)


def test_make_private_batches_are_poisson_at_the_plan_rate():
    setup, _, data = torch_setup(epochs=None, steps=400)
    sampler = setup.loader.batch_sampler
    assert isinstance(sampler.inner, dp.PoissonBatchSampler)
    assert sampler.inner.sample_rate == 20 / 90 and sampler.inner.steps == 400
    sizes = []
    while len(sampler):  # epoch after epoch, to the end of the run
        sizes += [len(batch) for batch in sampler]
    assert len(sizes) == 400
    # Binomial(90, 2/9) batch sizes: mean 20, standard error of the mean 3.9 / 20
    assert abs(np.mean(sizes) - 20) < 5 * np.sqrt(90 * (2 / 9) * (7 / 9) / 400)


def test_make_private_refuses_loader_options_that_would_change_the_sampling():
    with pytest.raises(PergradValueError, match=r"\['shuffle'\] cannot be passed"):
        torch_setup(shuffle=True)


def test_dp_step_loss_is_the_mean_loss_of_the_batch_without_another_forward_pass():
    torch = pytest.importorskip("torch", reason="DPStep is PyTorch's")
    setup, model, data = torch_setup(noise_multiplier=0.0)
    x, y = data.tensors[0][:12], data.tensors[1][:12]
    with torch.no_grad():
        before = torch.nn.functional.cross_entropy(model(x), y).item()
    stats = setup.optimizer.step(x, y)
    assert stats.strategy == "ghost" and stats.loss == pytest.approx(before, rel=1e-6)
    # accumulated micro-batches: the mean over all their examples
    with torch.no_grad():
        now = torch.nn.functional.cross_entropy(model(x), y).item()
    setup.optimizer.accumulate(x[:5], y[:5])
    assert setup.optimizer.step(x[5:], y[5:]).loss == pytest.approx(now, rel=1e-6)


def test_dp_step_loss_is_none_where_the_strategy_computes_no_losses():
    pytest.importorskip("torch", reason="DPStep is PyTorch's")
    setup, _, data = torch_setup(strategy="chunked")
    stats = setup.optimizer.step(data.tensors[0][:8], data.tensors[1][:8])
    assert stats.strategy == "chunked" and stats.loss is None


# --- JAX -----------------------------------------------------------------------------------


def test_make_private_optax_loader_yields_padded_batches_with_their_mask():
    jnp = pytest.importorskip("jax.numpy", reason="make_private_optax is JAX's")
    optax = pytest.importorskip("optax", reason="make_private_optax is JAX's")
    x = np.arange(120, dtype=np.float32).reshape(60, 2)
    y = np.arange(60, dtype=np.float32)
    setup = dp.make_private_optax(
        x, y, batch_size=6, epochs=2, noise_multiplier=1.0, delta=1e-5, max_norm=1.0,
        optimizer=optax.sgd(0.1), key=0, seed=0,
    )  # fmt: skip
    tx, loader, accountant = setup
    size = setup.plan.max_batch_size()
    assert loader.max_batch_size == size and len(loader) == 10
    seen = 0
    for _epoch in range(2):
        for xb, yb, mask in loader:
            assert xb.shape == (size, 2) and yb.shape == (size,) and mask.dtype == jnp.bool_
            real = np.asarray(yb)[np.asarray(mask)].astype(int)
            assert len(set(real)) == len(real)  # distinct examples, gathered row by row
            np.testing.assert_array_equal(np.asarray(xb)[np.asarray(mask)], x[real])
            np.testing.assert_array_equal(np.asarray(yb)[~np.asarray(mask)], 0.0)  # example 0
            seen += 1
            assert accountant.steps == seen  # the loader counts every batch it yields
    assert seen == setup.steps == 20
    with pytest.raises(PergradValueError, match="spent"):
        iter(loader)
    assert accountant.epsilon() == pytest.approx(pld_epsilon(1.0, 0.1, 20, 1e-5), rel=1e-9)
