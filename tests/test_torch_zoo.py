"""PyTorch models end to end: a zoo of layers, the torch.func tutorials, and the model left alone.

Every gradient is checked against ``_reference.torch_loop_grads``: ``torch.autograd.grad`` on one
example at a time, with no vmap. Its loss of one example is written here with ``functional_call``
(not with ``pergrad.module_loss``), and for the zoo the loop itself is checked once against a
plain ``loss.backward()`` through the model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="these tests exercise the PyTorch backend")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_loop_grads, torch_loop_losses, torch_module_loop_grads  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


# --- helpers -----------------------------------------------------------------------------------


def assert_grads_close(actual: dict, expected: dict, rtol: float = RTOL, atol: float = ATOL):
    assert set(actual) == set(expected)
    for name, value in expected.items():
        assert actual[name].shape == value.shape, name
        torch.testing.assert_close(
            actual[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def trainable(model: nn.Module) -> dict:
    return {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}


def loss_of_one(model: nn.Module, loss_fn: Callable, num_inputs: int = 1) -> Callable:
    """The tutorial's loss of one example, written independently of ``pergrad.module_loss``."""
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(params, *example):
        batch = [x.unsqueeze(0) for x in example]
        out = functional_call(model, (params, buffers), tuple(batch[:num_inputs]))
        return loss_fn(out, *batch[num_inputs:])

    return loss


def backward_grads_of_example(model: nn.Module, loss_fn: Callable, example: tuple) -> dict:
    """One example's gradient by ``loss.backward()`` on a copy of the model: no torch.func."""
    clone = copy.deepcopy(model)
    clone.zero_grad(set_to_none=True)
    inputs, targets = example[:1], example[1:]
    loss_fn(clone(*(x.unsqueeze(0) for x in inputs)), *(t.unsqueeze(0) for t in targets)).backward()
    return {
        k: p.grad if p.grad is not None else torch.zeros_like(p)
        for k, p in clone.named_parameters()
        if p.requires_grad
    }


def sum_of_squares(out, target):
    return ((out - target) ** 2).sum()


class NoFallback:
    """Turn a ``FallbackWarning`` into an error: the layer must be vectorised."""

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", pergrad.FallbackWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


# --- the layer zoo -------------------------------------------------------------------------------


