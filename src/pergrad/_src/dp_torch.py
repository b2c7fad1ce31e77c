"""DP-SGD for PyTorch: a wrapper around any ``torch.optim`` optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pergrad._src.clipping import _check_positive, add_noise, check_noise_multiplier
from pergrad._src.errors import PergradTypeError
from pergrad._src.ghost.api import choose_strategy, clipped_sum_of
from pergrad._src.torch_module import module_loss


@dataclass(frozen=True)
class DPStep:
    """What one private step did: the share of examples whose gradient was clipped, the batch
    size, and how the clipped sum was computed (``"ghost"``, ``"chunked"`` or
    ``"materialize"``, see :func:`pergrad.norms.choose_strategy`)."""

    clip_fraction: float
    batch_size: int
    strategy: str


class DPOptimizer:
    """DP-SGD around any ``torch.optim`` optimizer.

        optimizer = pergrad.dp.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, F.cross_entropy,
            max_norm=1.0, noise_multiplier=1.1, expected_batch_size=256,
            generator=torch.Generator().manual_seed(secrets.randbits(63)),
        )
        for x, y in loader:             # Poisson batches: pergrad.dp.PoissonBatchSampler
            stats = optimizer.step(x, y)   # per-example grads, clip, noise, optimizer step

    ``step`` computes per-example gradients of ``loss_fn(model(x), y)`` through
    :func:`pergrad.module_loss`, clips each to ``max_norm``, sums, adds Gaussian noise of std
    ``noise_multiplier * max_norm`` from ``generator``, divides by ``expected_batch_size``
    (None: the batch size), writes the result to each parameter's ``.grad`` and steps the
    wrapped optimizer. The model keeps its mode, hooks and flags; parameters with
    ``requires_grad=False`` are left out. An empty batch still takes a step (pure noise), as
    the accounting assumes. Pass an :class:`Accountant` to have it count the steps.

    Cost: the clipped sum comes from :func:`pergrad.dp.clipped_sum_of` with ``strategy``
    (default ``"auto"``): for models built from standard layers (Linear, Conv1d/2d, Embedding,
    norm layers) the ghost strategy, about two batch gradients of time and no ``B x P`` memory;
    otherwise per-example gradients ``chunk_size`` examples at a time.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        loss_fn: Callable[..., Any],
        *,
        max_norm: float,
        noise_multiplier: float,
        expected_batch_size: float | None = None,
        generator: torch.Generator | None = None,
        num_inputs: int = 1,
        chunk_size: int | None = None,
        strategy: str = "auto",
        accountant: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PergradTypeError(
                f"DPOptimizer: optimizer must be a torch.optim.Optimizer; got "
                f"{type(optimizer).__name__}."
            )
        _check_positive("DPOptimizer", "max_norm", max_norm)
        check_noise_multiplier("DPOptimizer", noise_multiplier)
        if expected_batch_size is not None:
            _check_positive("DPOptimizer", "expected_batch_size", expected_batch_size)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise PergradTypeError(
                f"DPOptimizer: generator must be a torch.Generator or None; got "
                f"{type(generator).__name__}."
            )
        self.optimizer = optimizer
        self.model = model
        self.max_norm = float(max_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.generator = generator
        self.accountant = accountant
        self._loss = module_loss(model, loss_fn, num_inputs=num_inputs)
        self.strategy = strategy
        self.chunk_size = chunk_size

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, *batch: Any) -> DPStep:
        """One DP-SGD step on ``batch`` (the model inputs, then the loss function's targets)."""
        params = self._loss.params()
        choice = choose_strategy(self._loss, params, *batch, strategy=self.strategy)
        clipped = clipped_sum_of(
            self._loss,
            params,
            *batch,
            max_norm=self.max_norm,
            strategy=self.strategy,
            chunk_size=self.chunk_size,
        )
        noisy = add_noise(clipped.sum, self.noise_multiplier * self.max_norm, self.generator)
        denominator = self.expected_batch_size or max(float(clipped.count), 1.0)
        for name, param in self.model.named_parameters():
            if name in noisy:
                param.grad = (noisy[name] / denominator).detach().to(param.dtype)
        self.optimizer.step()
        if self.accountant is not None:
            self.accountant.step()
        return DPStep(
            clip_fraction=float(clipped.clip_fraction),
            batch_size=int(clipped.count),
            strategy=choice.strategy,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
