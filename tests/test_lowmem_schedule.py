"""What the ghost strategies' capture holds, and when it lets go (PyTorch, issue 36).

The low-memory mode (``strategy="ghost-lowmem"``) peaks where the most is alive at once: the
forward pass (every activation autograd keeps, plus what the capture holds beside it) or a
layer's norms in the first backward pass. Holding a layer's records instead of recomputing
them never lowers that peak (each transformer block's output gradients are larger than the
activations a pass that does not retain its graph frees there), so what is left to save is
what the capture itself holds. Checked here:

- each recorded call of a layer with a vector parameter lets go of its output as soon as the
  call returns (the light target is then that parameter): an output that autograd does not
  keep is freed during the forward pass, not at its end;
- a layer without one (a bias-free linear layer, an embedding) keeps it: it is the light
  target through which the backward pass reaches the layer's output gradient;
- with both in one model, both ghost modes give the loop's clipped sums, on a first call and
  a later one, and the model keeps no hook of pergrad's.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the ghost strategies' capture is PyTorch's")

from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

B = 5


class Residual(nn.Module):
    """A small transformer-like stack: the embedding's output is only scaled, ``branch``'s only
    added to something (autograd keeps neither); ``head`` has no bias."""

    def __init__(self, vocab: int = 20, width: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.branch = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens) * 2.0
        x = x + self.branch(x)
        return self.head(self.norm(x)).mean(1)


def problem(seed: int = 0):
    torch.manual_seed(seed)
    model = Residual().double()
    tokens = torch.randint(0, 20, (B, 4))
    targets = torch.randint(0, 3, (B,))
    return model, tokens, targets


def alive_after_next_layer(model, layer: str, following: str, call) -> list[bool]:
    """For each call of ``layer`` during ``call()``, whether its output is still alive when
    ``following`` starts (seen by hooks of the test's own, removed after)."""
    outputs, alive = [], []
    first = model.get_submodule(layer).register_forward_hook(
        lambda module, args, output: outputs.append(weakref.ref(output))
    )
    second = model.get_submodule(following).register_forward_pre_hook(
        lambda module, args: alive.append(outputs.pop()() is not None)
    )
    try:
        call()
    finally:
        first.remove()
        second.remove()
    return alive


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_a_layer_with_a_bias_lets_go_of_its_output_during_the_forward_pass(strategy):
    model, tokens, targets = problem()
    loss = pergrad.module_loss(model, nn.functional.cross_entropy)

    def step():
        pergrad.dp.clipped_sum_of(
            loss, loss.params(), tokens, targets, max_norm=0.1, strategy=strategy
        )

    for call in ("first", "later"):  # (a first call may run the batch twice: its row check)
        alive = alive_after_next_layer(model, "branch", "norm", step)
        assert alive and not any(alive), call


def test_a_layer_without_a_vector_parameter_keeps_its_output_as_the_light_target():
    """The embedding's output is what the backward pass differentiates to reach its output
    gradient: held until the forward pass ends (no hook of the test's can see it die
    earlier)."""
    model, tokens, targets = problem()
    loss = pergrad.module_loss(model, nn.functional.cross_entropy)

    def step():
        pergrad.dp.clipped_sum_of(
            loss, loss.params(), tokens, targets, max_norm=0.1, strategy="ghost-lowmem"
        )

    step()  # the first call's checks
    assert all(alive_after_next_layer(model, "emb", "norm", step))


def loop_clipped_sum(model, tokens, targets, max_norm):
    grads = torch_module_loop_grads(model, nn.functional.cross_entropy, [tokens], [targets])
    flat = torch.cat([torch.as_tensor(g).reshape(B, -1) for g in grads.values()], 1)
    factors = (max_norm / flat.norm(dim=1)).clamp(max=1.0)
    return {k: torch.tensordot(factors, torch.as_tensor(g), dims=1) for k, g in grads.items()}


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_both_modes_give_the_loops_clipped_sum_and_leave_no_hook(strategy):
    model, tokens, targets = problem(1)
    loss = pergrad.module_loss(model, nn.functional.cross_entropy)
    want = loop_clipped_sum(model, tokens, targets, max_norm=0.05)
    hooks = {name: dict(m._forward_hooks) for name, m in model.named_modules()}
    for _ in ("first", "later"):
        got = pergrad.dp.clipped_sum_of(
            loss, loss.params(), tokens, targets, max_norm=0.05, strategy=strategy
        )
        for name, value in want.items():
            np.testing.assert_allclose(got.sum[name].numpy(), value.numpy(), rtol=1e-9, atol=0)
    assert {name: dict(m._forward_hooks) for name, m in model.named_modules()} == hooks


class Flaky(torch.autograd.Function):
    """The identity, whose backward pass scales the gradient by ``scale[0]`` (a
    non-deterministic kernel's stand-in: the test changes it between the two passes)."""

    scale = [1.0]

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * Flaky.scale[0]


class FlakyStack(nn.Module):
    def __init__(self, width: int = 6):
        super().__init__()
        self.lower = nn.Linear(width, width)
        self.upper = nn.Linear(width, 2)

    def forward(self, x):
        return self.upper(Flaky.apply(torch.tanh(self.lower(x))))


def test_sums_from_other_output_gradients_than_the_norms_are_refused(monkeypatch):
    """The low-memory mode's sums must come from the very output gradients its norms came
    from: a second pass that gives a layer other ones (here 1.5 times the first's, below the
    flaky op) is refused, never summed (scaled gradients with the first pass's clip factors
    would break the bound)."""
    torch.manual_seed(0)
    model = FlakyStack()
    loss = pergrad.module_loss(model, nn.functional.cross_entropy)
    x, y = torch.randn(B, 6), torch.randint(0, 2, (B,))

    def clipped():
        return pergrad.dp.clipped_sum_of(
            loss, loss.params(), x, y, max_norm=0.01, strategy="ghost-lowmem"
        )

    clipped()  # the first call's checks, with a deterministic op
    scales = iter([1.0, 1.5])  # the first backward pass, then the second
    backward = Flaky.backward

    def flaky(ctx, grad):
        Flaky.scale[0] = next(scales)
        return backward(ctx, grad)

    monkeypatch.setattr(Flaky, "backward", staticmethod(flaky))
    with pytest.raises(ValueError, match="other output gradients than the first") as caught:
        clipped()
    assert "'lower'" in str(caught.value)  # the layer below the flaky op


class Positions(nn.Module):
    """A token table larger than its outputs and a position table smaller than them."""

    def __init__(self, vocab: int = 64, length: int = 4, width: int = 8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.head = nn.Linear(width, 3, bias=False)

    def forward(self, ids, positions):
        return self.head(torch.tanh(self.tokens(ids) + self.positions(positions))).mean(1)


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_a_table_smaller_than_its_outputs_has_its_weight_differentiated(strategy, monkeypatch):
    """The light backward pass reaches the small table's output gradient through its weight
    (a scatter of the output gradients, no matrix product), so that its outputs are not held
    through the backward pass; the large table's through its output, as before. Same sums as
    the loop."""
    torch.manual_seed(0)
    model = Positions().double()
    ids = torch.randint(0, 64, (B, 4))
    positions = torch.arange(4).expand(B, 4).contiguous()
    targets = torch.randint(0, 3, (B,))
    loss = pergrad.module_loss(model, nn.functional.cross_entropy, num_inputs=2)

    def clipped():
        return pergrad.dp.clipped_sum_of(
            loss, loss.params(), ids, positions, targets, max_norm=0.05, strategy=strategy
        )

    clipped()  # the first call's checks differentiate every parameter
    asked = []
    grad = torch.autograd.grad

    def recording(outputs, inputs, *args, **kwargs):
        asked.extend(inputs)
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", recording)
    got = clipped()
    monkeypatch.undo()
    # (pergrad differentiates fresh leaves of the parameters' values: told apart by shape)
    differentiated = {tuple(x.shape) for x in asked if x.is_leaf and x.dim() >= 2}
    assert differentiated == {(4, 8)}  # positions.weight; not tokens' (64, 8), head's (3, 8)
    grads = torch_module_loop_grads(model, nn.functional.cross_entropy, [ids, positions], [targets])
    flat = torch.cat([torch.as_tensor(g).reshape(B, -1) for g in grads.values()], 1)
    factors = (0.05 / flat.norm(dim=1)).clamp(max=1.0)
    for name, value in grads.items():
        want = torch.tensordot(factors, torch.as_tensor(value), dims=1)
        np.testing.assert_allclose(got.sum[name].numpy(), want.numpy(), rtol=1e-9, atol=0)
