"""What a private step reports (:class:`DPStep`) and the helpers ``DPOptimizer`` steps with: the
loss scaling of a ``GradScaler``, the realised-batch-size warning, reading step statistics from
the device in one transfer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pergrad._src.dp.accounting import Accountant
from pergrad._src.errors import (
    PergradTypeError,
    PergradValueError,
    PrivacyWarning,
    warn_from_caller,
)


@dataclass(frozen=True)
class DPStep:
    """What one private step did: the share of examples whose gradient was clipped, the batch
    size, and how the clipped sum was computed (``"ghost"``, ``"ghost-lowmem"``, ``"chunked"``
    or ``"materialize"``: the strategy that ran, which :func:`pergrad.norms.choose_strategy`
    plans; where a planned ghost run fails its checks, the chunked one that stood in for it,
    with a :class:`pergrad.FallbackWarning`; ``"ghost-fsdp"`` on a model sharded with FSDP2's
    ``fully_shard``). With ``distributed``, the
    clip fraction and batch size are over all processes, the strategy this process's.

    ``skipped`` (with a ``scaler`` only): the loss scale overflowed, so the step drew no noise,
    left the parameters as they were and halved the scale (for :meth:`DPOptimizer.accumulate`:
    this micro-batch overflowed, so the step it belongs to will be skipped).

    ``nonfinite``: how many examples had a gradient that was not finite (inf or nan). Without a
    scaler each was zeroed: it contributed nothing, and still counts in ``batch_size``. With a
    scaler they are the overflow that skipped the step. With ``distributed``, this process's
    examples only.

    ``max_norm``: the bound this step clipped at (under :func:`pergrad.dp.adaptive`, the one
    :attr:`DPOptimizer.max_norm` held before the step moved it).

    ``loss``: the mean of the examples' losses (over the step's micro-batches; with
    ``distributed``, this process's examples), as the forward pass of the ghost strategies
    (``"ghost"``, ``"ghost-lowmem"``) computed them: no extra forward pass, and no privacy
    (print it, do not release it). None where the step ran another strategy (``"chunked"``,
    ``"materialize"``, user-level clipping), on an empty batch, or when some micro-batch of
    the step had no losses. A non-finite example's loss makes it nan or inf."""

    clip_fraction: float
    batch_size: int
    strategy: str
    skipped: bool = False
    nonfinite: int = 0
    max_norm: float | None = None
    loss: float | None = None


MAX_NORM_KEY = "pergrad_max_norm"


def warn_realised_batch_size(accountant: Any, expected_batch_size: Any) -> None:
    """Say so when the accountant assumes Poisson sampling but the step will divide by the
    realised batch size: that size depends on the data, and the accounting does not cover its
    release (the update's scale gives it away)."""
    if expected_batch_size is not None or not isinstance(accountant, Accountant):
        return
    if accountant.sampling != "poisson" or accountant.sample_rate is None:
        return
    groups = getattr(accountant.noise, "min_separation", None)
    if accountant.noise.steps is None or accountant.noise.sample_rate is None or not groups:
        sampling, fix = "Poisson sampling", "sample_rate * len(dataset)"
    else:  # cyclic Poisson sampling: a step samples one of min_separation groups
        sampling = f"cyclic Poisson sampling over min_separation={groups} groups"
        fix = (
            f"len(dataset) * sample_rate / min_separation (= len(dataset) * "
            f"{accountant.sample_rate:g} / {groups}; CyclicPoissonBatchSampler."
            f"expected_batch_size)"
        )
    warn_from_caller(
        f"DPOptimizer: the accountant assumes {sampling} (sample_rate="
        f"{accountant.sample_rate:g}), but expected_batch_size is None, so each step divides "
        f"by the realised batch size, which depends on the data and which the accounting does "
        f"not cover. Pass expected_batch_size={fix} (the global one when distributed).",
        PrivacyWarning,
    )


class ScaledLoss:
    """``loss_fn`` times the scaler's current scale (set before each micro-batch)."""

    def __init__(self, loss_fn: Callable[..., Any]) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0

    def __call__(self, output: Any, *targets: Any) -> Any:
        loss = self.loss_fn(output, *targets)
        if isinstance(loss, tuple) and len(loss) == 2:  # (loss, aux)
            return loss[0] * self.scale, loss[1]
        return loss * self.scale


def check_scaler(scaler: Any, distributed: Any) -> torch.amp.GradScaler | None:
    """The scaler if it scales (None for None or a disabled one); refuses anything else."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise PergradTypeError(
            f"DPOptimizer: scaler must be a torch.amp.GradScaler (e.g. "
            f"torch.amp.GradScaler('cuda') for float16 autocast) or None; got "
            f"{type(scaler).__name__}."
        )
    if distributed is not False:
        raise PergradValueError(
            "DPOptimizer: scaler is not supported with distributed yet (the processes would "
            "have to agree on skipping a step); autocast to bfloat16, which needs no scaler, "
            "or train in one process."
        )
    return scaler if scaler.is_enabled() else None


def mean_loss(losses: tuple[float, int] | None) -> float | None:
    """``sum / number`` of per-example losses; None where there are none."""
    if losses is None or losses[1] == 0:
        return None
    return losses[0] / losses[1]


def host_numbers(*values: Any) -> list[float]:
    """Tensors (0-d) and numbers as Python floats, the tensors read from their device together:
    one host sync for all of them, where ``float()`` of each would be one each."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    device = tensors[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    read = iter(torch.stack([t.detach().reshape(()).to(device, dtype) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
