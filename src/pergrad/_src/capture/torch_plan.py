"""The ownership planner of the PyTorch capture: which layer reduces which parameter.

Before anything runs, :func:`plan` says, for a :func:`pergrad.module_loss` and its parameter
dict, which layer owns each differentiated parameter and how it is reduced: by the layer's rule
(``capture/rules.rule_for``), by a *generic unit* run alone over the examples
(``torch_generic.py``: :data:`GENERIC`), as a position-bias table expanded to the batch
(``torch_position_bias.py``: :data:`POSITION_BIAS`), or, for a parameter several layers share
(tied weights), by each use's rule and the cross rules of ``torch_tied.py``; and which
parameters none of these can take, and why.

For one call, :func:`ownership` turns a plan's layers into the names a captured pass and its
reductions work with (:class:`Ownership`): the hooked layers, the units and the parameters each
handles, the tables, the tied parameters, and every name of a parameter in the model mapped to
its name in the parameter dict.

For ``nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))``, ``plan(loss,
loss.params()).layers`` is ``{"0": "linear", "2": "linear"}``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import cost, torch_generic, torch_position_bias, torch_tied
from pergrad._src.capture.rules import layer_parameters, parameter_owners, rule_for
from pergrad._src.core.module_loss import ModuleLoss

# The rule name of a layer without a rule, handled by torch_generic.py.
GENERIC = "generic"
# The kind of a position-bias table (T5's relative attention bias), torch_position_bias.py.
POSITION_BIAS = torch_position_bias.POSITION_BIAS


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
      structure: the :class:`Structure` the plan was worked out from: the same object for
        every call that finds the model as an earlier one did, for caches of what follows
        from it (``torch_probe``'s shapes); None for a plan that is not remembered.
    """

    layers: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    generic_size: int = 0
    tied: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    structure: Structure | None = field(default=None, compare=False, repr=False)


class Structure:
    """A model's structure as one remembered plan found it (module and parameter objects,
    their names, classes, rules, the rules' problems, parameter shapes), compared by identity:
    a cache keyed on it (holding it, so that its id is not reused) is one of that structure.
    ``routes`` memoises :func:`norm_routes` of its plan: ``(cost.settings(), routes)``."""

    def __init__(self) -> None:
        self.routes: tuple[tuple[Any, ...], dict[str, str]] | None = None


def plan(loss: ModuleLoss, params: Any) -> GhostPlan:
    """Check, without running anything, whether every parameter in ``params`` can go ghost.

    Working the plan out walks the model (0.18 ms a call on the bench transformer, and "auto"
    plans every call): a plan that covers every parameter is kept on the loss under what it
    depends on, read afresh at each call (:func:`_structure_key`, 0.03 ms there), and given
    again while that is unchanged and every object it names is alive (so that no id in it was
    reused)."""
    if not (
        isinstance(params, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items())
    ):
        return GhostPlan(
            unsupported={"params": "the ghost strategy needs a dict[str, Tensor] of parameters"}
        )
    key, objects = _structure_key(loss.model, params)
    kept = _PLANS.setdefault(loss, {})
    entry = kept.get(key)
    if entry is None or not all(ref() is not None for ref in entry.objects):
        found, formed = _worked_out(loss.model, params)
        if found.unsupported:  # (a tie may lack a cross rule registered later: not kept)
            return found
        if len(kept) >= _PLANS_KEPT:  # (the oldest dropped)
            kept.pop(next(iter(kept)))
        try:
            refs = [weakref.ref(obj) for obj in objects]
        except TypeError:  # (an object without weak references: its id could be reused)
            return found
        found = GhostPlan(found.layers, {}, found.generic_size, found.tied, Structure())
        entry = kept[key] = _KeptPlan(found, formed, refs)
    return entry.copy(params)


