"""The per-example quantities of one captured pass, reduced layer by layer from its records.

Each hooked layer's rule (``capture/rules.rule_for``) turns its calls' inputs and output
gradients (``torch_engine.layer_calls``) into:

- per-example squared norms of its parameters (:func:`squared_norms`). A tied parameter's adds
  each use's norms and the cross terms of every pair (``torch_tied.py``, in float64, and from
  float64 copies of the calls where some example's uses nearly cancel; a DP step's held tied
  parameter's, from its formed sum: ``torch_held_tied.py``); a generic unit's or a
  position-bias table's come from their formed per-example gradients (:func:`formed_gradients`);
- the weighted sum ``sum_i w_i g_i`` of its parameters' per-example gradients
  (:func:`weighted_sums`; for a linear layer one matrix product, the cost of its ordinary
  weight gradient). An example of weight 0 (padding, or a gradient that is not finite) has its
  output gradients zeroed and the non-finite entries of its inputs replaced by 0 first
  (:func:`weighted_calls`; ``0 * nan`` would be nan), so it adds exactly nothing;
- a registered plug-in reduction (:func:`plug_in_values`, ``rules.register_reduction``), or the
  per-example gradients where a layer lacks it.

Every function names its results as in the call's ``params`` (``torch_plan.Ownership``), and
gives the values per differentiated leaf, in the core's flat order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import (
    cost,
    torch_generic,
    torch_held_tied,
    torch_norms,
    torch_position_bias,
    torch_tied,
)
from pergrad._src.capture.quantities import Formed
from pergrad._src.capture.rules import (
    full_float32,
    in_reduction_precision,
    is_additive,
    layer_parameters,
    rule_for,
)
from pergrad._src.capture.torch_engine import LayerRecord, layer_calls
from pergrad._src.capture.torch_layers import LayerCall  # importing it registers the rules
from pergrad._src.capture.torch_plan import Ownership
from pergrad._src.capture.torch_session import CapturedPass

# [(weights (B,), indices of the leaves they weight)]: the leaves that share one weight array
WeightGroups = list[tuple[Any, list[int]]]
# clean(calls, weights) -> the calls as a weighted sum may read them (weighted_calls)
CleanFn = Callable[[list[LayerCall], torch.Tensor], list[LayerCall]]


def layer_squared_norms(module: nn.Module, calls: list[LayerCall]) -> dict[str, Any]:
    """``{parameter: (B,) squared norms}`` of one layer from its calls, by its rule: a
    ``cost.Certified`` pair where the rule computed them in a fast precision."""
    return rule_for(module).squared_norms(module, calls)


class LeafSquaredNorms(list):
    """Each leaf's ``(B,)`` squared norms, the best estimates (the list itself, what
    ``CapturedPass.squared`` holds), and ``bounds``: each leaf's ``(B,)`` bound on its
    estimate's rounding error (``cost.Certified``), None where the rule gave none (computed in
    float64, or formed as a materialised gradient is). ``all_finite``: whether every estimate
    is finite, where :func:`squared_norms` read it with its other flags (None: not read)."""

    def __init__(
        self, estimates: list[Any], bounds: list[Any], all_finite: bool | None = None
    ) -> None:
        super().__init__(estimates)
        self.bounds = bounds
        self.all_finite = all_finite


@full_float32()  # TF32 off: the certified bounds assume float32's rounding
def squared_norms(session: CapturedPass, computed: dict[str, dict[str, Any]]) -> LeafSquaredNorms:
    """Each leaf's ``(B,)`` per-example squared norms (and their rounding bounds,
    :class:`LeafSquaredNorms`): the layers' from their records (those in ``computed``, layer
    name -> its rule's norms, were reduced in their tensor hooks), the tied parameters' from
    their uses, the formed per-example gradients' (``session.unit_grads``), and zeros where no
    hook saw the parameter (a layer whose output did not reach the loss).

    What the host must know on the way (how many examples of each layer's certified norms are
    loose, ``torch_norms.deferred_tightening``; whether a tied parameter's uses cancel; whether
    every norm is finite, for ``ghost_torch``) is read in one go at the end: on an accelerator
    each read stalls the host until the device has caught up, and one a layer would cost a
    step tens of them. Only the layers with a loose example run their rule again, their fast
    results replayed (``torch_norms.replayed``) and tightened as before, the loose rows found
    on the device from the counts read; the same values, bit for bit, as with
    ``cost.DEFERRED_READS`` off (each layer reads where it runs). Whether every norm is finite
    is known from the same read unless the tied parameters' norms are computed again or a
    tightened norm could overflow (``all_finite`` None: ``ghost_torch`` reads it)."""
    # a held tied parameter whose uses did not all complete in their hooks: the rest now
    torch_held_tied.finish(session, computed)
    owners = session.owners
    rest = {
        n: m for n, m in owners.modules.items() if n not in owners.sharing and n not in computed
    }
    if not cost.DEFERRED_READS:
        layers = _layer_norms(rest, session.records, owners, layer_squared_norms)
        return _leaf_norms(session, computed, layers, _tied_squared_norms(session))
    loose: dict[str, list[Any]] = {}
    layers = _layer_norms(rest, session.records, owners, _deferred_norms(rest, loose))
    tied, tied_loose, cancelling = _tied_deferred(session)
    found = _leaf_norms(session, computed, layers, tied)
    checked = [pair for pairs in loose.values() for pair in pairs] + tied_loose
    # the one host read
    finite, keeps_finite, cancel, counts = _read_flags(all_finite(found), cancelling, checked)
    if not cancel and not any(counts):
        found.all_finite = finite
        return found
    # (some example's positions or a tied parameter's uses cancel) tighten those, no read
    start = 0
    for name, pairs in loose.items():
        layer_counts, start = counts[start : start + len(pairs)], start + len(pairs)
        if any(layer_counts):  # its fast results again, tightened
            with torch_norms.replayed(pairs, layer_counts):
                layers.update(_layer_norms({name: rest[name]}, session.records, owners))
    tied_again = cancel or any(counts[start:])
    if tied_again:
        tied = _tied_squared_norms(session, tied_loose, counts[start:], cancel)
    found = _leaf_norms(session, computed, layers, tied)
    # a norm not finite stays so (a loose one is finite; the others are as they were), unless
    # the tied norms are computed again (in float64 where their uses cancel)
    known = not tied_again and (not finite or keeps_finite)
    found.all_finite = finite if known else None
    return found


def _read_flags(
    finite: torch.Tensor, cancelling: list[torch.Tensor], checked: list[Any]
) -> tuple[bool, bool, bool, list[int]]:
    """The one host read of :func:`squared_norms`: ``(finite, keeps finite, cancel, counts)``.
    ``finite``: whether every norm is finite (from the 0-d ``finite``); ``cancel``: whether
    some tied sum's uses cancel (any of the 0-d ``cancelling``); ``counts``: for each
    certified norm of ``checked``, in its order, how many of its examples are loose
    (``torch_norms.loose_counts``), and ``keeps finite``: whether tightening them keeps every
    norm finite (True where ``checked`` is empty)."""
    pieces = [finite, *cancelling]
    order: list[int] = []
    if checked:
        counts, keeps_finite, order = torch_norms.loose_counts(checked)
        pieces += [keeps_finite, counts]
    flags = torch.cat([p.reshape(-1).to(device=finite.device, dtype=torch.int64) for p in pieces])
    read = flags.tolist()
    flag_count = 1 + len(cancelling)
    counts_read = [0] * len(checked)
    for k, count in zip(order, read[flag_count + 1 :]):
        counts_read[k] = count
    keeps = not checked or bool(read[flag_count])
    return bool(read[0]), keeps, any(read[1:flag_count]), counts_read


def all_finite(squared: list[Any]) -> torch.Tensor:
    """0-d boolean tensor on the norms' device: whether every ``(B,)`` squared norm of every
    leaf in ``squared`` is finite (three kernels, whatever the number of leaves)."""
    return torch.isfinite(torch.stack([x.detach() for x in squared])).all()


def _deferred_norms(
    modules: dict[str, nn.Module], loose: dict[str, list[Any]]
) -> Callable[[nn.Module, list[LayerCall]], dict[str, Any]]:
    """:func:`layer_squared_norms` in ``torch_norms.deferred_tightening``: each layer's
    certified norms still to check, into ``loose`` under the layer's name."""
    names = {id(module): name for name, module in modules.items()}

    def deferred(module: nn.Module, calls: list[LayerCall]) -> dict[str, Any]:
        with torch_norms.deferred_tightening() as found:
            values = layer_squared_norms(module, calls)
        if found:
            loose[names[id(module)]] = found
        return values

    return deferred


