"""The ``"hooks"`` strategy's later calls of a checked layout differentiate only the hooked
layers' outputs (``strategies/hooks_torch._outputs``): their per-example gradients must still be
those of a loop over the examples, and an output changed in place after its layer returned it
takes the full backward pass. (A layout refused on its first call stays refused:
``test_models_in_the_wild.test_hooks_refuse_a_parameter_used_outside_its_layer``.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.strategies import hooks_torch  # noqa: E402

B = 6


class Tied(nn.Module):
    """An embedding used again as the output layer, a bias-free layer and a norm: every kind
    of output the light pass differentiates (an LM head's is B x T x vocabulary)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.mix(self.embed(tokens)))))


class InPlace(nn.Module):
    """The first layer's output is changed in place after it returned (``h += ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc1(x)
        h += x
        return self.fc2(torch.tanh(h))


def lm_loss(logits, tokens):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def calls_of(monkeypatch) -> list:
    """What each light pass chose to differentiate: the outputs, or None (the full pass). A
    layout's first call runs the full pass, then example 0 alone light (its check against row
    0); the later calls are light."""
    seen = []
    original = hooks_torch._outputs

    def spy(records):
        result = original(records)
        seen.append(result)
        return result

    monkeypatch.setattr(hooks_torch, "_outputs", spy)
    return seen


def assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12)


def test_later_calls_differentiate_the_outputs_and_give_the_loop_gradients(monkeypatch):
    torch.manual_seed(0)
    model = Tied().double()
    loss = pergrad.module_loss(model, lm_loss)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    seen = calls_of(monkeypatch)
    for seed in (1, 2, 3):  # the first call checks the layout; the later ones are light
        tokens = torch.randint(0, 11, (B, 7), generator=torch.Generator().manual_seed(seed))
        got = grads(loss.params(), tokens, tokens)
        assert_close(got, torch_module_loop_grads(model, lm_loss, [tokens], [tokens]))
    assert len(seen) == 3 and all(s is not None for s in seen)
    assert all(len(s) == 4 for s in seen)  # embedding, mix, norm, head: one output each


def test_an_output_changed_in_place_takes_the_full_backward_pass(monkeypatch):
    torch.manual_seed(1)
    model = InPlace().double()
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    seen = calls_of(monkeypatch)
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(B, 5, dtype=torch.float64, generator=generator)
        y = torch.randint(0, 3, (B,), generator=generator)
        got = grads(loss.params(), x, y)
        assert_close(got, torch_module_loop_grads(model, F.cross_entropy, [x], [y]))
    assert seen == [None, None, None]


def test_an_empty_batch_after_a_checked_layout_leaves_the_model_as_it_was():
    torch.manual_seed(2)
    model = Tied().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = pergrad.module_loss(model, lm_loss)
    grads = pergrad.per_example_grads(loss, strategy="hooks")
    tokens = torch.randint(0, 11, (B, 7), generator=torch.Generator().manual_seed(5))
    for _ in range(2):  # the layout checked, then a light call
        grads(loss.params(), tokens, tokens)
    empty = grads(loss.params(), tokens[:0], tokens[:0])
    assert {k: tuple(v.shape) for k, v in empty.items()} == {
        k: (0, *v.shape) for k, v in loss.params().items()
    }
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())
