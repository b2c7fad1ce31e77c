"""pergrad.dp clipping, noise and the two DP-SGD optimizers, against numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pergrad
from pergrad import dp

RNG = np.random.default_rng(5)


def random_grads(batch_size=8, scale=3.0):
    return {
        "w": scale * RNG.normal(size=(batch_size, 4, 3)),
        "b": scale * RNG.normal(size=(batch_size, 3)),
    }


def to_fw(fw, tree):
    return {k: fw.array(v) for k, v in tree.items()}


def numpy_clipped_sum(grads, max_norm, mask=None):
    flat = np.concatenate([g.reshape(len(g), -1) for g in grads.values()], axis=1)
    norms = np.linalg.norm(flat, axis=1)
    factors = np.minimum(1.0, max_norm / np.maximum(norms, 1e-30))
    if mask is not None:
        factors = factors * mask
    return {k: np.tensordot(factors, g, axes=1) for k, g in grads.items()}, norms


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 10), st.floats(0.01, 10.0), st.floats(0.01, 100.0))
def test_clipped_norms_never_exceed_the_bound(batch_size, max_norm, scale):
    import torch

    grads = {k: torch.tensor(v) for k, v in random_grads(batch_size, scale).items()}
    norms = pergrad.norms.per_example_norms(dp.clip(grads, max_norm))
    assert (norms <= max_norm * (1 + 1e-6)).all()
    original = pergrad.norms.per_example_norms(grads)
    untouched = original <= max_norm
    torch.testing.assert_close(norms[untouched], original[untouched])


def test_clip_and_clipped_sum_match_numpy(fw):
    grads = random_grads()
    expected_sum, expected_norms = numpy_clipped_sum(grads, 2.0)
    result = dp.clipped_sum(to_fw(fw, grads), 2.0)
    for k in grads:
        np.testing.assert_allclose(
            fw.to_numpy(result.sum[k]), expected_sum[k], rtol=1e-4, atol=1e-5
        )
    np.testing.assert_allclose(fw.to_numpy(result.norms), expected_norms, rtol=1e-5)
    assert float(result.clip_fraction) == pytest.approx((expected_norms > 2.0).mean())
    clipped = dp.clip(to_fw(fw, grads), 2.0)
    for k in grads:
        np.testing.assert_allclose(
            fw.to_numpy(clipped[k]).sum(0), expected_sum[k], rtol=1e-4, atol=1e-5
        )


def test_mask_removes_padding(fw):
    grads = random_grads()
    mask = np.array([1, 1, 0, 1, 0, 0, 1, 1], dtype=np.float32)
    expected, _ = numpy_clipped_sum(grads, 1.0, mask)
    result = dp.clipped_sum(to_fw(fw, grads), 1.0, mask=fw.array(mask))
    for k in grads:
        np.testing.assert_allclose(fw.to_numpy(result.sum[k]), expected[k], rtol=1e-4, atol=1e-5)
    assert float(result.count) == 5


def test_per_layer_bounds_hold_per_group(fw):
    grads = random_grads()
    bounds = {"w": 0.5, "b": 2.0}
    clipped = dp.clip(to_fw(fw, grads), bounds)
    per_leaf = pergrad.norms.per_example_norms(clipped, per_layer=True)
    for k, bound in bounds.items():
        assert (fw.to_numpy(per_leaf[k]) <= bound * (1 + 1e-5)).all()
    assert dp.clipped_sum(to_fw(fw, grads), bounds).sensitivity == pytest.approx(
        math.hypot(0.5, 2.0)
    )


def test_huge_bound_and_no_noise_give_the_plain_mean(fw):
    w, x, y = RNG.normal(size=3), RNG.normal(size=(10, 3)), RNG.normal(size=10)

    def loss(w, x, y):
        return ((x * w).sum() - y) ** 2

    grads = pergrad.per_example_grads(loss)(fw.array(w), fw.array(x), fw.array(y))
    rng = _rng(fw, 0)
    private, _ = dp.private_mean({"w": grads}, 1e9, 0.0, rng)
    batch_gradient = (2 * (x @ w - y)[:, None] * x).mean(0)  # gradient of the mean loss
    np.testing.assert_allclose(fw.to_numpy(private["w"]), batch_gradient, rtol=1e-4, atol=1e-5)


def _rng(fw, seed):
    if fw.name == "jax":
        import jax

        return jax.random.key(seed)
    import torch

    return torch.Generator().manual_seed(seed)


def test_noise_has_the_promised_std_and_zero_mean(fw):
    zeros = {"w": fw.array(np.zeros(200_000, dtype=np.float32))}
    std = 1.7
    noise = fw.to_numpy(dp.add_noise(zeros, std, _rng(fw, 1))["w"]).astype(np.float64)
    n = noise.size
    # 5 standard errors each: a false alarm about once in 1.7 million runs per check.
    assert abs(noise.mean()) < 5 * std / math.sqrt(n)
    assert abs(noise.std() - std) < 5 * std / math.sqrt(2 * n)


def test_seeds_decide_the_noise(fw):
    zeros = {"w": fw.array(np.zeros(50, dtype=np.float32))}
    first = fw.to_numpy(dp.add_noise(zeros, 1.0, _rng(fw, 3))["w"])
    again = fw.to_numpy(dp.add_noise(zeros, 1.0, _rng(fw, 3))["w"])
    other = fw.to_numpy(dp.add_noise(zeros, 1.0, _rng(fw, 4))["w"])
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


def test_optax_aggregate_without_noise_matches_optax():
    jax = pytest.importorskip("jax", reason="the optax transform is JAX-only")
    optax_contrib = pytest.importorskip("optax.contrib", reason="compares with optax's own")
    grads = {k: jax.numpy.asarray(v, dtype="float32") for k, v in random_grads().items()}
    ours = dp.optax_aggregate(1.5, 0.0, key=0)
    theirs = optax_contrib.differentially_private_aggregate(1.5, 0.0, jax.random.key(0))
    ours_update, state = jax.jit(ours.update)(grads, ours.init(grads))
    theirs_update, _ = theirs.update(grads, theirs.init(grads))
    for k in grads:
        np.testing.assert_allclose(ours_update[k], theirs_update[k], rtol=1e-5, atol=1e-6)
    assert 0 <= float(state.clip_fraction) <= 1


def test_optax_padding_contributes_nothing_under_jit():
    jax = pytest.importorskip("jax", reason="the optax transform is JAX-only")
    grads = random_grads(batch_size=5)
    padded = {k: np.concatenate([v, 100 * np.ones((3, *v.shape[1:]))]) for k, v in grads.items()}
    mask = np.array([1, 1, 1, 1, 1, 0, 0, 0], dtype=bool)
    tx = dp.optax_aggregate(1.0, 0.0, key=0, expected_batch_size=4.0)
    step = jax.jit(tx.update)
    real, _ = step(
        {k: jax.numpy.asarray(v) for k, v in grads.items()}, tx.init(None), mask=np.ones(5, bool)
    )
    with_padding, _ = step(
        {k: jax.numpy.asarray(v) for k, v in padded.items()}, tx.init(None), mask=mask
    )
    for k in grads:
        np.testing.assert_allclose(real[k], with_padding[k], rtol=1e-5, atol=1e-6)
    empty, _ = step(
        {k: jax.numpy.asarray(v) for k, v in padded.items()}, tx.init(None), mask=np.zeros(8, bool)
    )
    assert all(float(abs(empty[k]).max()) == 0 for k in grads)  # no noise, no examples: zero


def test_dp_optimizer_zero_noise_step_matches_a_manual_step():
    torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch")
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    # The reference: autograd one example at a time, clip in numpy, average, one SGD step.
    per_example = []
    for i in range(12):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        per_example.append({k: p.grad.cpu().numpy().copy() for k, p in model.named_parameters()})
    stacked = {k: np.stack([g[k] for g in per_example]) for k in before}
    clipped_sum, _ = numpy_clipped_sum(stacked, 0.5)
    model.zero_grad(set_to_none=True)
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.3),
        model,
        F.cross_entropy,
        max_norm=0.5,
        noise_multiplier=0.0,
        expected_batch_size=10,
    )
    stats = optimizer.step(x, y)
    for k, p in model.named_parameters():
        expected = before[k].cpu().numpy() - 0.3 * clipped_sum[k] / 10
        np.testing.assert_allclose(p.detach().cpu().numpy(), expected, rtol=1e-4, atol=1e-6)
    assert stats.batch_size == 12 and 0 <= stats.clip_fraction <= 1
    assert stats.strategy == "ghost"  # Linear and Tanh: no B x P per-example gradients
    assert model.training  # the model's mode is untouched


def test_dp_step_reports_the_strategy_that_ran_not_the_plan():
    """A model whose examples interact in a way no assessment sees (its forward centres a
    hidden layer over the batch): the plan is ghost, the ghost run's row check refuses, and
    the chunked strategy stands in. ``DPStep.strategy`` must say "chunked"."""
    torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch")
    import torch.nn.functional as F
    from torch import nn

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x):
            hidden = torch.tanh(self.a(x))
            return self.b(hidden - hidden.mean(0, keepdim=True))

    torch.manual_seed(0)
    model = Centred()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    assert pergrad.norms.choose_strategy(loss, loss.params(), x, y).strategy == "ghost"
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=0.0,
        expected_batch_size=6,
    )
    with pytest.warns(pergrad.FallbackWarning, match="ghost strategy cannot handle"):
        stats = optimizer.step(x, y)
    assert stats.strategy == "chunked"


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad-scaler"])
def test_dp_optimizer_noised_update_is_clipped_sum_plus_add_noise(scaler):
    # the optimizer noises its sums in place: the same draws, order and rounding as add_noise,
    # and the clipped sum it noises is left alone by nobody else (a second step agrees too)
    torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch")
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        F.cross_entropy,
        max_norm=0.7,
        noise_multiplier=1.3,
        expected_batch_size=8,
        generator=torch.Generator().manual_seed(5),
        scaler=torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None,
    )
    reference = torch.Generator().manual_seed(5)
    for _ in range(2):
        clipped = dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=0.7)
        want = dp.add_noise(clipped.sum, 1.3 * 0.7, reference)
        optimizer.step(x, y)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, want[name] / 8, rtol=1e-6, atol=1e-7)
        optimizer.zero_grad()


def test_dp_optimizer_does_not_hold_the_last_steps_grads_through_the_next():
    # each step overwrites .grad: the last step's are dropped before this step's passes, as
    # zero_grad(set_to_none=True) would (a model's worth of memory otherwise)
    torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch")
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)
    seen = []

    def loss_fn(output, y):
        seen.append([p.grad is None for p in model.parameters() if p.requires_grad])
        return F.cross_entropy(output, y)

    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        loss_fn,
        max_norm=1.0,
        noise_multiplier=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    for _ in range(2):
        optimizer.step(x, y)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert model[0].bias.grad is None  # frozen: never written
    assert len(seen) >= 2 and all(all(flags) for flags in seen)


def test_dp_optimizer_takes_a_step_on_an_empty_batch():
    torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch")
    import torch.nn.functional as F
    from torch import nn

    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4,
        generator=torch.Generator().manual_seed(0),
    )
    stats = optimizer.step(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    assert stats.batch_size == 0
    assert not torch.equal(model.weight.detach(), before)  # the noise still moved it


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda g: dp.clip(g, 0.0), "max_norm must be a positive number"),
        (lambda g: dp.clip(g, -1.0), "max_norm must be a positive number"),
        (lambda g: dp.clip(g, {"w": 1.0, "z": 1.0}), "does not match the gradients"),
        (lambda g: dp.clipped_sum(g, 1.0, mask=g["b"][:, 0][:3]), r"mask must be a \(8,\) array"),
        (lambda g: dp.add_noise(g, -1.0, None), "std must be a number >= 0"),
        (lambda g: dp.private_mean(g, 1.0, -0.5, None), "noise_multiplier must be a number >= 0"),
        (
            lambda g: dp.private_mean(g, 1.0, 1.0, None, expected_batch_size=0),
            "expected_batch_size",
        ),
    ],
)
def test_bad_input(call, match):
    torch = pytest.importorskip("torch", reason="bad-input checks run on torch tensors")
    grads = {k: torch.tensor(v) for k, v in random_grads().items()}
    with pytest.raises(ValueError, match=match):
        call(grads)


def test_bad_optimizer_arguments():
    torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch")
    import torch.nn.functional as F

    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        dp.DPOptimizer("sgd", model, F.cross_entropy, max_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        dp.DPOptimizer(sgd, model, F.cross_entropy, max_norm=0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier must be a number >= 0"):
        dp.DPOptimizer(sgd, model, F.cross_entropy, max_norm=1.0, noise_multiplier=-1)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        dp.DPOptimizer(sgd, model, F.cross_entropy, max_norm=1.0, noise_multiplier=1.0, generator=3)
    with pytest.raises(TypeError, match="key must be a JAX PRNG key or an int seed"):
        dp.optax_aggregate(1.0, 1.0, key="seed")


def test_clip_fraction_counts_norms_above_the_bound(fw):
    """A bound that float32 cannot represent exactly must not mark unclipped examples."""
    grads = {"w": fw.array(np.array([[0.1], [0.2], [5.0]]))}
    result = dp.clipped_sum(grads, 3.7778365612)
    assert float(result.clip_fraction) == pytest.approx(1 / 3)
