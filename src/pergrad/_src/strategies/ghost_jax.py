"""The ghost strategy for JAX: per-example norms from each contraction's input and cotangent.

``capture/jax_engine.py`` traces the loss of one example and finds each differentiated leaf's
contraction (its *site*); a leaf with one site is a *ghost parameter*. Then (:func:`ghost`):

1. one vectorised forward and backward pass over the batch (``jax_engine.records``) records, per
   site, the layer input ``a`` and output cotangent ``dz`` of every example; the ghost
   parameters themselves are not differentiated, so no ``B x P`` weight gradient is formed;
2. each ghost parameter's per-example squared norm follows from ``a`` and ``dz`` by its
   contraction's rule (``capture/jax_contractions.py``: the factored dense norm, the embedding's
   segment sums, a per-example transpose for convolutions);
3. the weighted sum ``sum_i w_i g_i`` that a clipped sum needs is the contraction's transpose
   applied once to the whole batch with cotangents ``w_i dz_i``: no second backward pass. An
   example of weight 0 (padding, or a gradient that is not finite) has its records zeroed
   first (``where``; ``0 * nan`` would be nan), so it adds exactly nothing. Where a clipped
   sum follows, a dense or convolution leaf whose per-example gradients are no more numbers
   than its cotangents is instead formed once (``_held``): its norms and its weighted sum both
   come from those numbers, its records are freed early.

A table tied across uses (read by embedding lookups and by at most one dense contraction, as
GPT-2's or flax's ``Embed.attend`` output projection) is ghosted too, its squared norm combined
from its uses' records (``jax_contractions.tied_squared_norms``). Parameters used any other way
(biases, norm scales, a weight shared by several dense layers, anything inside ``scan`` /
``cond`` / a ``custom_jvp``) get ordinary per-example gradients in the same pass;
``strategy="auto"`` takes the ghost strategy only when those stay small
(``capture/cost.MAX_FORMED_NUMBERS``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pergrad._src.capture import (  # importing jax_contractions registers the rules
    cost,
    jax_contractions,
    jax_cost,
)
from pergrad._src.capture.jax_engine import JaxGhostPlan, JaxRecords, describe, plan, records
from pergrad._src.capture.jax_rules import rule_for
from pergrad._src.capture.jax_users import UserGroups
from pergrad._src.capture.quantities import USER_SQUARED_NORMS, Formed
from pergrad._src.core.call import Call, Spec
from pergrad._src.errors import PergradValueError
from pergrad._src.strategies.protocol import (
    Assessment,
    LeafReduction,
    ReduceRequest,
    Reduction,
    StrategyChoice,
    WeightsFn,
    per_leaf_weights,
)


def leaf_sizes(call: Call) -> list[int]:
    """Each differentiated leaf's size, in the core's flat order."""
    return [math.prod(call.backend.shape(call.leaves[i][j])) for i, j in call.diff_positions]


def materialized_numbers(ghost_plan: JaxGhostPlan, call: Call) -> int:
    """How many per-example gradient numbers the leaves without a site need: ``B x size``."""
    sizes = leaf_sizes(call)
    return call.batch_size * sum(sizes[k] for k in ghost_plan.other)


def assess(request: ReduceRequest, forced: bool) -> Assessment:
    """The registry's question for a JAX loss: does any parameter enter through a contraction,
    and (under "auto") do the per-example gradients of the others stay small?"""
    spec, call = request.spec, request.call
    found = plan(spec, call)
    names = _leaf_names(spec, call, request.args)
    layers, materialized = describe(found, names)
    numbers = materialized_numbers(found, call)
    if forced:
        if not found.sites:
            raise PergradValueError(
                f"{spec.func_name}: strategy='ghost' found no parameter that enters the loss "
                f"through a contraction (a dense layer, a convolution or an embedding lookup), "
                f"so there is nothing to compute without per-example gradients "
                f"({_listing(materialized)}). Use strategy='chunked', or 'auto', which picks it "
                f"for such losses."
            )
        choice = StrategyChoice(
            "ghost", "requested", None, layers, materialized, found, _routes(found, names)
        )
        return Assessment("ghost", True, "requested", choice)
    if found.sites and numbers <= cost.MAX_FORMED_NUMBERS:
        why = (
            "every differentiated parameter enters the loss through a contraction"
            if not materialized
            else f"the parameters outside contractions need only {numbers:,} per-example numbers"
        )
        routes = _routes(found, names)
        cheaper, comparison = _materialize_is_cheaper(request, found)
        if cheaper:
            why = f"materialising the per-example gradients is cheaper: {comparison}"
            choice = StrategyChoice(
                "materialize", why, request.chunk_size, layers, materialized, None, routes
            )
            return Assessment("ghost", False, why, choice)
        if comparison:
            why += f"; {comparison}"
        choice = StrategyChoice("ghost", why, None, layers, materialized, found, routes)
        return Assessment("ghost", True, why, choice)
    why = (
        "no differentiated parameter enters the loss through a contraction"
        if not found.sites
        else f"the parameters outside contractions would need {numbers:,} per-example numbers "
        f"(more than {cost.MAX_FORMED_NUMBERS:,}): {_listing(materialized)}"
    )
    return Assessment("ghost", False, why, StrategyChoice("ghost", why, None, layers, materialized))


def _materialize_is_cheaper(request: ReduceRequest, found: JaxGhostPlan) -> tuple[bool, str]:
    """``(whether "auto" materialises instead, the comparison in words)``: where the work model
    (``capture/jax_cost.py``) finds materialising faster, XLA's compiled temporary memory of
    both routes decides (materialising within ``cost.XLA_MEMORY_MARGIN`` of the ghost norms'
    memory). Below ``cost.MIN_CHOICE_NUMBERS`` per-example numbers, and at user level, the
    ghost norms are kept without estimating (``""``)."""
    call = request.call
    if request.users is not None or request.compiled_bytes is None:
        return False, ""
    sizes = leaf_sizes(call)
    numbers = call.batch_size * sum(sizes)
    if numbers < cost.MIN_CHOICE_NUMBERS:
        return False, ""
    clipped = request.clipped or request.weights_from is not None
    costs = jax_cost.route_costs(found, call.batch_size, sizes, clipped)
    work = (
        f"estimated extra work over a batch gradient: ghost norms {costs.ghost:.3g} "
        f"multiply-adds, materialised per-example gradients {costs.materialize:.3g} "
        f"({numbers:,} numbers)"
    )
    if costs.materialize >= costs.ghost:
        return False, f"the ghost norms are cheaper: {work}"
    try:
        ghost_bytes = request.compiled_bytes("ghost")
        materialized_bytes = request.compiled_bytes("materialize")
    except Exception as err:  # a loss that cannot be compiled alone: no estimate
        return False, (
            f"materialising is estimated faster ({work}), but the call could not be compiled "
            f"alone to compare the memory of the two ({type(err).__name__}): ghost norms kept"
        )
    memory = (
        f"XLA's temporary memory {materialized_bytes / 2**20:.1f} MiB materialising, "
        f"{ghost_bytes / 2**20:.1f} MiB by the ghost norms"
    )
    if materialized_bytes <= (1 + cost.XLA_MEMORY_MARGIN) * ghost_bytes:
        return True, f"{work}; {memory}"
    return False, (
        f"the ghost norms hold less memory: {memory}; materialising, estimated faster "
        f"({work}), takes more than {1 + cost.XLA_MEMORY_MARGIN:g}x (strategy='materialize' "
        f"takes it anyway)"
    )


def _routes(found: JaxGhostPlan, names: list[str]) -> dict[str, str]:
    """Each ghost leaf's norm route (``StrategyChoice.norm_routes``); a tied table's, per use."""
    routes = {
        names[k]: jax_contractions.norm_route(site) for k, site in sorted(found.sites.items())
    }
    for k, group in sorted(found.shared.items()):
        routes[names[k]] = "tied: " + "; ".join(jax_contractions.norm_route(site) for site in group)
    return routes


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


def ghost(
    spec: Spec,
    call: Call,
    ghost_plan: JaxGhostPlan,
    weights_from: WeightsFn | None,
    users: Any = None,
) -> Reduction:
    """Squared norms of every differentiated leaf (and, with ``weights_from``, the weighted sums)
    from one vectorised forward and backward pass; see the module docstring.

    ``users``: None, or a ``protocol.UserGrouping`` for user-level clipping: the squared norms
    are then each user's, in the row of its first real example (``capture/jax_users.py``), and
    ``weights_from`` still gives one weight per example."""
    del spec
    found = records(call, ghost_plan)
    # where a clipped sum follows: the leaves held as their formed per-example gradients
    held = _held(found) if weights_from is not None and users is None else {}
    if users is not None:
        squared = _user_squared_norms(found, UserGroups.from_slots(users.slots))
    else:
        squared = _squared_norms(found, held)
    # a rule's cost.Certified norms: the estimates reported, estimate + bound clipped by
    estimates, bounds = (list(column) for column in zip(*map(cost.split, squared)))
    if all(b is None for b in bounds):
        bounds = None
    if weights_from is None:
        return Reduction(estimates, None, rounding_bounds=bounds)
    upper = Reduction(estimates, None, rounding_bounds=bounds).upper_squared_norms()
    weights = per_leaf_weights(weights_from(upper), len(squared))
    per_leaf = [jax.lax.stop_gradient(w) for w in weights]
    sums: list[Any] = [None] * len(squared)
    for k, g in {**found.grads, **held}.items():
        sums[k] = jnp.tensordot(per_leaf[k].astype(g.dtype), _weighted_rows(g, per_leaf[k]), 1)
    for k, site in found.sites.items():
        if k in held:
            continue
        w = per_leaf[k]
        inputs, cotangents = (
            _weighted_rows(found.inputs[k], w),
            _weighted_rows(found.cotangents[k], w),
        )
        sums[k] = rule_for(site).weighted_sum(site, found.values[k], inputs, cotangents, w)
    for k, group in found.shared.items():
        if k in held:
            continue
        w = per_leaf[k]
        inputs = tuple(_weighted_rows(x, w) for x in found.shared_inputs[k])
        cotangents = tuple(_weighted_rows(d, w) for d in found.shared_cotangents[k])
        sums[k] = jax_contractions.tied_weighted_sum(group, found.values[k], inputs, cotangents, w)
    return Reduction(estimates, sums, rounding_bounds=bounds)


def _held(found: JaxRecords) -> dict[int, Any]:
    """Leaf -> ``(B, *leaf_shape)``: the formed per-example gradients of the single-site leaves
    whose rule allows it (``ContractionRule.held``: dense contractions, convolutions) and whose
    gradients are no more numbers than their cotangents (a long sequence over a narrow layer).
    Formed once, they give the leaf's certified norms (those of exactly the numbers the clipped
    sum adds, so each example's contribution is within the bound however forming it rounded)
    and its weighted sum (``B p q`` multiply-adds, not the ``B T p q`` of a transpose over the
    records, nor, on the formed norm route, a second ``A^T D``); its records are then dead, and
    XLA frees them (``benchmarks/dp_transformers_jax.py --records-held``). A table tied across
    uses (an embedding and its output projection) is held likewise, every use's per-example
    gradient summed (``jax_contractions.tied_per_example``: the lookups scattered into the
    projection's formed gradient), where that is no more numbers than all its uses' cotangents
    (an LM head over a long sequence: ``B V d`` against ``B T (V + d)``); its norms then need no
    cross terms. Read at trace time:
    ``cost.HOLD_FORMED`` (off: every leaf from its records, as before) and ``cost.FAST_NORMS``
    (off: the norms of before, uncertified)."""
    if not (cost.HOLD_FORMED and cost.FAST_NORMS):
        return {}
    held = {}
    for k, site in found.sites.items():
        rule, param, cotangents = rule_for(site), found.values[k], found.cotangents[k]
        if rule.held and cotangents.shape[0] * math.prod(jnp.shape(param)) <= cotangents.size:
            held[k] = rule.per_example(site, param, found.inputs[k], cotangents)
    for k, group in found.shared.items():
        param, inputs, cotangents = _tied_records(found, k)
        outputs = sum(d.size for d in cotangents)
        if cotangents[0].shape[0] * math.prod(jnp.shape(param)) <= outputs:
            held[k] = jax_contractions.tied_per_example(group, param, inputs, cotangents)
    return held


def _squared_norms(found: JaxRecords, held: dict[int, Any]) -> list[Any]:
    squared: list[Any] = [None] * len(found.values)
    for k, g in found.grads.items():
        squared[k] = (g.reshape(g.shape[0], -1) ** 2).sum(axis=1)
    for k, g in held.items():
        squared[k] = jax_contractions.formed_squared_norms(g)
    for k, site in found.sites.items():
        if k in held:
            continue
        squared[k] = rule_for(site).squared_norms(
            site, found.values[k], found.inputs[k], found.cotangents[k]
        )
    for k, group in found.shared.items():
        if k not in held:
            squared[k] = jax_contractions.tied_squared_norms(group, *_tied_records(found, k))
    return squared


def _user_squared_norms(found: JaxRecords, groups: UserGroups) -> list[Any]:
    """Each leaf's users' squared norms (the row layout): from the records by the registered
    quantity where the contraction gives tokens or lookups, else from its per-example
    gradients summed per user."""
    return [
        value if reduced else groups.formed(value)
        for value, reduced in _plug_ins(found, USER_SQUARED_NORMS.name, (groups,))
    ]


def _weighted_rows(records: Any, weights: Any) -> Any:
    """``records`` (``(B, ...)``) with the rows of the examples of weight 0 zeroed, so that a
    nan or inf there cannot reach the weighted sum as ``0 * nan``; integer records (lookup
    indices) are finite and stay as they are."""
    if not jnp.issubdtype(records.dtype, jnp.inexact):
        return records
    keep = (weights != 0).reshape((-1,) + (1,) * (records.ndim - 1))
    return jnp.where(keep, records, 0)


def _tied_records(found: JaxRecords, k: int) -> tuple[Any, Any, Any]:
    return found.values[k], found.shared_inputs[k], found.shared_cotangents[k]


def layerwise(call: Call, ghost_plan: JaxGhostPlan, reduction: str, args: tuple) -> list:
    """Reduction ``reduction`` (a plug-in of ``capture/jax_rules.py``) of every leaf whose
    contraction has it, from one batched pass; per-example gradients of the others."""
    return _plug_ins(records(call, ghost_plan), reduction, args)


def _plug_ins(found: JaxRecords, reduction: str, args: tuple) -> list[LeafReduction]:
    results: list[LeafReduction] = []
    for k, value in enumerate(found.values):
        site = found.sites.get(k)
        if k in found.shared:  # a tied table: its uses' per-example gradients, summed
            grads = jax_contractions.tied_per_example(found.shared[k], *_tied_records(found, k))
            results.append(LeafReduction(grads, False))
            continue
        if site is None:
            results.append(LeafReduction(found.grads[k], False))
            continue
        rule = rule_for(site)
        plug_in = rule.reduction(reduction)
        recorded = (site, value, found.inputs[k], found.cotangents[k])
        value = plug_in(*recorded, *args) if plug_in is not None else None
        if value is None or isinstance(value, Formed):
            grads = rule.per_example(*recorded) if value is None else value.grads
            results.append(LeafReduction(grads, False))
        else:
            results.append(LeafReduction(value, True))
    return results
