"""Per-example clipping, clipped sums and Gaussian noise: the DP-SGD aggregate.

Everything here takes per-example gradients (a pytree, leaves ``(B, *param_shape)``) from
either framework and works through the backend protocol and the arithmetic that JAX arrays and
torch tensors share, so one implementation serves both.

Bounds are either one number (flat clipping: each example's whole gradient to norm ``<= C``) or
a pytree prefix of the gradients (per-layer / per-group clipping: ``{"encoder": 1.0, "head":
0.5}`` clips each group of leaves to its own bound). The sensitivity of the clipped sum is then
``sqrt(sum of squared bounds)``, and the noise scales with it.

How each example is scaled under its bound is the clipping policy (``clipping=``, from
``clipping_policies.py``): ``min(1, bound / norm)`` by default, ``bound / (norm + gamma)``
under automatic clipping; every path turns norms into weights through :func:`clip_weights`.

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
from pergrad._src.dp.clipping_policies import (
    ClippingPolicy,
    check_clipping,
    clip_factors,
    gradient_noise_multiplier,
    num_groups,
)
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism, add_independent_gaussian
from pergrad._src.dp.sampling import warn_if_mask_forgotten
from pergrad._src.dp.types import ClippedSum
from pergrad._src.dp.users import check_user_ids, user_slots
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.norms import flat_leaves


def check_positive(func_name: str, name: str, value: Any) -> float:
    """A positive finite number (an infinite clipping bound would make the sensitivity, hence
    the noise, infinite, and gave nan sums: ``inf / inf``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        raise PergradValueError(
            f"{func_name}: {name} must be a positive number, finite; got {value!r}."
        )
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


def check_bound(func_name: str, bk: Backend, name: str, value: Any) -> Any:
    """A clipping bound: a positive number, or a 0-d array of the gradients' framework (a
    bound that changes between steps, such as adaptive clipping's under ``jax.jit``), checked
    positive where its value can be read."""
    if bk.is_array(value) and bk.shape(value) == ():
        if bk.known_all(value > 0) is False:
            raise PergradValueError(
                f"{func_name}: {name} must be positive; got the 0-d array {value!r}."
            )
        return value
    return check_positive(func_name, name, value)


def clip_groups(
    func_name: str, bk: Backend, grads: Any, max_norm: Any
) -> tuple[list[int], list[Any]]:
    """Each leaf's group index and each group's bound, from a number (or 0-d array) or a
    pytree prefix."""
    _, leaves, _ = bk.flatten(grads)
    if (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)) or (
        bk.is_array(max_norm) and bk.shape(max_norm) == ()
    ):
        return [0] * len(leaves), [check_bound(func_name, bk, "max_norm", max_norm)]
    max_norm = _in_key_order_of(max_norm, grads)
    _, bounds, bounds_def = bk.flatten(max_norm)
    ids = bk.broadcast_prefix(bk.unflatten(bounds_def, list(range(len(bounds)))), grads)
    if ids is None or not bounds:
        raise PergradValueError(
            f"{func_name}: max_norm must be a positive number (flat clipping) or a pytree "
            f"prefix of the gradients with one positive bound per group (per-layer "
            f"clipping); got {max_norm!r}, which does not match the gradients' structure."
        )
    return ids, [check_bound(func_name, bk, "each max_norm bound", b) for b in bounds]


def _in_key_order_of(prefix: Any, tree: Any) -> Any:
    """``prefix`` with each dict's keys in ``tree``'s order: torch's pytree flattens a dict in
    insertion order and matches a prefix by position, so ``{"head": 0.5, "encoder": 1.0}``
    against gradients ordered encoder-then-head would swap the bounds."""
    if isinstance(prefix, dict) and isinstance(tree, dict) and set(prefix) == set(tree):
        return {key: _in_key_order_of(prefix[key], tree[key]) for key in tree}
    if type(prefix) in (list, tuple) and type(prefix) is type(tree) and len(prefix) == len(tree):
        return type(prefix)(_in_key_order_of(p, t) for p, t in zip(prefix, tree))
    return prefix


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
    bk: Backend,
    group_norms: list[Any],
    bounds: list[Any],
    mask: Any,
    policy: ClippingPolicy | None = None,
) -> ClipWeights:
    """The examples' clip weights (``policy``'s factors; None: ``min(1, bound / norm)``):
    non-finite examples and padding get 0, written with ``where`` so that a nan norm cannot
    leak into the weights or the counts."""
    factors = clip_factors if policy is None else policy.factors
    finite = functools.reduce(operator.and_, [bk.isfinite(n) for n in group_norms])
    first = group_norms[0]
    # 1 in the norms' dtype and device, also for a nan norm (a bfloat16 model's weights @ grads
    # refuses float32, and nan * 0 is nan)
    ones = bk.where(finite, first * 0 + 1, 1.0)
    real = ones if mask is None else ones * mask
    weights = [bk.where(finite, factors(n, b), 0.0) * real for n, b in zip(group_norms, bounds)]
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