@dataclass(frozen=True)
class _KeptPlan:
    plan: GhostPlan
    formed: tuple[str, ...]  # the parameters generic_size counts
    objects: list[weakref.ref]  # every module, parameter and rule the key names by id

    def copy(self, params: dict[str, torch.Tensor]) -> GhostPlan:
        """The plan for a call with ``params`` (its sizes read afresh), in dicts of its own."""
        return GhostPlan(
            layers=dict(self.plan.layers),
            generic_size=sum(params[name].numel() for name in self.formed),
            tied={name: list(uses) for name, uses in self.plan.tied.items()},
            structure=self.plan.structure,
        )


# Each loss's remembered plans, by _structure_key (a few: a loop may alternate parameter sets).
_PLANS: weakref.WeakKeyDictionary[ModuleLoss, dict[Any, _KeptPlan]] = weakref.WeakKeyDictionary()
_PLANS_KEPT = 8


def _structure_key(model: nn.Module, params: dict[str, torch.Tensor]) -> tuple[Any, list[Any]]:
    """What :func:`plan` depends on, read afresh (a tenth of working the plan out), and the
    objects it names by id: the parameter names asked for; every module's name, object, class,
    rule and the rule's ``problem`` (which reads the module's state: a batch norm's
    ``training``), and whether it is a position-bias table; every parameter's name, object and
    shape. (The rules' ``route`` and the cost model read a module's attributes, its
    ``in_features``: those are taken as fixed for a module object.)"""
    modules, objects = [], []
    for name, module in model.named_modules(remove_duplicate=False):
        rule = rule_for(module)
        modules.append(
            (
                name,
                id(module),
                type(module),
                id(rule),
                None if rule is None else rule.problem(module),
                name.endswith("relative_attention_bias")
                and torch_position_bias.is_position_bias(model, name),
            )
        )
        objects.append(module)
        if rule is not None:
            objects.append(rule)
    parameters = []
    for name, param in model.named_parameters(remove_duplicate=False):
        parameters.append((name, id(param), param.shape))
        objects.append(param)
    return (tuple(params), tuple(modules), tuple(parameters)), objects


def _worked_out(model: nn.Module, params: dict[str, torch.Tensor]) -> tuple[GhostPlan, tuple]:
    """:func:`plan` worked out, and the names of the parameters its ``generic_size`` counts."""
    uses, canonical = uses_and_aliases(model, params)
    layers, unsupported, tied = {}, {}, {}
    formed = []
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
            formed.append(name)
        elif rule is None:
            unit = torch_generic.find_unit(model, module_name)
            if unit is None:
                unsupported[module_name or name] = f"no ghost rule for {type(module).__name__}"
            else:  # per-example gradients of its unit run alone (torch_generic.py)
                layers[unit] = GENERIC
                formed.append(name)
        elif problem is not None:
            unsupported[module_name] = f"{type(module).__name__}: {problem}"
        else:
            layers[module_name] = rule.name
    generic_size = sum(params[name].numel() for name in formed)
    return GhostPlan(layers, unsupported, generic_size, tied), tuple(formed)


