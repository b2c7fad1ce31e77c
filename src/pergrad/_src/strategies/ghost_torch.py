"""The ghost strategy for PyTorch models wrapped by :func:`pergrad.module_loss`.

One call:

1. the model runs ONCE on the whole batch (``functional_call`` with fresh leaf tensors for the
   parameters, so the model's own tensors, ``.grad`` fields and flags are never touched), with a
   forward hook on every layer that owns a differentiated parameter; the hook keeps the layer's
   inputs and puts a tensor hook on its output;
2. each example's loss is ``loss_fn`` on its row of the output (``torch.func.vmap`` over the rows,
   the ``unsqueeze(0)`` that ``module_loss`` does), and one backward pass of their sum gives, at
   each hooked output, the per-example output gradients (examples do not mix, so row ``b`` of the
   gradient of the sum is the gradient of loss ``b``). That pass differentiates only each layer's
   smallest parameter (its bias), so the weight gradients are never computed; the first run of a
   ``module_loss`` differentiates every parameter instead, for the check below;
3. each layer's rule (``torch_layers.py``, ``torch_rules/``) turns inputs and output gradients
   into per-example squared norms of its parameters (``capture/torch_quantities.py``);
4. for a clipped sum, the same inputs and output gradients, each example's scaled by its clip
   factor ``c_i``, give ``sum_i c_i g_i`` (the rule's ``weighted_sum``: for a linear layer one
   matrix product, the cost of its ordinary weight gradient). No second backward pass (the
   "book-keeping" of Bu et al. 2023, "Differentially private optimization on large model at
   small cost"). An example of weight 0 (padding, or a gradient that is not finite) has its
   output gradients zeroed and the non-finite entries of its inputs replaced by 0 first
   (``torch_quantities.weighted_calls``; ``0 * nan`` would be nan), so it adds exactly nothing.

The low-memory mode (``strategy="ghost-lowmem"``, ``capture/torch_passes.second_pass``): step
2 holds every layer's output gradients until step 3, where a non-private backward pass frees
each layer's saved tensors as it goes; that is the one-pass mode's extra memory. Instead, each layer's tensor
hook computes its norms as soon as all its calls' output gradients are in, and drops them (a
layer sharing a tied parameter, or whose calls are not all reached, waits for the end of the
pass); the graph is retained. For the clipped sum, a second backward pass through the same graph
gives the same output gradients again (checked, per row, against summaries of the first's), and
each layer's hook turns them into its weighted sum (step 4) and drops them. The sums come from
the very gradients the norms did, so the bound holds as exactly as in one pass (a backward pass
of the clip-weighted losses would not: under autocast it rounds each example differently).
Cost: one more backward pass without weight gradients.

Tensor hooks (not ``autograd.grad`` with respect to the outputs) because they see the gradient
of the value the layer produced even when a later in-place op (``ReLU(inplace=True)``) rewrites
it. Module hooks are removed in ``finally``; tensor hooks live on this call's own tensors.

What the hooks cannot see, and how it is handled:

- a parameter no layer rule owns (an ``nn.MultiheadAttention``'s, a ViT embedding's class token
  beside its patch convolution, a learnable scale of the model itself): found before running
  (``capture/torch_plan.plan``); its module (or the rule-less block around it) is run alone
  over the examples with only such parameters differentiated (``torch_generic.py``), while the
  layers with a rule inside it stay ghost. ``strategy="auto"`` takes the chunked strategy only when these
  per-example gradients would be large, or when no layer of the model has a rule;
- a parameter shared by several layers (tied weights: GPT-2's input embedding reused as its
  output projection): its per-example gradient is the sum of each layer's, so its squared norm
  adds each layer's and twice the inner product of every pair, which a *cross rule* for the
  two layer families gives from their calls (``torch_tied.py``: the cross terms in float64,
  and where some example's uses nearly cancel, every term from float64 copies of the calls),
  and its clipped sum adds each layer's. A tie between families without a
  cross rule, or with a layer without a rule, is found before running and takes the chunked
  strategy, as above;
- where the batch is. A layer is hooked only if axis 0 of its input and output has the batch
  size, but a size is not a layout (a time-first layer with ``T == B``, a table shared by the
  batch with ``T == B`` rows), so the first run of each layout (``torch_checks.layout_key``
  and ``records_signature``: the arguments' and the records' shapes, each dimension equal to
  the batch size marked, so that one check covers every batch size and a coincidence such as
  ``T == B`` is checked again) establishes it: every hooked output gradient must
  be row-local (the backward pass of the losses weighted per example, compared row by row with
  the plain pass's: ``torch_verify.weighted_run`` runs the batch once before the plain pass
  for it and keeps only summaries of its rows, so that no backward pass retains its graph and
  nothing of the plain pass is held through the other: the first step needs no more memory
  than the others) and the first examples run alone must get their batched losses
  (``torch_checks.py``, ``torch_verify.py``). A rule reads the records only after the check
  has passed (in the low-memory mode's sums, before it: its values are used, and its errors
  raised, only after the check). A layer run alone must also reproduce its batched output
  from each example's slice of its inputs. Any failure is
  :class:`Unsupported`, and ``"auto"`` takes the chunked strategy with a warning;
- a layer called with keyword arguments, or an input changed in place after the layer read it:
  found while running, reported the same way;
- activation checkpointing with ``use_reentrant=True`` (Hugging Face's default for
  ``gradient_checkpointing_enable()``): its backward pass refuses ``torch.autograd.grad``,
  found by the first backward pass and reported the same way (``use_reentrant=False`` runs
  here: the recomputation happens outside the capture);
- a parameter used outside its layer's ``forward`` (``F.linear(x, self.fc.weight)`` in a parent):
  only partly detectable. On the first run of each layout it is caught when the batch gradient
  is larger than the per-example norms allow (``|sum_i g_i|^2 <= B sum_i |g_i|^2``), e.g. when
  the layer itself is never called; a parameter used both inside and outside its layer may go
  unnoticed, and a model whose later calls of the same shapes take another path than its first
  is not checked again.

Where each piece lives, in ``capture/``: ``torch_plan.py`` (which layer owns which parameter),
``torch_session.py`` (the forward pass and its state, ``CapturedPass``), ``torch_passes.py``
(the backward passes, in the order the checks need), ``torch_quantities.py`` (the per-layer
reductions), ``torch_verify.py`` (the first call's checks). This module is the schedule:
:func:`assess`, :func:`ghost` (the norms, and the sums in the same pass or in a second one)
and :func:`layerwise`.
"""