def clip(grads: Any, max_norm: Any, clipping: ClippingPolicy | None = None) -> Any:
    """Per-example gradients scaled so each example's norm is at most ``max_norm``.

    Args:
      grads: per-example gradients, leaves ``(B, *param_shape)``, JAX or torch.
      max_norm: a positive number (flat), or a pytree prefix of ``grads`` with a bound per group
        (per-layer: each group's norm is at most its bound).
      clipping: None scales by ``min(1, max_norm / norm)``; :func:`pergrad.dp.automatic` by
        ``max_norm / (norm + gamma)``; :func:`pergrad.dp.adaptive` clips at ``max_norm`` as
        None does (its bound changes between steps, see :func:`pergrad.dp.adaptive`).

    Returns:
      A new pytree like ``grads``. This keeps a clipped copy of every per-example gradient;
      for DP-SGD, :func:`clipped_sum` gives the sum without it. An example whose gradient is
      not finite (inf or nan) comes back as zeros.
    """
    policy = check_clipping("clip", clipping)
    bk, _, flat, treedef, batch_size = flat_leaves("clip", grads)
    ids, bounds = clip_groups("clip", bk, grads, max_norm)
    weights = clip_weights(bk, _group_norms(flat, ids, len(bounds)), bounds, None, policy)
    all_finite = bk.known_all(weights.finite) is True
    _, leaves, _ = bk.flatten(grads)
    clipped = []
    for leaf, g in zip(leaves, ids):
        rows = (batch_size, *([1] * (len(bk.shape(leaf)) - 1)))
        if not all_finite:
            leaf = bk.where(weights.finite.reshape(rows), leaf, 0.0)
        clipped.append(leaf * weights.weights[g].reshape(rows))
    return bk.unflatten(treedef, clipped)


