"""The ghost strategy's backward pass computes no weight gradient (issue 19).

After the first call of a layout (which differentiates everything, to check it), a ghost pass
differentiates only what reaches each layer's output: a bias, or, for a bias-free layer (every
layer of Llama, an LM head, an embedding larger than its outputs), the layer's recorded output
itself -- unless an in-place op changed that output after the layer, when its hook would not
fire; then the layer's weight is differentiated as before. (A table smaller than its outputs
has its weight differentiated, a scatter: ``test_lowmem_schedule.py``.) Both routes must give
the same clipped sums as per-example gradients formed by a loop of autograd calls.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_of  # noqa: E402


class BiasFree(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        # more numbers (64 x 8) than its outputs (6 x 7 x 8): its output is the light target
        # (a smaller table has its weight differentiated, a scatter: test_lowmem_schedule.py)
        self.embed = nn.Embedding(64, 8)
        self.hidden = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 20, bias=False)
        self.in_place = in_place

    def forward(self, ids):
        h = self.hidden(self.embed(ids))
        if self.in_place:
            h.mul_(2.0)  # after the layer's hook recorded h
        return self.head(torch.tanh(h))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, 20), ids[:, 1:].reshape(-1))


def reference_clipped_sum(model, ids, max_norm, loss_fn=lm_loss):
    grads = torch_module_loop_grads(model, loss_fn, [ids], [ids])
    norms = torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads.values()))
    factors = (max_norm / norms).clamp(max=1.0)
    return {k: torch.tensordot(factors, g.double(), dims=1) for k, g in grads.items()}


def checked_ghost_call(model, loss_fn, high=20):
    """``(loss, params, ids)`` of a batch of token ids below ``high``, after a first ghost
    clipped sum has checked the layout (the later calls take the light backward pass)."""
    ids = torch.randint(0, high, (6, 7), generator=torch.Generator().manual_seed(1))
    loss = pergrad.module_loss(model, loss_fn)
    params = loss.params()
    clipped_sum_of(loss, params, ids, ids, max_norm=0.1, strategy="ghost")  # checks the layout
    return loss, params, ids


def assert_sums_equal(got, want):
    for name, value in want.items():
        torch.testing.assert_close(got.sum[name].double(), value, rtol=1e-5, atol=1e-7)


def ghost_sum_recording(monkeypatch, loss, params, ids):
    """A ghost clipped sum of ``ids``, and what its backward passes differentiated (each
    ``torch.autograd.grad`` call's inputs)."""
    asked = []
    grad = torch.autograd.grad

    def recording(outputs, inputs, *args, **kwargs):
        asked.extend(inputs)
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", recording)
    try:
        return clipped_sum_of(loss, params, ids, ids, max_norm=0.1, strategy="ghost"), asked
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("in_place", [False, True], ids=["outputs", "in-place: weights"])
def test_bias_free_layers_differentiate_their_outputs_not_their_weights(in_place, monkeypatch):
    torch.manual_seed(0)
    model = BiasFree(in_place)
    loss, params, ids = checked_ghost_call(model, lm_loss)
    got, asked = ghost_sum_recording(monkeypatch, loss, params, ids)
    differentiated = [x for x in asked if x.is_leaf and x.dim() >= 2]  # weight matrices
    assert len(asked) > len(differentiated)  # every layer's output was reached some way
    if in_place:  # the hidden layer's output changed: its weight is differentiated instead
        assert [tuple(x.shape) for x in differentiated] == [(8, 8)]
    else:
        assert differentiated == []
    want = reference_clipped_sum(model, ids, 0.1)
    assert_sums_equal(got, want)


class SharedInput(nn.Module):
    """Bias-free query, key and value projections reading one input, as Llama's and T5's do,
    and a square output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.norm = nn.LayerNorm(8)
        self.q = nn.Linear(8, 8, bias=False)
        self.k = nn.Linear(8, 8, bias=False)
        self.v = nn.Linear(8, 8, bias=False)
        self.o = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 20, bias=False)

    def forward(self, ids):
        x = self.norm(self.embed(ids))
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = torch.softmax(q @ k.transpose(1, 2) / 8**0.5, dim=-1) @ v
        return self.head(torch.tanh(self.o(h) + x))


def test_square_projections_of_one_input_differentiate_that_input_once(monkeypatch):
    """A bias-free layer whose input is no larger than its output has its input differentiated:
    autograd keeps that input for the weight gradient anyway, where it need not keep the
    output, and the query, key and value projections of one input share it (one gradient
    returned instead of three outputs held through the pass). The clipped sums stay the
    loop's."""
    torch.manual_seed(0)
    model = SharedInput()
    loss, params, ids = checked_ghost_call(model, lm_loss)
    outputs: dict[str, list] = {}
    handles = [
        getattr(model, name).register_forward_hook(
            lambda module, args, out, name=name: outputs.setdefault(name, []).append(out)
        )
        for name in ("norm", "q", "k", "v")
    ]
    try:
        got, asked = ghost_sum_recording(monkeypatch, loss, params, ids)
    finally:
        for handle in handles:
            handle.remove()
    assert [x.shape for x in asked if x.is_leaf and x.dim() >= 2] == []  # no weight gradient
    shared = outputs["norm"][-1]  # the projections' one input
    assert sum(x is shared for x in asked) == 1
    projected = [outputs[name][-1] for name in ("q", "k", "v")]
    assert not any(x is y for x in asked for y in projected)
    want = reference_clipped_sum(model, ids, 0.1)
    assert_sums_equal(got, want)


class BiasFreeHead(nn.Module):
    """A bias-free head: with fewer outputs than inputs its output is its light target, with
    more its input."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.hidden = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, classes, bias=False)
        self.classes = classes

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def scaling_loss(logits, labels):
    """Changes the model's output in place before using it."""
    return F.cross_entropy(logits.mul_(2.0).reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize("classes", [3, 20], ids=["output target", "input target"])
def test_an_output_the_loss_changes_in_place_is_not_relied_on(classes, monkeypatch):
    """The light targets are chosen at the end of the model's forward pass, before the loss, so
    that the outputs nothing else keeps are freed before the loss's own buffers come. The loss
    receives the model's output and may change it in place: the head's hook would then not
    fire for its output, so the head's weight is differentiated instead (whether its output or
    its input was the target), and the clipped sums stay the loop's (of the same loss, which
    doubles the logits)."""
    torch.manual_seed(0)
    model = BiasFreeHead(classes)
    loss, params, ids = checked_ghost_call(model, scaling_loss, high=3)
    got, asked = ghost_sum_recording(monkeypatch, loss, params, ids)
    assert [tuple(x.shape) for x in asked if x.is_leaf and x.dim() >= 2] == [(classes, 8)]
    want = reference_clipped_sum(model, ids, 0.1, scaling_loss)
    assert_sums_equal(got, want)
