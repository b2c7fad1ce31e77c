"""Per-example quantities written once, for both frameworks: the framework-free half of the kernel.

Both capture engines reduce the same two kinds of record. A layer that maps each position's
input linearly (``nn.Linear``, Hugging Face's ``Conv1D``, a convolution seen through its
patches, a JAX ``x @ W``) gives :class:`Tokens`: inputs ``a`` ``(B, T, I)`` and output gradients
``d`` ``(B, T, O)``, whose per-example weight gradient is ``G_i = sum_t a_t d_t^T``. A table read
by rows (``nn.Embedding``, a JAX row ``gather``) gives :class:`Lookups`: the rows read ``(B, N)``
and their output gradients ``(B, N, D)``. Each framework's rules turn their own records into
these (``rules.py``'s ``tokens`` / ``lookups`` for PyTorch layer families, ``jax_rules.py``'s
for JAX contractions); what is computed from them is plain array algebra (``@``, ``.mT``,
``.reshape``, ``.sum``, indexing), the same on a torch tensor and a JAX array.

A new per-example quantity (a Kronecker projection of the gradient, K-FAC's factors) is
therefore one function registered once with :func:`register_quantity`: every family of either
framework that gives tokens (or lookups) computes it from them; any other parameter gets its
per-example gradient formed (:class:`Formed`), which the caller reduces its own way. Neither
engine, nor any rule, changes (``influence/kronecker.py`` and ``influence/kfac.py`` are the
models).

This module imports no framework.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The reductions every family has, computed by its rule (not plug-ins).
BUILT_IN = ("squared_norms", "per_example", "weighted_sum")
# A weight stored (in, out) (a JAX ``x @ W``, Hugging Face's ``Conv1D``), or (out, in)
# (``nn.Linear``, a convolution's weight seen as (out, in * kernel)).
LAYOUTS = ("in_out", "out_in")


@dataclass(frozen=True)
class Tokens:
    """The records of one linear map over a batch: ``G_i = sum_t a[i, t] d[i, t]^T``.

    Attributes:
      a: the inputs, ``(B, T, I)`` (a convolution's patches; every call's positions side by side).
      d: the output gradients, ``(B, T, O)``.
      key: the weight's identity, the same for every call of a tied weight (``id(weight)`` in
        PyTorch, the leaf's path in JAX).
      layout: how the weight stores ``G``: ``"in_out"`` (as ``(I, O)``) or ``"out_in"``.
      shape: the weight's shape (a convolution's is ``(O, C, *kernel)``).
    """

    a: Any
    d: Any
    key: Any
    layout: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Lookups:
    """The records of one table read by rows: ``G_i[r] = sum_{n: rows[i, n] = r} d[i, n]``.

    Attributes:
      rows: ``(B, N)`` integer rows read (a position that reads none has a zero ``d``).
      d: ``(B, N, D)`` output gradients of the rows read.
      key: the table's identity (as for :class:`Tokens`).
      shape: the table's shape ``(V, D)``.
    """

    rows: Any
    d: Any
    key: Any
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Formed:
    """A parameter's per-example gradients ``(B, *shape)``, handed back where a quantity has
    no form for its records (a bias, a grouped convolution, a weight used with a layout the
    tokens do not cover): the caller reduces them itself."""

    grads: Any


@dataclass(frozen=True)
class Quantity:
    """A per-example quantity of a layer's weight, computed from its records.

    Attributes:
      name: the name callers ask for (``layer_reductions_of(..., reduction=name)``).
      of_tokens: ``of_tokens(tokens, *args) -> (B, ...)`` for a :class:`Tokens` record.
      of_lookups: ``of_lookups(lookups, *args) -> (B, ...)`` for a :class:`Lookups` record, or
        None: tables get their per-example gradients formed.
      additive: linear in the per-example gradient and in a frame of the weight's own (the
        same for every layer using it), so a weight tied across layers gets the sum of its
        uses' values; otherwise a tied weight's per-example gradient is formed.
    """

    name: str
    of_tokens: Callable[..., Any]
    of_lookups: Callable[..., Any] | None = None
    additive: bool = False


_QUANTITIES: dict[str, Quantity] = {}


def register_quantity(
    name: str,
    of_tokens: Callable[..., Any],
    of_lookups: Callable[..., Any] | None = None,
    additive: bool = False,
) -> Quantity:
    """Register the per-example quantity ``name`` for every family, on both frameworks, that
    gives :class:`Tokens` (and, with ``of_lookups``, :class:`Lookups`). Registering a name again
    replaces it. Raises ``ValueError`` for one of the built-in reductions' names."""
    if name in BUILT_IN:
        raise ValueError(
            f"register_quantity: {name!r} is a built-in reduction of every family "
            f"({', '.join(BUILT_IN)}); give the quantity a name of its own."
        )
    quantity = Quantity(name, of_tokens, of_lookups, additive)
    _QUANTITIES[name] = quantity
    return quantity


def quantity_named(name: str) -> Quantity | None:
    """The quantity registered under ``name``, or None."""
    return _QUANTITIES.get(name)


def of_records(
    quantity: Quantity, tokens: Tokens | None, lookups: Lookups | None, args: tuple[Any, ...]
) -> Any | None:
    """``quantity`` of whichever record a layer gave, or None where it has no form for it."""
    if tokens is not None:
        return quantity.of_tokens(tokens, *args)
    if lookups is not None and quantity.of_lookups is not None:
        return quantity.of_lookups(lookups, *args)
    return None


def find_reduction(rule: Any, name: str, of_quantity: Callable[..., Any]) -> Any:
    """Reduction ``name`` of a layer rule of either framework (``rules.LayerRule``,
    ``jax_rules.ContractionRule``): a built-in, a plug-in of its family, or a registered
    quantity where the family has records for it (``of_quantity(rule, quantity, *records,
    *args)`` computes it from that framework's records); else None."""
    if name in BUILT_IN:
        return getattr(rule, name)
    if name in rule.plugins:
        return rule.plugins[name]
    quantity = quantity_named(name)
    if quantity is None or not (
        rule.tokens is not None or (rule.lookups is not None and quantity.of_lookups)
    ):
        return None
    return functools.partial(of_quantity, rule, quantity)


def _user_tokens(tokens: Tokens, users: Any) -> Any:
    return users.tokens_norms(tokens)


def _user_lookups(lookups: Lookups, users: Any) -> Any:
    return users.lookups_norms(lookups)


# User-level clipping's squared norms (each user's summed gradient, in the row of its first
# example): a user's examples play the role of one example's positions. The grouping object
# each engine passes computes them by its framework's routes (``torch_users.UserRows``,
# ``jax_users.UserGroups``); this registration makes every family with records take it.
USER_SQUARED_NORMS = register_quantity("user_squared_norms", _user_tokens, _user_lookups)
