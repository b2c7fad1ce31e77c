"""The registry of PyTorch layer rules: how the capture engine is taught a layer family.

A rule turns one layer's captured calls (its inputs and output gradients over one batched pass,
``LayerCall`` records) into per-example quantities of the layer's own parameters: squared
norms, per-example gradients, and sums weighted per example. One small function per family
(``torch_layers.py``), registered under the layer types it handles, as Opacus's
``grad_sample`` does; the strategies ask :func:`rule_for`, never ``isinstance``. Adding a
layer family means writing its functions in ``torch_layers.py`` and decorating them.

Reductions are plug-ins: beyond the three every family has, a new per-example quantity (a
per-layer Kronecker projection of the gradient, for attribution) is taught to a family with
:func:`register_reduction`, from its own module, without touching the engine or the rules;
a strategy asks ``rule.reduction(name)``.

Precision: the built-in reductions of a registered rule always compute in at least float32 with
autocast off (:func:`in_reduction_precision`). Under ``torch.autocast`` the records are bfloat16
or float16 while the parameters are float32; squaring a float16 activation past 256 overflows,
and autocast would run the rules' own matrix products in the low dtype too, rounding the clip
factors by ``2**-9`` (so a clipped example could exceed its bound). The results come back in
the parameter's dtype (squared norms of a float16 parameter in float32, which holds them; a
float64 computation, the tied-weight path's, stays float64).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# A rule takes the layer and its calls in one forward pass, and returns each of the layer's own
# parameters' per-example squared gradient norms: {"weight": (B,), "bias": (B,)}.
SquaredNormsFn = Callable[[Any, list[Any]], dict[str, Any]]
# The same calls -> each parameter's per-example gradients: {"weight": (B, *weight.shape), ...}.
PerExampleFn = Callable[[Any, list[Any]], dict[str, Any]]
# Why a particular layer instance cannot use its family's rule (None: it can).
ProblemFn = Callable[[Any], "str | None"]
# The same calls and (B,) weights -> each parameter's sum_i w_i g_i, shaped like the parameter.
WeightedSumFn = Callable[[Any, list[Any], Any], dict[str, Any]]
# A plug-in reduction: (layer, calls, *its own arguments) -> {param_name: per-example values}.
ReductionFn = Callable[..., dict[str, Any]]

BUILT_IN = ("squared_norms", "per_example", "weighted_sum")


@dataclass(frozen=True)
class LayerRule:
    """How the ghost strategy handles one family of layers.

    Attributes:
      name: the family, as reported by :func:`pergrad.norms.choose_strategy` (``"linear"``).
      squared_norms: ``squared_norms(layer, calls) -> {param_name: (B,)}``, ``calls`` being the
        layer's :class:`~pergrad._src.capture.torch_layers.LayerCall` records of one forward pass.
      problem: ``problem(layer) -> str | None``: why this instance is not covered (an Embedding
        with ``max_norm``, say), or None.
      per_example: ``per_example(layer, calls) -> {param_name: (B, *param_shape)}``, the
        per-example gradients themselves, for the ``"hooks"`` strategy of
        :func:`pergrad.per_example_grads`.
      weighted_sum: ``weighted_sum(layer, calls, weights) -> {param_name: sum_i w_i g_i}``
        without forming the per-example gradients, for clipped sums; None: the ``per_example``
        gradients are contracted with the weights (fine where they are as small as an
        activation).
      plugins: reductions added with :func:`register_reduction`, by name.
    """

    name: str
    squared_norms: SquaredNormsFn
    problem: ProblemFn
    per_example: PerExampleFn
    weighted_sum: WeightedSumFn | None = None
    plugins: dict[str, ReductionFn] = field(default_factory=dict, compare=False)

    def reduction(self, name: str) -> ReductionFn | None:
        """The family's function for reduction ``name`` (a built-in or a plug-in), or None."""
        if name in BUILT_IN:
            return getattr(self, name)
        return self.plugins.get(name)


# Keyed by the layer's class, or by "module.QualName" for classes of libraries pergrad does not
# import (Hugging Face's Conv1D): importing transformers to register a rule would cost seconds.
_RULES: dict[type | str, LayerRule] = {}


def _no_problem(layer: Any) -> None:
    del layer


