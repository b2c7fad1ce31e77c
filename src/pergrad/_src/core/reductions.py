"""``per_example_norms_of``, ``clipped_sum_of`` and ``choose_strategy``: the public entry points.

They take the loss of ONE example and the batch, as :func:`pergrad.per_example_grads` does, and
return what :func:`pergrad.norms.per_example_norms` and :func:`pergrad.dp.clipped_sum` would
return on its per-example gradients, without keeping those ``B x P`` numbers. The strategy is
chosen here (see the package docstring for what each does); ``choose_strategy`` shows the choice.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pergrad._src.core.api import per_example_grads
from pergrad._src.core.call import Call, Spec, analyse_call, rebuild_grads
from pergrad._src.dp.clipping import (
    ClippedSum,
    check_positive,
    check_private_settings,
    clip_factors,
    clip_groups,
    clipped_sum,
    noisy_mean,
)
from pergrad._src.errors import (
    FallbackWarning,
    GhostUnsupported,
    PergradTypeError,
    PergradValueError,
)
from pergrad._src.norms import per_example_norms
from pergrad._src.strategies.chunked import Reduction, WeightsFn, chunked, default_chunk_size

STRATEGIES = ("auto", "materialize", "chunked", "ghost")


@dataclass(frozen=True)
class StrategyChoice:
    """How a call of :func:`per_example_norms_of` / :func:`clipped_sum_of` will be computed.

    Attributes:
      strategy: ``"ghost"``, ``"chunked"`` or ``"materialize"`` (never ``"auto"``).
      reason: why, in words.
      chunk_size: examples per chunk for ``"chunked"`` (the default is chosen from the number of
        parameters: ``chunk_size x P`` stays under 2**25 numbers); what was passed for
        ``"materialize"``; None for ``"ghost"``.
      layers: for a :func:`pergrad.module_loss` loss, module name -> ghost rule (``"linear"``,
        ``"conv"``, ``"embedding"``, ...) of each layer owning a differentiated parameter;
        ``"generic"`` for a layer without a rule, run alone (``torch_generic.py``). For a
        JAX loss, parameter path -> ``"dense"`` or ``"conv"``, the contraction it enters.
      unsupported: module name -> why the ghost strategy cannot handle it. For a JAX loss,
        parameter path -> why its per-example gradients are formed (the ghost strategy still
        runs; these parameters get ordinary per-example gradients in the same pass).
      plan: the analysis the ghost strategy runs from (internal).

    A ghost run can still meet something only visible while running (a layer that does not get
    the batch on axis 0, an input changed in place); ``"auto"`` then takes the chunked strategy
    and says so with a :class:`pergrad.FallbackWarning`.
    """

    strategy: str
    reason: str
    chunk_size: int | None = None
    layers: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    plan: Any = field(default=None, repr=False, compare=False)


def per_example_norms_of(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    per_layer: bool = False,
    strategy: str = "auto",
    chunk_size: int | None = None,
) -> Any:
    """Each example's gradient norm, without materialising the per-example gradients.

    Args:
      fn: the loss of ONE example, ``fn(params, x, y, ...) -> scalar`` (as for
        :func:`pergrad.per_example_grads`); in PyTorch, a :func:`pergrad.module_loss` loss for
        the ghost strategy; in JAX, any traceable loss.
      *args: the arguments of ``fn``, with the data batched: ``(params, X, Y)``.
      argnums, in_axes: as for :func:`pergrad.per_example_grads`.
      per_layer: False for one norm per example; True for one per parameter array, in the
        structure of the differentiated argument (their squares sum to the global norm squared).
      strategy: ``"auto"`` (default: ``"ghost"`` for a ``module_loss`` whose every trainable
        parameter sits in a layer with a ghost rule, and for a JAX loss whose parameters outside
        contractions need at most 2**25 per-example numbers; else ``"chunked"``), ``"ghost"``,
        ``"chunked"``, or ``"materialize"`` (per-example gradients, then their norms).
      chunk_size: examples per chunk for ``"chunked"`` / ``"materialize"``.

    Returns:
      ``(B,)`` norms (an array of the framework of ``args``), or with ``per_layer`` a pytree of
      them; equal to ``pergrad.norms.per_example_norms(pergrad.per_example_grads(fn)(*args))``.

    Example::

        loss = pergrad.module_loss(model, F.cross_entropy)
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), X, Y)   # (B,)
        # JAX: any loss of one example; jit it as you would jax.vmap(jax.grad(loss))
        norms = jax.jit(lambda p, x, y: pergrad.norms.per_example_norms_of(loss, p, x, y))(
            params, X, Y)

    Memory: ``"ghost"`` about that of one batch gradient (plus ``B x T^2`` per sequence layer);
    ``"chunked"`` that of ``chunk_size`` per-example gradients.
    """
    if not isinstance(per_layer, bool):
        raise PergradTypeError(
            f"per_example_norms_of: per_layer must be True or False; got {per_layer!r}."
        )
    func_name = "per_example_norms_of"
    spec, call, choice = _setup(func_name, fn, args, argnums, in_axes, strategy, chunk_size)
    if choice.strategy == "materialize":
        grads = per_example_grads(fn, argnums, in_axes, chunk_size=chunk_size)(*args)
        return per_example_norms(grads, per_layer=per_layer)
    reduction = _reduce(spec, call, fn, choice, strategy, None)
    if per_layer:
        return rebuild_grads(spec, call, [s**0.5 for s in reduction.squared_norms])
    return _global_norms(reduction.squared_norms)


def clipped_sum_of(
    fn: Callable[..., Any],
    *args: Any,
    max_norm: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
    mask: Any = None,
) -> ClippedSum:
    """The sum of per-example gradients clipped to ``max_norm``, without materialising them.

    Equal to ``pergrad.dp.clipped_sum(pergrad.per_example_grads(fn)(*args), max_norm, mask)``.
    The norms come as in :func:`per_example_norms_of`; then ``sum_i c_i g_i`` with
    ``c_i = min(1, max_norm / |g_i|)``: on the ghost path from the same layer inputs and output
    gradients, scaled by ``c_i`` (no second backward pass); on the chunked path as the gradient
    of ``sum_i c_i loss_i``, one more batch backward pass (Lee & Kifer 2021).

    Args:
      fn, *args, argnums, in_axes, strategy, chunk_size: as for :func:`per_example_norms_of`.
      max_norm: the clipping bound, a positive number; or, for per-layer clipping, a pytree
        prefix of the differentiated argument with one bound per group, as
        :func:`pergrad.dp.clipped_sum` takes (``{"encoder": 1.0, "head": 0.5}``): each group's
        gradient is clipped to its bound, and ``norms`` is then a list of ``(B,)`` group norms.
      mask: optional ``(B,)`` booleans or 0/1, False for padding examples, which then
        contribute nothing.

    Differentiating through the result (meta-learning, a hypergradient) treats the clip
    factors as constants, as DP-SGD does; ``pergrad.dp.clipped_sum`` of materialised
    gradients differentiates through them too.

    Returns:
      A :class:`pergrad.dp.ClippedSum`: ``sum`` like the differentiated argument (no batch
      axis), ``norms`` ``(B,)``, ``clip_fraction``, ``sensitivity`` (``max_norm``, or
      ``sqrt(sum bounds^2)`` per group), ``count``.

    Example::

        loss = pergrad.module_loss(model, F.cross_entropy)
        clipped = pergrad.dp.clipped_sum_of(loss, loss.params(), X, Y, max_norm=1.0)
        clipped.sum["fc.weight"]         # (10, 128), the sum of clipped gradients
    """
    func_name = "clipped_sum_of"
    per_group = isinstance(max_norm, (dict, list, tuple))
    if not per_group:
        check_positive(func_name, "max_norm", max_norm)
    spec, call, choice = _setup(func_name, fn, args, argnums, in_axes, strategy, chunk_size)
    if mask is not None:
        _check_mask(func_name, call, mask)
    if choice.strategy == "materialize":
        grads = per_example_grads(fn, argnums, in_axes, chunk_size=chunk_size)(*args)
        return clipped_sum(grads, max_norm, mask=mask)
    ids, bounds = _group_ids(spec, call, max_norm) if per_group else (None, [float(max_norm)])

    def group_norms(squared: list[Any]) -> list[Any]:
        if ids is None:
            return [_global_norms(squared)]
        return [
            _global_norms([s for s, g in zip(squared, ids) if g == group])
            for group in range(len(bounds))
        ]

    def weights_from(squared: list[Any]) -> Any:
        norms = group_norms(squared)
        weights = [clip_factors(n, b) * _real(n, mask) for n, b in zip(norms, bounds)]
        # one array object per group: the strategies compute each group's sum once
        return weights[0] if ids is None else [weights[g] for g in ids]

    reduction = _reduce(spec, call, fn, choice, strategy, weights_from)
    norms = group_norms(reduction.squared_norms)
    real = _real(norms[0], mask)
    count = real.sum()
    # norms > bound, not factors < 1: bound / norm can round to just under 1 for a norm at or
    # below the bound (float32, a bound not representable in it).
    clipped = sum((n > b) * 1.0 for n, b in zip(norms, bounds)).clip(max=1.0) * real
    return ClippedSum(
        sum=rebuild_grads(spec, call, reduction.weighted_sums),
        norms=norms[0] if ids is None else norms,
        clip_fraction=clipped.sum() / count.clip(min=1.0),
        sensitivity=sum(b * b for b in bounds) ** 0.5,
        count=count,
    )


def _group_ids(spec: Spec, call: Call, max_norm: Any) -> tuple[list[int], list[float]]:
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
    max_norm: float,
    noise_multiplier: float,
    rng: Any,
    expected_batch_size: float | None = None,
    mask: Any = None,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
) -> tuple[Any, ClippedSum]:
    """The DP-SGD gradient straight from the loss of one example, without per-example gradients.

    :func:`clipped_sum_of`, then Gaussian noise of std ``noise_multiplier * max_norm``, divided
    by ``expected_batch_size``: the same as :func:`pergrad.dp.private_mean` of
    ``pergrad.per_example_grads(fn)(*args)``, at about the cost of one or two batch gradients on
    the ghost path. Works under ``jax.jit``.

    Args:
      fn, *args, argnums, in_axes, strategy, chunk_size, mask: as for :func:`clipped_sum_of`.
      max_norm: the clipping bound, a positive number.
      noise_multiplier, rng, expected_batch_size: as for :func:`pergrad.dp.private_mean` (a JAX
        key or a ``torch.Generator``; divide by the expected batch size under Poisson sampling).

    Returns:
      ``(private_gradient, ClippedSum)``: the noisy mean gradient, shaped like the
      differentiated argument, and the clipping statistics.

    Example (JAX, with any optax optimizer)::

        grad, stats = pergrad.dp.private_grad_of(loss, params, X, Y, max_norm=1.0,
                                                 noise_multiplier=1.1, rng=key,
                                                 expected_batch_size=256)
        updates, opt_state = optimizer.update(grad, opt_state, params)
    """
    check_private_settings("private_grad_of", noise_multiplier, expected_batch_size)
    clipped = clipped_sum_of(
        fn,
        *args,
        max_norm=max_norm,
        argnums=argnums,
        in_axes=in_axes,
        strategy=strategy,
        chunk_size=chunk_size,
        mask=mask,
    )
    return noisy_mean(clipped, noise_multiplier, rng, expected_batch_size), clipped


def choose_strategy(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
) -> StrategyChoice:
    """The :class:`StrategyChoice` that :func:`per_example_norms_of` would make for this call.

    Runs nothing; validates like the real call (a bad ``strategy`` raises the same error).

    Example::

        pergrad.norms.choose_strategy(loss, loss.params(), X, Y)
        # StrategyChoice(strategy='ghost', reason='every differentiated parameter ...',
        #                layers={'fc1': 'linear', 'fc2': 'linear'}, ...)
    """
    _, _, choice = _setup("choose_strategy", fn, args, argnums, in_axes, strategy, chunk_size)
    return choice


def _setup(
    func_name: str,
    fn: Any,
    args: tuple[Any, ...],
    argnums: Any,
    in_axes: Any,
    strategy: Any,
    chunk_size: Any,
) -> tuple[Spec, Call, StrategyChoice]:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise PergradValueError(
            f"{func_name}: strategy must be one of {list(STRATEGIES)}; got {strategy!r}."
        )
    spec = Spec.create(func_name, fn, argnums, in_axes, False, chunk_size, None, None)
    call = analyse_call(spec, args)
    if call.backend.name == "jax":
        return spec, call, _choose_jax(spec, call, args, strategy, chunk_size)
    return spec, call, _choose(spec, call, fn, args, strategy, chunk_size)


def _choose(
    spec: Spec,
    call: Call,
    fn: Any,
    args: tuple[Any, ...],
    strategy: str,
    chunk_size: int | None,
) -> StrategyChoice:
    name = spec.func_name
    plan = _ghost_plan(spec, fn, args)
    unsupported = dict(plan.unsupported) if plan is not None else {}
    if strategy == "ghost":
        _check_ghost_possible(name, fn, plan)
    early = _materialize_choice(call, strategy, chunk_size)
    if early is not None:
        return early
    generic_numbers = call.batch_size * plan.generic_size if plan is not None else 0
    small_generic = generic_numbers <= _torch_generic_limit()
    if strategy == "ghost" or (
        strategy == "auto" and plan is not None and not unsupported and small_generic
    ):
        why = (
            "requested"
            if strategy == "ghost"
            else "every differentiated parameter belongs to a layer with a ghost rule"
            + (
                f" (layers without one, run alone: {generic_numbers:,} per-example numbers)"
                if generic_numbers
                else ""
            )
        )
        return StrategyChoice("ghost", why, None, dict(plan.layers))
    chunk = chunk_size or default_chunk_size(call)
    if strategy == "chunked":
        why = "requested"
    elif plan is not None and not unsupported:
        why = (
            f"the layers without a ghost rule would need {generic_numbers:,} per-example "
            f"numbers (more than {_torch_generic_limit():,})"
        )
    elif plan is None:
        why = (
            f"the ghost strategy needs a PyTorch pergrad.module_loss; fn is a "
            f"{type(fn).__name__} on {call.backend.name}"
        )
    else:
        why = "layers without a ghost rule: " + "; ".join(
            f"{layer!r}: {problem}" for layer, problem in unsupported.items()
        )
    layers = dict(plan.layers) if plan is not None else {}
    return StrategyChoice("chunked", why, chunk, layers, unsupported)


def _materialize_choice(call: Call, strategy: str, chunk_size: int | None) -> StrategyChoice | None:
    """The choice for an empty batch or a requested "materialize"; else None."""
    if call.batch_size == 0:
        return StrategyChoice("materialize", "empty batch", chunk_size)
    if strategy == "materialize":
        return StrategyChoice("materialize", "requested", chunk_size)
    return None


def _choose_jax(
    spec: Spec,
    call: Call,
    args: tuple[Any, ...],
    strategy: str,
    chunk_size: int | None,
) -> StrategyChoice:
    """JAX: ghost when parameters enter through contractions and the rest stay small."""
    name = spec.func_name
    early = _materialize_choice(call, strategy, chunk_size)
    if early is not None:
        return early
    if strategy == "chunked":
        return StrategyChoice("chunked", "requested", chunk_size or default_chunk_size(call))
    from pergrad._src.strategies import ghost_jax as jax_ghost

    plan = jax_ghost.plan(spec, call)
    layers, materialized = jax_ghost.describe(plan, _leaf_names(spec, call, args))
    numbers = jax_ghost.materialized_numbers(plan, call)
    if strategy == "ghost":
        if not plan.sites:
            raise PergradValueError(
                f"{name}: strategy='ghost' found no parameter that enters the loss through a "
                f"contraction (a dense layer, a convolution or an embedding lookup), so there "
                f"is nothing to compute without per-example gradients "
                f"({_listing(materialized)}). Use "
                f"strategy='chunked', or 'auto', which picks it for such losses."
            )
        return StrategyChoice("ghost", "requested", None, layers, materialized, plan)
    if plan.sites and numbers <= jax_ghost.MAX_MATERIALIZED_NUMBERS:
        why = (
            "every differentiated parameter enters the loss through a contraction"
            if not materialized
            else f"the parameters outside contractions need only {numbers:,} per-example numbers"
        )
        return StrategyChoice("ghost", why, None, layers, materialized, plan)
    why = (
        "no differentiated parameter enters the loss through a contraction"
        if not plan.sites
        else f"the parameters outside contractions would need {numbers:,} per-example numbers "
        f"(more than {jax_ghost.MAX_MATERIALIZED_NUMBERS:,}): {_listing(materialized)}"
    )
    chunk = chunk_size or default_chunk_size(call)
    return StrategyChoice("chunked", why, chunk, layers, materialized)


def _leaf_names(spec: Spec, call: Call, args: tuple[Any, ...]) -> list[str]:
    """A readable name for each differentiated leaf: its path, after the argument's index when
    several arguments are differentiated."""
    paths = {i: call.backend.flatten(args[i])[0] for i in spec.argnums}
    names = []
    for i, j in call.diff_positions:
        path = paths[i][j] or "(the whole argument)"
        names.append(path if spec.single_argnum else f"argument {i} {path}")
    return names


def _listing(reasons: dict[str, str]) -> str:
    items = list(reasons.items())
    text = "; ".join(f"{name}: {why}" for name, why in items[:4])
    return text + (f"; and {len(items) - 4} more" if len(items) > 4 else "")


def _torch_generic_limit() -> int:
    from pergrad._src.capture import torch_generic

    return torch_generic.MAX_MATERIALIZED_NUMBERS


def _ghost_plan(spec: Spec, fn: Any, args: tuple[Any, ...]) -> Any:
    """The ghost plan of a ``module_loss`` (None for any other fn). Never imports torch: a
    ModuleLoss cannot exist unless its module has been imported."""
    torch_module = sys.modules.get("pergrad._src.torch.module_loss")
    if torch_module is None or not isinstance(fn, torch_module.ModuleLoss):
        return None
    from pergrad._src.strategies import ghost_torch as torch_ghost

    if spec.argnums != (0,) or not spec.single_argnum:
        return torch_ghost.GhostPlan(
            unsupported={"argnums": "the ghost strategy differentiates the parameters only"}
        )
    return torch_ghost.plan(fn, args[0])


def _check_ghost_possible(name: str, fn: Any, plan: Any) -> None:
    if plan is None:
        raise PergradValueError(
            f"{name}: strategy='ghost' needs a PyTorch loss made with "
            f"pergrad.module_loss(model, loss_fn), whose layers it can hook; got a "
            f"{type(fn).__name__}. Use strategy='chunked' (any loss, either framework) or 'auto'."
        )
    if plan.unsupported:
        listing = "; ".join(f"{k!r}: {v}" for k, v in plan.unsupported.items())
        raise PergradValueError(
            f"{name}: strategy='ghost' cannot handle this model ({listing}). Use "
            f"strategy='chunked', or 'auto', which picks it for such models."
        )


def _reduce(
    spec: Spec,
    call: Call,
    fn: Any,
    choice: StrategyChoice,
    requested: str,
    weights_from: WeightsFn | None,
) -> Reduction:
    chunk_size = choice.chunk_size
    if choice.strategy == "ghost":
        try:
            if call.backend.name == "jax":
                from pergrad._src.strategies import ghost_jax as jax_ghost

                return jax_ghost.ghost(spec, call, choice.plan, weights_from)
            from pergrad._src.strategies.ghost_torch import ghost

            return ghost(spec, call, fn, choice.layers, weights_from)
        except GhostUnsupported as err:
            if requested == "ghost":
                raise PergradValueError(
                    f"{spec.func_name}: strategy='ghost' cannot handle this call: {err}. Use "
                    f"strategy='chunked', or 'auto', which falls back to it by itself."
                ) from err
            warnings.warn(
                f"{spec.func_name}: the ghost strategy cannot handle this call ({err}); using "
                f"the chunked strategy instead: the same result, with more time and memory.",
                FallbackWarning,
                stacklevel=3,
            )
            chunk_size = spec.chunk_size or default_chunk_size(call)
    return chunked(spec, call, chunk_size, weights_from)


def _global_norms(squared: list[Any]) -> Any:
    return sum(squared[1:], squared[0]) ** 0.5


def _real(like: Any, mask: Any) -> Any:
    """1 for real examples, 0 for padding: ``(B,)`` like ``like``."""
    return like * 0 + 1.0 if mask is None else mask * 1.0


def _check_mask(func_name: str, call: Call, mask: Any) -> None:
    bk = call.backend
    if not bk.is_array(mask) or bk.shape(mask) != (call.batch_size,):
        got = f"shape {bk.shape(mask)}" if bk.is_array(mask) else type(mask).__name__
        raise PergradValueError(
            f"{func_name}: mask must be a ({call.batch_size},) array of the arguments' "
            f"framework (True for real examples, False for padding); got {got}."
        )