from __future__ import annotations

import weakref
from typing import Any

from pergrad._src.capture import (
    cost,
    torch_compiled,
    torch_held,
    torch_passes,
    torch_probe,
    torch_quantities,
    torch_users,
)
from pergrad._src.capture.torch_plan import (
    GhostPlan,
    describe_formed,
    norm_routes,
    ownership,
    plan,
)
from pergrad._src.capture.torch_quantities import weighted_calls
from pergrad._src.capture.torch_session import CapturedPass
from pergrad._src.core.call import Call, Spec
from pergrad._src.core.module_loss import ModuleLoss
from pergrad._src.strategies.protocol import (
    Assessment,
    LeafReduction,
    ReduceRequest,
    Reduction,
    StrategyChoice,
    WeightsFn,
    weight_groups,
)


def assess(request: ReduceRequest, forced: bool, name: str = "ghost") -> Assessment:
    """The registry's question for a ``module_loss``: every differentiated parameter in a layer
    with a rule (or in a unit run alone whose per-example gradients stay small under "auto")?
    ``name``: the strategy asking (``"ghost"`` or ``"ghost-lowmem"``, whose plan is the same)."""
    spec = request.spec
    if spec.argnums != (0,) or not spec.single_argnum:
        found = GhostPlan(
            unsupported={"argnums": "the ghost strategy differentiates the parameters only"}
        )
    else:
        found = plan(request.fn, request.args[0])
    layers, unsupported = dict(found.layers), dict(found.unsupported)
    if unsupported:
        listing = "; ".join(f"{layer!r}: {problem}" for layer, problem in unsupported.items())
        why = listing if forced else "layers without a ghost rule: " + listing
        return Assessment(name, False, why, StrategyChoice(name, why, None, layers, unsupported))
    generic = request.call.batch_size * found.generic_size
    limit = cost.MAX_FORMED_NUMBERS
    if forced:
        why = "requested"
    elif generic > limit:
        why = (
            f"the layers without a ghost rule would need {generic:,} per-example numbers "
            f"(more than {limit:,}) to {describe_formed(layers)}"
        )
        return Assessment(name, False, why, StrategyChoice(name, why, None, layers))
    else:
        why = "every differentiated parameter belongs to a layer with a ghost rule" + (
            f" or has its per-example gradients formed: {describe_formed(layers)} ({generic:,} "
            f"per-example numbers)"
            if generic
            else ""
        )
        if found.tied:
            ties = "; ".join(
                f"{tied!r} by layers {[owner for owner, _ in uses]}"
                for tied, uses in found.tied.items()
            )
            why += f"; tied weights, each use's norms and their cross terms: {ties}"
    routes = norm_routes(request.fn.model, found)
    compiled = torch_compiled.describe(request.fn.model, layers)
    if compiled is not None:
        why += f"; {compiled}"
    costs = None if forced or name != "ghost" else _route_costs(request, found)
    if isinstance(costs, cost.RouteCosts) and costs.materialize_is_cheaper():
        why = f"materialising the per-example gradients is cheaper: {costs.describe()}"
        choice = StrategyChoice("materialize", why, request.chunk_size, layers, norm_routes=routes)
        return Assessment(name, False, why, choice)
    if isinstance(costs, cost.RouteCosts):
        better = "hold less memory" if costs.materialize < costs.ghost else "are cheaper"
        why += f"; the ghost norms {better}: {costs.describe()}"
    elif costs:
        why += f"; {costs}"
    return Assessment(name, True, why, StrategyChoice(name, why, None, layers, norm_routes=routes))