def register(
    *layer_types: type | str,
    name: str,
    per_example: PerExampleFn,
    problem: ProblemFn = _no_problem,
    weighted_sum: WeightedSumFn | None = None,
) -> Callable[[SquaredNormsFn], SquaredNormsFn]:
    """Decorator: register ``squared_norms`` (and ``per_example``) as the rule of ``layer_types``.

    A type is a class, or the ``"module.QualName"`` of one. Types are matched exactly, not by
    subclass: a subclass may override ``forward`` and compute something the rule does not know.
    A rule written without ``weighted_sum`` gets one that contracts its ``per_example``
    gradients with the weights (fine where those are as small as an activation). All three
    run through :func:`in_reduction_precision`.
    """

    def decorate(squared_norms: SquaredNormsFn) -> SquaredNormsFn:
        summed = weighted_sum if weighted_sum is not None else _contracted(per_example)
        rule = LayerRule(
            name,
            _in_precision(squared_norms, squared=True),
            problem,
            _in_precision(per_example),
            _in_precision(summed),
        )
        for layer_type in layer_types:
            _RULES[layer_type] = rule
        return squared_norms

    return decorate


def _contracted(per_example: PerExampleFn) -> WeightedSumFn:
    def weighted_sum(layer: Any, calls: list[Any], weights: Any) -> dict[str, Any]:
        grads = per_example(layer, calls)
        return {k: _contract(weights.to(g.dtype), g) for k, g in grads.items()}

    return weighted_sum


def _contract(weights: Any, grads: Any) -> Any:
    """``sum_i w_i g_i`` for ``(B,)`` weights and ``(B, ...)`` gradients."""
    import torch

    return torch.tensordot(weights, grads, dims=1)


@contextlib.contextmanager
def in_reduction_precision(device: Any) -> Iterator[None]:
    """Autocast off on ``device`` for the arithmetic inside: pergrad's own products of
    records, norms and clip factors run in the dtype of their operands, not autocast's."""
    import torch

    device_type = torch.device(device).type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


def _widen(x: Any) -> Any:
    """float16 / bfloat16 -> float32; anything else (float32, float64, integers) as it is."""
    import torch

    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.element_size() < 4:
        return x.float()
    return x


def _in_precision(fn: Callable[..., dict[str, Any]], squared: bool = False) -> Any:
    """``fn(layer, calls, *args)`` on calls widened to float32, autocast off; each result
    in its parameter's dtype (see the module docstring)."""
    import torch

    @functools.wraps(fn)
    def run(layer: Any, calls: list[Any], *args: Any) -> dict[str, Any]:
        widened = [
            type(call)(tuple(_widen(x) for x in call.inputs), _widen(call.output_grad))
            for call in calls
        ]
        with in_reduction_precision(calls[0].output_grad.device):
            values = fn(layer, widened, *(_widen(a) for a in args))
        result = {}
        for key, value in values.items():
            param = getattr(layer, key, None)
            dtype = param.dtype if isinstance(param, torch.Tensor) else value.dtype
            if value.dtype == torch.float64 or (squared and dtype == torch.float16):
                dtype = value.dtype  # float64 asked for; float16 cannot hold squared norms
            result[key] = value.to(dtype)
        return result

    return run


def rule_for(layer: Any) -> LayerRule | None:
    """The rule registered for ``type(layer)``, or None."""
    cls = type(layer)
    rule = _RULES.get(cls)
    return rule if rule is not None else _RULES.get(f"{cls.__module__}.{cls.__qualname__}")


def register_reduction(reduction: str, family: str) -> Callable[[ReductionFn], ReductionFn]:
    """Decorator: teach the layer family ``family`` (a rule's name: ``"linear"``, ``"conv"``,
    ...) the plug-in reduction ``reduction``, ``fn(layer, calls, *args) -> {param: values}``.

    Raises ``ValueError`` for an unknown family, or a name that is one of the built-in three.
    """
    if reduction in BUILT_IN:
        raise ValueError(
            f"register_reduction: {reduction!r} is a built-in reduction of every family "
            f"({', '.join(BUILT_IN)}); give the plug-in a name of its own."
        )
    rules = {id(rule): rule for rule in _RULES.values() if rule.name == family}
    if not rules:
        known = sorted({rule.name for rule in _RULES.values()})
        raise ValueError(f"register_reduction: no layer family {family!r}; known: {known}.")

    def decorate(fn: ReductionFn) -> ReductionFn:
        for rule in rules.values():
            rule.plugins[reduction] = fn
        return fn

    return decorate
