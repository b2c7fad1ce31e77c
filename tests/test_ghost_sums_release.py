"""The one-pass ghost DP step lets each layer's records go once its share of the clipped sum is
formed (issue 36: memory at the non-private step's).

The one-pass mode holds every hooked layer's inputs and output gradients from the backward pass
until all norms are known, then forms the clipped sum layer by layer. Holding the records of
the layers already summed until the last one is done kept all of them alive beside the sums
being formed (on the benchmark BERT at 128 tokens, the step's peak: 1.16x the non-private
step's resident memory, 1.12x once they go). The sums must still equal those of a loop of
ordinary backward passes, clipped.
"""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.capture import torch_quantities  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_of  # noqa: E402


def mlp() -> nn.Module:
    """Three dense layers on one token each: no layer's per-example gradients are fewer numbers
    than its output gradients, so none is held (every layer keeps its records to the sum)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def batch(size: int):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 8, generator=generator), torch.randint(0, 3, (size,))


@pytest.fixture
def records_alive(monkeypatch):
    """For each weighted sum of a layer, how many output gradients of the other layers summed
    before it are still alive when it starts (weak references: alive only while something
    holds them)."""
    alive: list[int] = []
    seen: list[tuple[nn.Module, weakref.ref]] = []
    original = torch_quantities._weighted_sum_of

    def spying(weights, clean):
        compute = original(weights, clean)

        def weighted_sum(module, calls):
            alive.append(sum(ref() is not None for layer, ref in seen if layer is not module))
            values = compute(module, calls)
            seen.extend((module, weakref.ref(call.output_grad)) for call in calls)
            return values

        return weighted_sum

    monkeypatch.setattr(torch_quantities, "_weighted_sum_of", spying)
    return alive


def test_each_layers_records_go_once_its_sum_is_formed(records_alive) -> None:
    model = mlp()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = batch(6)
    sums = clipped_sum_of(loss, loss.params(), x, y, max_norm=0.5, strategy="ghost").sum
    assert len(records_alive) == 3  # one weighted sum per dense layer
    assert records_alive == [0, 0, 0]
    grads = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    norms = torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads.values()))
    factors = (0.5 / norms).clamp(max=1.0)
    for name, value in sums.items():
        expected = torch.tensordot(factors, grads[name].double(), dims=1)
        torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6)


def test_records_go_with_several_weight_groups(records_alive) -> None:
    """Per-parameter clipping (a clip weight per example and parameter) sums each layer once per
    group it holds a parameter of: its records go after its last group."""
    model = mlp()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = batch(5)
    params = loss.params()
    bounds = {name: 0.2 + 0.1 * k for k, name in enumerate(params)}
    sums = clipped_sum_of(loss, params, x, y, max_norm=bounds, strategy="ghost").sum
    assert len(records_alive) == 6 and all(alive == 0 for alive in records_alive)
    grads = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    for name, bound in bounds.items():
        norms = grads[name].flatten(1).double().norm(dim=1)
        expected = torch.tensordot((bound / norms).clamp(max=1.0), grads[name].double(), dims=1)
        torch.testing.assert_close(sums[name].double(), expected, rtol=1e-5, atol=1e-6)
