"""What the first call of each layout verifies about a captured pass, before its values are used.

A layer is hooked only if axis 0 of its input and output has the batch size, but a size is not
a layout (a time-first layer with ``T == B``, a table shared by the batch with ``T == B``
rows), and a parameter used outside its layer's ``forward`` escapes the hooks. So the first
call of each layout (``torch_checks.layout_key``) establishes:

- every hooked output gradient is row-local: the backward pass of the losses weighted per
  example (:func:`weighted_run`, before the plain pass, keeping only summaries of its rows, so
  that no backward pass retains its graph; or :func:`check_layout`, through a retained graph)
  compared row by row with the plain pass's (``torch_checks.py``);
- the first examples run alone get their batched losses (:func:`check_losses_alone`);
- the formed per-example gradients (generic units, position-bias tables) add up to the batch
  gradient, and no parameter's batch gradient is larger than its per-example norms allow,
  ``|sum_i g_i|^2 <= B sum_i |g_i|^2`` (:func:`check_batch_gradient`, from the batch
  gradient :func:`batch_gradient` streams). A parameter used both inside and outside its
  layer may go unnoticed, and a model whose later calls of the same shapes take another path
  than its first is not checked again.

Any failure is :class:`Unsupported`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from pergrad._src.capture import torch_checks, torch_generic
from pergrad._src.capture.torch_session import CapturedPass, reentrant_refused
from pergrad._src.core.call import Call, Spec, single_example_fn
from pergrad._src.errors import Unsupported


@dataclass(kw_only=True)
class BatchGradient:
    """A first run's batch gradient, as its checks need it: each leaf's squared norm (None
    where the loss does not reach it), and the whole gradient of the ``kept`` leaves (those
    whose per-example gradients are formed, checked entry by entry), by position."""

    squared_norms: list[Any]
    kept: dict[int, torch.Tensor]


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """``|grad|^2``, detached."""
    return torch.linalg.vector_norm(grad.detach()) ** 2


def formed_positions(session: CapturedPass) -> set[int]:
    """The positions in ``diff`` of the leaves whose per-example gradients are formed (generic
    units' parameters, position-bias tables): their batch gradient is checked whole."""
    owners = session.owners
    keep = {
        session.index_of(n) for names in owners.unit_parameters.values() for n in names.values()
    }
    return keep | {session.index_of(weight) for weight in owners.tables.values()}


def batch_gradient(
    total: torch.Tensor, diff: list[torch.Tensor], keep: set[int], retain: bool
) -> BatchGradient:
    """The backward pass of ``total`` into every leaf of ``diff``, each leaf's gradient
    reduced to its squared norm as soon as the pass has accumulated it and then dropped (kept
    whole for the leaves in ``keep``): a first run checks the norms against the batch gradient
    without holding a model's worth of gradients beside the records."""
    found = BatchGradient(squared_norms=[None] * len(diff), kept={})

    def reduce(k: int, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        assert grad is not None
        found.squared_norms[k] = squared_norm(grad)
        if k in keep:
            found.kept[k] = grad

    handles = [
        leaf.register_post_accumulate_grad_hook(functools.partial(reduce, k))
        for k, leaf in enumerate(diff)
    ]
    try:
        torch.autograd.backward(total, inputs=diff, retain_graph=retain)
    finally:
        for handle in handles:
            handle.remove()
    return found


def check_batch_gradient(
    session: CapturedPass, batch_squared_norms: list[Any], kept: dict[int, Any]
) -> None:
    """A first run: the formed per-example gradients add up to the batch gradient (``kept``:
    position -> the whole batch gradient of the formed leaves), and no parameter's batch
    gradient (``batch_squared_norms``: each leaf's ``|sum_i g_i|^2``, None where the loss does
    not reach it) is larger than its norms (``session.squared``) allow."""
    by_name = {name: kept.get(session.index_of(name)) for name in session.params}
    _check_unit_sums(session, by_name)
    _check_consistency(session, batch_squared_norms)


def check_batch_gradients(session: CapturedPass, batch_grads: tuple[Any, ...]) -> None:
    """:func:`check_batch_gradient` from every leaf's whole batch gradient (``batch_grads``,
    None where the loss does not reach it): the low-memory mode's second pass."""
    squared_norms = [None if g is None else squared_norm(g) for g in batch_grads]
    check_batch_gradient(session, squared_norms, dict(enumerate(batch_grads)))


def _check_unit_sums(session: CapturedPass, by_name: dict[str, Any]) -> None:
    """The formed per-example gradients (generic units, position-bias tables) add up to the
    batch gradient (``by_name``: name in ``params`` -> its batch gradient, or None)."""
    owners, unit_grads = session.owners, session.unit_grads
    for unit in owners.units:
        owned = {
            full: unit_grads[full]
            for full in owners.unit_parameters[unit].values()
            if full in unit_grads
        }
        torch_generic.check_sums(unit, owned, by_name)
    for table, weight in owners.tables.items():
        torch_generic.check_sums(table, {weight: unit_grads[weight]}, by_name)


def _check_consistency(session: CapturedPass, batch_squared_norms: list[Any]) -> None:
    """Refuse norms the batch gradient contradicts (``batch_squared_norms``: each leaf's
    ``|sum_i g_i|^2``, None where the loss does not reach it).

    For any per-example gradients, ``|sum_i g_i|^2 <= B sum_i |g_i|^2``. If the batch gradient
    breaks it, some use of the parameter escaped the layer hooks.
    """
    squared = session.squared
    assert squared is not None
    checked = [(k, g) for k, g in enumerate(batch_squared_norms) if g is not None]
    if not checked:
        return
    batch_sq = torch.stack([g for _, g in checked])
    bound = session.batch_size * torch.stack([squared[k].sum() for k, _ in checked])
    dtype = torch_checks.checked_dtype(batch_sq)
    slack = torch_checks.TOLERANCES["norms_consistency"].of(dtype)
    escaped = (batch_sq > bound * (1 + slack) + 1e-30).nonzero().flatten().tolist()
    if escaped:
        names = {session.index_of(name): name for name in session.params}
        raise Unsupported(
            f"parameter {names[checked[escaped[0]][0]]!r} has a batch gradient larger than its "
            f"per-example norms allow: it is used outside the forward pass of the layer that "
            f"owns it"
        )


@dataclass(frozen=True, kw_only=True)
class WeightedRun:
    """The first half of a first run's row check (:func:`weighted_run`): the random-number
    state before it, the per-example weights, and each record's summary of its weighted
    output gradient (None: it got none), by name, in the order of the calls."""

    rng: Any
    weights: torch.Tensor
    summaries: dict[str, list[torch_checks.RowSummary | None]]


def weighted_run(session: CapturedPass) -> WeightedRun:
    """The backward pass of ``sum_b w_b loss_b`` through ``session`` (only to the layers'
    outputs, no weight gradient), each hooked output gradient summarised row by row and
    dropped as it comes, the graph freed. The plain pass that follows, from the same
    random-number state (the same dropout masks), checks its rows against these summaries
    (:func:`check_rows_against_weighted`) where its records are finite. Costs one forward and
    one light backward pass, once per layout, at about the memory of a non-private step, with
    nothing of the plain pass alive beside it."""
    losses = session.losses
    assert losses is not None
    weights = torch_checks.row_weights(session.batch_size, losses)

    def weighted_backward(weights: torch.Tensor) -> None:
        with reentrant_refused(), torch.enable_grad():
            torch.autograd.grad((losses * weights).sum(), session.light, allow_unused=True)

    summaries = torch_checks.weighted_summaries(session.captured(), weighted_backward, weights)
    return WeightedRun(rng=session.rng, weights=weights, summaries=summaries)


def check_rows_against_weighted(
    spec: Spec, call: Call, session: CapturedPass, weighted: WeightedRun
) -> None:
    """The first run of a layout, its row check's second half: every captured output gradient
    of the plain pass (or its summary) is row-local, as :func:`weighted_run` summarised the
    weighted pass's; and examples run alone get their batched loss."""
    torch_checks.check_rows_against(
        session.captured(), weighted.summaries, weighted.weights, session.summaries
    )
    check_losses_alone(spec, call, session)


def check_layout(spec: Spec, call: Call, session: CapturedPass, retain: bool) -> None:
    """The first run of a layout: every captured output gradient (or, for those dropped
    before the check, its summary in ``session.summaries``) is row-local, and examples run
    alone get their batched loss (``torch_checks.py``). ``retain``: keep the graph for a
    later pass."""
    batch_size, losses = call.batch_size, session.losses
    if batch_size < 2:  # one example: every row is its own
        return
    assert losses is not None

    def weighted_backward(weights: torch.Tensor) -> None:
        with torch.enable_grad():
            torch.autograd.grad(
                (losses * weights).sum(), session.light, allow_unused=True, retain_graph=retain
            )

    torch_checks.check_rows(
        session.captured(),
        weighted_backward,
        torch_checks.row_weights(batch_size, losses),
        session.summaries,
    )
    check_losses_alone(spec, call, session)


def check_losses_alone(spec: Spec, call: Call, session: CapturedPass) -> None:
    """The first examples run alone must get their batched losses (unless the model drew
    random numbers in the pass: a run alone would draw other ones)."""
    if call.backend.rng_state_changed(session.rng):
        return  # the model draws random numbers (dropout): a run alone draws other ones
    assert session.losses is not None
    single = single_example_fn(spec, call, {})
    batched = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    detached = tuple(x.detach() for x in session.diff)
    index = torch_checks.check_losses_alone(
        single, detached, batched, session.losses.detach(), torch_checks.LOSS_CHECKS
    )
    if index is not None:
        raise Unsupported(
            f"example {index} gets another loss when run alone than in the batched pass: the "
            f"examples interact (batch statistics, a branch on the whole batch), or the "
            f"model's output does not hold the batch on axis 0"
        )
