"""One first-call check per layout, whatever the batch size (Poisson sampling draws a new one
every step), and never one where the batch size meets another axis's size.

``capture/torch_checks.py``: a layout is the arguments' shapes and every captured record's
shapes, each dimension equal to the batch size marked as the batch. The checks (a weighted
backward pass, examples run alone, the sums against the batch gradient) ran on every new batch
size before: a DP step on Poisson batches of a small GPT-2 took 2.4x a fixed-size one. Here:
they run once across batch sizes, and again where a time axis made inside the model (no
argument shows it) meets the batch size, whose rows would otherwise be taken for examples.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch capture's checks")

from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402
from pergrad._src.capture import torch_checks  # noqa: E402

WIDTH, STEPS = 3, 4


def abs_mean(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return out.abs().mean() * weight.sum()


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class InternalTimeFirst(nn.Module):
    """Each example ``(D,)`` repeated over ``STEPS`` time steps made inside the model and run
    time-first ``(STEPS, B, D)`` through a linear layer with a per-step shift: the layer's
    batch is on axis 1, except that with ``B == STEPS`` axis 0 has the batch size too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, STEPS)[:, None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.unsqueeze(0) * (1.0 + self.shift)  # (STEPS, B, D)
        return torch.tanh(self.fc(steps)).transpose(0, 1)  # (B, STEPS, 2)


def batch(size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, WIDTH, generator=gen, dtype=torch.float64)
    return [x, torch.rand(size, generator=gen, dtype=torch.float64) + 0.5]


def loop_norms(model: nn.Module, args: list[torch.Tensor]) -> torch.Tensor:
    grads = torch_module_loop_grads(model, abs_mean, args[:1], args[1:])
    return torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)


@pytest.fixture
def checks_run(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batch sizes at which the examples-alone check (every schedule's first-call check)
    ran."""
    sizes: list[int] = []
    original = torch_checks.check_losses_alone

    def counted(single, diff_values, batched_values, losses, count):
        sizes.append(int(losses.shape[0]))
        return original(single, diff_values, batched_values, losses, count)

    monkeypatch.setattr(torch_checks, "check_losses_alone", counted)
    return sizes


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_the_ghost_norms_check_a_layout_once_across_batch_sizes(strategy, checks_run):
    torch.manual_seed(0)
    model = Mlp().double()
    loss = pergrad.module_loss(model, abs_mean)
    for seed, size in enumerate([6, 7, 9, 4, 8]):
        args = batch(size, seed)
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *args, strategy=strategy)
        torch.testing.assert_close(norms, loop_norms(model, args))
    assert checks_run == [6]  # (sizes that meet no other axis: 2, 3, 5 would)


def test_the_hooks_check_a_layout_once_across_batch_sizes(checks_run):
    torch.manual_seed(0)
    model = Mlp().double()
    loss = pergrad.module_loss(model, abs_mean)
    for seed, size in enumerate([6, 7, 9, 4]):
        args = batch(size, seed)
        grads = pergrad.per_example_grads(loss, strategy="hooks")(loss.params(), *args)
        reference = torch_module_loop_grads(model, abs_mean, args[:1], args[1:])
        for name, value in reference.items():
            torch.testing.assert_close(grads[name], value)
    assert checks_run == [6]


def test_a_dp_step_on_poisson_batches_checks_once_and_clips_every_example(checks_run):
    torch.manual_seed(0)
    model = Mlp().double()
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        abs_mean,
        max_norm=1e-3,  # every example clipped: the update is B x max_norm at most
        noise_multiplier=0.0,
        strategy="ghost",
    )
    for seed, size in enumerate([6, 4, 8]):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        optimizer.step(*batch(size, seed))
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        # the mean of clipped gradients: within max_norm (plus rounding)
        assert float((before - after).norm()) <= 1e-3 * (1 + 1e-9)
        assert float((before - after).norm()) > 0.5e-3  # (the examples mostly agree)
    assert checks_run == [6]


def test_a_time_axis_made_inside_the_model_is_checked_again_when_it_meets_the_batch_size(
    checks_run,
):
    """At ``B = 5`` the layer's batch is found on axis 1 and the checks pass; at ``B = STEPS``
    the arguments look the same (``(B, D)``) but axis 0 of the layer, its time steps, has the
    batch size: the records' marks differ, the checks run again, and refuse it (the rows of
    that axis are time steps, each mixing every example). Without the records in the layout
    this returned the time steps' norms as the examples'."""
    torch.manual_seed(0)
    model = InternalTimeFirst().double()
    loss = pergrad.module_loss(model, abs_mean)
    args = batch(5, 0)
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *args, strategy="ghost")
    torch.testing.assert_close(norms, loop_norms(model, args))
    args = batch(STEPS, 1)
    with pytest.raises(ValueError, match="strategy='ghost' cannot handle"):
        pergrad.norms.per_example_norms_of(loss, loss.params(), *args, strategy="ghost")
    with pytest.warns(pergrad.FallbackWarning):
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), *args)
    torch.testing.assert_close(norms, loop_norms(model, args))
    assert checks_run[0] == 5


def test_the_hooks_check_again_when_a_time_axis_meets_the_batch_size(checks_run):
    torch.manual_seed(0)
    model = InternalTimeFirst().double()
    loss = pergrad.module_loss(model, abs_mean)
    hooks = pergrad.per_example_grads(loss, strategy="hooks")
    args = batch(5, 0)
    grads = hooks(loss.params(), *args)
    flat = torch.cat([grads[name].flatten(1) for name in ("fc.weight", "fc.bias")], 1)
    torch.testing.assert_close(flat.norm(dim=1), loop_norms(model, args))
    with pytest.raises(ValueError, match="strategy='hooks' cannot handle"):
        hooks(loss.params(), *batch(STEPS, 1))
    assert checks_run == [5]
