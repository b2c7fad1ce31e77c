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
3. each layer's rule (``torch_layers.py``) turns inputs and output gradients into per-example
   squared norms of its parameters;
4. for a clipped sum, the same inputs and output gradients, each example's scaled by its clip
   factor ``c_i``, give ``sum_i c_i g_i`` (the rule's ``weighted_sum``: for a linear layer one
   matrix product, the cost of its ordinary weight gradient). No second backward pass (the
   "book-keeping" of Bu et al. 2023, "Differentially private optimization on large model at
   small cost"). An example of weight 0 (padding, or a gradient that is not finite) has its
   output gradients zeroed and the non-finite entries of its inputs replaced by 0 first
   (:func:`weighted_calls`; ``0 * nan`` would be nan), so it adds exactly nothing.

Tensor hooks (not ``autograd.grad`` with respect to the outputs) because they see the gradient
of the value the layer produced even when a later in-place op (``ReLU(inplace=True)``) rewrites
it. Module hooks are removed in ``finally``; tensor hooks live on this call's own tensors.

What the hooks cannot see, and how it is handled:

- a parameter no layer rule owns (an ``nn.MultiheadAttention``'s, a ViT embedding's class token
  beside its patch convolution, a learnable scale of the model itself): found before running
  (:func:`plan`); its module (or the rule-less block around it) is run alone over the examples
  with only such parameters differentiated (``torch_generic.py``), while the layers with a rule
  inside it stay ghost. ``strategy="auto"`` takes the chunked strategy only when these
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
  batch with ``T == B`` rows), so the first run of each layout (``torch_checks.layout_key``:
  the arguments' shapes, batch size included) establishes it: every hooked output gradient must
  be row-local (a second, weighted backward pass) and the first examples run alone must get
  their batched losses (``torch_checks.py``). A layer run alone must also reproduce its batched
  output from each example's slice of its inputs. Any failure is :class:`GhostUnsupported`, and
  ``"auto"`` takes the chunked strategy with a warning;
- a layer called with keyword arguments, or an input changed in place after the layer read it:
  found while running, reported the same way;
- a parameter used outside its layer's ``forward`` (``F.linear(x, self.fc.weight)`` in a parent):
  only partly detectable. On the first run of each layout it is caught when the batch gradient
  is larger than the per-example norms allow (``|sum_i g_i|^2 <= B sum_i |g_i|^2``), e.g. when
  the layer itself is never called; a parameter used both inside and outside its layer may go
  unnoticed, and a model whose later calls of the same shapes take another path than its first
  is not checked again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import torch_checks, torch_generic, torch_position_bias, torch_tied
from pergrad._src.capture.rules import (
    in_reduction_precision,
    is_additive,
    layer_parameters,
    parameter_owners,
    rule_for,
)
from pergrad._src.capture.torch_engine import (
    LayerRecord,
    capturing,
    layer_calls,
    model_and_loss_arguments,
    per_example_losses,
)
from pergrad._src.capture.torch_layers import LayerCall  # importing it registers the rules
from pergrad._src.core.call import Call, Spec, single_example_fn
from pergrad._src.errors import GhostUnsupported, is_pergrad_error
from pergrad._src.strategies.protocol import (
    Assessment,
    LeafReduction,
    ReduceRequest,
    Reduction,
    StrategyChoice,
    WeightsFn,
    weight_groups,
)
from pergrad._src.torch.module_loss import ModuleLoss, refuse_batch_mixing_layers

# The rule name of a layer without a rule, handled by torch_generic.py.
GENERIC = "generic"
# The kind of a position-bias table (T5's relative attention bias), torch_position_bias.py.
POSITION_BIAS = torch_position_bias.POSITION_BIAS

# Slack of the check |sum_i g_i|^2 <= B sum_i |g_i|^2 for float rounding (under autocast, for
# bfloat16 / float16 rounding: the norms come from the records, the batch gradient was rounded).
_CONSISTENCY_SLACK = {torch.float32: 1e-3, torch.float64: 1e-3}
_LOW_PRECISION_SLACK = 3e-2


@dataclass(frozen=True)
class GhostPlan:
    """Which layers own the differentiated parameters and whether each has a ghost rule.

    Attributes:
      layers: module name -> rule name (``"linear"``, ``"conv"``, ...) for the covered layers.
      unsupported: module name (or parameter name) -> why the ghost strategy cannot handle it.
      generic_size: how many numbers the parameters of ``"generic"`` layers and position-bias
        tables hold (their per-example gradients are formed: ``B x generic_size`` numbers).
      tied: parameter name (as in ``params``) -> the ``(module name, attribute)`` of each layer
        sharing it, for the covered tied parameters (``{"emb.weight": [("emb", "weight"),
        ("head", "weight")]}``).
    """

    layers: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    generic_size: int = 0
    tied: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def plan(loss: ModuleLoss, params: Any) -> GhostPlan:
    """Check, without running anything, whether every parameter in ``params`` can go ghost."""
    if not (
        isinstance(params, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items())
    ):
        return GhostPlan(
            unsupported={"params": "the ghost strategy needs a dict[str, Tensor] of parameters"}
        )
    model = loss.model
    uses, canonical = _uses_and_aliases(model, params)
    layers, unsupported, tied = {}, {}, {}
    generic_size = 0
    for name in params:
        if name not in uses:
            unsupported[name] = "not a parameter of the model"
            continue
        module_name = uses[name][0][0]  # the layer reducing it (out_proj's: its attention)
        others = [alias for alias, of in canonical.items() if of == name and alias != name]
        given = [other for other in others if other in params]
        if given:
            unsupported[name] = f"the same parameter is passed twice, as {name!r} and {given}"
            continue
        if len(uses[name]) > 1:
            problem = _tie_problem(model, name, others, uses[name])
            if problem is not None:
                unsupported[module_name] = problem
                continue
            tied[name] = uses[name]
            for owner, _ in uses[name]:
                layers[owner] = rule_for(model.get_submodule(owner)).name
            continue
        module = model.get_submodule(module_name)
        rule = rule_for(module)
        problem = rule.problem(module) if rule is not None else None
        if problem is None and torch_position_bias.is_position_bias(model, module_name):
            layers[module_name] = POSITION_BIAS  # looked up once for the whole batch
            generic_size += params[name].numel()
        elif rule is None:
            unit = torch_generic.find_unit(model, module_name)
            if unit is None:
                unsupported[module_name or name] = f"no ghost rule for {type(module).__name__}"
            else:  # per-example gradients of its unit run alone (torch_generic.py)
                layers[unit] = GENERIC
                generic_size += params[name].numel()
        elif problem is not None:
            unsupported[module_name] = f"{type(module).__name__}: {problem}"
        else:
            layers[module_name] = rule.name
    return GhostPlan(layers, unsupported, generic_size, tied)


def _uses_and_aliases(
    model: nn.Module, params: dict[str, torch.Tensor]
) -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
    """For each name in ``params`` that names a parameter of ``model``, the layers using that
    parameter, ``(module name, attribute)``; and every name of those parameters in the model
    (``"head.weight"`` for a weight tied to ``"emb.weight"``) -> its name in ``params``.

    A module registered under two names is one layer (its hooks see every call): it is listed
    once, under its first name.
    """
    by_name: dict[str, torch.Tensor] = {}
    names_of: dict[int, list[str]] = {}
    uses_of: dict[int, list[tuple[str, str]]] = {}
    seen = set()
    owners = parameter_owners(model)
    for full, param in model.named_parameters(remove_duplicate=False):
        module_name, attribute = owners[full]
        by_name[full] = param
        names_of.setdefault(id(param), []).append(full)
        layer = (id(model.get_submodule(module_name)), attribute)
        if layer not in seen:
            seen.add(layer)
            uses_of.setdefault(id(param), []).append((module_name, attribute))
    uses, canonical = {}, {}
    for name in params:
        if name in by_name:
            uses[name] = uses_of[id(by_name[name])]
            canonical.update(dict.fromkeys(names_of[id(by_name[name])], name))
    return uses, canonical


def _tie_problem(
    model: nn.Module, name: str, others: list[str], uses: list[tuple[str, str]]
) -> str | None:
    """Why the ghost strategy cannot take parameter ``name`` shared by the layers ``uses``
    (None: every layer has a rule and every pair of them a cross rule, ``torch_tied.py``)."""
    shared = f"{name!r} is shared with {others} (tied weights)"
    families = []
    for owner, attribute in uses:
        module = model.get_submodule(owner)
        rule = rule_for(module)
        if rule is None:
            return f"{shared} and layer {owner!r} ({type(module).__name__}) has no ghost rule"
        problem = rule.problem(module)
        if problem is not None:
            return f"{shared} and layer {owner!r} ({type(module).__name__}): {problem}"
        families.append((rule.name, attribute))
    pair = torch_tied.missing_cross(families)
    if pair is not None:
        return f"{shared} and pergrad has no cross rule for {pair}"
    return None


def assess(request: ReduceRequest, forced: bool) -> Assessment:
    """The registry's question for a ``module_loss``: every differentiated parameter in a layer
    with a rule (or in a unit run alone whose per-example gradients stay small under "auto")?"""
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
        return Assessment(
            "ghost", False, why, StrategyChoice("ghost", why, None, layers, unsupported)
        )
    generic = request.call.batch_size * found.generic_size
    limit = torch_generic.MAX_MATERIALIZED_NUMBERS
    if forced:
        why = "requested"
    elif generic > limit:
        why = (
            f"the layers without a ghost rule would need {generic:,} per-example numbers "
            f"(more than {limit:,}) to {_formed(layers)}"
        )
        return Assessment("ghost", False, why, StrategyChoice("ghost", why, None, layers))
    else:
        why = "every differentiated parameter belongs to a layer with a ghost rule" + (
            f" or has its per-example gradients formed: {_formed(layers)} ({generic:,} "
            f"per-example numbers)"
            if generic
            else ""
        )
        if found.tied:
            ties = "; ".join(
                f"{name!r} by layers {[owner for owner, _ in uses]}"
                for name, uses in found.tied.items()
            )
            why += f"; tied weights, each use's norms and their cross terms: {ties}"
    return Assessment("ghost", True, why, StrategyChoice("ghost", why, None, layers))


def _formed(layers: dict[str, str]) -> str:
    """Where per-example gradients are formed, for a message: ``"run 'embed', the model itself
    alone"``, ``"expand the bias of the position-bias table 'rel' to the batch"``."""
    units = [repr(n) if n else "the model itself" for n, r in layers.items() if r == GENERIC]
    tables = [repr(n) for n, r in layers.items() if r == POSITION_BIAS]
    parts = [f"run {', '.join(units)} alone"] if units else []
    if tables:
        parts.append(
            f"expand the bias of the position-bias table{'s' * (len(tables) > 1)} "
            f"{', '.join(tables)} to the batch"
        )
    return " and ".join(parts)


@dataclass
class Captured:
    """One batched pass of a ``module_loss`` under the hooks, its first-run checks done.

    Attributes:
      diff: the differentiated leaves (fresh tensors), in the core's flat order.
      params: the parameter dict the model ran with (its values are ``diff``).
      position: ``id(leaf) -> index`` in ``diff``.
      modules: the hooked layers with a rule, by module name; ``records`` their calls.
      unit_grads: full name -> ``(B, *shape)`` per-example gradients of the generic units'
        parameters.
      tied: name -> the layers sharing it; ``canonical``: every name of a parameter in the
        model -> its name in ``params``.
      squared: per leaf ``(B,)`` squared norms, or None when not asked for.
    """

    diff: list[torch.Tensor]
    params: dict[str, torch.Tensor]
    position: dict[int, int]
    modules: dict[str, nn.Module]
    records: dict[str, list[LayerRecord]]
    unit_grads: dict[str, torch.Tensor]
    tied: dict[str, list[tuple[str, str]]]
    canonical: dict[str, str]
    squared: list[Any] | None


def capture(
    spec: Spec, call: Call, loss: ModuleLoss, layers: dict[str, str], norms: bool = True
) -> Captured:
    """The model once over the batch with every layer of ``layers`` hooked (steps 1-2 of the
    module docstring), the first run of a layout checked; with ``norms`` (always on a first
    run, whose check needs them) each leaf's per-example squared norms (step 3)."""
    model = loss.model
    refuse_batch_mixing_layers(model, spec.func_name)
    batch_size = call.batch_size
    diff = [call.leaves[i][j].detach().requires_grad_(True) for i, j in call.diff_positions]
    batched = [call.leaves[i][j] for i, j in call.batched_positions]
    args = call.rebuild(diff, batched)
    params = args[0]
    inputs, targets, target_dims = model_and_loss_arguments(call, args, loss.num_inputs, batch_size)
    modules = {
        name: model.get_submodule(name)
        for name, r in layers.items()
        if r not in (GENERIC, POSITION_BIAS)
    }
    units = {name: model.get_submodule(name) for name, r in layers.items() if r == GENERIC}
    assigned = _unit_parameters(model, units, params)
    uses, canonical = _uses_and_aliases(model, params)
    # each position-bias table -> the name of its weight in params
    tables = {
        name: canonical[_full_name(name, "weight")]
        for name, r in layers.items()
        if r == POSITION_BIAS
    }
    tied = {name: owners for name, owners in uses.items() if len(owners) > 1}
    key = torch_checks.layout_key(params, [x for leaves in call.leaves[1:] for x in leaves])
    checked = key in loss.ghost_checked
    # Each generic unit's smallest parameter (and below, each layer's bias or output):
    # differentiating these reaches every output gradient at almost no cost of its own.
    unit_light = [
        min((params[full] for full in names.values()), key=lambda p: p.numel())
        for names in assigned.values()
    ] + [params[weight] for weight in tables.values()]  # a table: buckets x heads numbers
    rng = call.backend.rng_state()
    with torch.enable_grad():
        with (
            capturing(modules, batch_size) as records,
            torch_generic.capturing_units(units, batch_size) as unit_records,
            torch_position_bias.capturing(model, list(tables), batch_size) as bias_records,
        ):
            output = loss.forward(params, inputs)
        losses = per_example_losses(spec, loss, output, targets, target_dims, batch_size)
        # The first run of a layout differentiates every parameter, to check the norms against
        # the batch gradient; later ones only what reaches each layer's output, so the weight
        # gradients (a third of a training step's work) are never computed.
        light = _light_targets(modules, records, params, canonical) + unit_light
        wanted = light if checked else diff
        batch_grads = torch.autograd.grad(
            losses.sum(), wanted, allow_unused=True, retain_graph=not checked
        )
        # an overflowed pass (a skipped mixed-precision step) is checked on a later one
        captured = {**records, **unit_records, **bias_records}
        checking = not checked and torch_checks.records_finite(captured)
        if checking:
            _check_layout(spec, call, diff, losses, light, captured, rng, batch_size)
        del light, wanted, captured
        for layer_records in records.values():
            for record in layer_records:
                record.output = None  # its gradient is recorded: free the output itself
    position = {id(leaf): k for k, leaf in enumerate(diff)}
    unit_grads = _unit_grads(units, assigned, unit_records, params, canonical, batch_size)
    for table, weight in tables.items():
        unit_grads[weight] = torch_position_bias.per_example(
            model.get_submodule(table), bias_records[table], batch_size
        )
    found = Captured(diff, params, position, modules, records, unit_grads, tied, canonical, None)
    if not (norms or not checked):
        return found
    squared: list[Any] = [None] * len(diff)
    sharing = {owner for owners in tied.values() for owner, _ in owners}
    unshared = {name: module for name, module in modules.items() if name not in sharing}
    for name, values in _per_layer(unshared, records, params, _squared_norms_of, canonical):
        squared[position[id(params[name])]] = values
    for name, values in _tied_squared_norms(modules, records, params, tied, canonical).items():
        squared[position[id(params[name])]] = values
    for name, grads in unit_grads.items():
        squared[position[id(params[name])]] = (grads**2).reshape(batch_size, -1).sum(1)
    if checking:
        by_name = {name: batch_grads[position[id(leaf)]] for name, leaf in params.items()}
        for unit in units:
            owned = {
                full: unit_grads[full] for full in assigned[unit].values() if full in unit_grads
            }
            torch_generic.check_sums(unit, owned, by_name)
        for table, weight in tables.items():
            torch_generic.check_sums(table, {weight: unit_grads[weight]}, by_name)
        _check_consistency(params, position, squared, batch_grads, batch_size)
        loss.ghost_checked.add(key)
    _fill_zeros(params, position, squared, batch_size)
    del batch_grads  # P numbers no longer needed: keep the peak at one gradient's worth
    found.squared = squared
    return found


def ghost(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    weights_from: WeightsFn | None,
) -> Reduction:
    """Squared norms (and, with ``weights_from``, the weighted sum) by the ghost strategy."""
    found = capture(spec, call, loss, layers)
    squared, params, position = found.squared, found.params, found.position
    assert squared is not None
    if weights_from is None:
        return Reduction(squared, None)
    # The clipped sum from the same inputs and output gradients, each example's scaled by its
    # weight: one weight-gradient computation, no second backward pass. A non-finite record
    # makes its example's squared norm non-finite, so when every norm is finite (one host sync)
    # no record needs cleaning before the weighted sums (see weighted_calls).
    finite = bool(torch.isfinite(sum(x.detach().float() for x in squared)).all())
    sums: list[Any] = [torch.zeros_like(x) for x in found.diff]
    for weights, leaves in weight_groups(weights_from(squared), len(found.diff)):
        group = {name for name, leaf in params.items() if position[id(leaf)] in leaves}
        owners = {
            m: module
            for m, module in found.modules.items()
            if _owns_any(m, module, group, found.canonical)
        }
        computed = _per_layer(
            owners,
            found.records,
            params,
            _weighted_sum_of(weights.detach(), clean=not finite),
            found.canonical,
        )
        for name, value in computed:
            if name in group:  # a tied parameter's weighted sum: the sum of its uses'
                k = position[id(params[name])]
                sums[k] = sums[k] + value if name in found.tied else value
        for name in group & set(found.unit_grads):
            grads = _zero_rows(found.unit_grads[name], weights != 0)
            with in_reduction_precision(grads.device):  # not in autocast's bfloat16
                sums[position[id(params[name])]] = torch.tensordot(
                    weights.detach().to(grads.dtype), grads, dims=1
                )
    return Reduction(squared, sums)


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
    every use has it, else the sum of their per-example gradients)."""
    found = capture(spec, call, loss, layers, norms=False)
    params, position = found.params, found.position
    results: list[LeafReduction | None] = [None] * len(found.diff)
    additive = {
        name
        for name, uses in found.tied.items()
        if is_additive(reduction)
        and all(
            owner in found.modules and rule_for(found.modules[owner]).reduction(reduction)
            for owner, _ in uses
        )
    }
    formed_ties = set(found.tied) - additive
    tied: dict[str, torch.Tensor] = {}
    for module_name, module in found.modules.items():
        rule = rule_for(module)
        plug_in = rule.reduction(reduction)
        uses_formed = any(
            found.canonical.get(_full_name(module_name, p)) in formed_ties
            for p, _ in layer_parameters(module)
        )
        calls = layer_calls(module_name, found.records[module_name])
        if not calls:  # never called, or its output did not reach the loss: zeros below
            continue
        own = [
            p
            for p, _ in layer_parameters(module)
            if found.canonical.get(_full_name(module_name, p)) in params
        ]
        with torch.no_grad():
            values = plug_in(module, calls, *args) if plug_in is not None else {}
            missing = uses_formed or any(p not in values for p in own)
            grads = rule.per_example(module, calls) if missing else {}
        for param_name in own:
            name = found.canonical[_full_name(module_name, param_name)]
            k = position[id(params[name])]
            if name in found.tied:  # summed over its uses: values, or formed gradients
                value = values[param_name] if name in additive else grads[param_name]
                tied[name] = tied[name] + value if name in tied else value
            elif param_name in values:
                results[k] = LeafReduction(values[param_name], True)
            else:
                results[k] = LeafReduction(grads[param_name], False)
    for name, value in tied.items():
        results[position[id(params[name])]] = LeafReduction(value, name in additive)
    for name, value in found.unit_grads.items():
        results[position[id(params[name])]] = LeafReduction(value, False)
    batch_size = call.batch_size
    return [
        result
        if result is not None
        else LeafReduction(leaf.detach().new_zeros((batch_size, *leaf.shape)), False)
        for result, leaf in zip(results, found.diff)
    ]


def _check_layout(
    spec: Spec,
    call: Call,
    diff: list[torch.Tensor],
    losses: torch.Tensor,
    light: list[torch.Tensor],
    records: dict[str, list[Any]],
    rng: Any,
    batch_size: int,
) -> None:
    """The first run of a layout: every captured output gradient is row-local, and examples
    run alone get their batched loss (``torch_checks.py``)."""
    if batch_size < 2:  # one example: every row is its own
        return

    def weighted_backward(weights: torch.Tensor) -> None:
        torch.autograd.grad((losses * weights).sum(), light, allow_unused=True)

    torch_checks.check_rows(
        records, weighted_backward, torch_checks.row_weights(batch_size, losses)
    )
    if call.backend.rng_state_changed(rng):
        return  # the model draws random numbers (dropout): a run alone draws other ones
    single = single_example_fn(spec, call, {})
    batched = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    detached = tuple(x.detach() for x in diff)
    index = torch_checks.check_losses_alone(
        single, detached, batched, losses.detach(), torch_checks.LOSS_CHECKS
    )
    if index is not None:
        raise GhostUnsupported(
            f"example {index} gets another loss when run alone than in the batched pass: the "
            f"examples interact (batch statistics, a branch on the whole batch), or the "
            f"model's output does not hold the batch on axis 0"
        )


def _unit_parameters(
    model: nn.Module, units: dict[str, nn.Module], params: dict[str, torch.Tensor]
) -> dict[str, dict[str, str]]:
    """unit name -> {name relative to the unit: full name} of the parameters it handles."""
    assigned: dict[str, dict[str, str]] = {unit: {} for unit in units}
    for name in params:
        owner = name.rpartition(".")[0]
        if rule_for(model.get_submodule(owner)) is not None:
            continue
        unit = torch_generic.find_unit(model, owner)
        if unit in assigned:
            assigned[unit][_relative_name(unit, name)] = name
    return assigned


def _relative_name(module_name: str, full_name: str) -> str:
    return full_name[len(module_name) + 1 :] if module_name else full_name


def _unit_grads(
    units: dict[str, nn.Module],
    assigned: dict[str, dict[str, str]],
    unit_records: dict[str, list[Any]],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """full name -> ``(B, *shape)`` per-example gradients of the generic units' parameters."""
    result = {}
    for unit, module in units.items():
        names = assigned[unit]
        unit_params = {rel: params[full].detach() for rel, full in names.items()}
        constants = _unit_constants(unit, module, set(names.values()), params, canonical)
        try:
            grads = torch_generic.per_example(
                module, unit_params, unit_records[unit], batch_size, constants
            )
        except GhostUnsupported as err:
            raise GhostUnsupported(f"layer {unit!r} ({type(module).__name__}): {err}") from err
        except Exception as err:
            if is_pergrad_error(err):
                raise
            raise GhostUnsupported(
                f"layer {unit!r} ({type(module).__name__}) has no ghost rule and torch.func "
                f"could not vectorise it alone ({type(err).__name__}: {err})"
            ) from err
        result.update({names[rel]: g.detach() for rel, g in grads.items()})
    return result


