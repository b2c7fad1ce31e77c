"""Norm diagnostics of per-example gradients: norms, summaries, alignment, noise scale.

Every function takes the per-example gradients that :func:`pergrad.per_example_grads` returns
(a pytree, each leaf ``(B, *param_shape)``) from either framework. The arithmetic uses only the
operators and methods that JAX arrays and torch tensors share (``reshape``, ``sum``, ``mean``,
``**``), so one implementation serves both and results stay on the framework and device they
came from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pergrad._src.backends import Backend, backend_of
from pergrad._src.errors import PergradTypeError, PergradValueError


def flat_leaves(func_name: str, grads: Any) -> tuple[Backend, list[str], list[Any], Any, int]:
    """Backend, paths, leaves reshaped to ``(B, -1)``, structure and batch size of ``grads``."""
    bk = backend_of(grads, func_name, "grads")
    paths, leaves, treedef = bk.flatten(grads)
    sizes = set()
    for path, leaf in zip(paths, leaves):
        if not bk.is_array(leaf):
            raise PergradTypeError(
                f"{func_name}: every leaf of grads must be an array; the leaf at "
                f"{path or 'the root'} is a {type(leaf).__name__}. (Gradients of non-array "
                f"leaves come back as None: drop them before asking for norms.)"
            )
        if len(bk.shape(leaf)) == 0:
            raise PergradValueError(
                f"{func_name}: grads must be per-example gradients, each leaf of shape "
                f"(B, *param_shape); the leaf at {path or 'the root'} is 0-d."
            )
        sizes.add(bk.shape(leaf)[0])
    if len(sizes) != 1:
        listing = ", ".join(f"{p or 'root'}: {bk.shape(x)[0]}" for p, x in zip(paths, leaves))
        raise PergradValueError(
            f"{func_name}: the leaves of grads disagree on the batch size (leading sizes "
            f"{listing}); pass the output of per_example_grads for one batch."
        )
    batch_size = sizes.pop()
    # An explicit width (not -1) so that an empty batch (B == 0) reshapes too.
    flat = [leaf.reshape(batch_size, math.prod(bk.shape(leaf)[1:])) for leaf in leaves]
    return bk, paths, flat, treedef, batch_size


def _squared_norms(flat: Sequence[Any]) -> list[Any]:
    return [(leaf**2).sum(1) for leaf in flat]


def per_example_norms(grads: Any, per_layer: bool = False) -> Any:
    """The L2 norm of each example's gradient.

    Args:
      grads: per-example gradients, a pytree with leaves ``(B, *param_shape)``.
      per_layer: False (default) for one norm over the whole pytree; True for one norm per
        leaf (per parameter array), returned in the structure of ``grads``.

    Returns:
      A ``(B,)`` array of the framework of ``grads``, or a pytree of them with ``per_layer``.
      The per-leaf norms squared sum to the global norm squared.
    """
    bk, _, flat, treedef, _ = flat_leaves("per_example_norms", grads)
    if not isinstance(per_layer, bool):
        raise PergradTypeError(f"per_example_norms: per_layer must be a bool; got {per_layer!r}.")
    squared = _squared_norms(flat)
    if per_layer:
        return bk.unflatten(treedef, [s**0.5 for s in squared])
    return sum(squared[1:], squared[0]) ** 0.5


def cosine_to_mean(grads: Any, eps: float = 1e-12) -> Any:
    """Cosine similarity of each example's gradient with the batch's mean gradient, ``(B,)``.

    Examples that pull against the rest of the batch (mislabeled, adversarial) have low or
    negative values. ``eps`` guards zero gradients, which get a cosine of 0.
    """
    bk, _, flat, _, batch_size = flat_leaves("cosine_to_mean", grads)
    if batch_size == 0:
        raise PergradValueError("cosine_to_mean: grads has an empty batch (B == 0).")
    means = [leaf.mean(0) for leaf in flat]
    dots = sum(((leaf * mean).sum(1) for leaf, mean in zip(flat, means)), 0)
    norms = sum(_squared_norms(flat)) ** 0.5
    mean_norm = sum((mean**2).sum() for mean in means) ** 0.5
    return dots / (norms * mean_norm + eps)


@dataclass(frozen=True)
class NoiseScale:
    """The gradient noise scale of one batch (McCandlish et al. 2018, "An Empirical Model of
    Large-Batch Training", appendix A).

    Attributes:
      b_simple: ``trace_sigma / grad_norm_sq``, the batch size beyond which larger batches stop
        paying off. A ratio of two unbiased estimates (not itself unbiased); noisy for small
        batches, so average ``trace_sigma`` and ``grad_norm_sq`` over steps before dividing.
      trace_sigma: unbiased estimate of tr(Σ), the summed variance of one example's gradient.
      grad_norm_sq: unbiased estimate of |G|², the squared norm of the true mean gradient.
      batch_size: B, the number of per-example gradients used.
    """

    b_simple: float
    trace_sigma: float
    grad_norm_sq: float
    batch_size: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def noise_scale(grads: Any) -> NoiseScale:
    """Estimate the gradient noise scale B_simple = tr(Σ) / |G|² from one batch.

    With per-example gradients ``g_i`` (i = 1..B) and their mean ``ḡ``:

    - ``trace_sigma = Σ_i |g_i - ḡ|² / (B - 1)`` is unbiased for tr(Σ);
    - ``grad_norm_sq = |ḡ|² - trace_sigma / B`` is unbiased for |G|², since
      ``E|ḡ|² = |G|² + tr(Σ)/B``. It can come out negative when the signal is buried in noise;
      ``b_simple`` is then ``inf``.

    Needs ``B >= 2``. Returns a :class:`NoiseScale` of Python floats.
    """
    bk, _, flat, _, batch_size = flat_leaves("noise_scale", grads)
    if batch_size < 2:
        raise PergradValueError(
            f"noise_scale: needs at least 2 examples to estimate a variance; grads has a batch "
            f"of {batch_size}."
        )
    mean_sq = float(bk.to_numpy(sum((leaf.mean(0) ** 2).sum() for leaf in flat)))
    total_sq = float(bk.to_numpy(sum((leaf**2).sum() for leaf in flat)))
    return noise_scale_from_sums(total_sq, mean_sq, batch_size)


def noise_scale_from_sums(total_sq: float, mean_sq: float, batch_size: int) -> NoiseScale:
    """:func:`noise_scale` from two numbers: ``total_sq = Σ_i |g_i|²`` (the squared
    per-example norms, summed) and ``mean_sq = |ḡ|²`` (the mean gradient's squared norm), so
    that a caller with the norms and the summed gradient (a ghost pass) needs no per-example
    gradients. ``batch_size >= 2``."""
    # Σ_i |g_i - ḡ|² = Σ_i |g_i|² - B |ḡ|²
    trace_sigma = max(total_sq - batch_size * mean_sq, 0.0) / (batch_size - 1)
    grad_norm_sq = mean_sq - trace_sigma / batch_size
    b_simple = trace_sigma / grad_norm_sq if grad_norm_sq > 0 else float("inf")
    return NoiseScale(b_simple, trace_sigma, grad_norm_sq, batch_size)


@dataclass(frozen=True)
class NormSummary:
    """Summary statistics of per-example gradient norms (or any per-example scores)."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    quantiles: dict[float, float] = field(default_factory=dict)
    threshold: float | None = None
    fraction_above: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __getattr__(self, name: str) -> float:
        """The quantiles by the names ``__str__`` prints them under: ``summary.q50`` is
        ``summary.quantiles[0.5]`` (``q99_9`` for 0.999)."""
        if name.startswith("q") and name != "quantiles":
            for q, value in self.__dict__.get("quantiles", {}).items():
                if _quantile_name(q) == name:
                    return value
            known = ", ".join(_quantile_name(q) for q in self.__dict__.get("quantiles", {}))
            raise AttributeError(
                f"NormSummary has no quantile {name!r}; it holds {known or 'none'} "
                f"(summarize(..., quantiles=...) chooses them)."
            )
        raise AttributeError(f"'NormSummary' object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *(_quantile_name(q) for q in self.quantiles)]

    def __str__(self) -> str:
        parts = [
            f"n={self.count}",
            f"mean={self.mean:.4g}",
            f"std={self.std:.4g}",
            f"min={self.min:.4g}",
            f"max={self.max:.4g}",
        ]
        parts += [f"{_quantile_name(q)}={v:.4g}" for q, v in self.quantiles.items()]
        if self.threshold is not None:
            parts.append(f"above {self.threshold:.4g}: {self.fraction_above:.1%}")
        return "NormSummary(" + ", ".join(parts) + ")"


def _quantile_name(q: float) -> str:
    """``0.5 -> "q50"``, ``0.999 -> "q99_9"``: the attribute of quantile ``q``."""
    return "q" + f"{q * 100:g}".replace(".", "_")


def summarize(
    norms: Any, quantiles: Sequence[float] = (0.5, 0.9, 0.99), threshold: float | None = None
) -> NormSummary:
    """Mean, std (ddof=1), min, max, quantiles and the fraction above ``threshold`` of a
    ``(B,)`` array of norms, as a :class:`NormSummary` that prints on one line."""
    values = scores_to_numpy("summarize", norms, "norms")
    if not np.all(np.isfinite(values)):
        bad = np.flatnonzero(~np.isfinite(values))
        raise PergradValueError(
            f"summarize: norms holds {len(bad)} non-finite value(s) (at indices "
            f"{bad[:10].tolist()}): those examples' gradients are NaN or infinite."
        )
    quantiles = tuple(quantiles)
    if not all(isinstance(q, (int, float)) and 0 <= q <= 1 for q in quantiles):
        raise PergradValueError(
            f"summarize: quantiles must be numbers in [0, 1]; got {list(quantiles)}."
        )
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold > 0):
        raise PergradValueError(
            f"summarize: threshold must be a positive number or None; got {threshold!r}."
        )
    return NormSummary(
        count=len(values),
        mean=float(values.mean()),
        std=float(values.std(ddof=1)) if len(values) > 1 else 0.0,
        min=float(values.min()),
        max=float(values.max()),
        quantiles={float(q): float(np.quantile(values, q)) for q in quantiles},
        threshold=None if threshold is None else float(threshold),
        fraction_above=None if threshold is None else float((values > threshold).mean()),
    )


def scores_to_numpy(func_name: str, scores: Any, arg_name: str) -> np.ndarray:
    """A non-empty 1-D float numpy copy of per-example ``scores`` from any framework."""
    if isinstance(scores, np.ndarray):
        values = scores
    else:
        bk = backend_of(scores, func_name, arg_name)
        if not bk.is_array(scores):
            raise PergradTypeError(
                f"{func_name}: {arg_name} must be a 1-D array of per-example values; got "
                f"{type(scores).__name__}."
            )
        values = bk.to_numpy(scores)
    if values.ndim != 1:
        raise PergradValueError(
            f"{func_name}: {arg_name} must be 1-D, one value per example; got shape "
            f"{values.shape}. (For per-layer norms, pass one layer's array.)"
        )
    if values.size == 0:
        raise PergradValueError(f"{func_name}: {arg_name} is empty; there is nothing to rank.")
    return values.astype(np.float64)