def clipped_sum(
    grads: Any,
    max_norm: Any,
    mask: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    clipping: ClippingPolicy | None = None,
    user_ids: Any = None,
) -> ClippedSum:
    """Sum over the batch of per-example gradients clipped to ``max_norm``.

    The sum is taken as a weighted contraction (``factors @ leaf``), so neither a clipped copy
    of the per-example gradients nor a second B x P array is made. Under ``jax.jit`` with the
    batch sharded over devices, each device clips its own examples and only the ``P``-sized
    sum crosses devices.

    Args:
      grads: per-example gradients, leaves ``(B, *param_shape)``.
      max_norm: a positive number (or a 0-d array of the gradients' framework, a bound that
        changes between steps under ``jax.jit``), or a pytree prefix of ``grads`` with one
        bound per group.
      mask: optional ``(B,)`` booleans or 0/1, False for padding examples (a Poisson batch
        padded to a fixed size for ``jax.jit``); padding contributes nothing.
      axis_name: JAX only, inside ``jax.shard_map``: the mesh axis the examples are split
        over. ``grads`` are then this device's examples, and the result's ``sum``, ``count``
        and ``clip_fraction`` cover all devices (see :func:`pergrad.dp.psum_clipped`).
      clipping: the clipping policy, as for :func:`clip` (None: ``min(1, max_norm / norm)``).
      user_ids: None (example-level), or ``(B,)`` non-negative integer user ids (an array of
        the gradients' framework, on their device, or numpy) for user-level privacy: the
        gradients of each user's examples are summed, and each user's sum is clipped, so
        that one user moves ``sum`` by at most ``max_norm`` however many examples it has.
        ``count`` is then the number of users, ``clip_fraction`` and ``nonfinite`` count
        users, and ``norms`` holds each user's norm in the row of its first example in the
        batch (0 in the other rows). Costs ``B x B x P`` arithmetic (a ``(B, B)`` grouping
        matrix times the gradients), static shapes: it runs under ``jax.jit``. Not with
        ``axis_name`` (a user's examples must be on one device).

    Returns:
      A :class:`ClippedSum`. An example whose gradient is not finite (inf or nan) contributes
      nothing and is counted in ``nonfinite``; it still counts in ``count``. (With
      ``user_ids``: its user contributes nothing.)
    """
    policy = check_clipping("clipped_sum", clipping)
    if user_ids is not None:
        if axis_name is not None:
            raise PergradValueError(
                "clipped_sum: user_ids cannot be combined with axis_name (each device would "
                "clip its part of a user's examples on its own); keep each user's examples on "
                "one device and sum the clipped sums, or pass axis_name=None."
            )
        return user_clipped_sum("clipped_sum", grads, max_norm, user_ids, mask, policy)
    if axis_name is not None:
        from pergrad._src.dp.psum import check_axis_name, psum_clipped

        check_axis_name("clipped_sum", axis_name)
        local = clipped_sum(grads, max_norm, mask, clipping=policy)
        return psum_clipped(local, axis_name, func_name="clipped_sum")
    bk, _, flat, treedef, batch_size = flat_leaves("clipped_sum", grads)
    ids, bounds = clip_groups("clipped_sum", bk, grads, max_norm)
    warn_if_mask_forgotten("clipped_sum", batch_size, mask)
    if mask is not None:
        _check_mask(bk, mask, batch_size)
    group_norms = _group_norms(flat, ids, len(bounds))
    weights = clip_weights(bk, group_norms, bounds, mask, policy)
    finite_rows = weights.finite.reshape(batch_size, 1)
    _, leaves, _ = bk.flatten(grads)
    # The where keeps a non-finite example's rows out of the product (0 * nan would still be
    # nan) at the cost of one pass over the gradients and a B x P temporary (1.55x a torch DP
    # step, benchmarks/results/cpu/nonfinite_cost.md), so it is skipped where the norms can
    # be read and are all finite (eager torch, JAX outside jit). Under jax.jit it always runs:
    # a lax.cond would compile both branches' all-reduce of a sharded batch's sum.
    clean = bk.known_all(weights.finite) is not True
    summed = [
        (weights.weights[g] @ (bk.where(finite_rows, f_leaf, 0.0) if clean else f_leaf)).reshape(
            bk.shape(leaf)[1:]
        )
        for f_leaf, leaf, g in zip(flat, leaves, ids)
    ]
    return clip_statistics(bk, bk.unflatten(treedef, summed), group_norms, bounds, weights)


