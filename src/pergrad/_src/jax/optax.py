"""DP-SGD for JAX as an optax ``GradientTransformation``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pergrad._src.backends import get_backend
from pergrad._src.dp.clipping import (
    check_noise_multiplier,
    check_positive,
    clipped_sum,
    noisy_mean,
)
from pergrad._src.dp.clipping_policies import (
    AdaptiveClipping,
    ClippingPolicy,
    check_adaptive_noise,
    check_clipping,
)
from pergrad._src.dp.noise import NoiseMechanism, check_mechanism
from pergrad._src.dp.psum import check_axis_name
from pergrad._src.dp.users import user_slots
from pergrad._src.errors import PergradTypeError


class PrivateAggregateState(NamedTuple):
    """The noise key, the last step's clipping statistics (for logging): the share of
    real examples clipped, their number, and how many of them had a gradient that was not
    finite (zeroed, see :func:`optax_aggregate`); the noise mechanism's state (``()`` for
    independent Gaussian noise); and, under :func:`pergrad.dp.adaptive` clipping, the bound
    the next step clips at (a 0-d array, or ``max_norm``'s pytree of them; ``()`` otherwise).
    """

    key: jax.Array
    clip_fraction: jax.Array
    count: jax.Array
    nonfinite: jax.Array
    noise_state: Any = ()
    max_norm: Any = ()


def optax_aggregate(
    max_norm: Any,
    noise_multiplier: float,
    key: jax.Array | int,
    expected_batch_size: float | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    noise: NoiseMechanism | None = None,
    clipping: ClippingPolicy | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The private aggregate of DP-SGD: per-example gradients in, one noisy mean gradient out.

    Put it first in an optax chain and feed it per-example gradients (leaves ``(B, ...)``):

        tx = optax.chain(pergrad.dp.optax_aggregate(1.0, 1.1, key, expected_batch_size=256),
                         optax.adam(1e-3))
        grads = pergrad.per_example_grads(loss)(params, x, y)
        updates, state = tx.update(grads, state, params, mask=mask)   # mask optional
        # user-level privacy: tx.update(grads, state, params, user_ids=ids)

    Each step clips every example's gradient to ``max_norm`` (a number, or a pytree prefix of
    the gradients for per-layer bounds), sums, adds Gaussian noise of std
    ``noise_multiplier * sensitivity`` and divides by ``expected_batch_size`` (Poisson
    sampling; None divides by the number of real examples). ``mask`` (``(B,)``, False for
    padding) lets Poisson batches be padded to one size, so ``jax.jit`` compiles once; an
    all-padding batch gives pure noise. Works under ``jax.jit``; ``state.clip_fraction`` holds
    the share of examples clipped in the last step.

    An example whose gradient is not finite (an inf or nan entry) is zeroed rather than
    poisoning the update: it contributes nothing, still counts in the batch (the accounting is
    unaffected: 0 is within the bound), and ``state.nonfinite`` counts such examples of the
    last step. Cost: one elementwise ``where`` over the per-example gradients.

    **User-level privacy**: pass ``user_ids`` (``(B,)`` non-negative integer ids, one per
    example) to ``update``: each user's summed gradient is clipped instead of each example's
    (:func:`pergrad.dp.clipped_sum` with ``user_ids``; static shapes, so under ``jax.jit`` too,
    with a traced ``user_ids``), ``expected_batch_size`` is then the expected number of USERS
    per batch and ``state.count`` the users of the last step. Sample users with
    :func:`pergrad.dp.poisson_user_batches` and account with its ``sample_rate``. Under
    :func:`pergrad.dp.adaptive` clipping the bound follows the count of users within it. Not
    with ``axis_name`` (a user's examples must be on one device).

    Several devices: under ``jax.jit`` with the batch sharded over a mesh
    (:func:`pergrad.dp.shard_batch`) and the state replicated, it needs nothing more: each
    device clips its own examples and only the summed gradient crosses devices. Inside
    ``jax.shard_map``, where ``update`` sees only the local examples, pass ``axis_name`` (the
    mesh axis the examples are split over) and keep the state replicated (``PartitionSpec()``):
    the clipped sums are added over the devices, then noise is added once from the shared key,
    so the update equals the one-device update of the whole batch.

    Args:
      max_norm: clipping bound(s).
      noise_multiplier: >= 0; 0 gives clipping without privacy.
      key: a JAX PRNG key or an int seed (seed it from ``secrets.randbits(63)`` for real use).
      expected_batch_size: the normaliser, see above (the global batch, on several devices).
      axis_name: for use inside ``jax.shard_map`` only, see above.
      noise: the noise mechanism (None: :func:`pergrad.dp.gaussian`, independent Gaussian
        noise at every step); its state is kept in the optax state.
      clipping: the clipping policy (None: ``min(1, max_norm / norm)``).
        :func:`pergrad.dp.automatic` scales each gradient by ``max_norm / (norm + gamma)``.
        :func:`pergrad.dp.adaptive` starts at ``max_norm`` and moves the bound after each step
        (``state.max_norm`` holds it; per group for a pytree ``max_norm``), releasing a noisy
        count of the examples within it from the state's key; the gradient's noise
        multiplier is raised to pay for it, so account with ``noise_multiplier``. Adaptive
        clipping needs independent Gaussian noise (``noise`` None).
    """
    if isinstance(key, int) and not isinstance(key, bool):
        key = jax.random.key(key)
    elif not isinstance(key, jax.Array):
        raise PergradTypeError(
            f"optax_aggregate: key must be a JAX PRNG key or an int seed; got {type(key).__name__}."
        )
    check_noise_multiplier("optax_aggregate", noise_multiplier)
    if expected_batch_size is not None:
        check_positive("optax_aggregate", "expected_batch_size", expected_batch_size)
    if isinstance(max_norm, (int, float)):
        check_positive("optax_aggregate", "max_norm", max_norm)
    check_axis_name("optax_aggregate", axis_name)
    mechanism = check_mechanism("optax_aggregate", noise)
    policy = check_clipping("optax_aggregate", clipping)
    if isinstance(policy, AdaptiveClipping):
        return _adaptive_aggregate(
            max_norm, noise_multiplier, key, expected_batch_size, axis_name, mechanism, policy
        )

    def init(params: Any) -> PrivateAggregateState:
        zeros = jnp.zeros(())
        return PrivateAggregateState(key, zeros, zeros, zeros, mechanism.init(params))

    def update(
        updates: Any,
        state: PrivateAggregateState,
        params: Any = None,
        *,
        mask: Any = None,
        user_ids: Any = None,
        **extra: Any,
    ) -> tuple[Any, PrivateAggregateState]:
        del params, extra
        next_key, noise_key = jax.random.split(state.key)
        stats = clipped_sum(
            updates, max_norm, mask=mask, axis_name=axis_name, clipping=policy, user_ids=user_ids
        )
        mean, noise_state = noisy_mean(
            stats, noise_multiplier, noise_key, expected_batch_size, mechanism, state.noise_state
        )
        return mean, PrivateAggregateState(
            next_key, stats.clip_fraction, stats.count, stats.nonfinite, noise_state
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _adaptive_aggregate(
    max_norm: Any,
    noise_multiplier: float,
    key: jax.Array,
    expected_batch_size: float | None,
    axis_name: str | tuple[str, ...] | None,
    mechanism: NoiseMechanism,
    policy: AdaptiveClipping,
) -> optax.GradientTransformationExtraArgs:
    """:func:`optax_aggregate` under adaptive clipping: the bounds live in the state."""
    initial, bounds_def = jax.tree_util.tree_flatten(max_norm)
    for bound in initial:
        check_positive("optax_aggregate", "each max_norm bound", bound)
    gradient_multiplier = check_adaptive_noise(
        "optax_aggregate", policy, mechanism, noise_multiplier, len(initial)
    )

    def init(params: Any) -> PrivateAggregateState:
        zeros = jnp.zeros(())
        bounds = [jnp.asarray(b, jnp.float32) for b in initial]
        return PrivateAggregateState(
            key, zeros, zeros, zeros, mechanism.init(params), bounds_def.unflatten(bounds)
        )

    def update(
        updates: Any,
        state: PrivateAggregateState,
        params: Any = None,
        *,
        mask: Any = None,
        user_ids: Any = None,
        **extra: Any,
    ) -> tuple[Any, PrivateAggregateState]:
        del params, extra
        next_key, noise_key, count_key = jax.random.split(state.key, 3)
        bounds = jax.tree_util.tree_leaves(state.max_norm)
        stats = clipped_sum(
            updates,
            state.max_norm,
            mask=mask,
            axis_name=axis_name,
            clipping=policy,
            user_ids=user_ids,
        )
        counted = mask
        if user_ids is not None:  # the norms are in the users' rows: count those rows
            unit = jnp.ones((), jax.tree_util.tree_leaves(updates)[0].dtype)
            rows = user_slots(get_backend("jax"), jnp.asarray(user_ids), mask, unit).real
            counted = rows != 0
        mean, noise_state = noisy_mean(
            stats, gradient_multiplier, noise_key, expected_batch_size, mechanism, state.noise_state
        )
        group_norms = stats.norms if isinstance(stats.norms, list) else [stats.norms]
        bk = get_backend("jax")
        unclipped = policy.unclipped_counts(bk, group_norms, bounds, counted)
        if axis_name is not None:  # the norms are this device's; the count is global already
            unclipped = jax.lax.psum(unclipped, axis_name)
        new_bounds = policy.next_bounds(
            bounds, unclipped, stats.count, count_key, expected_batch_size
        )
        return mean, PrivateAggregateState(
            next_key,
            stats.clip_fraction,
            stats.count,
            stats.nonfinite,
            noise_state,
            bounds_def.unflatten(new_bounds),
        )

    return optax.GradientTransformationExtraArgs(init, update)


def dpsgd(
    learning_rate: float,
    max_norm: Any,
    noise_multiplier: float,
    key: jax.Array | int,
    expected_batch_size: float | None = None,
    momentum: float | None = None,
    axis_name: str | tuple[str, ...] | None = None,
    noise: NoiseMechanism | None = None,
    clipping: ClippingPolicy | None = None,
) -> optax.GradientTransformationExtraArgs:
    """DP-SGD as one optax optimizer: :func:`optax_aggregate` then ``optax.sgd``.

    ``axis_name``, ``noise`` and ``clipping`` as for :func:`optax_aggregate`.
    """
    return optax.chain(
        optax_aggregate(
            max_norm, noise_multiplier, key, expected_batch_size, axis_name, noise, clipping
        ),
        optax.sgd(learning_rate, momentum=momentum),
    )