def uses_and_aliases(
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


def norm_routes(model: nn.Module, found: GhostPlan) -> dict[str, str]:
    """:func:`norm_route` of each of the plan's layers (``StrategyChoice.norm_routes``),
    worked out once per remembered plan (:class:`Structure`) and ``cost.settings()``: a rule's
    ``route`` is taken to depend on its layer and those alone, as the built-in ones do."""
    structure = found.structure
    settings = cost.settings()
    if structure is not None and structure.routes is not None and structure.routes[0] == settings:
        return dict(structure.routes[1])
    routes = {layer: norm_route(model, layer, rule) for layer, rule in found.layers.items()}
    if structure is not None:
        structure.routes = (settings, routes)
    return dict(routes)


def norm_route(model: nn.Module, layer: str, rule: str) -> str:
    """How the ghost strategy computes the norms of ``layer``, whose plan entry is ``rule``
    (for ``StrategyChoice.norm_routes``)."""
    if rule == GENERIC:
        return "per-example gradients formed, the unit run alone on each example"
    if rule == POSITION_BIAS:
        return "per-example gradients of the table formed, its bias expanded to the batch"
    module = model.get_submodule(layer)
    return rule_for(module).route(module)


def describe_formed(layers: dict[str, str]) -> str:
    """Where a plan's ``layers`` form per-example gradients, for a message: ``"run 'embed',
    the model itself alone"``, ``"expand the bias of the position-bias table 'rel' to the
    batch"``."""
    units = [repr(n) if n else "the model itself" for n, r in layers.items() if r == GENERIC]
    tables = [repr(n) for n, r in layers.items() if r == POSITION_BIAS]
    parts = [f"run {', '.join(units)} alone"] if units else []
    if tables:
        parts.append(
            f"expand the bias of the position-bias table{'s' * (len(tables) > 1)} "
            f"{', '.join(tables)} to the batch"
        )
    return " and ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Ownership:
    """Who reduces which differentiated parameter in one call (:func:`ownership`).

    Attributes:
      model: the model the call runs.
      modules: the layers with a rule, hooked, by module name.
      units: the generic units (``torch_generic.py``), by module name.
      unit_parameters: unit name -> ``{name relative to the unit: name in params}`` of the
        parameters it handles.
      tables: position-bias table name -> the name of its weight in ``params``.
      tied: name in ``params`` -> ``(module name, attribute)`` of each layer sharing it (only
        parameters that more than one layer uses).
      canonical: every name of a differentiated parameter in the model -> its name in
        ``params``.
    """

    model: nn.Module
    modules: dict[str, nn.Module]
    units: dict[str, nn.Module]
    unit_parameters: dict[str, dict[str, str]]
    tables: dict[str, str]
    tied: dict[str, list[tuple[str, str]]]
    canonical: dict[str, str]

    @property
    def sharing(self) -> set[str]:
        """The layers that share a tied parameter."""
        return {owner for owners in self.tied.values() for owner, _ in owners}

    def name_in_params(self, module_name: str, param_name: str) -> str | None:
        """The name in ``params`` of layer ``module_name``'s parameter ``param_name`` (None:
        it is not differentiated)."""
        return self.canonical.get(full_name(module_name, param_name))

    def named(
        self, module_name: str, values: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A layer's ``{parameter: value}`` as ``(name in params, value)``, for the
        differentiated ones."""
        for param_name, value in values.items():
            name = self.name_in_params(module_name, param_name)
            if name is not None:
                yield name, value

    def owns_any(self, module_name: str, module: nn.Module, names: set[str]) -> bool:
        """Whether layer ``module_name`` holds a parameter named (in ``params``) in ``names``."""
        return any(
            self.name_in_params(module_name, name) in names for name, _ in layer_parameters(module)
        )


def ownership(
    model: nn.Module, params: dict[str, torch.Tensor], layers: dict[str, str]
) -> Ownership:
    """The :class:`Ownership` of one call, from a plan's ``layers`` (module name -> rule, as
    :func:`plan` gives) and the parameter dict the model runs with."""
    units = {name: model.get_submodule(name) for name, r in layers.items() if r == GENERIC}
    uses, canonical = uses_and_aliases(model, params)
    return Ownership(
        model=model,
        modules={
            name: model.get_submodule(name)
            for name, r in layers.items()
            if r not in (GENERIC, POSITION_BIAS)
        },
        units=units,
        unit_parameters=_unit_parameters(model, units, params),
        tables={
            name: canonical[full_name(name, "weight")]
            for name, r in layers.items()
            if r == POSITION_BIAS
        },
        tied={name: owners for name, owners in uses.items() if len(owners) > 1},
        canonical=canonical,
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


def full_name(module_name: str, param_name: str) -> str:
    """A parameter's name in the model from its layer's name and its own (``"fc.weight"``)."""
    return f"{module_name}.{param_name}" if module_name else param_name
