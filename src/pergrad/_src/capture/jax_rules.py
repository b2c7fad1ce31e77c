"""The registry of JAX contraction rules: how the JAX capture engine's records are reduced.

The JAX engine (``jax_engine.py``) finds, for each differentiated leaf, the one contraction it
enters (a :class:`~pergrad._src.capture.jax_engine.Site`: ``"dense"`` for ``dot_general``,
``"conv"`` for ``conv_general_dilated``, ``"embedding"`` for a row-lookup ``gather``), and its
batched pass records that contraction's other operand (the layer input, ``(B, ...)``) and its
output cotangent (``(B, ...)``). A rule turns those records into per-example quantities of the
leaf, one small function per kind (``jax_contractions.py``), as the PyTorch layer rules of
``rules.py`` do for a layer family.

Every kind has three built-in reductions: the two the ghost strategy needs (``squared_norms``,
``weighted_sum``) and the per-example gradients themselves (``per_example``: what a caller
falls back to where a kind lacks a plug-in). A new per-example quantity (a per-layer Kronecker projection of the
gradient, for attribution) is a plug-in: :func:`register_reduction` teaches it to a kind from
its own module, and a caller asks ``rule_for(site).reduction(name)``; neither the engine nor
the built-in rules change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# squared_norms(site, param, inputs, cotangents) -> (B,) the leaf's per-example squared norms.
SquaredNormsFn = Callable[[Any, Any, Any, Any], Any]
# per_example(site, param, inputs, cotangents) -> (B, *param.shape) the per-example gradients.
PerExampleFn = Callable[[Any, Any, Any, Any], Any]
# weighted_sum(site, param, inputs, cotangents, weights) -> sum_i w_i g_i, shaped like param.
WeightedSumFn = Callable[[Any, Any, Any, Any, Any], Any]
# A plug-in: (site, param, inputs, cotangents, *its own arguments) -> (B, ...) per example.
ReductionFn = Callable[..., Any]

BUILT_IN = ("squared_norms", "per_example", "weighted_sum")


@dataclass(frozen=True)
class ContractionRule:
    """How the records of one kind of contraction are reduced.

    Attributes:
      kind: ``"dense"``, ``"conv"`` or ``"embedding"`` (``Site.kind``).
      squared_norms: ``(site, param, inputs, cotangents) -> (B,)``, where ``param`` is the
        leaf's value, ``inputs`` the site's other operand per example and ``cotangents`` the
        contraction's output cotangent per example.
      per_example: ``(site, param, inputs, cotangents) -> (B, *param.shape)``.
      weighted_sum: ``(site, param, inputs, cotangents, weights) -> sum_i w_i g_i``.
      plugins: reductions added with :func:`register_reduction`, by name.
    """

    kind: str
    squared_norms: SquaredNormsFn
    per_example: PerExampleFn
    weighted_sum: WeightedSumFn
    plugins: dict[str, ReductionFn] = field(default_factory=dict, compare=False)

    def reduction(self, name: str) -> ReductionFn | None:
        """The kind's function for reduction ``name`` (a built-in or a plug-in), or None."""
        if name in BUILT_IN:
            return getattr(self, name)
        return self.plugins.get(name)


_RULES: dict[str, ContractionRule] = {}


def register(
    kind: str, per_example: PerExampleFn, weighted_sum: WeightedSumFn
) -> Callable[[SquaredNormsFn], SquaredNormsFn]:
    """Decorator: register ``squared_norms`` (with ``per_example`` and ``weighted_sum``) as the
    rule of ``kind``."""

    def decorate(squared_norms: SquaredNormsFn) -> SquaredNormsFn:
        _RULES[kind] = ContractionRule(kind, squared_norms, per_example, weighted_sum)
        return squared_norms

    return decorate


def rule_for(site: Any) -> ContractionRule:
    """The rule of ``site.kind`` (every kind the engine finds has one)."""
    return rule_for_kind(site.kind)


def rule_for_kind(kind: str) -> ContractionRule:
    """The rule registered for ``kind``; ``KeyError`` if none."""
    return _RULES[kind]


def register_reduction(reduction: str, kind: str) -> Callable[[ReductionFn], ReductionFn]:
    """Decorator: teach the contraction kind ``kind`` (``"dense"``, ``"conv"``,
    ``"embedding"``) the plug-in reduction ``reduction``,
    ``fn(site, param, inputs, cotangents, *args) -> (B, ...)``.

    Raises ``ValueError`` for an unknown kind, or a name that is one of the built-in three.
    """
    if reduction in BUILT_IN:
        raise ValueError(
            f"register_reduction: {reduction!r} is a built-in reduction of every contraction "
            f"({', '.join(BUILT_IN)}); give the plug-in a name of its own."
        )
    if kind not in _RULES:
        raise ValueError(
            f"register_reduction: no contraction kind {kind!r}; known: {sorted(_RULES)}."
        )

    def decorate(fn: ReductionFn) -> ReductionFn:
        _RULES[kind].plugins[reduction] = fn
        return fn

    return decorate