class LastStep(nn.Module):
    """A recurrent layer's output at the last time step."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, _ = self.rnn(x)
        return out[:, -1]


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, need_weights: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x):
        out, weights = self.attn(x, x, x, need_weights=self.need_weights)
        if weights is not None:
            out = out + weights.sum(-1, keepdim=True)
        return out


def with_head(body: nn.Module, example: Any, num_outputs: int = 3) -> nn.Module:
    """``body -> flatten -> Linear``, the head sized by running ``body`` on one example."""
    with torch.no_grad():
        features = body(example.unsqueeze(0)).flatten(1).shape[1]
    return nn.Sequential(body, nn.Flatten(), nn.Linear(features, num_outputs))


def warmed_batchnorm_body() -> nn.Module:
    body = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    body.train()
    with torch.no_grad():  # running statistics far from (0, 1), so the buffers matter
        for _ in range(3):
            body(torch.randn(16, 2, 6, 6) * 3 + 2)
    return body.eval()


def floats(*shape):
    return lambda batch_size: torch.randn(batch_size, *shape)


def tokens(length, vocab):
    return lambda batch_size: torch.randint(0, vocab, (batch_size, length))


@dataclass
class Case:
    body: Callable[[], nn.Module]
    inputs: Callable[[int], Any]
    loss: str = "ce"  # "ce": cross-entropy on 3 classes; "sse": sum of squares on 3 outputs
    falls_back: bool = False


ZOO = {
    "linear": Case(lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh()), floats(6)),
    "conv1d": Case(lambda: nn.Conv1d(2, 4, 3, stride=2, padding=1), floats(2, 9)),
    "conv2d": Case(lambda: nn.Conv2d(4, 4, 3), floats(4, 7, 7)),
    "conv2d_stride_pad": Case(lambda: nn.Conv2d(4, 4, 3, stride=2, padding=1), floats(4, 7, 7)),
    "conv2d_groups": Case(lambda: nn.Conv2d(4, 6, 3, groups=2), floats(4, 7, 7), "sse"),
    "conv2d_depthwise": Case(lambda: nn.Conv2d(4, 4, 3, groups=4, bias=False), floats(4, 6, 6)),
    "conv2d_dilation": Case(lambda: nn.Conv2d(4, 3, 2, dilation=2, padding=1), floats(4, 7, 7)),
    "conv2d_same_reflect": Case(
        lambda: nn.Conv2d(4, 3, 3, padding="same", padding_mode="reflect"), floats(4, 5, 5)
    ),
    "conv3d": Case(lambda: nn.Conv3d(2, 3, 2), floats(2, 3, 4, 4), "sse"),
    "conv_transpose1d": Case(lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), floats(2, 5)),
    "conv_transpose2d": Case(
        lambda: nn.ConvTranspose2d(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
        floats(2, 4, 4),
        "sse",
    ),
    "embedding": Case(lambda: nn.Embedding(10, 4), tokens(5, 10)),
    "embedding_padding_idx": Case(lambda: nn.Embedding(4, 3, padding_idx=0), tokens(6, 4)),
    "layer_norm": Case(lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8)), floats(6)),
    "group_norm": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)), floats(2, 5, 5)
    ),
    "instance_norm_affine": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=True)),
        floats(2, 5, 5),
    ),
    "batch_norm_eval": Case(warmed_batchnorm_body, floats(2, 6, 6), "sse"),
    "rnn": Case(lambda: LastStep(nn.RNN(3, 4, batch_first=True)), floats(4, 3), falls_back=True),
    "gru": Case(lambda: LastStep(nn.GRU(3, 4, batch_first=True)), floats(4, 3), falls_back=True),
    "lstm": Case(lambda: LastStep(nn.LSTM(3, 4, batch_first=True)), floats(4, 3)),
    "multihead_attention": Case(lambda: SelfAttention(8, 2, need_weights=True), floats(4, 8)),
    "multihead_attention_no_weights": Case(
        lambda: SelfAttention(8, 2, need_weights=False), floats(4, 8), "sse"
    ),
    "transformer_encoder_layer": Case(
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), floats(4, 8)
    ),
    "nested_sequential": Case(
        lambda: nn.Sequential(
            nn.Sequential(nn.Linear(6, 5), nn.Tanh()),
            nn.Sequential(nn.Linear(5, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())),
        ),
        floats(6),
    ),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_layer_zoo_matches_loop(name):
    torch.manual_seed(0)
    case = ZOO[name]
    batch_size = 5
    x = case.inputs(batch_size)
    model = with_head(case.body(), x[0])
    if case.loss == "ce":
        loss_fn, y = F.cross_entropy, torch.randint(0, 3, (batch_size,))
    else:
        loss_fn, y = sum_of_squares, torch.randn(batch_size, 3)
    loss = pergrad.module_loss(model, loss_fn)

    if case.falls_back:
        with pytest.warns(pergrad.FallbackWarning, match="loop"):
            grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    else:
        with NoFallback():
            grads = pergrad.per_example_grads(loss)(loss.params(), x, y)

    expected = torch_loop_grads(loss_of_one(model, loss_fn), trainable(model), x, y)
    assert_grads_close(grads, expected)
    # The loop reference itself agrees with a plain backward through the model.
    assert_grads_close(
        {k: v[0] for k, v in expected.items()},
        backward_grads_of_example(model, loss_fn, (x[0], y[0])),
    )


def test_nested_model_keeps_dotted_names():
    torch.manual_seed(0)
    model = with_head(ZOO["nested_sequential"].body(), torch.zeros(6))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    assert list(grads) == [k for k, _ in model.named_parameters()]
    assert "0.1.1.0.weight" in grads
    assert grads["0.1.1.0.weight"].shape == (4, 4, 4)


def test_embedding_padding_row_gets_no_gradient():
    torch.manual_seed(0)
    model = with_head(nn.Embedding(4, 3, padding_idx=0), torch.zeros(6, dtype=torch.long))
    x, y = torch.randint(0, 4, (5, 6)), torch.randint(0, 3, (5,))
    x[:, 0] = 0
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    assert torch.count_nonzero(grads["0.weight"][:, 0]) == 0
    assert torch.count_nonzero(grads["0.weight"][:, 1:]) > 0


# --- the tutorials ------------------------------------------------------------------------------


def test_seed_tutorial_linear_with_named_parameters():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    params = dict(model.named_parameters())  # requires_grad=True, not detached

    def compute_loss(params, x, y):
        pred = functional_call(model, params, (x.unsqueeze(0),)).squeeze(0)
        return ((pred - y) ** 2).mean()

    batch_x, batch_y = torch.randn(16, 4), torch.randn(16, 2)
    with NoFallback():
        grads = pergrad.per_example_grads(compute_loss)(params, batch_x, batch_y)
    assert {k: tuple(v.shape) for k, v in grads.items()} == {
        "weight": (16, 2, 4),
        "bias": (16, 2),
    }
    expected = torch_loop_grads(compute_loss, params, batch_x, batch_y)
    assert_grads_close(grads, expected)
    # Closed form too: d/dW mean((Wx + b - y)^2) = (2 / 2) (Wx + b - y) x^T.
    residual = batch_x @ model.weight.detach().T + model.bias.detach() - batch_y
    torch.testing.assert_close(grads["bias"], residual, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(
        grads["weight"], residual[:, :, None] * batch_x[:, None, :], rtol=RTOL, atol=ATOL
    )


class SimpleCNN(nn.Module):
    """The model of the PyTorch per-sample-gradients tutorial (dropout as in eval mode)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def kink_margins(model: SimpleCNN, data: Any) -> Any:
    """Per example, how far the forward pass is from a kink: ReLU inputs near 0, or a max-pool
    window whose two largest entries nearly tie. Within ~1e-7 of one, float32 rounding decides
    the branch, and a batched and a looped pass may take different ones (with seed 0 a window
    of gap 1.6e-9 moved conv2.weight's gradient by 3.8e-3 against the loop)."""
    with torch.no_grad():
        pre1 = model.conv1(data)
        pre2 = model.conv2(F.relu(pre1))
        act2 = F.relu(pre2)
        top2 = act2.unfold(2, 2, 2).unfold(3, 2, 2).flatten(-2).topk(2, dim=-1).values
        gaps = torch.where(top2[..., 0] > 0, top2[..., 0] - top2[..., 1], torch.inf)
        pre3 = model.fc1(torch.flatten(F.max_pool2d(act2, 2), 1))
        margins = [pre1.abs(), pre2.abs(), gaps, pre3.abs()]
        return torch.stack([m.flatten(1).amin(1) for m in margins], dim=1).amin(1)


