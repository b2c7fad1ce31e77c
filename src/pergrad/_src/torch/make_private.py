"""One call to set up DP-SGD in PyTorch: a ``DPOptimizer`` and a ``DataLoader`` that agree
with each other and with the accountant (what Opacus's ``make_private`` is; the numbers come
from ``dp/setup.py``)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from pergrad._src.backends.secure import SecureRandom
from pergrad._src.dp.clipping_policies import ClippingPolicy
from pergrad._src.dp.noise import NoiseMechanism
from pergrad._src.dp.setup import DEFAULT_ACCOUNTANT, DPPlan, DPSetup, RunBatches, plan
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.torch.dp_optimizer import DPOptimizer
from pergrad._src.torch.sampling import (
    CyclicPoissonBatchSampler,
    PoissonBatchSampler,
    collate_with_empty_batches,
)

# DataLoader options make_private sets itself: the batches are the plan's
_OWN_LOADER_OPTIONS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class RunBatchSampler(Sampler[list[int]]):
    """A ``DataLoader`` ``batch_sampler`` over one planned run: each pass (epoch) yields the
    next ``plan.steps_per_epoch`` batches of a :class:`pergrad.dp.PoissonBatchSampler` (or
    ``CyclicPoissonBatchSampler``, for a banded mechanism) drawn for the whole run, and a
    pass after the run's steps raises (the accounting covers those only)."""

    def __init__(self, run: DPPlan, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if run.cyclic:
            inner: Sampler[list[int]] = CyclicPoissonBatchSampler(
                run.num_examples, generator=generator, noise=run.noise
            )
        else:
            inner = PoissonBatchSampler(run.num_examples, run.sample_rate, run.steps, generator)
        self.inner = inner
        self.plan = run
        self._batches = RunBatches(run, stream=iter(inner))

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def __repr__(self) -> str:
        return (
            f"RunBatchSampler({self.inner!r}, steps_per_epoch={self.plan.steps_per_epoch}, "
            f"drawn={self._batches.drawn})"
        )


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Any,
    loss_fn: Callable[..., Any],
    *,
    batch_size: float | None,
    delta: float,
    max_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    noise: NoiseMechanism | None = None,
    clipping: ClippingPolicy | None = None,
    generator: torch.Generator | SecureRandom | None = None,
    sampler_generator: torch.Generator | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_inputs: int = 1,
    strategy: str = "auto",
    chunk_size: int | None = None,
    **loader_options: Any,
) -> DPSetup:
    """DP-SGD for a PyTorch model in one call: the optimizer, the data loader and the
    accountant, with the noise, the sample rate and the expected batch size derived together.

    Example (Opacus's ``make_private_with_epsilon``, and it unpacks the same way)::

        optimizer, loader, accountant = pergrad.dp.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), train_set, F.cross_entropy,
            batch_size=64, epochs=10, target_epsilon=3.0, delta=1e-5, max_norm=1.0)
        for epoch in range(10):
            for x, y in loader:                  # Poisson batches, empty ones included
                stats = optimizer.step(x, y)     # clip, noise, step; stats.loss: the mean loss
            print(accountant.epsilon())          # spent so far

    What it derives (:func:`pergrad.dp.plan`): ``sample_rate = batch_size / len(dataset)``;
    the noise multiplier for ``target_epsilon`` over the run's steps (``epochs *
    ceil(len(dataset) / batch_size)``) with ``accountant``; a
    :class:`pergrad.dp.DPOptimizer` around ``optimizer`` that divides by
    ``expected_batch_size = batch_size`` (never by the realised size) and steps the
    accountant; and a ``DataLoader`` whose ``batch_sampler`` draws Poisson batches at that
    rate (cyclic Poisson batches for a banded ``noise=pergrad.dp.toeplitz(...,
    sample_rate=)``), one epoch per pass, refusing a pass past the run, with
    :func:`pergrad.dp.collate_with_empty_batches`. Each piece stays available by itself.

    Args:
      model: the ``nn.Module`` (its parameters are ``optimizer``'s).
      optimizer: any ``torch.optim.Optimizer`` over the model's parameters.
      dataset: a map-style dataset (``len`` and ``dataset[i]``).
      loss_fn: the batch loss ``loss_fn(output, *targets)``, as for ``DPOptimizer``.
      batch_size, delta, epochs, steps, target_epsilon, noise_multiplier, accountant, noise:
        as for :func:`pergrad.dp.plan` (``accountant="pld"`` by default: Opacus's PRV's
        numbers; ``"rdp"`` is looser).
      max_norm: the clipping bound, > 0.
      clipping: the clipping policy (:func:`pergrad.dp.automatic`, :func:`pergrad.dp.adaptive`),
        as for ``DPOptimizer``.
      generator: the noise's ``torch.Generator`` or :class:`pergrad.dp.SecureRandom` (None: a
        ``torch.Generator`` seeded from ``secrets``).
      sampler_generator: the sampling's ``torch.Generator`` (None: seeded from ``secrets``).
      collate_fn: the collate function of non-empty batches (None: PyTorch's default).
      num_inputs, strategy, chunk_size: as for ``DPOptimizer``.
      **loader_options: more ``DataLoader`` options (``num_workers``, ``pin_memory``, ...);
        not ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler`` or ``drop_last``.

    Returns:
      A :class:`pergrad.dp.DPSetup`: ``optimizer, loader, accountant = setup``, and
      ``setup.noise_multiplier``, ``.sample_rate``, ``.steps``, ``.epsilon()`` (the whole
      run's), ``.plan``.
    """
    fn = "make_private"
    if not isinstance(model, nn.Module):
        raise PergradTypeError(
            f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}."
        )
    clashing = sorted(set(loader_options) & set(_OWN_LOADER_OPTIONS))
    if clashing:
        raise PergradValueError(
            f"{fn}: {clashing} cannot be passed: the loader's batches are the planned run's "
            f"Poisson batches (batch_size= is their expected size)."
        )
    try:
        num_examples = len(dataset)
    except TypeError as err:
        raise PergradTypeError(
            f"{fn}: dataset must be a map-style dataset with len(), got {type(dataset).__name__}."
        ) from err
    run = plan(
        num_examples,
        batch_size,
        delta=delta,
        epochs=epochs,
        steps=steps,
        target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
        noise=noise,
    )
    spent = run.make_accountant()
    if generator is None:
        generator = torch.Generator().manual_seed(secrets.randbits(63))
    private = DPOptimizer(
        optimizer,
        model,
        loss_fn,
        max_norm=max_norm,
        noise_multiplier=run.noise_multiplier,
        expected_batch_size=run.expected_batch_size,
        generator=generator,
        num_inputs=num_inputs,
        chunk_size=chunk_size,
        strategy=strategy,
        accountant=spent,
        noise=run.noise,
        clipping=clipping,
    )
    loader = DataLoader(
        dataset,
        batch_sampler=RunBatchSampler(run, sampler_generator),
        collate_fn=collate_with_empty_batches(dataset, collate_fn),
        **loader_options,
    )
    return DPSetup(private, loader, spent, run, float(max_norm))
