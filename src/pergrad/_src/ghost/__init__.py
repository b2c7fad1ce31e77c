"""Per-example gradient norms and clipped sums without materialising per-example gradients.

Storing ``B x P`` per-example gradients is what makes DP-SGD and gradient-norm diagnostics
expensive, yet most users need only each example's norm, or the sum of the clipped gradients.
This package computes those directly, with one of three strategies (``api.py`` chooses):

- ``"materialize"``: :func:`pergrad.per_example_grads`, then reduce. The reference.
- ``"chunked"`` (``strategies.py``, any backend): per-example gradients of a few examples at a
  time, reduced to squared norms at once; the clipped sum is then ONE batch gradient of the
  weighted loss ``sum_i c_i * loss_i`` (Lee & Kifer 2021), so only ``chunk_size x P`` numbers
  are ever live.
- ``"ghost"`` (``torch_ghost.py``, PyTorch models through :func:`pergrad.module_loss`): one
  forward pass over the whole batch with hooks that keep each layer's input and output gradient;
  each layer's per-example norms then follow from those (the "ghost norm" of Goodfellow 2015 and
  Li et al. 2021) without forming the gradients; the clipped sum from the same records, each
  example's output gradient scaled by its clip factor (no second backward pass).
- ``"ghost"`` (``jax_ghost.py``, any JAX loss): the loss of one example is traced to a jaxpr;
  parameters that enter through one contraction (dense, convolution, embedding lookup) get
  their norms from the contraction's input and output cotangent, and their clipped sum from one
  transpose of the contraction over the batch.

This module holds the registry of PyTorch layer rules for the ghost strategy: one small function per
layer family (``torch_layers.py``), registered under the layer types it handles, as Opacus's
``grad_sample`` does. Adding a layer family means writing one function and decorating it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class LayerRule:
    """How the ghost strategy handles one family of layers.

    Attributes:
      name: the family, as reported by :func:`pergrad.norms.choose_strategy` (``"linear"``).
      squared_norms: ``squared_norms(layer, calls) -> {param_name: (B,)}``, ``calls`` being the
        layer's :class:`~pergrad._src.ghost.torch_layers.LayerCall` records of one forward pass.
      problem: ``problem(layer) -> str | None``: why this instance is not covered (an Embedding
        with ``max_norm``, say), or None.
      per_example: ``per_example(layer, calls) -> {param_name: (B, *param_shape)}``, the
        per-example gradients themselves, for the ``"hooks"`` strategy of
        :func:`pergrad.per_example_grads`.
      weighted_sum: ``weighted_sum(layer, calls, weights) -> {param_name: sum_i w_i g_i}``
        without forming the per-example gradients, for clipped sums; None: the ``per_example``
        gradients are contracted with the weights (fine where they are as small as an
        activation).
    """

    name: str
    squared_norms: SquaredNormsFn
    problem: ProblemFn
    per_example: PerExampleFn
    weighted_sum: WeightedSumFn | None = None


# Keyed by the layer's class, or by "module.QualName" for classes of libraries pergrad does not
# import (Hugging Face's Conv1D): importing transformers to register a rule would cost seconds.
_RULES: dict[type | str, LayerRule] = {}


class GhostUnsupported(Exception):
    """This call cannot take the ghost strategy (of either framework); the message says why."""


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
    """

    def decorate(squared_norms: SquaredNormsFn) -> SquaredNormsFn:
        rule = LayerRule(name, squared_norms, problem, per_example, weighted_sum)
        for layer_type in layer_types:
            _RULES[layer_type] = rule
        return squared_norms

    return decorate


def rule_for(layer: Any) -> LayerRule | None:
    """The rule registered for ``type(layer)``, or None."""
    cls = type(layer)
    rule = _RULES.get(cls)
    return rule if rule is not None else _RULES.get(f"{cls.__module__}.{cls.__qualname__}")