def mnist_shaped_batch(model: SimpleCNN, batch_size: int) -> tuple:
    """Random (B, 1, 28, 28) images, any within 1e-6 of a kink drawn again."""
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(batch_size, 1, 28, 28, generator=generator)
    for _ in range(20):
        near_kink = kink_margins(model, data) < 1e-6
        if not near_kink.any():
            return data, torch.randint(10, (batch_size,), generator=generator)
        data[near_kink] = torch.randn(int(near_kink.sum()), 1, 28, 28, generator=generator)
    raise AssertionError("could not draw a batch away from the kinks")


@pytest.mark.slow
def test_simple_cnn_tutorial_matches_loop():
    torch.manual_seed(0)
    model = SimpleCNN().eval()
    batch_size = 64
    data, targets = mnist_shaped_batch(model, batch_size)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def compute_loss(params, buffers, sample, target):
        batch = sample.unsqueeze(0)
        targets = target.unsqueeze(0)
        predictions = functional_call(model, (params, buffers), (batch,))
        return F.nll_loss(predictions, targets)

    expected = torch_loop_grads(
        lambda p, sample, target: compute_loss(p, buffers, sample, target), params, data, targets
    )
    with NoFallback():
        grads = pergrad.per_example_grads(compute_loss)(params, buffers, data, targets)
    assert grads["fc1.weight"].shape == (batch_size, 128, 9216)
    # The tutorial's atol=3e-3 covers kinks; away from them the default tolerance holds.
    assert_grads_close(grads, expected)
    del grads

    loss = pergrad.module_loss(model, F.nll_loss)
    with NoFallback():
        grads = pergrad.per_example_grads(loss)(loss.params(), data, targets)
    assert_grads_close(grads, expected)


