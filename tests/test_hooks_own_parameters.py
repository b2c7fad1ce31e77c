"""The ``"hooks"`` strategy's light passes run the model on its own parameters (no
``functional_call``) when ``params`` are views of them that require grad: the gradients must
be those of a loop at the values passed, whatever was passed, and nothing of the model (its
``.grad``, its hooks, hooks the user put on its parameters) may notice."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.strategies import hooks_torch  # noqa: E402

B = 5


class Net(nn.Module):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.in_place = in_place

    def forward(self, x):
        h = self.fc1(x)
        if self.in_place:
            h += 1.0  # the first layer's output changed after it returned
        return self.fc2(torch.tanh(h))


def _data(seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 4, dtype=torch.float64, generator=generator)
    return x, torch.randint(0, 3, (B,), generator=generator)


def _assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def _count_own_passes(monkeypatch) -> list:
    passes = []
    original = hooks_torch._light_forward_backward_own

    def spy(*args, **kwargs):
        passes.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(hooks_torch, "_light_forward_backward_own", spy)
    return passes


def test_other_values_than_the_models_are_differentiated_at_those_values(monkeypatch):
    """Cloned parameters (other storage, other values) never take the model's own."""
    torch.manual_seed(0)
    model = Net().double()
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    passes = _count_own_passes(monkeypatch)
    params = {k: v.clone() + 0.1 for k, v in loss.params().items()}
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in shifted.named_parameters():
            p.copy_(params[name])
    for seed in (1, 2, 3):  # the first call checks the layout; the later ones are light
        x, y = _data(seed)
        _assert_close(
            grads(params, x, y), torch_module_loop_grads(shifted, F.cross_entropy, [x], [y])
        )
    assert not passes


def test_the_models_own_parameters_take_the_light_pass_and_leave_no_trace(monkeypatch):
    torch.manual_seed(1)
    model = Net().double()
    fired = []
    handle = model.fc1.weight.register_hook(lambda g: fired.append(g))
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    passes = _count_own_passes(monkeypatch)
    for seed in (1, 2, 3):
        x, y = _data(seed)
        _assert_close(
            grads(loss.params(), x, y), torch_module_loop_grads(model, F.cross_entropy, [x], [y])
        )
    assert len(passes) >= 2  # the later calls (and the first call's example-0 pass)
    assert not fired  # no pass reached the parameters
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    handle.remove()


def test_a_frozen_parameter_passed_is_differentiated_through_functional_call(monkeypatch):
    """``requires_grad=False`` on the model, passed in params: its layer's output would not
    be differentiable on the model's own parameters."""
    torch.manual_seed(2)
    model = Net().double()
    model.fc1.weight.requires_grad_(False)
    model.fc1.bias.requires_grad_(False)
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    passes = _count_own_passes(monkeypatch)
    params = {name: p.detach() for name, p in model.named_parameters()}
    trainable = copy.deepcopy(model).requires_grad_(True)
    for seed in (1, 2, 3):
        x, y = _data(seed)
        want = torch_module_loop_grads(trainable, F.cross_entropy, [x], [y])
        _assert_close(grads(params, x, y), want)
    assert not passes


def test_an_output_changed_in_place_falls_back_once_and_no_parameter_hook_fires(monkeypatch):
    torch.manual_seed(3)
    model = Net(in_place=True).double()
    fired = []
    handle = model.fc2.weight.register_hook(lambda g: fired.append(g))
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    passes = _count_own_passes(monkeypatch)
    for seed in (1, 2, 3, 4):
        x, y = _data(seed)
        _assert_close(
            grads(loss.params(), x, y), torch_module_loop_grads(model, F.cross_entropy, [x], [y])
        )
    assert len(passes) == 1  # found the change once; functional_call from then on
    assert not fired
    assert all(p.grad is None for p in model.parameters())
    handle.remove()


def test_empty_batches_on_the_models_own_parameters(monkeypatch):
    """An empty batch, twice (its layout checked, then light on the model's own parameters),
    between full ones: zero rows of the right shapes, the full batches still the loop's, and
    the model's parameters, buffers and ``.grad`` as they were."""
    torch.manual_seed(0)
    model = Net().double()
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    passes = _count_own_passes(monkeypatch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    empty = torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    for batch in (_data(1), empty, empty, _data(2), _data(3)):
        got = grads(loss.params(), *batch)
        if len(batch[0]):
            _assert_close(
                got, torch_module_loop_grads(model, F.cross_entropy, [batch[0]], [batch[1]])
            )
        else:
            assert {k: v.shape for k, v in got.items()} == {
                k: (0, *p.shape) for k, p in model.named_parameters()
            }
    assert len(passes) >= 2  # light calls took the model's own parameters
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
