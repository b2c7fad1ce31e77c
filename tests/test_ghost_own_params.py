"""The ghost strategy's later runs of a checked layout run the model on its own parameters (no
``functional_call``) where ``params`` are views of them (``torch_session.own_leaves``): the
norms and clipped sums must be those of the ``functional_call`` path and of a loop of
single-example gradients, the path must be taken exactly where it may be, and nothing of the
model (parameters, buffers, ``.grad``, hooks, ``requires_grad``) may change, also when the loss
raises."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import pergrad  # noqa: E402
from _reference import (  # noqa: E402
    torch_clipped_sum,
    torch_flat_norms,
    torch_module_loop_grads,
)
from pergrad._src.capture import torch_session  # noqa: E402

B = 6
MAX_NORM = 0.3


class Net(nn.Module):
    """Biases (vector light targets), a bias-free layer (its input or output differentiated),
    an embedding of a table (a lookup rule) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 5, bias=False)
        self.head = nn.Linear(5, 3)
        self.register_buffer("offset", torch.full((5,), 0.1))
        self.skip = False

    def forward(self, tokens):
        h = torch.tanh(self.fc1(self.embed(tokens).mean(1)))
        if not self.skip:
            h = torch.tanh(self.fc2(h) + self.offset)
        else:  # another path, same shapes: the records' signature changes
            h = torch.tanh(h[:, :5] + self.offset)
        return self.head(h)


def _data(seed: int, batch_size: int = B):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 7, (batch_size, 3), generator=generator)
    return tokens, torch.randint(0, 3, (batch_size,), generator=generator)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Net().double()


def _own_passes(monkeypatch) -> list[bool]:
    """One entry per forward pass of the ghost capture: whether it ran on the model's own
    parameters."""
    passes: list[bool] = []
    original = torch_session._forward

    def spy(*args, **kwargs):
        passes.append(args[-1] is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch_session, "_forward", spy)
    return passes


def _snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grad": {
            k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()
        },
        "flags": {k: p.requires_grad for k, p in model.named_parameters()},
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "tensor_hooks": {k: len(p._backward_hooks or {}) for k, p in model.named_parameters()},
    }


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert after["flags"] == before["flags"]
    assert after["hooks"] == before["hooks"]
    assert after["tensor_hooks"] == before["tensor_hooks"]
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k
    for k, g in before["grad"].items():
        assert (after["grad"][k] is None) == (g is None), k
        assert g is None or torch.equal(after["grad"][k], g), k


def _norms_and_sum(loss, params, batch, strategy: str = "ghost"):
    norms = pergrad.norms.per_example_norms_of(loss, params, *batch, strategy=strategy)
    clipped = pergrad.dp.clipped_sum_of(loss, params, *batch, max_norm=MAX_NORM, strategy=strategy)
    return norms, clipped.sum


def _assert_loop(model: nn.Module, batch, norms, sums, names=None) -> None:
    """Against a loop of single-example gradients of ``model`` (restricted to ``names``)."""
    want = torch_module_loop_grads(model, F.cross_entropy, [batch[0]], [batch[1]])
    if names is not None:
        want = {k: v for k, v in want.items() if k in names}
    np.testing.assert_allclose(norms.numpy(), torch_flat_norms(want), rtol=1e-9, atol=1e-12)
    clipped = torch_clipped_sum(want, MAX_NORM)
    assert set(sums) == set(clipped)
    for k, v in clipped.items():
        np.testing.assert_allclose(sums[k].numpy(), v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_own_parameters_give_the_functional_call_paths_results_and_the_loops(monkeypatch, strategy):
    model = _model()
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 7.0)  # a .grad of the user's
    loss = pergrad.module_loss(model, F.cross_entropy)
    passes = _own_passes(monkeypatch)
    before = _snapshot(model)
    for seed in (1, 2):  # the first call checks the layout; the later ones run light
        batch = _data(seed)
        norms, sums = _norms_and_sum(loss, loss.params(), batch, strategy)
        _assert_loop(model, batch, norms, sums)
        monkeypatch.setattr(torch_session, "OWN_PARAMETERS", False)
        fresh_norms, fresh_sums = _norms_and_sum(loss, loss.params(), batch, strategy)
        monkeypatch.setattr(torch_session, "OWN_PARAMETERS", True)
        torch.testing.assert_close(norms, fresh_norms, rtol=1e-12, atol=1e-15)
        for k, v in fresh_sums.items():
            torch.testing.assert_close(sums[k], v, rtol=1e-12, atol=1e-15)
    assert passes.count(True) == 3, passes  # every call after the first, with the switch on
    _assert_unchanged(model, before)