def test_buffers_shared_when_batch_size_equals_batchnorm_width():
    torch.manual_seed(0)
    channels = 8
    model = nn.Sequential(nn.Linear(5, channels), nn.BatchNorm1d(channels), nn.Linear(channels, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-2, 2)
        model[1].running_var.uniform_(0.2, 4)
    model.eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    x, y = torch.randn(channels, 5), torch.randint(0, 3, (channels,))  # B == 8 == channels

    def loss(params, buffers, sample, target):
        out = functional_call(model, (params, buffers), (sample.unsqueeze(0),))
        return F.cross_entropy(out, target.unsqueeze(0))

    with NoFallback():
        grads = pergrad.per_example_grads(loss)(params, buffers, x, y)
    expected = torch_loop_grads(lambda p, s, t: loss(p, buffers, s, t), params, x, y)
    assert_grads_close(grads, expected)


# --- dropout and batch norm in training mode -------------------------------------------------


P_DROP = 0.5


def dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Dropout(P_DROP), nn.Linear(6, 3)).train()


def masks_from_grads(grads: dict) -> Any:
    """Each example's dropout mask, read off the zero columns of its last-layer weight grad."""
    return (grads["2.weight"].abs().sum(dim=1) != 0).float()  # (B, 6)


def masked_loss(params, x, y, mask):
    """The dropout model's loss of one example with a given dropout mask, by hand."""
    hidden = (params["0.weight"] @ x + params["0.bias"]) * mask / (1 - P_DROP)
    logits = params["2.weight"] @ hidden + params["2.bias"]
    return F.cross_entropy(logits[None], y[None])


def test_dropout_needs_randomness():
    torch.manual_seed(0)
    model = dropout_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="randomness"):
        pergrad.per_example_grads(loss)(loss.params(), x, y)


def test_dropout_randomness_different_gives_each_example_its_mask():
    torch.manual_seed(0)
    model = dropout_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    batch_size = 8
    x = torch.randn(1, 4).expand(batch_size, 4).contiguous()  # one example, repeated
    y = torch.randint(0, 3, (1,)).expand(batch_size).contiguous()
    with NoFallback():
        grads = pergrad.per_example_grads(loss, randomness="different")(loss.params(), x, y)
    assert {k: tuple(v.shape) for k, v in grads.items()} == {
        "0.weight": (batch_size, 6, 4),
        "0.bias": (batch_size, 6),
        "2.weight": (batch_size, 3, 6),
        "2.bias": (batch_size, 3),
    }
    masks = masks_from_grads(grads)
    assert len({tuple(m.tolist()) for m in masks}) > 1, "the same mask for every example"
    expected = torch_loop_grads(masked_loss, trainable(model), x, y, masks)
    assert_grads_close(grads, expected)


def test_dropout_randomness_same_shares_one_mask():
    torch.manual_seed(0)
    model = dropout_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with NoFallback():
        grads = pergrad.per_example_grads(loss, randomness="same")(loss.params(), x, y)
    masks = masks_from_grads(grads)
    assert (masks == masks[0]).all()
    expected = torch_loop_grads(masked_loss, trainable(model), x, y, masks)
    assert_grads_close(grads, expected)


def batchnorm_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Sequential(nn.BatchNorm2d(3)), nn.Flatten(), nn.Linear(12, 2)
    )


def test_module_loss_refuses_batchnorm_in_training_mode():
    model = batchnorm_model().train()
    with pytest.raises(ValueError, match=r"'1\.0'.*BatchNorm2d.*eval\(\).*GroupNorm"):
        pergrad.module_loss(model, F.cross_entropy)


@pytest.mark.parametrize("pass_buffers", [True, False], ids=["buffers", "no_buffers"])
def test_tutorial_form_with_batchnorm_in_training_mode_raises_value_error(pass_buffers):
    torch.manual_seed(0)
    model = batchnorm_model().train()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    x, y = torch.randn(6, 2, 4, 4), torch.randint(0, 2, (6,))

    def loss_with_buffers(params, buffers, sample, target):
        out = functional_call(model, (params, buffers), (sample.unsqueeze(0),))
        return F.cross_entropy(out, target.unsqueeze(0))

    def loss_without_buffers(params, sample, target):
        out = functional_call(model, params, (sample.unsqueeze(0),))
        return F.cross_entropy(out, target.unsqueeze(0))

    if pass_buffers:
        call = pergrad.per_example_grads(loss_with_buffers)
        args = (params, buffers, x, y)
    else:
        call = pergrad.per_example_grads(loss_without_buffers)
        args = (params, x, y)
    with NoFallback(), pytest.raises(ValueError, match="BatchNorm.*eval"):
        call(*args)


