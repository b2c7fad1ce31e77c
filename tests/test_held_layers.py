"""Layers held as their formed per-example gradients in the one-pass ghost DP step (issue 36).

Where a layer's per-example gradients (``B`` times its parameter count) are no more numbers
than its output gradients (long sequences over narrow layers, norm layers), the ghost step
forms them in the layer's tensor hook, takes the layer's norms from them and drops its records
there (``capture/torch_held.py``); the clipped sum adds them with the clip weights. The clipped
sums must equal those of per-example gradients formed by a loop of ordinary backward passes,
and each example must stay within the bound.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.capture import torch_held  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_of  # noqa: E402

TOKENS = 12


class Narrow(nn.Module):
    """Over 12 tokens: ``wide`` (16 x 16 + 16 = 272 numbers per example against 12 x 16 = 192
    output gradients) and ``down`` (68 against 48) keep their records; the norm layer (32
    against 192), ``small`` (20 against 48) and ``head`` (15 against 36) are held."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.down = nn.Linear(16, 4)
        self.small = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.norm(torch.tanh(self.wide(x)))
        return self.head(torch.tanh(self.small(torch.tanh(self.down(h)))))


HELD = {"norm", "small", "head"}


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1))


def batch(size: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(size, TOKENS, 16, generator=generator)
    labels = torch.randint(0, 3, (size, TOKENS), generator=generator)
    return x, labels


def reference(model, x, labels, max_norm):
    grads = torch_module_loop_grads(model, token_loss, [x], [labels])
    norms = torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads.values()))
    factors = (max_norm / norms).clamp(max=1.0)
    sums = {k: torch.tensordot(factors, g.double(), dims=1) for k, g in grads.items()}
    return sums, norms


@pytest.fixture
def sessions(monkeypatch):
    """The captured passes the held path was armed on."""
    armed = []
    arm = torch_held.arm

    def spying(session, computed, first_run):
        armed.append(session)
        arm(session, computed, first_run)

    monkeypatch.setattr(torch_held, "arm", spying)
    return armed


def held_layers(session) -> set[str]:
    return {name.rsplit(".", 1)[0] for name in session.held}


def test_held_layers_give_the_loops_clipped_sum(sessions):
    torch.manual_seed(0)
    model = Narrow()
    loss = pergrad.module_loss(model, token_loss)
    params = loss.params()
    x, labels = batch(6)
    first = clipped_sum_of(loss, params, x, labels, max_norm=0.3, strategy="ghost")
    assert held_layers(sessions[0]) == HELD  # the first call of a layout too (its checks pass)
    got = clipped_sum_of(loss, params, x, labels, max_norm=0.3, strategy="ghost")
    session = sessions[-1]
    assert held_layers(session) == HELD
    for name in HELD:  # their records were dropped in the backward pass
        assert all(r.inputs == () and r.output_grad is None for r in session.records[name])
    assert sum(g.numel() for g in session.held.values()) <= sum(
        6 * TOKENS * model.get_submodule(name).weight.shape[0] for name in HELD
    )
    want, norms = reference(model, x, labels, 0.3)
    assert (norms > 0.3).sum() >= 3  # most examples are clipped
    torch.testing.assert_close(got.norms.double(), norms, rtol=1e-5, atol=1e-6)
    for name, value in want.items():
        torch.testing.assert_close(got.sum[name].double(), value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(first.sum[name], got.sum[name], rtol=1e-5, atol=1e-6)


def test_each_held_example_stays_within_the_bound(sessions):
    torch.manual_seed(1)
    model = Narrow()
    loss = pergrad.module_loss(model, token_loss)
    params = loss.params()
    max_norm = 1e-3  # far below every example's norm
    x, labels = batch(5, seed=2)
    clipped_sum_of(loss, params, x, labels, max_norm=max_norm, strategy="ghost")
    for k in range(5):  # each example alone, at the batch's layout (checked above)
        one = clipped_sum_of(
            loss,
            params,
            x,
            labels,
            max_norm=max_norm,
            strategy="ghost",
            mask=(torch.arange(5) == k),
        )
        total = torch.sqrt(sum(v.double().pow(2).sum() for v in one.sum.values()))
        assert total <= max_norm * (1 + 1e-6)
    assert held_layers(sessions[-1]) == HELD


def test_a_layer_with_a_frozen_parameter_keeps_its_records(sessions):
    torch.manual_seed(2)
    model = Narrow()
    model.head.bias.requires_grad_(False)  # its weight's gradient only: nothing to hold
    loss = pergrad.module_loss(model, token_loss)
    params = loss.params()
    x, labels = batch(4, seed=3)
    clipped_sum_of(loss, params, x, labels, max_norm=0.3, strategy="ghost")
    got = clipped_sum_of(loss, params, x, labels, max_norm=0.3, strategy="ghost")
    assert held_layers(sessions[-1]) == HELD - {"head"}
    want, _ = reference(model, x, labels, 0.3)
    assert set(got.sum) == set(want) - {"head.bias"}
    for name in got.sum:
        torch.testing.assert_close(got.sum[name].double(), want[name], rtol=1e-5, atol=1e-6)


def test_norms_alone_hold_nothing(sessions):
    model = Narrow()
    loss = pergrad.module_loss(model, token_loss)
    params = loss.params()
    x, labels = batch(4)
    for _ in range(2):
        pergrad.norms.per_example_norms_of(loss, params, x, labels, strategy="ghost")
    assert sessions == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formed_norms_are_certified_and_tight(dtype):
    """The held gradients' norms: the bound covers the float32 sum's rounding against the
    exact (float64) sum of the same numbers, and is tight, as the split axes allow: an LM
    head's ``(256, 8192)`` squares pass through 224 additions, not 8448."""
    from pergrad._src.capture import cost, torch_norms

    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 3, 8192)  # magnitudes over six orders
    grads = (torch.randn(3, 256, 8192, generator=generator) * scales).to(dtype)
    found = torch_norms.formed_squared_norms(grads)
    exact = grads.double().pow(2).sum((1, 2))
    assert ((found.estimate.double() - exact).abs() <= found.bound.double()).all()
    assert cost.split_axes((256, 8192)) == (16, 16, 128, 64)
    assert (found.bound <= 4 * cost.gamma(16 + 16 + 128 + 64 + 1, 2**-24) * found.estimate).all()