def _route_costs(request: ReduceRequest, found: GhostPlan) -> cost.RouteCosts | str | None:
    """The cost model's estimates of the ghost norms and of materialising for this call
    (``cost.route_costs``); or why materialising is out of the question (more per-example
    numbers than ``cost.MAX_FORMED_NUMBERS``), or why there is no estimate (a rule the model
    does not know, a model that does not run on one example alone); None below
    ``cost.MIN_CHOICE_NUMBERS`` per-example numbers, where the ghost norms are kept."""
    params = request.args[0]
    num_params = sum(p.numel() for p in params.values())
    numbers = request.call.batch_size * num_params
    if numbers > cost.MAX_FORMED_NUMBERS:
        return (
            f"materialising would form {numbers:,} per-example numbers (more than "
            f"{cost.MAX_FORMED_NUMBERS:,})"
        )
    if numbers < cost.MIN_CHOICE_NUMBERS:
        return None
    held = (
        (request.clipped or request.weights_from is not None)
        and request.users is None
        and cost.HOLD_FORMED
        and cost.FAST_NORMS
    )
    holdable = _holdable(request.fn, params, found) if held else frozenset()
    works = torch_probe.layer_works(
        request.fn, found.layers, found.generic_size, request.args, holdable, found.structure
    )
    if isinstance(works, str):
        return f"no estimate of materialising's cost: {works}"
    return cost.route_costs(request.call.batch_size, num_params, works)