def _unit_constants(
    unit: str,
    module: nn.Module,
    differentiated: set[str],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
) -> dict[str, torch.Tensor]:
    """The values in ``params`` of the unit's other parameters (its layers with a rule, its
    nested units'), named relative to the unit, so that run alone it computes what the batched
    pass did; detached, so that only the unit's own parameters are differentiated. A tied
    parameter is given once, under its first name in the unit (``functional_call`` ties the
    others)."""
    constants = {}
    for rel, _ in module.named_parameters():
        name = canonical.get(_full_name(unit, rel))
        if name in params and name not in differentiated:
            constants[rel] = params[name].detach()
    return constants


def _light_targets(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
) -> list[torch.Tensor]:
    """What to differentiate so that the backward pass reaches every hooked layer's output
    and computes no weight gradient: a layer's vector parameter (a bias, a norm's scale) if
    it has one; otherwise (a bias-free linear layer, an embedding: Llama's every layer, an LM
    head) its recorded outputs, as long as no in-place op has changed them since (their hooks
    would not fire), else its smallest parameter."""
    chosen: dict[int, torch.Tensor] = {}
    for module_name, module in modules.items():
        own = [
            params[name]
            for param_name, _ in layer_parameters(module)
            if (name := canonical.get(_full_name(module_name, param_name))) in params
        ]
        if not own:
            continue
        smallest = min(own, key=lambda p: p.numel())
        outputs = [r.output for r in records[module_name] if r.output is not None]
        unchanged = all(
            r.output is None or r.output._version == r.output_version for r in records[module_name]
        )
        if smallest.dim() >= 2 and outputs and unchanged:
            for output in outputs:
                chosen[id(output)] = output
        else:
            chosen[id(smallest)] = smallest
    return list(chosen.values())


