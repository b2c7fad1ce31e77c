"""What the ``"hooks"`` strategy (``hooks_torch.py``) must watch, worked out without running
anything: for each differentiated parameter the layers that use it, whether each has a rule
that can give its per-example gradients (:func:`plan`), and whether ``params`` are the model's
own parameters (``capture/torch_own.views_of``), which the strategy's light passes run the model
on."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture.rules import rule_for
from pergrad._src.capture.torch_own import views_of
from pergrad._src.capture.torch_plan import uses_and_aliases
from pergrad._src.core.call import Spec
from pergrad._src.core.module_loss import ModuleLoss


@dataclass(frozen=True)
class HooksPlan:
    """Which layers the hooks must watch, and what they cannot cover.

    Attributes:
      owners: parameter name (as in ``params``) -> the ``(module_name, attribute)`` of every
        layer using it (two for tied weights).
      unsupported: parameter or module name -> why the hooks cannot give its gradients.
      layers: module name -> module, for every layer in ``owners`` (as planned: the call
        that planned runs them).
      parameters: the model's own parameters by name (every name, tied ones included), as
        planned.
    """

    owners: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    layers: dict[str, nn.Module] = field(default_factory=dict)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)


def plan(spec: Spec, loss: Any, params: Any) -> HooksPlan:
    """Check, without running anything, whether the hooks can give every parameter's gradient."""
    if not isinstance(loss, ModuleLoss):
        return HooksPlan(unsupported={"fn": "layer hooks need a loss made by pergrad.module_loss"})
    if spec.argnums != (0,) or not spec.single_argnum:
        return HooksPlan(unsupported={"argnums": "the hooks differentiate the parameters only"})
    if spec.has_aux:
        return HooksPlan(unsupported={"has_aux": "the hooks take a loss without aux outputs"})
    if spec.randomness == "same":
        return HooksPlan(
            unsupported={"randomness": "'same' (one draw for all examples) needs a loop"}
        )
    if not (
        isinstance(params, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items())
    ):
        return HooksPlan(unsupported={"params": "the hooks need a dict[str, Tensor] of parameters"})
    uses_of, modules, own = _ownership(loss, params)
    owners, unsupported = {}, {}
    problems: dict[str, str | None] = {}  # by layer: a weight's and a bias's rule asked once
    for name in params:
        if name not in uses_of:
            unsupported[name] = "not a parameter of the model"
            continue
        uses = uses_of[name]
        for module_name, _ in uses:
            if module_name not in problems:
                problems[module_name] = _layer_problem(modules[module_name])
            if problems[module_name] is not None:
                unsupported[module_name or name] = problems[module_name]
        owners[name] = uses
    return HooksPlan(owners, unsupported, {m: modules[m] for m in sorted(problems)}, own)


def _layer_problem(module: nn.Module) -> str | None:
    """Why the hooks cannot give a layer's per-example gradients, or None."""
    rule = rule_for(module)
    if rule is None:
        return f"no layer rule for {type(module).__name__}"
    problem = rule.problem(module)
    return None if problem is None else f"{type(module).__name__}: {problem}"


# Each loss's last ownership of its parameters, under the model's structure it was worked out
# from (see _ownership).
_OWNERSHIP: weakref.WeakKeyDictionary[ModuleLoss, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _ownership(
    loss: ModuleLoss, params: dict[str, torch.Tensor]
) -> tuple[dict[str, list[tuple[str, str]]], dict[str, nn.Module], dict[str, torch.Tensor]]:
    """The layers using each parameter, as the ghost strategy plans with (a module registered
    under two names is one layer; a rule's nested parameters, attention's out_proj, belong to
    its layer), every module by name and every parameter of the model by name.

    Working the uses out walks the model (0.2 ms a call on the bench transformer, 4% of its
    batch gradient, and "auto" plans every call): they are kept on the loss, under what they
    depend on, read afresh at each call: the parameter names asked for, every module (name,
    object, class, rule) and every parameter (name, object)."""
    model = loss.model
    modules = dict(model.named_modules(remove_duplicate=False))
    own = dict(model.named_parameters(remove_duplicate=False))
    structure = (
        tuple(params),
        tuple((name, id(m), type(m), id(rule_for(m))) for name, m in modules.items()),
        tuple((name, id(p)) for name, p in own.items()),
    )
    kept = _OWNERSHIP.get(loss)
    if kept is not None and kept[0] == structure:
        return kept[1], modules, own
    uses_of, _ = uses_and_aliases(model, params)
    _OWNERSHIP[loss] = (structure, uses_of)
    return uses_of, modules, own


def own_parameters(loss: ModuleLoss, params: dict[str, torch.Tensor]) -> bool:
    """Whether ``params`` are views of the model's own parameters (as ``loss.params()`` gives)."""
    return views_of(params, dict(loss.model.named_parameters(remove_duplicate=False)))
