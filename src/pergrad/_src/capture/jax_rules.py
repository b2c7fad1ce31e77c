"""The registry of JAX layer rules: how the JAX capture engine's records are reduced.

The JAX engine (``jax_engine.py``) finds, for each differentiated leaf, the one contraction it
enters (a :class:`~pergrad._src.capture.jax_engine.Site`, of the family ``"linear"`` for
``dot_general``, ``"conv"`` for ``conv_general_dilated``, ``"embedding"`` for a row-lookup
``gather``: the names of the PyTorch families, ``rules.py``), and its batched pass records that
contraction's other operand (the layer input, ``(B, ...)``) and its output cotangent
(``(B, ...)``). A rule turns those records into per-example quantities of the leaf, one small
function per family (``jax_contractions.py``), as the PyTorch layer rules do.

The registry has the PyTorch one's shape: :func:`rule_for` (of a site, as ``rules.rule_for``
of a layer), :func:`register`, ``rule.reduction(name)`` and :func:`register_reduction` (a
reduction of one family). Every family has three built-in reductions (``squared_norms``,
``weighted_sum``, ``per_example``). A per-example quantity written once for both frameworks
(``quantities.py``'s ``register_quantity``) is computed from the family's ``tokens`` /
``lookups`` records; where a leaf has none (a weight used through a reshape, a convolution),
its per-example gradient comes back :class:`~pergrad._src.capture.quantities.Formed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pergrad._src.capture.quantities import (
    BUILT_IN,
    Formed,
    find_reduction,
    of_records,
)

# squared_norms(site, param, inputs, cotangents) -> (B,) the leaf's per-example squared norms.
SquaredNormsFn = Callable[[Any, Any, Any, Any], Any]
# per_example(site, param, inputs, cotangents) -> (B, *param.shape) the per-example gradients.
PerExampleFn = Callable[[Any, Any, Any, Any], Any]
# weighted_sum(site, param, inputs, cotangents, weights) -> sum_i w_i g_i, shaped like param.
WeightedSumFn = Callable[[Any, Any, Any, Any, Any], Any]
# A plug-in: (site, param, inputs, cotangents, *its own arguments) -> (B, ...) per example.
ReductionFn = Callable[..., Any]
# The records as quantities.Tokens / Lookups, or None: (site, param, inputs, cotangents).
RecordsFn = Callable[[Any, Any, Any, Any], Any]


@dataclass(frozen=True)
class ContractionRule:
    """How the records of one family of contractions are reduced.

    Attributes:
      name: the family, ``"linear"``, ``"conv"`` or ``"embedding"`` (``Site.family``).
      squared_norms: ``(site, param, inputs, cotangents) -> (B,)``, where ``param`` is the
        leaf's value, ``inputs`` the site's other operand per example and ``cotangents`` the
        contraction's output cotangent per example.
      per_example: ``(site, param, inputs, cotangents) -> (B, *param.shape)``.
      weighted_sum: ``(site, param, inputs, cotangents, weights) -> sum_i w_i g_i``.
      tokens: ``(site, param, inputs, cotangents) -> Tokens | None``, the records of a linear
        map of the weight (``quantities.py``); None: the family has no such form.
      lookups: the same for a table read by rows, ``-> Lookups | None``.
      held: whether a clipped sum may take the family's formed per-example gradients in
        place of its records where they are no more numbers than its cotangents (dense
        contractions and convolutions: one formed gradient serves the norm and the sum,
        ``ghost_jax.py``); not a lookup, whose weighted sum scatters the cotangents and whose
        formed gradient is the size of the table.
      plugins: reductions added with :func:`register_reduction`, by name.
    """

    name: str
    squared_norms: SquaredNormsFn
    per_example: PerExampleFn
    weighted_sum: WeightedSumFn
    tokens: RecordsFn | None = None
    lookups: RecordsFn | None = None
    held: bool = False
    plugins: dict[str, ReductionFn] = field(default_factory=dict, compare=False)

    def reduction(self, name: str) -> ReductionFn | None:
        """The family's function for reduction ``name``: a built-in, a plug-in of this family,
        or a registered quantity where the family has records for it; else None."""
        return find_reduction(self, name, _of_quantity)


def _of_quantity(
    rule: ContractionRule,
    quantity: Any,
    site: Any,
    param: Any,
    inputs: Any,
    cotangents: Any,
    *args: Any,
) -> Any:
    """A registered quantity of the leaf from its records, or its per-example gradients
    :class:`Formed` where this use of it has no record the quantity takes."""
    recorded = (site, param, inputs, cotangents)
    tokens = rule.tokens(*recorded) if rule.tokens is not None else None
    lookups = rule.lookups(*recorded) if rule.lookups is not None and tokens is None else None
    value = of_records(quantity, tokens, lookups, args)
    return Formed(rule.per_example(*recorded)) if value is None else value


_RULES: dict[str, ContractionRule] = {}


def register(
    family: str,
    per_example: PerExampleFn,
    weighted_sum: WeightedSumFn,
    tokens: RecordsFn | None = None,
    lookups: RecordsFn | None = None,
    held: bool = False,
) -> Callable[[SquaredNormsFn], SquaredNormsFn]:
    """Decorator: register ``squared_norms`` (with ``per_example`` and ``weighted_sum``, and the
    records ``tokens`` / ``lookups`` if the family has them) as the rule of ``family``;
    ``held``: :attr:`ContractionRule.held`."""

    def decorate(squared_norms: SquaredNormsFn) -> SquaredNormsFn:
        _RULES[family] = ContractionRule(
            family, squared_norms, per_example, weighted_sum, tokens, lookups, held
        )
        return squared_norms

    return decorate


def rule_for(site: Any) -> ContractionRule:
    """The rule of ``site.family`` (every family the engine finds has one)."""
    return rule_for_family(site.family)


def rule_for_family(family: str) -> ContractionRule:
    """The rule registered for ``family``; ``KeyError`` if none."""
    return _RULES[family]


def register_reduction(
    reduction: str, family: str, additive: bool = False
) -> Callable[[ReductionFn], ReductionFn]:
    """Decorator: teach the layer family ``family`` (``"linear"``, ``"conv"``,
    ``"embedding"``) the plug-in reduction ``reduction``,
    ``fn(site, param, inputs, cotangents, *args) -> (B, ...)``: the signature of
    ``rules.register_reduction``. ``additive`` is accepted for the same signature; a JAX
    leaf shared by several contractions always gets its per-example gradient formed.

    Raises ``ValueError`` for an unknown family, or a name that is one of the built-in three.
    """
    del additive
    if reduction in BUILT_IN:
        raise ValueError(
            f"register_reduction: {reduction!r} is a built-in reduction of every family "
            f"({', '.join(BUILT_IN)}); give the plug-in a name of its own."
        )
    if family not in _RULES:
        raise ValueError(
            f"register_reduction: no layer family {family!r}; known: {sorted(_RULES)}."
        )

    def decorate(fn: ReductionFn) -> ReductionFn:
        _RULES[family].plugins[reduction] = fn
        return fn

    return decorate