def _layer_norms(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    owners: Ownership,
    compute: Callable[[nn.Module, list[LayerCall]], dict[str, Any]] = layer_squared_norms,
) -> dict[str, Any]:
    """``{parameter name: (B,) squared norms}`` of the hooked layers ``modules``."""
    return dict(_per_layer(modules, records, compute, owners))


def _leaf_norms(
    session: CapturedPass,
    computed: dict[str, dict[str, Any]],
    layers: dict[str, Any],
    tied: dict[str, Any],
) -> LeafSquaredNorms:
    """:func:`squared_norms` from the layers' (``layers``, by parameter name, and ``computed``)
    and the tied parameters' norms: in the leaves' order, with the formed gradients' and
    zeros."""
    owners = session.owners
    squared: list[Any] = [None] * len(session.diff)
    for name, values in layers.items():
        squared[session.index_of(name)] = values
    for module_name, values in computed.items():
        layer_calls(module_name, session.records[module_name])  # raises for an unread output grad
        for name, value in owners.named(module_name, values):
            squared[session.index_of(name)] = value
    for name, values in tied.items():
        squared[session.index_of(name)] = values
    batch_size = session.batch_size
    for name, grads in session.unit_grads.items():
        squared[session.index_of(name)] = (grads**2).reshape(batch_size, -1).sum(1)
    for k, leaf in enumerate(session.diff):  # zeros for the parameters no hook saw
        if squared[k] is None:
            squared[k] = leaf.new_zeros(batch_size)
    estimates, bounds = zip(*map(cost.split, squared))
    return LeafSquaredNorms(list(estimates), list(bounds))


