"""Gradient diagnostics over training: a running noise scale and per-step norm histories.

One batch's noise scale (:func:`pergrad.norms.noise_scale`) swings by an order of magnitude from
batch to batch and is ``inf`` whenever its estimate of ``|G|^2`` comes out negative (the signal
buried in noise). McCandlish et al. (2018, appendix A) average the two unbiased estimates over
steps and divide the averages; :class:`TrainingMonitor` does that with exponential moving
averages (bias-corrected, as Adam's moments), and keeps, per step, the norms' quantiles, the
clipped fraction and the flagged examples, for :func:`pergrad.plotting.training_curves`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pergrad._src.backends import backend_of
from pergrad._src.errors import PergradValueError
from pergrad._src.norms import (
    NoiseScale,
    noise_scale,
    noise_scale_from_sums,
    per_example_norms,
    scores_to_numpy,
)


class TrainingMonitor:
    """Per-step gradient diagnostics, framework-free, for any training loop.

    Example (any framework, a JAX loop as a PyTorch one: one call per step)::

        monitor = pergrad.norms.TrainingMonitor()
        for step, batch in enumerate(loader):
            grads = pergrad.per_example_grads(loss)(params, *batch)
            monitor.update(grads=grads, max_norm=1.0)    # or update(norms=..., clip_fraction=...)
            ...
        monitor.noise_scale        # the running B_simple
        pergrad.plotting.training_curves(monitor, path="training.png")

    Without per-example gradients (the ghost path), the norms and the summed gradient give the
    same numbers: ``s = pergrad.dp.clipped_sum_of(loss, params, X, Y, max_norm=1e30)``
    then ``monitor.update(norms=s.norms, grad_sum=s.sum)``. In ``transformers.Trainer``,
    :class:`pergrad.norms.TrainingMonitorCallback` makes the calls.

    Args:
      smoothing: the moving averages' decay per step, in ``[0, 1)``: 0.9 averages over about
        10 steps, 0.99 over about 100.
      quantiles: the norm quantiles kept per step.

    Attributes:
      history: per step, lists of ``step``, ``q{...}`` (each quantile of the norms),
        ``clip_fraction`` (None where unknown), ``noise_scale`` (the running estimate after
        that step, ``nan`` until it is defined) and ``batch_noise_scale`` (that batch's alone,
        ``nan`` where its ``|G|^2`` estimate was not positive).
    """

    def __init__(self, smoothing: float = 0.95, quantiles: Sequence[float] = (0.1, 0.5, 0.9)):
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)):
            raise PergradValueError(
                f"TrainingMonitor: smoothing must be a number in [0, 1); got {smoothing!r}."
            )
        if not 0.0 <= smoothing < 1.0:
            raise PergradValueError(
                f"TrainingMonitor: smoothing must be in [0, 1); got {smoothing!r}."
            )
        quantiles = tuple(float(q) for q in quantiles)
        if not quantiles or not all(0.0 <= q <= 1.0 for q in quantiles):
            raise PergradValueError(
                f"TrainingMonitor: quantiles must be a non-empty sequence of numbers in [0, 1]; "
                f"got {quantiles!r}."
            )
        self.smoothing, self.quantiles = float(smoothing), quantiles
        self._trace = self._signal = 0.0  # moving averages (biased towards 0 early on)
        self._weight = 0.0  # 1 - smoothing ** (number of noise-scale updates): the correction
        self.history: dict[str, list[Any]] = {
            "step": [],
            **{quantile_key(q): [] for q in quantiles},
            "clip_fraction": [],
            "noise_scale": [],
            "batch_noise_scale": [],
        }

    @property
    def noise_scale(self) -> float:
        """The running ``B_simple``: the average ``tr(Sigma)`` over the average ``|G|^2``;
        ``nan`` before any update with gradients, or while the average ``|G|^2`` is not
        positive. Never ``inf``."""
        if self._weight == 0.0:
            return math.nan
        signal = self._signal / self._weight
        return self._trace / self._weight / signal if signal > 0 else math.nan

    def update(
        self,
        grads: Any = None,
        norms: Any = None,
        clip_fraction: float | None = None,
        max_norm: float | None = None,
        step: int | None = None,
        grad_sum: Any = None,
    ) -> None:
        """Record one step.

        Args:
          grads: the step's per-example gradients (either framework; leaves ``(B, ...)``):
            their norms, and the noise scale's two estimates (needs ``B >= 2``).
          norms: the per-example norms, where the gradients were not formed (a ghost step:
            ``pergrad.norms.per_example_norms_of``, ``ClippedSum.norms``); no noise scale
            then, unless ``grad_sum`` comes with them.
          clip_fraction: the share of examples clipped, if known (a ``DPStep``'s).
          max_norm: with ``grads`` or ``norms``: the clipping bound, to compute the clipped
            fraction from the norms.
          step: the step's number (default: one more than the last).
          grad_sum: with ``norms``: the sum over the batch of the UNCLIPPED per-example
            gradients (a pytree like one example's gradient; ``clipped_sum_of(...,
            max_norm=1e30).sum``): with the norms it gives the noise scale's two
            estimates, equal to those of ``grads``.
        """
        if (grads is None) == (norms is None):
            raise PergradValueError(
                "TrainingMonitor.update: pass exactly one of grads (per-example gradients) or "
                "norms (per-example norms)."
            )
        if grad_sum is not None and norms is None:
            raise PergradValueError(
                "TrainingMonitor.update: grad_sum goes with norms (the norms and the summed "
                "gradient of the same batch); with grads, leave it out."
            )
        if grads is not None:
            values = scores_to_numpy("TrainingMonitor.update", per_example_norms(grads), "grads")
            batch = noise_scale(grads) if values.size >= 2 else None
        else:
            values = scores_to_numpy("TrainingMonitor.update", norms, "norms")
            batch = None if grad_sum is None else _estimates_of_sum(values, grad_sum)
        if max_norm is not None:
            clip_fraction = float(np.mean(values > max_norm)) if values.size else 0.0
        if batch is not None:
            decay = self.smoothing
            self._trace = decay * self._trace + (1 - decay) * batch.trace_sigma
            self._signal = decay * self._signal + (1 - decay) * batch.grad_norm_sq
            self._weight = decay * self._weight + (1 - decay)
        history = self.history
        last = history["step"][-1] if history["step"] else -1
        history["step"].append(last + 1 if step is None else int(step))
        finite = values[np.isfinite(values)]
        for q in self.quantiles:
            value = float(np.quantile(finite, q)) if finite.size else math.nan
            history[quantile_key(q)].append(value)
        history["clip_fraction"].append(None if clip_fraction is None else float(clip_fraction))
        history["noise_scale"].append(self.noise_scale)
        single = math.nan if batch is None or not math.isfinite(batch.b_simple) else batch.b_simple
        history["batch_noise_scale"].append(single)


def quantile_key(q: float) -> str:
    """``0.5 -> "q50"``, ``0.999 -> "q99_9"``: the key of a quantile (``NormSummary``'s)."""
    return "q" + f"{q * 100:g}".replace(".", "_")


def _estimates_of_sum(norms: np.ndarray, grad_sum: Any) -> NoiseScale | None:
    """The noise scale's estimates from the norms and the summed gradient of one batch
    (None for fewer than 2 examples, or where some norm is not finite)."""
    if norms.size < 2 or not np.all(np.isfinite(norms)):
        return None
    bk = backend_of(grad_sum, "TrainingMonitor.update", "grad_sum")
    leaves = bk.flatten(grad_sum)[1]
    if not leaves:
        raise PergradValueError("TrainingMonitor.update: grad_sum has no array leaves.")
    sum_sq = sum(float(bk.to_numpy((leaf**2).sum())) for leaf in leaves)
    size = norms.size
    total_sq = float(np.sum(norms.astype(np.float64) ** 2))
    return noise_scale_from_sums(total_sq, sum_sq / size**2, size)