# --- the model is left as it was -----------------------------------------------------------------


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def snapshot(model: nn.Module) -> dict:
    return {
        "params": {k: (p.detach().clone(), p.requires_grad) for k, p in model.named_parameters()},
        "grads": {
            k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()
        },
        "grad_ids": {k: id(p.grad) for k, p in model.named_parameters()},
        "buffers": {k: b.clone() for k, b in model.named_buffers()},
        "training": {k: m.training for k, m in model.named_modules()},
        "hooks": {
            (k, h): list(getattr(m, h).items())
            for k, m in model.named_modules()
            for h in HOOK_DICTS
        },
        "identity": {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()},
    }


def assert_same_snapshot(before: dict, after: dict):
    assert before["params"].keys() == after["params"].keys()
    for k, (value, requires_grad) in before["params"].items():
        assert torch.equal(after["params"][k][0], value), k
        assert after["params"][k][1] == requires_grad, k
    for k, grad in before["grads"].items():
        if grad is None:
            assert after["grads"][k] is None, k
        else:
            assert torch.equal(after["grads"][k], grad), k
    assert after["grad_ids"] == before["grad_ids"]
    assert before["buffers"].keys() == after["buffers"].keys()
    for k, value in before["buffers"].items():
        assert torch.equal(after["buffers"][k], value), k
    assert after["training"] == before["training"]
    assert after["hooks"] == before["hooks"]
    assert after["identity"] == before["identity"]