def test_params_that_are_not_the_models_own_take_fresh_leaves(monkeypatch):
    """Copies at other values, a frozen parameter passed, a parameter under a tensor hook of
    the user's (it must not fire): fresh leaves, at the values passed."""
    model = _model(1)
    loss = pergrad.module_loss(model, F.cross_entropy)
    passes = _own_passes(monkeypatch)
    copies = {k: v.clone() + 0.05 for k, v in loss.params().items()}
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in shifted.named_parameters():
            p.copy_(copies[name])
    for seed in (1, 2):
        batch = _data(seed)
        _assert_loop(shifted, batch, *_norms_and_sum(loss, copies, batch))
    assert passes and not any(passes)

    model.fc1.bias.requires_grad_(False)
    every = {k: p.detach() for k, p in model.named_parameters()}  # the frozen one included
    trainable = copy.deepcopy(model).requires_grad_(True)
    before = _snapshot(model)
    passes.clear()
    for seed in (4, 5):
        batch = _data(seed)
        _assert_loop(trainable, batch, *_norms_and_sum(loss, every, batch))
    assert passes and not any(passes)
    _assert_unchanged(model, before)

    model.fc1.bias.requires_grad_(True)
    fired = []
    handle = model.head.bias.register_hook(fired.append)
    before = _snapshot(model)
    passes.clear()
    for seed in (7, 8):
        batch = _data(seed)
        _assert_loop(model, batch, *_norms_and_sum(loss, loss.params(), batch))
    assert passes and not any(passes)
    assert not fired
    _assert_unchanged(model, before)
    handle.remove()


def test_a_subset_of_the_models_own_parameters_runs_on_them(monkeypatch):
    """Some parameters asked for (as when others are frozen): the model's own, differentiated
    with respect to those only; the others get no gradient and no ``.grad``."""
    model = _model(2)
    loss = pergrad.module_loss(model, F.cross_entropy)
    passes = _own_passes(monkeypatch)
    names = {"fc1.weight", "fc2.weight", "head.bias"}
    subset = {k: v for k, v in loss.params().items() if k in names}
    before = _snapshot(model)
    for seed in (1, 2):
        batch = _data(seed)
        norms, sums = _norms_and_sum(loss, subset, batch)
        assert set(sums) == names
        _assert_loop(model, batch, norms, sums, names)
    assert passes.count(True) == 3, passes  # every call after the first
    _assert_unchanged(model, before)


def test_a_later_path_of_the_same_shapes_is_checked_with_fresh_leaves(monkeypatch):
    """The layout checked, then the model takes another path (other records): the pass on
    the model's own parameters is dropped and the first run's checks run on fresh leaves,
    whose backward pass writes ``.grad``: the model's own ``.grad`` must stay as it was."""
    model = _model(3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    loss = pergrad.module_loss(model, F.cross_entropy)
    passes = _own_passes(monkeypatch)
    before = _snapshot(model)
    _norms_and_sum(loss, loss.params(), _data(1))
    model.skip = True
    passes.clear()
    batch = _data(2)
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *batch, strategy="ghost")
    # each pass on the model's own parameters dropped for one on fresh leaves: the weighted
    # pass of the first run's row check, then the plain pass
    assert passes == [True, False, True, False], passes
    want = torch_module_loop_grads(model, F.cross_entropy, [batch[0]], [batch[1]])
    want = {k: v for k, v in want.items() if not k.startswith("fc2")}  # unused now
    np.testing.assert_allclose(norms.numpy(), torch_flat_norms(want), rtol=1e-9, atol=1e-12)
    _assert_unchanged(model, before)