def _full_name(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def _owns_any(
    module_name: str, module: nn.Module, names: set[str], canonical: dict[str, str]
) -> bool:
    return any(
        canonical.get(_full_name(module_name, name)) in names
        for name, _ in layer_parameters(module)
    )


def _squared_norms_of(module: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    return rule_for(module).squared_norms(module, calls)


def _weighted_sum_of(weights: torch.Tensor, clean: bool = True) -> Any:
    def weighted_sum(module: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
        rule = rule_for(module)
        if clean:
            calls = weighted_calls(calls, weights)
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


def _per_layer(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    params: dict[str, torch.Tensor],
    compute: Any,
    canonical: dict[str, str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(parameter name, value)`` from ``compute(layer, calls)`` for each hooked layer, over the
    differentiated parameters it owns, named as in ``params`` (``canonical``: every name of a
    parameter in the model -> that one). A tied parameter comes once for each layer using it."""
    for module_name, module in modules.items():
        calls = layer_calls(module_name, records[module_name])
        if not calls:  # never called, or its output did not reach the loss: zero gradients
            continue
        with torch.no_grad():
            values = compute(module, calls)
        for param_name, value in values.items():
            name = canonical.get(_full_name(module_name, param_name))
            if name in params:
                yield name, value


def _tied_squared_norms(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    params: dict[str, torch.Tensor],
    tied: dict[str, list[tuple[str, str]]],
    canonical: dict[str, str],
) -> dict[str, torch.Tensor]:
    """Squared norms of the parameters of the layers that share one (``tied``: name ->
    ``(module name, attribute)`` of each use): each layer's rule gives its own parameters'
    norms, and each shared parameter's adds its uses' norms and their cross terms in float64
    (``torch_tied.py``). Where some example's uses nearly cancel, the rules run again on float64
    copies of the calls. Layers whose output did not reach the loss add nothing."""
    sharing = sorted({owner for owners in tied.values() for owner, _ in owners})
    calls = {owner: layer_calls(owner, records[owner]) for owner in sharing}
    result, exact_enough = _tied_pass(modules, calls, params, tied, canonical)
    if not exact_enough:
        wide = {owner: torch_tied.widened(owner_calls) for owner, owner_calls in calls.items()}
        result, _ = _tied_pass(modules, wide, params, tied, canonical)
    return result


def _tied_pass(
    modules: dict[str, nn.Module],
    calls: dict[str, list[LayerCall]],
    params: dict[str, torch.Tensor],
    tied: dict[str, list[tuple[str, str]]],
    canonical: dict[str, str],
) -> tuple[dict[str, torch.Tensor], bool]:
    """:func:`_tied_squared_norms` from the sharing layers' ``calls`` as they are, and whether
    every tied sum is :func:`torch_tied.well_conditioned` (always, for float64 calls)."""
    result, exact_enough = {}, True
    with torch.no_grad():
        own = {
            owner: rule_for(modules[owner]).squared_norms(modules[owner], owner_calls)
            for owner, owner_calls in calls.items()
            if owner_calls
        }
        for owner, values in own.items():
            for param_name, value in values.items():
                name = canonical.get(_full_name(owner, param_name))
                if name in params and name not in tied:
                    result[name] = value.to(params[name].dtype)
        for name, owners in tied.items():
            present = [(owner, attribute) for owner, attribute in owners if owner in own]
            if present:
                terms = [own[o][a] for o, a in present]
                total = torch_tied.tied_squared_norms(
                    [torch_tied.Use(modules[o], a, calls[o]) for o, a in present], terms
                )
                wide = all(t.dtype == torch.float64 for t in terms)
                exact_enough &= wide or torch_tied.well_conditioned(total, terms)
                result[name] = total.to(params[name].dtype)
    return result, exact_enough


def _fill_zeros(
    params: dict[str, torch.Tensor], position: dict[int, int], squared: list[Any], batch_size: int
) -> None:
    """Zero norms for the parameters no hook saw (layers whose output did not reach the loss)."""
    for leaf in params.values():
        if squared[position[id(leaf)]] is None:
            squared[position[id(leaf)]] = leaf.new_zeros(batch_size)


def _check_consistency(
    params: dict[str, torch.Tensor],
    position: dict[int, int],
    squared: list[Any],
    batch_grads: tuple[Any, ...],
    batch_size: int,
) -> None:
    """Refuse norms the batch gradient contradicts.

    For any per-example gradients, ``|sum_i g_i|^2 <= B sum_i |g_i|^2``. If the batch gradient
    breaks it, some use of the parameter escaped the layer hooks.
    """
    _fill_zeros(params, position, squared, batch_size)
    checked = [(k, g) for k, g in enumerate(batch_grads) if g is not None]
    if not checked:
        return
    batch_sq = torch.stack([torch.linalg.vector_norm(g.detach()) ** 2 for _, g in checked])
    bound = batch_size * torch.stack([squared[k].sum() for k, _ in checked])
    slack = _CONSISTENCY_SLACK.get(torch_checks.checked_dtype(batch_sq), _LOW_PRECISION_SLACK)
    escaped = (batch_sq > bound * (1 + slack) + 1e-30).nonzero().flatten().tolist()
    if escaped:
        names = {position[id(leaf)]: name for name, leaf in params.items()}
        raise GhostUnsupported(
            f"parameter {names[checked[escaped[0]][0]]!r} has a batch gradient larger than its "
            f"per-example norms allow: it is used outside the forward pass of the layer that "
            f"owns it"
        )