# The layers a DP step may hold, per loss and per (layers, differentiated parameters, the
# model's structure as its plan found it): the ownership they come from walks the model (about
# 6 ms on a 12-layer GPT-2), and "auto" asks at every step. Weakly held beside the losses, as
# torch_probe's shapes.
_HOLDABLE: weakref.WeakKeyDictionary[ModuleLoss, dict[Any, frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def _holdable(loss: ModuleLoss, params: dict[str, Any], found: GhostPlan) -> frozenset[str]:
    """``torch_held.candidate_layers`` of this call's ownership, remembered per layout and
    structure (``GhostPlan.structure``; a plan without one: worked out afresh)."""
    layers = found.layers
    if found.structure is None:
        return frozenset(torch_held.candidate_layers(ownership(loss.model, params, layers)))
    remembered = _HOLDABLE.setdefault(loss, {})
    key = (tuple(sorted(layers.items())), tuple(params), found.structure)
    if key not in remembered:
        if len(remembered) >= 16:  # (the oldest dropped, as torch_probe's)
            remembered.pop(next(iter(remembered)))
        owners = ownership(loss.model, params, layers)
        remembered[key] = frozenset(torch_held.candidate_layers(owners))
    return remembered[key]


def ghost(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    weights_from: WeightsFn | None,
    low_memory: bool = False,
    users: Any = None,
) -> Reduction:
    """Squared norms (and, with ``weights_from``, the weighted sum) by the ghost strategy;
    ``low_memory``: the ``"ghost-lowmem"`` strategy (each layer's norms in the backward pass's
    hooks, the sums from a second backward pass: ``torch_passes.second_pass``).

    ``users``: None, or a ``protocol.UserGrouping`` for user-level clipping: the squared norms are
    then those of each user's summed gradient, in the row layout of ``dp/users.user_slots``
    (``torch_users.py``), and ``weights_from`` still gives one weight per example (its user's
    clip factor)."""
    if users is not None:
        assert not low_memory  # refused by name before (dp/from_loss.py)
        found = torch_passes.capture(spec, call, loss, layers, norms=False)
        rows = torch_users.UserRows(users.user_ids, users.mask)
        found.squared = torch_users.user_squared_norms(found, rows)
        return _reduce(loss, found, weights_from, low_memory=False, always_clean=True)
    retain = low_memory and weights_from is not None
    hold = weights_from is not None and not low_memory  # (a clipped sum from the records)
    found = torch_passes.capture(
        spec, call, loss, layers, low_memory=low_memory, retain=retain, hold=hold
    )
    return _reduce(loss, found, weights_from, low_memory)


def _reduce(
    loss: ModuleLoss,
    found: CapturedPass,
    weights_from: WeightsFn | None,
    low_memory: bool,
    always_clean: bool = False,
) -> Reduction:
    """:func:`ghost`'s norms and weighted sums from a captured pass, whose runs of the batch
    and first-call checks are all done."""
    assert found.squared is not None
    # the rules' rounding bounds (torch_quantities.LeafSquaredNorms): clip weights are formed
    # from estimate + bound, an upper bound of each exact squared norm (cost.Certified)
    bounds = getattr(found.squared, "bounds", None)
    squared = list(found.squared)
    losses = found.loss_values
    if weights_from is None:
        return Reduction(squared, None, losses, bounds)
    upper = Reduction(squared, None, rounding_bounds=bounds).upper_squared_norms()
    # The clipped sum from the same inputs and output gradients, each example's scaled by its
    # weight: one weight-gradient computation, no second backward pass. A non-finite record
    # makes its example's squared norm non-finite, so when every norm is finite no record
    # needs cleaning before the weighted sums (see weighted_calls). That is read on the host
    # with the norms' other flags where they were (LeafSquaredNorms.all_finite), else here.
    # (Not so for users' norms, which leave out padding: ``always_clean``.)
    known = getattr(found.squared, "all_finite", None)
    finite = not always_clean and (
        known if known is not None else bool(torch_quantities.all_finite(squared))
    )
    clean = None if finite else weighted_calls  # (looked up here: a benchmark replaces it)
    groups = weight_groups(weights_from(upper), len(found.diff))
    if low_memory:
        sums = torch_passes.second_pass(loss, found, groups, clean)
    else:
        sums = torch_quantities.weighted_sums(found, groups, clean)
    return Reduction(squared, sums, losses, bounds)


def layerwise(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    reduction: str,
    args: tuple[Any, ...],
) -> list[LeafReduction]:
    """Plug-in reduction ``reduction`` (``capture/rules.register_reduction``) of each parameter
    whose layer's rule has it, from one captured pass; per-example gradients of the others
    (a layer without the plug-in: its rule's ``per_example``; a generic unit's parameters; a
    tied parameter: the sum of its uses' plug-in values where the plug-in is additive and
    every use has it, else the sum of their per-example gradients): see
    ``torch_quantities.plug_in_values``."""
    found = torch_passes.capture(spec, call, loss, layers, norms=False)
    return [
        LeafReduction(value, reduced)
        for value, reduced in torch_quantities.plug_in_values(found, reduction, args)
    ]
