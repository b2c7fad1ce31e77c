"""The DP reductions straight from the loss of one example: ``clipped_sum_of`` and
``private_grad_of``, without per-example gradients. The strategy is chosen and run as for
:func:`pergrad.norms.per_example_norms_of` (``api/reductions.py``); the clip weights they hand
each strategy come from ``clipping.py``, and the noise from the run's mechanism
(``noise.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from pergrad._src.api.reductions import global_norms, setup_reduce_request
from pergrad._src.core.call import Call, Spec, rebuild_grads
from pergrad._src.dp.clipping import (
    ClippedSum,
    check_bound,
    check_positive,
    check_private_settings,
    clip_groups,
    clip_statistics,
    clip_weights,
    clipped_sum,
    noisy_mean,
    user_clipped_sum,
)
from pergrad._src.dp.clipping_policies import (
    AdaptiveClipping,
    ClippingPolicy,
    check_adaptive_noise,
    check_clipping,
    gradient_noise_multiplier,
    num_groups,
)
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism, check_mechanism
from pergrad._src.dp.sampling import warn_if_mask_forgotten
from pergrad._src.dp.users import check_user_ids, user_slots
from pergrad._src.errors import PergradValueError, Unsupported
from pergrad._src.strategies import registry
from pergrad._src.strategies.protocol import (
    Assessment,
    ReduceRequest,
    StrategyChoice,
    UserGrouping,
)


def clipped_sum_of(
    fn: Callable[..., Any],
    *args: Any,
    max_norm: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
    mask: Any = None,
    clipping: ClippingPolicy | None = None,
    user_ids: Any = None,
) -> ClippedSum:
    """The sum of per-example gradients clipped to ``max_norm``, without materialising them.

    Equal to ``pergrad.dp.clipped_sum(pergrad.per_example_grads(fn)(*args), max_norm, mask)``.
    The norms come as in :func:`per_example_norms_of`; then ``sum_i c_i g_i`` with
    ``c_i = min(1, max_norm / |g_i|)``: on the ghost path from the same layer inputs and output
    gradients, scaled by ``c_i`` (no second backward pass); on the chunked path as the gradient
    of ``sum_i c_i loss_i``, one more batch backward pass (Lee & Kifer 2021).

    Args:
      fn: as for :func:`per_example_norms_of`.
      *args: as for :func:`per_example_norms_of`.
      argnums: as for :func:`per_example_norms_of`.
      in_axes: as for :func:`per_example_norms_of`.
      strategy: as for :func:`per_example_norms_of`.
      chunk_size: as for :func:`per_example_norms_of`.
      max_norm: the clipping bound, a positive number; or, for per-layer clipping, a pytree
        prefix of the differentiated argument with one bound per group, as
        :func:`pergrad.dp.clipped_sum` takes (``{"encoder": 1.0, "head": 0.5}``): each group's
        gradient is clipped to its bound, and ``norms`` is then a list of ``(B,)`` group norms.
      mask: optional ``(B,)`` booleans or 0/1, False for padding examples, which then
        contribute nothing.
      clipping: the clipping policy, as for :func:`pergrad.dp.clip`: None gives
        ``c_i = min(1, max_norm / |g_i|)``, :func:`pergrad.dp.automatic` gives
        ``c_i = max_norm / (|g_i| + gamma)`` on every strategy (per group with per-group
        bounds), :func:`pergrad.dp.adaptive` clips at ``max_norm`` as None does.
      user_ids: None (example-level), or ``(B,)`` non-negative integer user ids (an array of
        the arguments' framework, or numpy) for user-level privacy: the sum over the batch's
        users of each user's summed gradient, clipped to ``max_norm``, as
        :func:`pergrad.dp.clipped_sum` with ``user_ids`` (``count`` is the number of users).
        On a PyTorch ``module_loss`` the ghost strategy computes each user's norm from its
        examples' layer records side by side (no per-example gradient of a layer with a rule
        is formed); elsewhere the per-example gradients are formed and summed per user
        (``"materialize"``; the chunked and low-memory ghost strategies clip examples, not
        users, and are refused by name).

    Differentiating through the result (meta-learning, a hypergradient) treats the clip
    factors as constants, as DP-SGD does; ``pergrad.dp.clipped_sum`` of materialised
    gradients differentiates through them too.

    An example whose gradient is not finite (an inf or nan anywhere, so its norm is not
    finite) gets weight 0 and contributes exactly nothing: its layer records (ghost), its
    per-example gradient (materialize) or its inputs (chunked: the weighted loss runs another
    example's data in its place, at weight 0) are masked with ``where`` before the sum, at
    the cost of one elementwise pass over them. ``nonfinite`` counts such examples.

    Returns:
      A :class:`pergrad.dp.ClippedSum`: ``sum`` like the differentiated argument (no batch
      axis), ``norms`` ``(B,)``, ``clip_fraction``, ``sensitivity`` (``max_norm``, or
      ``sqrt(sum bounds^2)`` per group), ``count``, ``nonfinite``.

    Example::

        loss = pergrad.module_loss(model, F.cross_entropy)
        clipped = pergrad.dp.clipped_sum_of(loss, loss.params(), X, Y, max_norm=1.0)
        clipped.sum["fc.weight"]         # (10, 128), the sum of clipped gradients
    """
    return clipped_sum_run(
        fn,
        *args,
        max_norm=max_norm,
        argnums=argnums,
        in_axes=in_axes,
        strategy=strategy,
        chunk_size=chunk_size,
        mask=mask,
        clipping=clipping,
        user_ids=user_ids,
    ).clipped


class ClippedRun(NamedTuple):
    """What :func:`clipped_sum_run` returns: the clipped sum, the registry's plan for the call
    (what :func:`choose_strategy` reports, with its reason), the strategy that ran (the
    plan's, or the one "auto" fell back to when it failed at run time) and the ``(B,)``
    per-example losses, detached, where that strategy computed them anyway (PyTorch's ghost
    strategies; None elsewhere)."""

    clipped: ClippedSum
    choice: StrategyChoice
    strategy: str
    losses: Any = None


def clipped_sum_run(
    fn: Callable[..., Any],
    *args: Any,
    max_norm: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
    mask: Any = None,
    clipping: ClippingPolicy | None = None,
    user_ids: Any = None,
) -> ClippedRun:
    """:func:`clipped_sum_of`, with the plan and the strategy that ran (internal: for callers
    that report them, such as ``DPOptimizer``, from one assessment of the call)."""
    func_name = "clipped_sum_of"
    policy = check_clipping(func_name, clipping)
    if user_ids is not None:
        return _user_level_run(
            fn, args, max_norm, argnums, in_axes, strategy, chunk_size, mask, policy, user_ids
        )
    per_group = isinstance(max_norm, (dict, list, tuple))
    if not per_group and getattr(max_norm, "shape", None) != ():
        check_positive(func_name, "max_norm", max_norm)  # before the call is analysed
    request, chosen = setup_reduce_request(
        func_name, fn, args, argnums, in_axes, strategy, chunk_size, clipped=True
    )
    spec, call = request.spec, request.call
    if not per_group:
        max_norm = check_bound(func_name, call.backend, "max_norm", max_norm)
    if mask is not None:
        check_mask(func_name, call, mask)
    assert chosen.choice is not None  # every "reduce" strategy reports its choice
    if chosen.strategy == "materialize":
        grads, ran = registry.execute("reduce", request, strategy, chosen)
        clipped = clipped_sum(grads, max_norm, mask=mask, clipping=policy)
        return ClippedRun(clipped, chosen.choice, ran)
    warn_if_mask_forgotten(func_name, call.batch_size, mask)
    ids, bounds = _group_ids(spec, call, max_norm) if per_group else (None, [max_norm])

    group_norms = functools.partial(_group_norms, ids, len(bounds))

    def weights_from(squared: list[Any]) -> Any:
        # 0 for padding and for an example whose gradient is not finite: the strategies zero
        # the records of every example of weight 0 before summing (0 * nan is nan)
        weights = clip_weights(call.backend, group_norms(squared), bounds, mask, policy).weights
        # one array object per group: the strategies compute each group's sum once
        return weights[0] if ids is None else [weights[g] for g in ids]

    request.weights_from = weights_from
    reduction, ran = registry.execute("reduce", request, strategy, chosen)
    norms = group_norms(reduction.squared_norms)
    summed = rebuild_grads(spec, call, reduction.weighted_sums)
    weights = clip_weights(call.backend, norms, bounds, mask, policy)
    clipped = clip_statistics(call.backend, summed, norms, bounds, weights)
    return ClippedRun(clipped, chosen.choice, ran, reduction.losses)


def _user_level_run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    max_norm: Any,
    argnums: Any,
    in_axes: Any,
    strategy: str,
    chunk_size: int | None,
    mask: Any,
    policy: ClippingPolicy | None,
    user_ids: Any,
) -> ClippedRun:
    """:func:`clipped_sum_run` at user level: by the ghost strategy where it takes the call
    (each user's norms from its examples' layer records, ``capture/torch_users.py`` and
    ``jax_users.py``), else from the per-example gradients summed per user."""
    func_name = "clipped_sum_of"
    check_user_level_strategy(func_name, strategy)
    per_group = isinstance(max_norm, (dict, list, tuple))
    if not per_group:
        check_positive(func_name, "max_norm", max_norm)
    why_not = "the ghost strategy was not asked for"
    if strategy in ("auto", "ghost"):
        # "auto" picks the ghost strategy if it takes the call (never the chunked one here)
        request, chosen = setup_reduce_request(
            func_name, fn, args, argnums, in_axes, "auto", chunk_size
        )
        if strategy == "ghost" and chosen.strategy != "ghost" and request.call.batch_size:
            chosen = registry.assess_named("reduce", request, "ghost")  # as asked, forced
        if chosen.strategy == "ghost" and chosen.accepted:
            try:
                return _user_level_ghost(request, chosen, max_norm, mask, policy, user_ids)
            except PergradValueError as err:
                if strategy != "auto" or not isinstance(err.__cause__, Unsupported):
                    raise
                why_not = f"the ghost strategy failed ({err.__cause__})"
        else:
            why_not = (
                f"{CHEAPER}: {chosen.why}"  # "auto"'s cost model (never a refusal to warn of)
                if chosen.strategy == "materialize"
                else f"the ghost strategy cannot take this call: {chosen.why}"
            )
            if strategy == "ghost" and request.call.batch_size:  # (an empty batch: ordinary)
                raise PergradValueError(
                    f"{func_name}: strategy='ghost' cannot clip by user (user_ids=) here: "
                    f"{why_not}. Pass strategy='auto' or 'materialize' (the per-example "
                    f"gradients, summed per user)."
                )
    request, chosen = setup_reduce_request(
        func_name, fn, args, argnums, in_axes, "materialize", chunk_size
    )
    if mask is not None:
        check_mask(func_name, request.call, mask)
    grads, ran = registry.execute("reduce", request, "materialize", chosen)
    clipped = user_clipped_sum(func_name, grads, max_norm, user_ids, mask, policy)
    reason = f"{USER_LEVEL_REASON}: {why_not}"
    return ClippedRun(clipped, StrategyChoice("materialize", reason), ran)


def _user_level_ghost(
    request: ReduceRequest,
    chosen: Assessment,
    max_norm: Any,
    mask: Any,
    policy: ClippingPolicy | None,
    user_ids: Any,
) -> ClippedRun:
    """User-level clipping by the ghost strategy: each user's squared norms in the row
    of its first real example (``users.user_slots``), the clip factors formed there and handed
    to every example of the user, the weighted sum from the same records as per example."""
    spec, call = request.spec, request.call
    bk, func_name = call.backend, spec.func_name
    per_group = isinstance(max_norm, (dict, list, tuple))
    if not per_group:
        max_norm = check_bound(func_name, bk, "max_norm", max_norm)
    if mask is not None:
        check_mask(func_name, call, mask)
    like = call.leaves[0][0]
    user_ids = check_user_ids(func_name, bk, user_ids, call.batch_size, like)
    ids, bounds = _group_ids(spec, call, max_norm) if per_group else (None, [max_norm])
    probe = like.sum()  # a 0-d 1 in the parameters' dtype and device (finite, or not)
    unit = bk.where(bk.isfinite(probe), probe * 0 + 1, 1.0)
    groups = user_slots(bk, user_ids, mask, unit)

    group_norms = functools.partial(_group_norms, ids, len(bounds))

    def weights_from(squared: list[Any]) -> Any:
        # each user's clip factor, in its row, handed to each of its examples (padding: 0)
        rows = clip_weights(bk, group_norms(squared), bounds, groups.real, policy).weights
        per_example = [(w[:, None] * groups.slots).sum(0) for w in rows]  # (dtypes promote)
        return per_example[0] if ids is None else [per_example[g] for g in ids]

    request.weights_from = weights_from
    request.users = UserGrouping(user_ids, mask, groups.slots)
    reduction, ran = registry.execute("reduce", request, "ghost", chosen)
    norms = group_norms(reduction.squared_norms)
    summed = rebuild_grads(spec, call, reduction.weighted_sums)
    weights = clip_weights(bk, norms, bounds, groups.real, policy)
    clipped = clip_statistics(bk, summed, norms, bounds, weights)
    assert chosen.choice is not None
    choice = replace(chosen.choice, reason=f"{USER_GHOST_REASON}; {chosen.choice.reason}")
    return ClippedRun(clipped, choice, ran, reduction.losses)


CHEAPER = "forming them is cheaper here"
USER_LEVEL_REASON = (
    "user-level clipping (user_ids=): per-example gradients formed, summed per user, then clipped"
)
USER_GHOST_REASON = (
    "user-level clipping (user_ids=) by the ghost strategy: each user's norms from its "
    "examples' layer records side by side, no per-example gradient of a layer with a rule formed"
)


def check_user_level_strategy(func_name: str, strategy: Any) -> None:
    """User-level clipping runs by the PyTorch ghost strategy or on per-example gradients: a
    named chunked or low-memory ghost strategy, which clip examples, is refused rather than
    silently clipping the wrong unit."""
    if strategy in ("auto", "ghost", "materialize"):
        return
    if strategy in ("ghost-lowmem", "chunked"):
        raise PergradValueError(
            f"{func_name}: strategy={strategy!r} cannot clip by user (user_ids=): it clips "
            f"each example's gradient. Pass strategy='auto' (the ghost strategy where it runs, "
            f"else the per-example gradients summed per user), 'ghost' or 'materialize'."
        )
    raise PergradValueError(
        f"{func_name}: strategy must be one of ['auto', 'ghost', 'materialize'] with "
        f"user_ids=; got {strategy!r}."
    )


def _group_norms(ids: list[int] | None, num_groups: int, squared: list[Any]) -> list[Any]:
    """Each clipping group's ``(B,)`` norms from the leaves' squared norms (one group: all)."""
    if ids is None:
        return [global_norms(squared)]
    return [
        global_norms([s for s, g in zip(squared, ids) if g == group]) for group in range(num_groups)
    ]


def _group_ids(spec: Spec, call: Call, max_norm: Any) -> tuple[list[int], list[Any]]:
    """Each differentiated leaf's group and each group's bound, for per-group ``max_norm``."""
    template = rebuild_grads(spec, call, [call.leaves[i][j] for i, j in call.diff_positions])
    ids, bounds = clip_groups(spec.func_name, call.backend, template, max_norm)
    if len(ids) != len(call.diff_positions):
        raise PergradValueError(
            f"{spec.func_name}: cannot match the per-group max_norm to the differentiated "
            f"parameters ({len(ids)} leaves against {len(call.diff_positions)}); pass "
            f"strategy='materialize', or one number as max_norm."
        )
    return ids, bounds


def private_grad_of(
    fn: Callable[..., Any],
    *args: Any,
    max_norm: Any,
    noise_multiplier: float,
    rng: Any,
    expected_batch_size: float | None = None,
    mask: Any = None,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
    clipping: ClippingPolicy | None = None,
    user_ids: Any = None,
    noise: NoiseMechanism | None = None,
    noise_state: Any = None,
) -> tuple[Any, ...]:
    """The DP-SGD gradient straight from the loss of one example, without per-example gradients.

    :func:`clipped_sum_of`, then Gaussian noise of std ``noise_multiplier * max_norm``, divided
    by ``expected_batch_size``: the same as :func:`pergrad.dp.private_mean` of
    ``pergrad.per_example_grads(fn)(*args)``, at about the cost of one or two batch gradients on
    the ghost path. Works under ``jax.jit``.

    Args:
      fn: as for :func:`clipped_sum_of`.
      *args: as for :func:`clipped_sum_of`.
      max_norm: the clipping bound, as for :func:`clipped_sum_of`.
      noise_multiplier: as for :func:`pergrad.dp.private_mean`.
      rng: as for :func:`pergrad.dp.private_mean` (a JAX key, a ``torch.Generator`` or a
        :class:`pergrad.dp.SecureRandom`).
      expected_batch_size: as for :func:`pergrad.dp.private_mean` (divide by the expected batch
        size under Poisson sampling).
      argnums: as for :func:`clipped_sum_of`.
      in_axes: as for :func:`clipped_sum_of`.
      strategy: as for :func:`clipped_sum_of`.
      chunk_size: as for :func:`clipped_sum_of`.
      mask: as for :func:`clipped_sum_of`.
      clipping: as for :func:`pergrad.dp.private_mean`: under :func:`pergrad.dp.adaptive` the
        gradient's noise multiplier is raised to leave room for the noisy count that
        :meth:`~pergrad.dp.AdaptiveClipping.next_max_norm` releases.
      user_ids: None, or ``(B,)`` user ids for user-level privacy, as for
        :func:`clipped_sum_of`: each user's summed gradient is clipped, and
        ``expected_batch_size`` is then the expected number of USERS per batch
        (``sample_rate * number of users``, see :func:`pergrad.dp.poisson_user_batches`).
      noise: the noise mechanism (None: :func:`pergrad.dp.gaussian`). One that keeps a state
        across steps (correlated noise: :func:`pergrad.dp.toeplitz`, :func:`pergrad.dp.blt`)
        needs ``noise_state``; without it such a mechanism is refused.
      noise_state: None, or the mechanism's state: ``noise.init(template)`` (``template``
        shaped like the differentiated argument) at the first step, then the state the last
        call returned. Given, the call returns the next state too, as optax's ``update``
        does; it is a pytree of arrays, so it goes through ``jax.jit``.

    Returns:
      ``(private_gradient, ClippedSum)``: the noisy mean gradient, shaped like the
      differentiated argument, and the clipping statistics; with ``noise_state``,
      ``(private_gradient, ClippedSum, next_noise_state)``.

    Example (correlated noise, a state threaded through the steps)::

        mech = pergrad.dp.optimal_blt(steps=1000)
        noise_state = mech.init(params)
        for x, y in batches:                     # 1000 steps
            grad, stats, noise_state = pergrad.dp.private_grad_of(
                loss, params, x, y, max_norm=1.0, noise_multiplier=sigma, rng=key,
                expected_batch_size=256, noise=mech, noise_state=noise_state)

    Example (JAX, with any optax optimizer)::

        grad, stats = pergrad.dp.private_grad_of(loss, params, X, Y, max_norm=1.0,
                                                 noise_multiplier=1.1, rng=key,
                                                 expected_batch_size=256)
        updates, opt_state = optimizer.update(grad, opt_state, params)
    """
    check_private_settings("private_grad_of", noise_multiplier, expected_batch_size)
    policy = check_clipping("private_grad_of", clipping)
    mechanism = check_noise_state("private_grad_of", noise, noise_state, policy)
    clipped = clipped_sum_of(
        fn,
        *args,
        max_norm=max_norm,
        argnums=argnums,
        in_axes=in_axes,
        strategy=strategy,
        chunk_size=chunk_size,
        mask=mask,
        clipping=policy,
        user_ids=user_ids,
    )
    multiplier = gradient_noise_multiplier(policy, noise_multiplier, num_groups(clipped.norms))
    state = () if noise_state is None else noise_state
    noisy, next_state = noisy_mean(clipped, multiplier, rng, expected_batch_size, mechanism, state)
    if noise_state is None:
        return noisy, clipped
    return noisy, clipped, next_state


NOISE_STATE_NEEDED = """\
{func_name}: noise={noise!r} keeps a state from step to step (its buffers of past draws and
its step count), which {func_name} cannot keep between calls. Pass the state in and take the
next one back, as optax's update does:

    noise_state = noise.init(params)   # once, shaped like the differentiated argument
    grad, stats, noise_state = pergrad.dp.{func_name}(..., noise=noise, noise_state=noise_state)

Without it every call would restart the mechanism at its first step: the noise of the run
would not be the one its accounting describes."""


def check_noise_state(
    func_name: str, noise: Any, noise_state: Any, policy: ClippingPolicy
) -> NoiseMechanism:
    """``noise`` as a mechanism; one that keeps a state (it overrides ``init``) is refused
    without ``noise_state``, and adaptive clipping refuses any but Gaussian noise."""
    mechanism = check_mechanism(func_name, noise)
    if noise_state is None and type(mechanism).init is not NoiseMechanism.init:
        raise PergradValueError(NOISE_STATE_NEEDED.format(func_name=func_name, noise=mechanism))
    if isinstance(policy, AdaptiveClipping) and not isinstance(mechanism, GaussianNoise):
        check_adaptive_noise(func_name, policy, mechanism, 1.0, 1)  # raises: not accounted
    return mechanism


def check_mask(func_name: str, call: Call, mask: Any) -> None:
    bk = call.backend
    if not bk.is_array(mask) or bk.shape(mask) != (call.batch_size,):
        got = f"shape {bk.shape(mask)}" if bk.is_array(mask) else type(mask).__name__
        raise PergradValueError(
            f"{func_name}: mask must be a ({call.batch_size},) array of the arguments' "
            f"framework (True for real examples, False for padding); got {got}."
        )