def test_a_loss_that_raises_on_the_models_own_parameters_leaves_it_as_it_was(monkeypatch):
    model = _model(4)
    model.head.weight.grad = torch.full_like(model.head.weight, 3.0)
    failing = []

    def loss_fn(output, target):
        if failing:
            raise RuntimeError("a loss that fails")
        return F.cross_entropy(output, target)

    loss = pergrad.module_loss(model, loss_fn)
    passes = _own_passes(monkeypatch)
    before = _snapshot(model)
    pergrad.norms.per_example_norms_of(loss, loss.params(), *_data(1), strategy="ghost")
    failing.append(True)
    with pytest.raises(RuntimeError, match="a loss that fails"):
        pergrad.norms.per_example_norms_of(loss, loss.params(), *_data(2), strategy="ghost")
    assert passes[-1], passes  # it raised in a pass on the model's own parameters
    _assert_unchanged(model, before)


def test_empty_batches_between_full_ones_on_the_models_own_parameters(monkeypatch):
    model = _model(5)
    loss = pergrad.module_loss(model, F.cross_entropy)
    passes = _own_passes(monkeypatch)
    before = _snapshot(model)
    empty = torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    for batch in (_data(1), empty, empty, _data(2)):
        norms, sums = _norms_and_sum(loss, loss.params(), batch)
        if len(batch[0]):
            _assert_loop(model, batch, norms, sums)
        else:
            assert norms.shape == (0,)
            for k, p in model.named_parameters():
                torch.testing.assert_close(sums[k], torch.zeros_like(p))
    assert any(passes)
    _assert_unchanged(model, before)


def test_a_layer_replaced_between_calls_is_hooked_in_its_place():
    """The ownership kept on the loss (``torch_session._remembered_ownership``) is worked out
    again when a module is replaced under the same name, even holding the same parameter: the
    new layer is hooked, not the old one, which is no longer called."""
    model = _model(6)
    loss = pergrad.module_loss(model, F.cross_entropy)
    for seed in (1, 2):
        _norms_and_sum(loss, loss.params(), _data(seed))
    replacement = nn.Linear(6, 5, bias=False).double()
    replacement.weight = model.fc2.weight  # the same parameter, in another module
    model.fc2 = replacement
    for seed in (3, 4):
        batch = _data(seed)
        _assert_loop(model, batch, *_norms_and_sum(loss, loss.params(), batch))


def test_steps_inside_one_autocast_region_take_fresh_leaves(monkeypatch):
    """``torch.autocast`` keeps each parameter's low-precision copy until its region ends: a DP
    step taken inside the region would leave the next pass on the model's own parameters the
    old weights' copies. Under autocast the capture takes fresh leaves, and three steps in one
    region end where they end with the own-parameters path switched off."""

    def three_steps(own: bool) -> dict:
        monkeypatch.setattr(torch_session, "OWN_PARAMETERS", own)
        torch.manual_seed(0)
        model = Net()  # float32: autocast casts it to bfloat16
        optimizer = pergrad.dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            model,
            F.cross_entropy,
            max_norm=MAX_NORM,
            noise_multiplier=0.0,
            strategy="ghost",
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for seed in (1, 2, 3):  # the first checks the layout; the later ones may run light
                optimizer.step(*_data(seed))
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    passes = _own_passes(monkeypatch)
    on = three_steps(True)
    assert not any(passes), passes  # never on the model's own parameters under autocast
    off = three_steps(False)
    for k, v in off.items():
        torch.testing.assert_close(on[k], v, rtol=0, atol=0)