def user_clipped_sum(
    func_name: str,
    grads: Any,
    max_norm: Any,
    user_ids: Any,
    mask: Any,
    policy: ClippingPolicy | None,
) -> ClippedSum:
    """:func:`clipped_sum` at user level: each user's summed gradient clipped (see its
    ``user_ids``). The users' sums ``slots @ g`` are clipped as examples are, each in the row
    of its user's first example (``users.user_slots``), the other rows masked out."""
    bk, _, flat, treedef, batch_size = flat_leaves(func_name, grads)
    ids, bounds = clip_groups(func_name, bk, grads, max_norm)
    user_ids = check_user_ids(func_name, bk, user_ids, batch_size, flat[0])
    if mask is not None:
        _check_mask(bk, mask, batch_size)
    squared = sum(((f**2).sum(1) for f in flat[1:]), (flat[0] ** 2).sum(1))
    finite = bk.isfinite(squared)
    probe = flat[0].sum()  # a 0-d value in the gradients' dtype and device
    unit = bk.where(bk.isfinite(probe), probe * 0 + 1, 1.0)
    groups = user_slots(bk, user_ids, mask, unit)
    if bk.known_all(finite) is not True:  # 0 * nan is nan: a non-finite row would reach all
        flat = [bk.where(finite.reshape(batch_size, 1), f, 0.0) for f in flat]
    user_sums = [groups.slots @ f for f in flat]
    # a user with any non-finite example gets a nan norm, hence weight 0 (clip_weights)
    user_finite = (groups.slots @ bk.where(finite, unit * 0, unit)) == 0
    group_norms = [
        bk.where(user_finite, norm, float("nan"))
        for norm in _group_norms(user_sums, ids, len(bounds))
    ]
    weights = clip_weights(bk, group_norms, bounds, groups.real, policy)
    summed = [
        (weights.weights[g] @ s).reshape(bk.shape(leaf)[1:])
        for s, leaf, g in zip(user_sums, bk.flatten(grads)[1], ids)
    ]
    return clip_statistics(bk, bk.unflatten(treedef, summed), group_norms, bounds, weights)


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
      summed: a pytree of arrays (e.g. :attr:`ClippedSum.sum`): the SUM of the clipped
        gradients, not their mean. A :class:`ClippedSum` itself is refused (pass its ``.sum``).
      std: the noise standard deviation, ``noise_multiplier * sensitivity`` for DP-SGD
        (``sensitivity``: :attr:`ClippedSum.sensitivity`, the bound of one example's
        contribution to the sum). Divide by the expected batch size AFTER the noise, as
        :func:`private_mean` does: noise of this std added to a mean is that many times too
        much, and a std divided by the batch size and added to the sum that many times too
        little (the privacy claimed would not hold).
      rng: a JAX PRNG key, or a ``torch.Generator`` (None: torch's global generator). For real
        privacy, seed it from a secure source: ``torch.Generator().manual_seed(
        secrets.randbits(63))`` / ``jax.random.key(secrets.randbits(63))``; or pass
        :class:`pergrad.dp.SecureRandom` (both frameworks) to draw every value from the
        operating system's cryptographic source.
    """
    if isinstance(summed, ClippedSum):
        raise PergradTypeError(NOISE_THE_SUM)
    return add_independent_gaussian(summed, std, rng)


NOISE_THE_SUM = """\
add_noise: summed is a ClippedSum (the sum with its norms, count and sensitivity): noising it
whole would noise the per-example norms and the count too, and release them. Noise the sum of
the clipped gradients, with the std of that sum's sensitivity, then divide by the expected
batch size:

    noisy = pergrad.dp.add_noise(clipped.sum, noise_multiplier * clipped.sensitivity, rng)
    grad = {name: value / expected_batch_size for name, value in noisy.items()}

or call pergrad.dp.private_mean(grads, max_norm, noise_multiplier, rng, expected_batch_size),
which does both."""


def private_mean(
    grads: Any,
    max_norm: Any,
    noise_multiplier: float,
    rng: Any,
    expected_batch_size: float | None = None,
    mask: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    clipping: ClippingPolicy | None = None,
    user_ids: Any = None,
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
      clipping: the clipping policy, as for :func:`clip`. Under :func:`pergrad.dp.adaptive`
        the gradient's noise multiplier is raised
        (:meth:`~pergrad.dp.AdaptiveClipping.gradient_noise_multiplier`) to leave room for the
        noisy count that :meth:`~pergrad.dp.AdaptiveClipping.next_max_norm` releases: account
        with ``noise_multiplier``.
      user_ids: None, or ``(B,)`` user ids for user-level privacy, as for :func:`clipped_sum`:
        each user's summed gradient is clipped, and ``expected_batch_size`` (or, when None,
        the count) is then the number of USERS.

    Returns:
      ``(private_gradient, ClippedSum)``: the noisy mean gradient (like one example's gradient)
      and the clipping statistics.
    """
    check_private_settings("private_mean", noise_multiplier, expected_batch_size)
    policy = check_clipping("private_mean", clipping)
    clipped = clipped_sum(
        grads, max_norm, mask=mask, axis_name=axis_name, clipping=policy, user_ids=user_ids
    )
    multiplier = gradient_noise_multiplier(policy, noise_multiplier, num_groups(clipped.norms))
    return noisy_mean(clipped, multiplier, rng, expected_batch_size)[0], clipped


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
    sensitivity = clipped.sensitivity
    if isinstance(sensitivity, (int, float)):
        std = noise_multiplier * sensitivity
        noisy, noise_state = mechanism.add(clipped.sum, std, rng, noise_state)
    else:
        # A bound held in an array (adaptive clipping under jax.jit): the noise of std
        # noise_multiplier * sensitivity is sensitivity times that of std noise_multiplier
        # added to sum / sensitivity, which the mechanisms take as a number.
        bk = backend_of(clipped.sum, "private_mean", "grads")
        _, leaves, treedef = bk.flatten(clipped.sum)
        scaled = bk.unflatten(treedef, [leaf / sensitivity for leaf in leaves])
        noisy, noise_state = mechanism.add(scaled, noise_multiplier, rng, noise_state)
        _, leaves, treedef = bk.flatten(noisy)
        noisy = bk.unflatten(treedef, [leaf * sensitivity for leaf in leaves])
    bk = backend_of(noisy, "private_mean", "grads")
    if expected_batch_size is None:
        denominator = clipped.count.clip(min=1.0)
    else:
        denominator = float(expected_batch_size)
    _, leaves, treedef = bk.flatten(noisy)
    return bk.unflatten(treedef, [leaf / denominator for leaf in leaves]), noise_state
