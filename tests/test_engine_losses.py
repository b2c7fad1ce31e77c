"""The capture engine's per-example losses: ``F.cross_entropy`` and ``F.mse_loss`` taken with
``reduction="none"`` in one call give what each example alone gives (through ``vmap``, the
general path a wrapped loss takes), values and gradients."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import pergrad  # noqa: E402
from pergrad._src.capture.torch_engine import per_example_losses  # noqa: E402

SPEC = types.SimpleNamespace(func_name="test")


def _losses(loss_fn, output, target):
    loss = pergrad.module_loss(torch.nn.Identity(), loss_fn)
    output = output.detach().requires_grad_(True)
    losses = per_example_losses(SPEC, loss, output, [target], [0], output.shape[0])
    (grad,) = torch.autograd.grad((losses * torch.arange(1.0, len(losses) + 1)).sum(), output)
    return losses.detach(), grad


def _cases():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g)
    classes = torch.tensor([0, 4, -100, 2, 1, 3])
    sequence = torch.randn(6, 5, 4, generator=g)
    sequence_classes = torch.randint(0, 5, (6, 4), generator=g)
    sequence_classes[2] = -100  # every position of example 2 ignored: NaN, as alone
    sequence_classes[3, 1] = -100
    probabilities = torch.softmax(torch.randn(6, 5, generator=g), 1)
    return {
        "classes": (F.cross_entropy, logits, classes),
        "sequence": (F.cross_entropy, sequence, sequence_classes),
        "probabilities": (F.cross_entropy, logits, probabilities),
        "mse": (F.mse_loss, torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)),
        "mse broadcast": (F.mse_loss, torch.randn(6, 3, generator=g), torch.randn(6, 1)),
        "float64": (F.cross_entropy, logits.double(), classes),
    }


@pytest.mark.filterwarnings("ignore:Using a target size")  # the broadcast case's
@pytest.mark.parametrize("case", list(_cases()))
def test_known_losses_match_each_example_alone(case):
    loss_fn, output, target = _cases()[case]
    fast_losses, fast_grad = _losses(loss_fn, output, target)
    # a wrapper is not recognised: vmap over the rows, each a batch of one
    slow_losses, slow_grad = _losses(lambda o, t: loss_fn(o, t), output, target)
    alone = torch.stack([loss_fn(output[i : i + 1], target[i : i + 1]) for i in range(6)])
    torch.testing.assert_close(fast_losses, alone, equal_nan=True)
    torch.testing.assert_close(slow_losses, alone, equal_nan=True)
    torch.testing.assert_close(fast_grad, slow_grad, equal_nan=True)


def test_known_loss_error_is_the_general_paths():
    """A target out of range raises what the general path raises (the user's loss_fn's)."""
    logits, classes = torch.randn(3, 4), torch.tensor([0, 7, 1])
    with pytest.raises(Exception) as fast:
        _losses(F.cross_entropy, logits, classes)
    with pytest.raises(Exception) as slow:
        _losses(lambda o, t: F.cross_entropy(o, t), logits, classes)
    assert type(fast.value) is type(slow.value)