def test_a_held_layer_on_a_wrong_axis_is_refused_on_its_first_call(sessions):
    """A layer held from its first call on is still checked there: its dropped output
    gradients' row summaries go to the row check. The time-first layer of
    ``test_layout_batch_sizes`` (its batch on axis 1, axis 0 of the same size at ``B ==
    STEPS``) is held (8 numbers per example against 8 output gradients): at ``B = 5`` its
    clipped sum is the loop's; at ``B = STEPS`` the first call is refused, not summed along
    the time steps."""
    from test_layout_batch_sizes import STEPS, InternalTimeFirst, abs_mean
    from test_layout_batch_sizes import batch as time_batch

    torch.manual_seed(0)
    model = InternalTimeFirst().double()
    loss = pergrad.module_loss(model, abs_mean)
    args = time_batch(5, 0)
    got = clipped_sum_of(loss, loss.params(), *args, max_norm=0.01, strategy="ghost")
    assert held_layers(sessions[-1]) == {"fc"}
    grads = torch_module_loop_grads(model, abs_mean, args[:1], args[1:])
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    factors = (0.01 / norms).clamp(max=1.0)
    for name, g in grads.items():
        torch.testing.assert_close(got.sum[name], torch.tensordot(factors, g, dims=1))
    args = time_batch(STEPS, 1)
    with pytest.raises(ValueError, match="strategy='ghost' cannot handle"):
        clipped_sum_of(loss, loss.params(), *args, max_norm=0.01, strategy="ghost")
    assert held_layers(sessions[-1]) == {"fc"}  # held, and refused by the row check


def test_an_empty_batch_between_held_steps_and_the_model_left_as_it_was(sessions):
    """An empty batch is ordinary input on the held path too: zero sums, no norms; and no step
    changes the model's parameters, buffers or ``.grad``."""
    torch.manual_seed(4)
    model = Narrow()
    loss = pergrad.module_loss(model, token_loss)
    params = loss.params()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for size in (4, 0, 4):
        x, labels = batch(size, seed=size + 1)
        got = clipped_sum_of(loss, params, x, labels, max_norm=0.3, strategy="ghost")
        assert got.norms.shape == (size,)
        if size == 0:
            assert all(float(v.abs().sum()) == 0.0 for v in got.sum.values())
    assert held_layers(sessions[-1]) == HELD
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