def _per_layer(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    compute: Callable[[nn.Module, list[LayerCall]], dict[str, torch.Tensor]],
    owners: Ownership,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(parameter name, value)`` from ``compute(layer, calls)`` for each hooked layer, over the
    differentiated parameters it owns, named as in ``params``. A tied parameter comes once for
    each layer using it."""
    for module_name, module in modules.items():
        calls = layer_calls(module_name, records[module_name])
        if not calls:  # never called, or its output did not reach the loss: zero gradients
            continue
        with torch.no_grad():
            values = compute(module, calls)
        yield from owners.named(module_name, values)


def _tied_squared_norms(
    session: CapturedPass,
    replay: list[Any] | None = None,
    loose_counts: list[int] | None = None,
    cancel: bool | None = None,
) -> dict[str, Any]:
    """Squared norms of the parameters of the layers that share one: each layer's rule gives
    its own parameters' norms, and each shared parameter's adds its uses' norms and their cross
    terms in float64 (``torch_tied.py``). Where some example's uses nearly cancel, the rules
    run again on float64 copies of the calls. Layers whose output did not reach the loss add
    nothing. ``replay``: the fast results of :func:`_tied_deferred`'s pass, taken again
    (``torch_norms.replayed``, with their ``loose_counts`` where read) instead of computed;
    ``cancel``: whether some uses cancel, where read (None: read here)."""
    calls = _sharing_calls(session)
    replaying = replay is not None
    with torch_norms.replayed(replay, loose_counts) if replaying else contextlib.nullcontext():
        result, cancelling = _tied_pass(session, calls)
    if cancel is None:
        cancel = bool(cancelling) and bool(torch.stack(cancelling).any())
    if cancel:
        wide = {owner: torch_tied.widened(owner_calls) for owner, owner_calls in calls.items()}
        result, _ = _tied_pass(session, wide)
    return result


def _tied_deferred(
    session: CapturedPass,
) -> tuple[dict[str, Any], list[Any], list[torch.Tensor]]:
    """:func:`_tied_squared_norms`' first pass, from the calls as they are, and without a host
    read: its certified norms still to check (``torch_norms.deferred_tightening``) and its 0-d
    flags of uses that cancel. Where one is loose or one flag true, :func:`_tied_squared_norms`
    computes them again."""
    if not session.owners.sharing:
        return {}, [], []
    with torch_norms.deferred_tightening() as found:
        result, cancelling = _tied_pass(session, _sharing_calls(session))
    return result, found, cancelling


def _sharing_calls(session: CapturedPass) -> dict[str, list[LayerCall]]:
    return {
        owner: layer_calls(owner, session.records[owner])
        for owner in sorted(session.owners.sharing)
    }


def _tied_pass(
    session: CapturedPass, calls: dict[str, list[LayerCall]]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """:func:`_tied_squared_norms` from the sharing layers' ``calls`` as they are, and for each
    tied sum not in float64 a 0-d flag: whether some example's uses cancel (not
    :func:`torch_tied.well_conditioned`), read by the caller."""
    owners, params, modules = session.owners, session.params, session.owners.modules
    result, cancelling = {}, []
    with torch.no_grad():
        own = {
            owner: layer_squared_norms(modules[owner], owner_calls)
            for owner, owner_calls in calls.items()
            if owner_calls
        }
        for owner, values in own.items():
            for name, value in owners.named(owner, values):
                if name not in owners.tied:
                    result[name] = value.to(params[name].dtype)
        for name, uses in owners.tied.items():
            if name in session.held:  # its norms are its formed sum's (torch_held_tied.py)
                continue
            present = [(owner, attribute) for owner, attribute in uses if owner in own]
            if present:
                terms, bounds = zip(*(cost.split(own[o][a]) for o, a in present))
                total = torch_tied.tied_squared_norms(
                    [torch_tied.Use(modules[o], a, calls[o]) for o, a in present], list(terms)
                )
                if not all(t.dtype == torch.float64 for t in terms):
                    cancelling.append(~torch_tied.well_conditioned(total, list(terms)))
                # the cross terms are float64; each use's own norm brings its bound
                own_bounds = [b for b in bounds if b is not None]
                found = cost.Certified(total, sum(own_bounds)) if own_bounds else total
                result[name] = found.to(params[name].dtype)
    return result, cancelling


def formed_gradients(session: CapturedPass) -> dict[str, torch.Tensor]:
    """Name in ``params`` -> ``(B, *shape)`` per-example gradients of the generic units'
    parameters (each unit run alone over the examples, ``torch_generic.py``) and of the
    position-bias tables (``torch_position_bias.py``)."""
    owners, batch_size = session.owners, session.batch_size
    result = {}
    for unit, module in owners.units.items():
        names = owners.unit_parameters[unit]
        unit_params = {rel: session.params[full].detach() for rel, full in names.items()}
        constants = _unit_constants(session, unit, module, set(names.values()))
        with torch_generic.running_alone(unit, module):
            grads = torch_generic.per_example(
                module, unit_params, session.unit_records[unit], batch_size, constants
            )
        result.update({names[rel]: g.detach() for rel, g in grads.items()})
    for table, weight in owners.tables.items():
        result[weight] = torch_position_bias.per_example(
            owners.model.get_submodule(table), session.bias_records[table], batch_size
        )
    return result


def _unit_constants(
    session: CapturedPass, unit: str, module: nn.Module, differentiated: set[str]
) -> dict[str, torch.Tensor]:
    """The values in ``params`` of the unit's other parameters (its layers with a rule, its
    nested units'), named relative to the unit, so that run alone it computes what the batched
    pass did; detached, so that only the unit's own parameters are differentiated. A tied
    parameter is given once, under its first name in the unit (``functional_call`` ties the
    others)."""
    constants = {}
    for rel, _ in module.named_parameters():
        name = session.owners.name_in_params(unit, rel)
        if name is not None and name not in differentiated:
            constants[rel] = session.params[name].detach()
    return constants


def _weighted_sum_of(
    weights: torch.Tensor, clean: CleanFn | None
) -> Callable[[nn.Module, list[LayerCall]], dict[str, torch.Tensor]]:
    """A layer's ``{parameter: sum_i weights[i] g_i}`` from its calls (through ``clean``
    first, :func:`weighted_calls`, for records that may hold non-finite values)."""

    def weighted_sum(module: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
        rule = rule_for(module)
        if clean is not None:
            calls = clean(calls, weights)
        if rule.weighted_sum is not None:
            return rule.weighted_sum(module, calls, weights)
        per_example = rule.per_example(module, calls)  # as small as an activation
        return {k: torch.tensordot(weights.to(g.dtype), g, dims=1) for k, g in per_example.items()}

    return weighted_sum


def weighted_calls(calls: list[LayerCall], weights: torch.Tensor) -> list[LayerCall]:
    """The calls as a rule's weighted sum may read them: in the rows of the examples of weight
    0, the output gradients zeroed and the non-finite entries of the floating inputs replaced
    by 0.

    An example of weight 0 then adds exactly nothing (finite inputs, a zero output gradient,
    and a rule's sum is linear in the output gradients), where ``0 * nan`` from a nan record
    would be nan. Inputs are touched only where axis 0 has the batch size, and only their
    non-finite entries: an example of positive weight, a mask's ``-inf`` of a real example
    and an input shared by the batch keep their values. One elementwise pass over the records.
    """
    keep = weights != 0
    return [
        LayerCall(
            tuple(_finite_in_zero_rows(x, keep) for x in call.inputs),
            _zero_rows(call.output_grad, keep),
        )
        for call in calls
    ]


def _rows(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return keep.to(like.device).reshape((-1,) + (1,) * (like.dim() - 1))


def _finite_in_zero_rows(x: Any, keep: torch.Tensor) -> Any:
    if not (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dim() > 0
        and x.shape[0] == keep.shape[0]
    ):
        return x
    return torch.where(_rows(keep, x) | torch.isfinite(x), x, 0.0)


def _zero_rows(records: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``records`` (``(B, ...)``) with the rows of the examples of weight 0 zeroed."""
    return torch.where(_rows(keep, records), records, 0.0)


def _group_names(session: CapturedPass, leaves: list[int]) -> set[str]:
    """The names in ``params`` of the leaves at positions ``leaves``."""
    return {name for name, leaf in session.params.items() if session.position[id(leaf)] in leaves}


def _accumulate(session: CapturedPass, sums: list[Any], name: str, value: torch.Tensor) -> None:
    """Put a layer's weighted sum of parameter ``name`` into ``sums``: a tied parameter's is
    the sum of its uses', added into the first (its own)."""
    k = session.index_of(name)
    tied = name in session.owners.tied and sums[k] is not None
    sums[k] = sums[k].add_(value) if tied else value


@full_float32()  # TF32 off: the certified bounds assume float32's rounding
def weighted_sums(
    session: CapturedPass, groups: WeightGroups, clean: CleanFn | None
) -> list[torch.Tensor]:
    """Each leaf's ``sum_i w_i g_i`` from the records as they are (the one-pass mode), ``w``
    its group's weights (``groups``); ``clean``: how each layer's calls are read first
    (:func:`weighted_calls`; None where every record is finite, so none needs cleaning).
    Zeros where no layer's records reached a parameter.

    Layer by layer, each layer's records are let go once its sums (one per group it holds a
    parameter of) are formed, so that the records still to be read and the sums formed so far
    are never all held at once: on the benchmark BERT (T=128, B=16) the DP step's live tensors
    peaked at 149 MiB, against 131 for the non-private step, with every record still held
    beside the sums; the records are not read again."""
    owners = session.owners
    computes = [
        (_group_names(session, leaves), _weighted_sum_of(weights.detach(), clean))
        for weights, leaves in groups
    ]
    sums: list[Any] = [None] * len(session.diff)
    for module_name, module in owners.modules.items():
        owned = [(g, compute) for g, compute in computes if owners.owns_any(module_name, module, g)]
        if not owned:
            continue
        calls = layer_calls(module_name, session.records[module_name])
        session.records[module_name] = []  # what the sums read is in ``calls`` now
        for group, compute in owned if calls else ():  # no calls: its output missed the loss
            with torch.no_grad():
                values = compute(module, calls)
            for name, value in owners.named(module_name, values):
                if name in group:
                    _accumulate(session, sums, name, value)
        del calls  # before the next layer's are read
    add_formed_sums(session, groups, sums)
    return zeros_where_unreached(sums, session.diff)


def add_layer_sums(
    session: CapturedPass,
    module_name: str,
    module: nn.Module,
    calls: list[LayerCall],
    groups: WeightGroups,
    clean: CleanFn | None,
    sums: list[Any],
) -> None:
    """Add layer ``module_name``'s weighted sums from its ``calls`` into ``sums`` (per leaf),
    for each group of ``groups`` it holds a parameter of (as :func:`weighted_sums` does for
    every layer at once): the low-memory mode's second pass, one layer at a time."""
    owners = session.owners
    for weights, leaves in groups:
        group = _group_names(session, leaves)
        if owners.owns_any(module_name, module, group):
            values = _weighted_sum_of(weights.detach(), clean)(module, calls)
            for name, value in owners.named(module_name, values):
                if name in group:
                    _accumulate(session, sums, name, value)


def add_formed_sums(session: CapturedPass, groups: WeightGroups, sums: list[Any]) -> None:
    """The weighted sums of the formed per-example gradients (generic units, position-bias
    tables, the layers held as them: ``session.held``) into ``sums``, examples of weight 0
    zeroed first."""
    formed = {**session.unit_grads, **session.held}
    for weights, leaves in groups:
        for name, grads in formed.items():
            k = session.index_of(name)
            if k not in leaves:
                continue
            grads = _zero_rows(grads, weights != 0)
            with in_reduction_precision(grads.device):  # not in autocast's bfloat16
                sums[k] = torch.tensordot(weights.detach().to(grads.dtype), grads, dims=1)


def zeros_where_unreached(sums: list[Any], diff: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weighted sums, zeros for a parameter no layer's records reached (a model's worth of
    zeros written up front would be a noticeable part of a large model's step)."""
    return [torch.zeros_like(x) if s is None else s for s, x in zip(sums, diff)]


def plug_in_values(
    session: CapturedPass, reduction: str, args: tuple[Any, ...]
) -> list[tuple[torch.Tensor, bool]]:
    """Per leaf ``(value, reduced)``: plug-in reduction ``reduction``
    (``rules.register_reduction``) of each parameter whose layer's rule has it (``reduced``
    True); otherwise its ``(B, *shape)`` per-example gradients (a layer without the plug-in:
    its rule's ``per_example``; a generic unit's parameters; a tied parameter: the sum of its
    uses' plug-in values where the plug-in is additive and every use has it, else the sum of
    their per-example gradients; zeros where no record reached it)."""
    owners = session.owners
    results: list[tuple[torch.Tensor, bool] | None] = [None] * len(session.diff)
    additive = {
        name
        for name, uses in owners.tied.items()
        if is_additive(reduction)
        and all(
            owner in owners.modules and rule_for(owners.modules[owner]).reduction(reduction)
            for owner, _ in uses
        )
    }
    tied: dict[str, torch.Tensor] = {}
    for module_name, module in owners.modules.items():
        for name, value, reduced in _layer_plug_in(
            session, module_name, module, reduction, args, additive
        ):
            if name in owners.tied:  # summed over its uses: values, or formed gradients
                tied[name] = tied[name] + value if name in tied else value
            else:
                results[session.index_of(name)] = (value, reduced)
    for name, value in tied.items():
        results[session.index_of(name)] = (value, name in additive)
    for name, value in session.unit_grads.items():
        results[session.index_of(name)] = (value, False)
    return [
        result
        if result is not None
        else (leaf.detach().new_zeros((session.batch_size, *leaf.shape)), False)
        for result, leaf in zip(results, session.diff)
    ]


def _layer_plug_in(
    session: CapturedPass,
    module_name: str,
    module: nn.Module,
    reduction: str,
    args: tuple[Any, ...],
    additive: set[str],
) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name in params, value, reduced)`` for each differentiated parameter of one layer
    (:func:`plug_in_values`); a tied parameter's value is its plug-in value where it is in
    ``additive``, else its per-example gradient. Empty where the layer has no calls."""
    owners = session.owners
    rule = rule_for(module)
    plug_in = rule.reduction(reduction)
    own = {
        p: name
        for p, _ in layer_parameters(module)
        if (name := owners.name_in_params(module_name, p)) is not None
    }
    formed_ties = set(owners.tied) - additive
    uses_formed = any(name in formed_ties for name in own.values())
    calls = layer_calls(module_name, session.records[module_name])
    if not calls:  # never called, or its output did not reach the loss: zeros
        return []
    with torch.no_grad():
        values = plug_in(module, calls, *args) if plug_in is not None else {}
        grads = {k: v.grads for k, v in values.items() if isinstance(v, Formed)}
        values = {k: v for k, v in values.items() if not isinstance(v, Formed)}
        missing = uses_formed or any(p not in values and p not in grads for p in own)
        if missing:
            grads = {**rule.per_example(module, calls), **grads}
    found = []
    for param_name, name in own.items():
        if name in owners.tied:
            value = values[param_name] if name in additive else grads[param_name]
            found.append((name, value, name in additive))
        elif param_name in values:
            found.append((name, values[param_name], True))
        else:
            found.append((name, grads[param_name], False))
    return found
