"""Per-example clipping, clipped sums and Gaussian noise: the DP-SGD aggregate.

Everything here takes per-example gradients (a pytree, leaves ``(B, *param_shape)``) from
either framework and works through the backend protocol and the arithmetic that JAX arrays and
torch tensors share, so one implementation serves both.

Bounds are either one number (flat clipping: each example's whole gradient to norm ``<= C``) or
a pytree prefix of the gradients (per-layer / per-group clipping: ``{"encoder": 1.0, "head":
0.5}`` clips each group of leaves to its own bound). The sensitivity of the clipped sum is then
``sqrt(sum of squared bounds)``, and the noise scales with it.

An example whose gradient is not finite (an inf or nan in any entry, so its norm is not
finite) gets weight 0 and is masked with ``where`` before any product (``0 * nan`` is nan): it
contributes exactly nothing, is counted in :attr:`ClippedSum.nonfinite`, and still counts in
the batch (``count``), which the privacy accounting allows: its contribution, 0, is within the
bound. Every DP reduction (these functions, ``clipped_sum_of`` on each strategy, the optax
transform, ``DPOptimizer``) does the same through :func:`clip_weights`.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

from pergrad._src.backends import Backend, backend_of
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism, add_independent_gaussian
from pergrad._src.dp.types import ClippedSum
from pergrad._src.errors import PergradValueError
from pergrad._src.norms import flat_leaves


def check_positive(func_name: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PergradValueError(f"{func_name}: {name} must be a positive number; got {value!r}.")
    return float(value)


def check_noise_multiplier(func_name: str, noise_multiplier: Any) -> float:
    if (
        isinstance(noise_multiplier, bool)
        or not isinstance(noise_multiplier, (int, float))
        or noise_multiplier < 0
    ):
        raise PergradValueError(
            f"{func_name}: noise_multiplier must be a number >= 0; got {noise_multiplier!r}."
        )
    return float(noise_multiplier)


def clip_groups(
    func_name: str, bk: Backend, grads: Any, max_norm: Any
) -> tuple[list[int], list[float]]:
    """Each leaf's group index and each group's bound, from a number or a pytree prefix."""
    _, leaves, _ = bk.flatten(grads)
    if isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool):
        return [0] * len(leaves), [check_positive(func_name, "max_norm", max_norm)]
    _, bounds, bounds_def = bk.flatten(max_norm)
    ids = bk.broadcast_prefix(bk.unflatten(bounds_def, list(range(len(bounds)))), grads)
    if ids is None or not bounds:
        raise PergradValueError(
            f"{func_name}: max_norm must be a positive number (flat clipping) or a pytree "
            f"prefix of the gradients with one positive bound per group (per-layer "
            f"clipping); got {max_norm!r}, which does not match the gradients' structure."
        )
    return ids, [check_positive(func_name, "each max_norm bound", b) for b in bounds]


def clip_factors(norms: Any, bound: float) -> Any:
    """min(1, bound / norm), written so that a zero norm gives 1 without a division by zero."""
    return bound / norms.clip(min=bound)


class ClipWeights(NamedTuple):
    """Each example's weight in a clipped sum, from its group norms (:func:`clip_weights`).

    Attributes:
      weights: one ``(B,)`` array per group: ``min(1, bound / norm)`` for a real example with
        finite norms, 0 for padding and for an example with any non-finite group norm.
      real: ``(B,)`` 1 for real examples, 0 for padding, in the norms' dtype.
      finite: ``(B,)`` booleans, True where every group norm of the example is finite.
    """

    weights: list[Any]
    real: Any
    finite: Any


def clip_weights(
    bk: Backend, group_norms: list[Any], bounds: list[float], mask: Any
) -> ClipWeights:
    """The examples' clip weights: non-finite examples and padding get 0, written with
    ``where`` so that a nan norm cannot leak into the weights or the counts."""
    finite = functools.reduce(operator.and_, [bk.isfinite(n) for n in group_norms])
    first = group_norms[0]
    # 1 in the norms' dtype and device, also for a nan norm (a bfloat16 model's weights @ grads
    # refuses float32, and nan * 0 is nan)
    ones = bk.where(finite, first * 0 + 1, 1.0)
    real = ones if mask is None else ones * mask
    weights = [
        bk.where(finite, clip_factors(n, b), 0.0) * real for n, b in zip(group_norms, bounds)
    ]
    return ClipWeights(weights, real, finite)


def clip_statistics(
    bk: Backend,
    summed: Any,
    group_norms: list[Any],
    bounds: list[float],
    clipping: ClipWeights,
) -> ClippedSum:
    """The :class:`ClippedSum` of ``summed`` (the weighted sum) and the weights it used."""
    real, finite = clipping.real, clipping.finite
    # Compare norms with bounds, not factors with 1: bound / bound can round below 1 in float32.
    above = functools.reduce(operator.or_, [n > b for n, b in zip(group_norms, bounds)])
    clipped_any = bk.where(above & finite, real, 0.0)
    count = real.sum()
    return ClippedSum(
        sum=summed,
        norms=group_norms[0] if len(bounds) == 1 else group_norms,
        clip_fraction=clipped_any.sum() / count.clip(min=1.0),
        sensitivity=sum(b * b for b in bounds) ** 0.5,
        count=count,
        nonfinite=bk.where(finite, 0.0, real).sum(),
    )


def _group_norms(flat: list[Any], ids: list[int], num_groups: int) -> list[Any]:
    squared = [(leaf**2).sum(1) for leaf in flat]
    return [
        sum(s for s, g in zip(squared, ids) if g == group) ** 0.5 for group in range(num_groups)
    ]


def clip(grads: Any, max_norm: Any) -> Any:
    """Per-example gradients scaled so each example's norm is at most ``max_norm``.

    Args:
      grads: per-example gradients, leaves ``(B, *param_shape)``, JAX or torch.
      max_norm: a positive number (flat), or a pytree prefix of ``grads`` with a bound per group
        (per-layer: each group's norm is at most its bound).

    Returns:
      A new pytree like ``grads``. This keeps a clipped copy of every per-example gradient;
      for DP-SGD, :func:`clipped_sum` gives the sum without it. An example whose gradient is
      not finite (inf or nan) comes back as zeros.
    """
    bk, _, flat, treedef, batch_size = flat_leaves("clip", grads)
    ids, bounds = clip_groups("clip", bk, grads, max_norm)
    clipping = clip_weights(bk, _group_norms(flat, ids, len(bounds)), bounds, None)
    all_finite = bk.known_all(clipping.finite) is True
    _, leaves, _ = bk.flatten(grads)
    clipped = []
    for leaf, g in zip(leaves, ids):
        rows = (batch_size, *([1] * (len(bk.shape(leaf)) - 1)))
        if not all_finite:
            leaf = bk.where(clipping.finite.reshape(rows), leaf, 0.0)
        clipped.append(leaf * clipping.weights[g].reshape(rows))
    return bk.unflatten(treedef, clipped)


def clipped_sum(
    grads: Any, max_norm: Any, mask: Any = None, axis_name: str | tuple[str, ...] | None = None
) -> ClippedSum:
    """Sum over the batch of per-example gradients clipped to ``max_norm``.

    The sum is taken as a weighted contraction (``factors @ leaf``), so neither a clipped copy
    of the per-example gradients nor a second B x P array is made. Under ``jax.jit`` with the
    batch sharded over devices, each device clips its own examples and only the ``P``-sized
    sum crosses devices.

    Args:
      grads: per-example gradients, leaves ``(B, *param_shape)``.
      max_norm: a positive number, or a pytree prefix of ``grads`` with one bound per group.
      mask: optional ``(B,)`` booleans or 0/1, False for padding examples (a Poisson batch
        padded to a fixed size for ``jax.jit``); padding contributes nothing.
      axis_name: JAX only, inside ``jax.shard_map``: the mesh axis the examples are split
        over. ``grads`` are then this device's examples, and the result's ``sum``, ``count``
        and ``clip_fraction`` cover all devices (see :func:`pergrad.dp.psum_clipped`).

    Returns:
      A :class:`ClippedSum`. An example whose gradient is not finite (inf or nan) contributes
      nothing and is counted in ``nonfinite``; it still counts in ``count``.
    """
    if axis_name is not None:
        from pergrad._src.dp.psum import check_axis_name, psum_clipped

        check_axis_name("clipped_sum", axis_name)
        local = clipped_sum(grads, max_norm, mask)
        return psum_clipped(local, axis_name, func_name="clipped_sum")
    bk, _, flat, treedef, batch_size = flat_leaves("clipped_sum", grads)
    ids, bounds = clip_groups("clipped_sum", bk, grads, max_norm)
    if mask is not None:
        _check_mask(bk, mask, batch_size)
    group_norms = _group_norms(flat, ids, len(bounds))
    clipping = clip_weights(bk, group_norms, bounds, mask)
    finite_rows = clipping.finite.reshape(batch_size, 1)
    _, leaves, _ = bk.flatten(grads)
    # The where keeps a non-finite example's rows out of the product (0 * nan would still be
    # nan) at the cost of one pass over the gradients and a B x P temporary (1.55x a torch DP
    # step, benchmarks/results/cpu/nonfinite_cost.md), so it is skipped where the norms can
    # be read and are all finite (eager torch, JAX outside jit). Under jax.jit it always runs:
    # a lax.cond would compile both branches' all-reduce of a sharded batch's sum.
    clean = bk.known_all(clipping.finite) is not True
    summed = [
        (clipping.weights[g] @ (bk.where(finite_rows, f_leaf, 0.0) if clean else f_leaf)).reshape(
            bk.shape(leaf)[1:]
        )
        for f_leaf, leaf, g in zip(flat, leaves, ids)
    ]
    return clip_statistics(bk, bk.unflatten(treedef, summed), group_norms, bounds, clipping)


def _check_mask(bk: Backend, mask: Any, batch_size: int) -> Any:
    if not bk.is_array(mask) or bk.shape(mask) != (batch_size,):
        shape = bk.shape(mask) if bk.is_array(mask) else type(mask).__name__
        raise PergradValueError(
            f"clipped_sum: mask must be a ({batch_size},) array of the gradients' framework "
            f"(True for real examples, False for padding); got {shape}."
        )
    return mask


def add_noise(summed: Any, std: float, rng: Any) -> Any:
    """``summed`` plus independent Gaussian noise of standard deviation ``std`` per entry.

    Args:
      summed: a pytree of arrays (e.g. :attr:`ClippedSum.sum`).
      std: the noise standard deviation, ``noise_multiplier * sensitivity`` for DP-SGD.
      rng: a JAX PRNG key, or a ``torch.Generator`` (None: torch's global generator). For real
        privacy, seed it from a secure source: ``torch.Generator().manual_seed(
        secrets.randbits(63))`` / ``jax.random.key(secrets.randbits(63))``; or pass
        :class:`pergrad.dp.SecureRandom` (both frameworks) to draw every value from the
        operating system's cryptographic source.
    """
    return add_independent_gaussian(summed, std, rng)


def private_mean(
    grads: Any,
    max_norm: Any,
    noise_multiplier: float,
    rng: Any,
    expected_batch_size: float | None = None,
    mask: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> tuple[Any, ClippedSum]:
    """The DP-SGD gradient: clip each example, sum, add noise, divide by the batch size.

    Args:
      grads: per-example gradients, leaves ``(B, *param_shape)``.
      max_norm: clipping bound, a number or a pytree prefix (per-layer).
      noise_multiplier: noise std as a multiple of the sensitivity (``>= 0``).
      rng: JAX key or ``torch.Generator`` (see :func:`add_noise`).
      expected_batch_size: divide by this (``sample_rate * dataset size`` under Poisson
        sampling, which the accounting assumes: dividing by the actual size would leak it).
        None divides by the number of real examples, as a fixed-size batch does.
      mask: ``(B,)`` real-example mask for padded batches.
      axis_name: JAX only, inside ``jax.shard_map``: the mesh axis the examples are split
        over. The clipped sums are added across devices first, then the noise is added once
        (``rng`` must be the same key on every device) and the sum divided by the global
        count or ``expected_batch_size``.

    Returns:
      ``(private_gradient, ClippedSum)``: the noisy mean gradient (like one example's gradient)
      and the clipping statistics.
    """
    check_private_settings("private_mean", noise_multiplier, expected_batch_size)
    clipped = clipped_sum(grads, max_norm, mask=mask, axis_name=axis_name)
    return noisy_mean(clipped, noise_multiplier, rng, expected_batch_size)[0], clipped


def check_private_settings(func_name: str, noise_multiplier: Any, expected_batch_size: Any) -> None:
    check_noise_multiplier(func_name, noise_multiplier)
    if expected_batch_size is not None:
        check_positive(func_name, "expected_batch_size", expected_batch_size)


def noisy_mean(
    clipped: ClippedSum,
    noise_multiplier: float,
    rng: Any,
    expected_batch_size: float | None,
    noise: NoiseMechanism | None = None,
    noise_state: Any = (),
) -> tuple[Any, Any]:
    """``(the clipped sum plus the mechanism's noise of scale noise_multiplier * sensitivity,
    divided by expected_batch_size (or by the number of real examples when it is None), the
    mechanism's next state)``; ``noise`` None is independent Gaussian noise."""
    mechanism = GaussianNoise() if noise is None else noise
    std = noise_multiplier * clipped.sensitivity
    noisy, noise_state = mechanism.add(clipped.sum, std, rng, noise_state)
    bk = backend_of(noisy, "private_mean", "grads")
    if expected_batch_size is None:
        denominator = clipped.count.clip(min=1.0)
    else:
        denominator = float(expected_batch_size)
    _, leaves, treedef = bk.flatten(noisy)
    return bk.unflatten(treedef, [leaf / denominator for leaf in leaves]), noise_state