def hooked_model(training: bool) -> nn.Module:
    """A model with BatchNorm, dropout, a frozen layer, a pre-set .grad and hooks of each kind."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3)
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model[0].bias.requires_grad_(False)
    model[4].weight.grad = torch.randn(3, 6)
    model[0].register_forward_hook(lambda m, i, o: None)
    model[1].register_forward_pre_hook(lambda m, i: None)
    # torch.func cannot run register_full_backward_hook's hooks at all (see the xfail below).
    model[4].register_backward_hook(lambda m, gi, go: None)
    model.train(training)
    return model


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook")
def test_successful_calls_leave_the_model_untouched():
    model = hooked_model(training=False)
    before = snapshot(model)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    loss = pergrad.module_loss(model, F.cross_entropy)
    pergrad.per_example_grads(loss)(loss.params(), x, y)
    pergrad.value_and_per_example_grads(loss, chunk_size=2)(loss.params(), x, y)
    assert_same_snapshot(before, snapshot(model))

    params = dict(model.named_parameters())  # requires_grad=True leaves of the model itself
    buffers = dict(model.named_buffers())

    def compute_loss(params, buffers, sample, target):
        out = functional_call(model, (params, buffers), (sample.unsqueeze(0),))
        return F.cross_entropy(out, target.unsqueeze(0))

    pergrad.per_example_grads(compute_loss)(params, buffers, x, y)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook")
def test_failed_calls_leave_the_model_untouched():
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    # Dropout in training mode without randomness=..., BatchNorm switched to eval.
    model = hooked_model(training=True)
    model[1].eval()
    before = snapshot(model)
    loss = pergrad.module_loss(model, F.cross_entropy)
    with pytest.raises(ValueError, match="randomness"):
        pergrad.per_example_grads(loss)(loss.params(), x, y)
    assert_same_snapshot(before, snapshot(model))

    # BatchNorm in training mode, refused by module_loss when made and when called.
    model = hooked_model(training=True)
    before = snapshot(model)
    with pytest.raises(ValueError, match="BatchNorm"):
        pergrad.module_loss(model, F.cross_entropy)
    assert_same_snapshot(before, snapshot(model))
    model.eval()
    loss = pergrad.module_loss(model, F.cross_entropy)
    model.train()
    before = snapshot(model)
    with pytest.raises(ValueError, match="BatchNorm"):
        pergrad.per_example_grads(loss, randomness="different")(loss.params(), x, y)
    assert_same_snapshot(before, snapshot(model))

    # BatchNorm in training mode through functional_call, where torch's in-place error is
    # translated: running statistics must not have moved.
    params = {k: v.detach() for k, v in model.named_parameters()}

    def compute_loss(params, sample, target):
        out = functional_call(model, params, (sample.unsqueeze(0),))
        return F.cross_entropy(out, target.unsqueeze(0))

    with pytest.raises(ValueError, match="BatchNorm"):
        pergrad.per_example_grads(compute_loss, randomness="different")(params, x, y)
    assert_same_snapshot(before, snapshot(model))

    # A loss that is not a scalar.
    model = hooked_model(training=False)
    before = snapshot(model)
    bad = pergrad.module_loss(model, lambda out, target: out)
    with pytest.raises(ValueError, match="scalar"):
        pergrad.per_example_grads(bad)(bad.params(), x, y)
    assert_same_snapshot(before, snapshot(model))


def tracked_instance_norm_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 3, 3),
        nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(3 * 6, 2),
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.train()


@pytest.mark.parametrize(
    "call",
    [
        lambda loss, x, y: pergrad.per_example_grads(loss)(loss.params(), x, y),
        lambda loss, x, y: pergrad.norms.per_example_norms_of(loss, loss.params(), x, y),
        lambda loss, x, y: pergrad.dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=1.0),
        lambda loss, x, y: pergrad.dp.clipped_sum_of(
            loss, loss.params(), x, y, max_norm=1.0, strategy="chunked"
        ),
        lambda loss, x, y: pergrad.dp.clipped_sum_of(
            loss, loss.params(), x, y, max_norm=1.0, strategy="ghost-lowmem"
        ),
    ],
    ids=["per_example_grads", "norms_of", "clipped_sum_of", "chunked", "ghost-lowmem"],
)
def test_tracked_instance_norm_in_training_mode_leaves_its_statistics_alone(call):
    """An InstanceNorm with track_running_stats in training mode: the call takes its fast path
    (no fallback to the loop, which wrote the running statistics by 0.16 in one call) and the
    model's buffers are exactly as they were."""
    model = tracked_instance_norm_model()
    before = snapshot(model)
    x, y = torch.randn(5, 2, 8), torch.randint(0, 2, (5,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    with NoFallback():
        call(loss, x, y)
    assert_same_snapshot(before, snapshot(model))


def test_tracked_instance_norm_in_training_mode_matches_training_code():
    """Each example normalised by its own statistics, as a training forward pass does."""
    model = tracked_instance_norm_model()
    x, y = torch.randn(5, 2, 8), torch.randint(0, 2, (5,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    with NoFallback():
        grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    assert_grads_close(grads, torch_module_loop_grads(model, F.cross_entropy, [x], [y]))
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y)
    torch.testing.assert_close(norms, pergrad.norms.per_example_norms(grads), rtol=1e-4, atol=0)


# --- has_aux, values, chunks, argnums, frozen parameters -----------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def test_has_aux_returns_batched_logits():
    model = mlp()
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))

    def loss_and_logits(params, sample, target):
        logits = functional_call(model, params, (sample.unsqueeze(0),))
        return F.cross_entropy(logits, target.unsqueeze(0)), logits.squeeze(0)

    with NoFallback():
        grads, logits = pergrad.per_example_grads(loss_and_logits, has_aux=True)(
            trainable(model), x, y
        )
    expected = torch_loop_grads(lambda p, s, t: loss_and_logits(p, s, t)[0], trainable(model), x, y)
    assert_grads_close(grads, expected)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(x), rtol=RTOL, atol=ATOL)


