"""The chunked strategy, written once over the backend protocol (JAX and PyTorch alike).

Squared norms: ``vmap`` over the examples of "gradient of one example, then its squared norm per
leaf", with the backend's ``chunk_size`` (JAX: ``lax.map`` over chunks; torch: ``vmap``'s
``chunk_size``), so at most ``chunk_size x P`` gradient numbers are live at once and only
``(B,)`` vectors leave each chunk.

Clipped sum: with the clip factors ``c_i`` known, ``sum_i c_i g_i`` is the gradient of
``sum_i c_i loss_i`` (Lee & Kifer 2021, "Scaling up differentially private deep learning with
fast per-example gradient clipping"): ONE batch gradient of the weighted loss, whose batched
forward pass is the framework's ``vmap`` of the loss of one example.

Where the framework cannot vectorise the loss, the order of :func:`pergrad.per_example_grads`
follows: for a PyTorch ``pergrad.module_loss`` whose layers all have rules (reentrant activation
checkpointing, an ``autograd.Function`` without a vmap rule), the layer hooks' per-example
gradients chunk by chunk; otherwise (torch's ``nn.GRU`` with torch.func) the examples one at a
time with the core's loop, again reduced at once.

An example of weight 0 (padding, or a gradient that is not finite) must add exactly nothing,
but in the weighted loss its ``0 * loss_i`` still sends ``0 * nan`` into the gradient when its
loss or gradient is nan. So the weighted loss runs the data of an example of positive weight in
its place (:func:`stand_in_for_zero_weights`): one ``where`` over the batch's inputs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from pergrad._src.backends import Backend
from pergrad._src.core.call import Call, Spec, single_example_fn
from pergrad._src.errors import FallbackWarning, Unsupported
from pergrad._src.strategies.loop import loop
from pergrad._src.strategies.protocol import (
    Assessment,
    ReduceRequest,
    Reduction,
    StrategyChoice,
    WeightsFn,
    per_leaf_weights,
    weight_groups,
)
from pergrad._src.strategies.vmap import vmap_failure

# Default chunk: as many examples as keep chunk_size x P under this many gradient numbers
# (128 MB in float32): big enough that per-chunk overhead vanishes, small next to B x P.
_DEFAULT_CHUNK_NUMBERS = 2**25


def default_chunk_size(call: Call) -> int:
    """Examples per chunk when the user gives none: ``B`` for small models."""
    bk = call.backend
    num_params = sum(math.prod(bk.shape(call.leaves[i][j])) for i, j in call.diff_positions)
    return max(1, min(call.batch_size, _DEFAULT_CHUNK_NUMBERS // max(num_params, 1)))


def chunked(spec: Spec, call: Call, chunk_size: int, weights_from: WeightsFn | None) -> Reduction:
    """Squared norms chunk by chunk, then (if ``weights_from``) one weighted batch gradient."""
    bk = call.backend
    single = single_example_fn(spec, call, {})
    batched = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    # inside shard_map: per-device parameters, so each sum stays on its device (see the backend)
    diff = bk.match_varying(tuple(call.leaves[i][j] for i, j in call.diff_positions), batched)
    squared, cause = (
        (None, "an earlier call of this function found it could not")
        if spec.resolved in ("hooks", "loop")
        else _vectorised_squared_norms(spec, bk, single, diff, batched, chunk_size)
    )
    if squared is None:  # the framework could not vectorise fn: layer hooks, else a loop
        if spec.resolved != "loop":
            hooked = _hooked(spec, call, single, diff, batched, chunk_size, weights_from, cause)
            if isinstance(hooked, Reduction):
                return hooked
            cause = hooked
        # If one example fails on its own, the problem is in fn and its own error is clearest.
        loop(spec, bk, single, diff, tuple(v[:1] for v in batched), 1, stacked=False)
        if spec.resolved != "loop":
            _warn_loop(spec, bk, cause, "fn")
            spec.resolved = "loop"
        return _looped(spec, bk, single, diff, batched, call.batch_size, weights_from)
    if weights_from is None:
        return Reduction(squared, None)
    try:
        sums = _weighted_gradient(spec, bk, single, diff, batched, weights_from(squared))
    except Exception as err:
        # The norms' vmap(grad) ran, but grad(vmap) of the weighted loss batches other
        # operators (torch's LSTM); the loop gives the same result, one example at a time.
        _warn_loop(spec, bk, vmap_failure(bk, err), "the weighted loss")
        spec.resolved = "loop"
        return _looped(spec, bk, single, diff, batched, call.batch_size, weights_from)
    return Reduction(squared, sums)


def _warn_loop(spec: Spec, bk: Backend, cause: str, what: str) -> None:
    warnings.warn(
        f"{spec.func_name}: {bk.name} could not vectorise {what} ({cause}). Falling back to "
        f"one example at a time: the same result, but slower.",
        FallbackWarning,
        stacklevel=6,
    )


def _vectorised_squared_norms(
    spec: Spec,
    bk: Backend,
    single: Callable[..., Any],
    diff: tuple[Any, ...],
    batched: tuple[Any, ...],
    chunk_size: int,
) -> tuple[list[Any] | None, str]:
    """The squared norms by vmap, or None and why the framework could not vectorise fn."""
    value_and_grad = bk.value_and_grad(single, False)

    def squared_norms_of_one(diff_values: Any, example: Any) -> tuple[Any, ...]:
        _, grads = value_and_grad(diff_values, example)
        return tuple((g**2).sum() for g in grads)

    vectorised = bk.vmap(squared_norms_of_one, (None, 0), chunk_size, spec.randomness)
    try:
        return list(vectorised(diff, batched)), ""
    except Exception as err:
        return None, vmap_failure(bk, err)


def _hooked(
    spec: Spec,
    call: Call,
    single: Callable[..., Any],
    diff: tuple[Any, ...],
    batched: tuple[Any, ...],
    chunk_size: int,
    weights_from: WeightsFn | None,
    cause: str,
) -> Reduction | str:
    """Where torch's vmap cannot batch a ``pergrad.module_loss`` (activation checkpointing
    with ``use_reentrant=True``, an ``autograd.Function`` without a vmap rule) and every
    parameter is in a layer with a rule: the hooks' per-example gradients, as
    :func:`pergrad.per_example_grads` would take them, one chunk of ``chunk_size`` examples
    at a time (one forward and backward pass each), reduced chunk by chunk. With weights, a
    second pass over the chunks (the hooks refuse a model that draws random numbers, so it
    recomputes the same gradients); one chunk is kept instead. Where the hooks cannot take
    the call: ``cause`` (why vmap could not) and why not (then the loop)."""
    from pergrad._src.strategies import hooks_torch

    bk = call.backend
    found = hooks_torch.plan(spec, spec.fn, bk.unflatten(call.treedefs[0], call.leaves[0]))
    if found.unsupported:
        return cause
    starts = range(0, call.batch_size, chunk_size)

    def grads_of(start: int) -> list[Any]:
        rows = tuple(v[start : start + chunk_size] for v in batched)
        size = min(chunk_size, call.batch_size - start)
        return hooks_torch.value_and_grads(spec, call, found, single, diff, rows, size)[1]

    kept: list[list[Any]] = []
    columns: list[list[Any]] = [[] for _ in diff]
    try:
        for start in starts:
            grads = grads_of(start)
            for column, g in zip(columns, grads):
                column.append((g.reshape(g.shape[0], -1) ** 2).sum(1))
            if len(starts) == 1:
                kept.append(grads)
    except Unsupported as err:
        return f"{cause}; layer hooks cannot take it either ({err})"
    squared = [bk.concatenate(column, 0) for column in columns]
    if spec.resolved != "hooks":
        warnings.warn(
            f"{spec.func_name}: {bk.name} could not vectorise fn ({cause}). Taking "
            f"per-example gradients from layer hooks instead, {chunk_size} examples at a "
            f"time (one forward and backward pass of each chunk): the same result.",
            FallbackWarning,
            stacklevel=6,
        )
        spec.resolved = "hooks"
    if weights_from is None:
        return Reduction(squared, None)
    per_leaf = [bk.stop_gradient(w) for w in per_leaf_weights(weights_from(squared), len(diff))]
    sums = [leaf * 0 for leaf in diff]
    for start in starts:
        grads = kept.pop() if kept else grads_of(start)
        for k, (w, g) in enumerate(zip(per_leaf, grads)):
            w = w[start : start + g.shape[0]]
            # where, not w * g: a non-finite example has weight 0, and 0 * nan is nan
            shaped = w.reshape((-1,) + (1,) * (g.ndim - 1))
            sums[k] = sums[k] + bk.where(shaped != 0, shaped * g, 0.0).sum(0)
    return Reduction(squared, sums)


def _weighted_gradient(
    spec: Spec,
    bk: Backend,
    single: Callable[..., Any],
    diff: tuple[Any, ...],
    batched: tuple[Any, ...],
    weights: Any,
) -> list[Any]:
    """One batch gradient of the weighted loss per group of leaves that share weights."""
    losses_of = bk.vmap(single, (None, 0), None, spec.randomness)
    sums: list[Any] = [None] * len(diff)
    for group_weights, leaves in weight_groups(weights, len(diff)):

        def weighted_loss(
            subset: Any, examples: Any, example_weights: Any, leaves: list[int] = leaves
        ) -> Any:
            values = list(diff)
            for k, value in zip(leaves, subset):
                values[k] = value
            return (losses_of(tuple(values), examples) * example_weights).sum()

        subset = tuple(diff[k] for k in leaves)
        example_weights = bk.stop_gradient(group_weights)
        examples = stand_in_for_zero_weights(bk, batched, example_weights)
        _, grads = bk.value_and_grad(weighted_loss, False)(subset, examples, example_weights)
        # every weight 0: the stand-in itself may be non-finite, and the sum is 0
        weighted = (example_weights != 0).any()
        for k, g in zip(leaves, grads):
            sums[k] = bk.where(weighted, g, 0.0)
    return sums


def stand_in_for_zero_weights(bk: Backend, batched: tuple[Any, ...], weights: Any) -> Any:
    """``batched`` with each example of weight 0 replaced by the example of largest weight:
    its loss, times 0, adds exactly 0 to the weighted gradient, where its own loss could add
    ``0 * nan``."""
    stand_in = weights.argmax()
    zero = weights == 0
    return tuple(
        bk.where(zero.reshape((-1,) + (1,) * (len(bk.shape(x)) - 1)), x[stand_in], x)
        for x in batched
    )


def _looped(
    spec: Spec,
    bk: Backend,
    single: Callable[..., Any],
    diff: tuple[Any, ...],
    batched: tuple[Any, ...],
    batch_size: int,
    weights_from: WeightsFn | None,
) -> Reduction:
    """One example at a time (the core's loop, randomness rules included); two passes when
    weights are asked for, so that only one example's gradient is ever held."""

    def grads_of(index: int) -> tuple[Any, ...]:
        example = tuple(v[index : index + 1] for v in batched)
        [(_, grads)] = loop(spec, bk, single, diff, example, 1, stacked=False)
        return grads

    per_example = [[(g**2).sum() for g in grads_of(i)] for i in range(batch_size)]
    squared = [bk.stack(column) for column in zip(*per_example)]
    if weights_from is None:
        return Reduction(squared, None)
    per_leaf = [bk.stop_gradient(w) for w in per_leaf_weights(weights_from(squared), len(diff))]
    sums = [leaf * 0 for leaf in diff]
    for i in range(batch_size):
        # where, not w[i] * g: a non-finite example has weight 0, and 0 * nan is nan
        sums = [
            s + bk.where(w[i] != 0, w[i] * g, 0.0) for s, w, g in zip(sums, per_leaf, grads_of(i))
        ]
    return Reduction(squared, sums)


def assess(request: ReduceRequest, forced: bool, refused: dict[str, Assessment]) -> Assessment:
    chunk = request.chunk_size or default_chunk_size(request.call)
    ghost = refused.get("ghost")
    if forced or ghost is None:
        why = "requested" if forced else "the ghost strategy failed while running"
        return Assessment("chunked", True, why, StrategyChoice("chunked", why, chunk))
    found = ghost.choice or StrategyChoice("ghost", "")
    choice = StrategyChoice("chunked", ghost.why, chunk, found.layers, found.unsupported)
    return Assessment("chunked", True, ghost.why, choice)


def run(request: ReduceRequest, verdict: Assessment) -> Reduction:
    assert verdict.choice is not None and verdict.choice.chunk_size  # set by assess
    return chunked(request.spec, request.call, verdict.choice.chunk_size, request.weights_from)
