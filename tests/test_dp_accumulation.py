"""Gradient accumulation with ``pergrad.dp.DPOptimizer`` (issue 19): k micro-batches through
``accumulate`` then ``step`` equal one ``step`` on their concatenation, noise included (drawn
once from the same generator), the accountant counting one step; and a loop of per-example
autograd gradients, clipped and averaged, as the independent reference at zero noise."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="DPOptimizer is PyTorch's")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402

MICRO, PARTS, MAX_NORM, LR = 4, 3, 0.5, 0.1


class Counter:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def setup(noise_multiplier, seed=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    counter = Counter()
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=noise_multiplier,
        expected_batch_size=MICRO * PARTS,
        generator=torch.Generator().manual_seed(seed),
        accountant=counter,
    )
    return model, optimizer, counter


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(MICRO * PARTS, 6, generator=g), torch.randint(
        0, 3, (MICRO * PARTS,), generator=g
    )


@pytest.mark.parametrize("noise_multiplier", [0.0, 1.3])
def test_accumulated_micro_batches_equal_one_batch(noise_multiplier):
    x, y = data()
    whole, whole_optimizer, whole_counter = setup(noise_multiplier)
    whole_stats = whole_optimizer.step(x, y)
    parts, parts_optimizer, parts_counter = setup(noise_multiplier)
    for k in range(PARTS - 1):
        parts_optimizer.accumulate(x[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO])
    stats = parts_optimizer.step(x[-MICRO:], y[-MICRO:])
    for a, b in zip(whole.parameters(), parts.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert stats.batch_size == whole_stats.batch_size == MICRO * PARTS
    assert stats.clip_fraction == pytest.approx(whole_stats.clip_fraction)
    assert whole_counter.steps == parts_counter.steps == 1
    assert stats.strategy == "ghost"


def test_noise_is_drawn_once_per_logical_step():
    """Against a deliberately wrong accumulation that adds noise to every micro-batch: the
    update's deviation from the noiseless one has the single draw's size, not sqrt(k) of it."""
    x, y = data()
    noiseless, quiet, _ = setup(0.0)
    quiet.step(x, y)
    noisy, optimizer, _ = setup(1.0, seed=5)
    for k in range(PARTS):
        optimizer.accumulate(x[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO])
    optimizer.step()
    deviation = torch.cat(
        [(a - b).flatten() for a, b in zip(noisy.parameters(), noiseless.parameters())]
    )
    # one draw: LR * std / expected batch size per coordinate
    expected = LR * 1.0 * MAX_NORM / (MICRO * PARTS)
    assert deviation.std().item() == pytest.approx(expected, rel=0.25)


def test_zero_noise_step_equals_the_per_example_loop():
    x, y = data()
    model, optimizer, _ = setup(0.0)
    reference = copy.deepcopy(model)
    for k in range(PARTS):
        optimizer.accumulate(x[k * MICRO : (k + 1) * MICRO], y[k * MICRO : (k + 1) * MICRO])
    optimizer.step()
    total = [torch.zeros_like(p) for p in reference.parameters()]
    for i in range(len(x)):
        grads = torch.autograd.grad(
            F.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]), list(reference.parameters())
        )
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        scale = min(1.0, MAX_NORM / norm.item())
        total = [t + scale * g for t, g in zip(total, grads)]
    with torch.no_grad():
        for p, t in zip(reference.parameters(), total):
            p -= LR * t / len(x)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_step_needs_a_batch_or_accumulated_micro_batches():
    _, optimizer, _ = setup(0.0)
    with pytest.raises(TypeError, match="accumulate\\(\\) micro-batches first"):
        optimizer.step()
    with pytest.raises(TypeError, match="pass one micro-batch"):
        optimizer.accumulate()