def test_value_and_per_example_grads_losses_match_loop():
    model = mlp()
    x, y = torch.randn(7, 5), torch.randint(0, 3, (7,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    with NoFallback():
        losses, grads = pergrad.value_and_per_example_grads(loss)(loss.params(), x, y)
    reference = loss_of_one(model, F.cross_entropy)
    assert losses.shape == (7,)
    torch.testing.assert_close(
        losses, torch_loop_losses(reference, trainable(model), x, y), rtol=RTOL, atol=ATOL
    )
    assert_grads_close(grads, torch_loop_grads(reference, trainable(model), x, y))
    with torch.no_grad():
        batch_losses = F.cross_entropy(model(x), y, reduction="none")
    torch.testing.assert_close(losses, batch_losses, rtol=RTOL, atol=ATOL)


def test_chunk_size_does_not_change_the_result():
    model = mlp()
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    with NoFallback():
        chunked = pergrad.per_example_grads(loss, chunk_size=3)(loss.params(), x, y)
        whole = pergrad.per_example_grads(loss)(loss.params(), x, y)
    expected = torch_loop_grads(loss_of_one(model, F.cross_entropy), trainable(model), x, y)
    assert_grads_close(chunked, expected)
    assert_grads_close(whole, expected)
    assert_grads_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_argnums_tuple_returns_params_and_temperature_grads():
    model = mlp()
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    temperature = torch.tensor(1.7)

    def loss(params, temperature, sample, target):
        logits = functional_call(model, params, (sample.unsqueeze(0),)) / temperature
        return F.cross_entropy(logits, target.unsqueeze(0))

    with NoFallback():
        out = pergrad.per_example_grads(loss, argnums=(0, 1))(trainable(model), temperature, x, y)
    assert isinstance(out, tuple) and len(out) == 2
    param_grads, temperature_grads = out
    assert temperature_grads.shape == (6,)

    both = {**trainable(model), "temperature": temperature}

    def loss_of_both(leaves, sample, target):
        params = {k: v for k, v in leaves.items() if k != "temperature"}
        return loss(params, leaves["temperature"], sample, target)

    expected = torch_loop_grads(loss_of_both, both, x, y)
    torch.testing.assert_close(temperature_grads, expected.pop("temperature"), rtol=RTOL, atol=ATOL)
    assert_grads_close(param_grads, expected)


def test_frozen_parameters_are_left_out():
    model = mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = loss.params()
    assert list(params) == ["0.bias", "2.weight", "2.bias"]
    with NoFallback():
        grads = pergrad.per_example_grads(loss)(params, x, y)
    expected = torch_loop_grads(loss_of_one(model, F.cross_entropy), trainable(model), x, y)
    assert_grads_close(grads, expected)
    assert_grads_close(
        {k: v[0] for k, v in grads.items()},
        backward_grads_of_example(model, F.cross_entropy, (x[0], y[0])),
    )
    assert not model[0].weight.requires_grad
    assert torch.equal(model[0].weight, frozen)


# --- known pergrad bugs (strict xfails: they start failing when the bug is fixed) ---------------


def test_full_backward_hook_gets_correct_per_example_grads():
    """torch.func refuses modules with full backward hooks; "auto" takes the layer hooks (plain
    autograd on the batch) ahead of vmap, without a warning, and the loop agrees."""
    model = mlp()
    model[2].register_full_backward_hook(lambda m, gi, go: None)
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(5, 5), torch.randint(0, 3, (5,))
    fn = pergrad.per_example_grads(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = fn(loss.params(), x, y)
    assert fn.last_strategy == "hooks"
    with pytest.raises(ValueError, match="strategy='vmap'.*setup_context"):
        pergrad.per_example_grads(loss, strategy="vmap")(loss.params(), x, y)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def reference(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    expected = torch_loop_grads(reference, params, x, y)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-5)


class RecurrentWithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, 6, batch_first=True)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(self.drop(out[:, -1]))


def test_fallback_loop_refuses_randomness_by_default():
    model = RecurrentWithDropout().train()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(4, 3, 4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="randomness='different'"):
        pergrad.per_example_grads(loss)(loss.params(), x, y)


def test_fallback_loop_keeps_randomness_same():
    torch.manual_seed(0)
    model = RecurrentWithDropout().train()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x = torch.randn(1, 3, 4).expand(6, 3, 4).contiguous()  # one example, repeated
    y = torch.zeros(6, dtype=torch.long)
    with pytest.warns(pergrad.FallbackWarning):
        grads = pergrad.per_example_grads(loss, randomness="same")(loss.params(), x, y)
    masks = grads["fc.weight"].abs().sum(dim=1) != 0  # (B, 6): units dropout kept
    assert (masks == masks[0]).all(), "randomness='same' but the examples got different masks"
