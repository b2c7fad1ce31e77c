"""The JAX capture engine: the loss of one example traced to a jaxpr, and each differentiated
leaf's contraction found in it.

A JAX loss is a plain function, so there are no layers to hook. :func:`plan` traces the loss of
one example and finds every parameter array that enters the computation through exactly one
contraction (``dot_general``: dense layers, attention projections, einsums;
``conv_general_dilated``: convolutions; a ``gather`` of whole rows: embedding lookups), possibly
after layout ops (``transpose``, ``reshape``, a dtype cast): its :class:`Site`; and each table
tied across uses that the ghost strategy takes (:func:`is_tied_table`), with all its sites.
:func:`evaluate` runs the jaxpr with a zero "probe" added to the output of each site and the
site's other operand (the layer input) kept, so that the gradient with respect to a probe is
the contraction's output cotangent. :func:`records` does that in one vectorised forward and
backward pass over the batch: per site, the layer input and output cotangent of every example
(the leaves with a site are not differentiated, so no ``B x P`` weight gradient is formed), and
per-example gradients of the leaves without one. The contraction rules (``jax_rules.py``,
``jax_contractions.py``) reduce those records, as the PyTorch layer rules reduce
``torch_engine``'s. Calls of ``jax.jit``-ed functions inside the loss are looked into;
everything else is evaluated as the primitive it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from pergrad._src.core.call import Call, Spec, single_example_fn
from pergrad._src.errors import Unsupported

# Ops that move a parameter's numbers around without mixing them: the gradient through them
# has the same norm, and its transpose is cheap.
_LAYOUT_OPS = frozenset({"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims"})
# Calls whose body is looked into (a jax.jit-ed function called inside the loss).
_CALL_OPS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# The layer family of each contraction: the same names as the PyTorch rules' (capture/rules.py).
_CONTRACTIONS = {"dot_general": "linear", "conv_general_dilated": "conv", "gather": "embedding"}


@dataclass(frozen=True)
class Site:
    """One contraction that a ghost parameter enters.

    Attributes:
      path: where the equation is: its index in the top-level jaxpr, then its index inside each
        called jaxpr on the way down.
      eqn: the contraction's equation.
      param_operand: 0 or 1, which operand of ``eqn`` comes from the parameter.
      chain: the layout equations between the parameter and that operand, in order.
    """

    path: tuple[int, ...]
    eqn: Any
    param_operand: int
    chain: tuple[Any, ...]

    @property
    def family(self) -> str:
        """``"linear"`` (``dot_general``), ``"conv"`` or ``"embedding"`` (a row ``gather``)."""
        return _CONTRACTIONS[self.eqn.primitive.name]


@dataclass(frozen=True)
class JaxGhostPlan:
    """Which differentiated leaves go ghost and why the others cannot.

    Attributes:
      sites: leaf index (in the core's flat order of differentiated leaves) -> its :class:`Site`.
      other: leaf index -> why that leaf needs ordinary per-example gradients.
      jaxpr: the traced loss of one example (a ``ClosedJaxpr``), its inputs the differentiated
        leaves then the example's batched leaves.
    """

    sites: dict[int, Site] = field(default_factory=dict)
    other: dict[int, str] = field(default_factory=dict)
    jaxpr: Any = None
    shared: dict[int, tuple[Site, ...]] = field(default_factory=dict)

    def all_sites(self) -> list[Site]:
        """Every site, of single-use and shared leaves alike."""
        return [*self.sites.values(), *(s for group in self.shared.values() for s in group)]

    @property
    def prefixes(self) -> frozenset[tuple[int, ...]]:
        """Paths of the call equations that hold a site, so evaluation looks inside them."""
        return frozenset(s.path[:k] for s in self.all_sites() for k in range(1, len(s.path)))


def plan(spec: Spec, call: Call) -> JaxGhostPlan:
    """Trace the loss of one example and find each differentiated leaf's contraction, if any."""
    diff = tuple(call.leaves[i][j] for i, j in call.diff_positions)
    example = tuple(
        jax.ShapeDtypeStruct(call.backend.shape(call.leaves[i][j])[1:], call.leaves[i][j].dtype)
        for i, j in call.batched_positions
    )
    closed = jax.make_jaxpr(single_example_fn(spec, call, {}))(diff, example)
    uses: dict[int, list[Site]] = {k: [] for k in range(len(diff))}
    other: dict[int, str] = {}
    tags = {var: (k, ()) for k, var in enumerate(closed.jaxpr.invars[: len(diff)])}
    _find_uses(closed.jaxpr, tags, (), uses, other)
    sites: dict[int, Site] = {}
    shared: dict[int, tuple[Site, ...]] = {}
    for k, found in uses.items():
        if k in other:
            continue
        if not found:
            other[k] = "does not enter the loss through a contraction"
        elif len(found) == 1:
            sites[k] = found[0]
        elif is_tied_table(found, diff[k]):
            shared[k] = tuple(found)
        else:
            families = ", ".join(sorted(site.family for site in found))
            other[k] = (
                f"used by {len(found)} contractions ({families}): a shared weight other than a "
                f"table read by embedding lookups and at most one dense layer"
            )
    return JaxGhostPlan(sites, other, closed, shared)


def is_tied_table(sites: Sequence[Site], leaf: Any) -> bool:
    """A table tied across uses that the ghost strategy takes: read by embedding lookups (one
    or several) and by at most one dense contraction that maps each of its rows to its own
    output column (a tied output projection, ``h @ table.T``)."""
    dense = [site for site in sites if site.family == "linear"]
    if any(site.family not in ("embedding", "linear") for site in sites) or len(dense) > 1:
        return False
    return not dense or row_axis(dense[0], jnp.shape(leaf), jnp.result_type(leaf)) is not None


def row_axis(site: Site, table_shape: tuple[int, ...], dtype: Any) -> int | None:
    """The output axis of a dense site along which the table's rows (its axis 0) come out, one
    output column per row, or None if the rows do not map to one free output axis that way
    (contracted, batched, or behind a layout op that fixes the row count, such as a reshape).

    Found by tracing the site on tables of two other row counts: the one axis whose size
    follows the row count is the rows' axis, and a dot_general whose output keeps the rows on
    a free axis computes each output column from its row alone."""
    example = site.eqn.invars[1 - site.param_operand].aval
    layer_input = jax.ShapeDtypeStruct(example.shape, example.dtype)
    shapes = []
    for rows in (table_shape[0] + 1, table_shape[0] + 2):
        table = jax.ShapeDtypeStruct((rows, *table_shape[1:]), dtype)
        try:
            out = jax.eval_shape(
                lambda x, w: contract(site, x, apply_chain(site, w)), layer_input, table
            )
        except Exception:  # noqa: BLE001 - a layout that fixes the row count
            return None
        shapes.append(out.shape)
    if len(shapes[0]) != len(shapes[1]):
        return None
    moved = [axis for axis, (a, b) in enumerate(zip(*shapes)) if a != b]
    if len(moved) != 1 or shapes[1][moved[0]] - shapes[0][moved[0]] != 1:
        return None
    return moved[0]


def _find_uses(
    jaxpr: Any,
    tags: dict[Any, tuple[int, tuple[Any, ...]]],
    path: tuple[int, ...],
    uses: dict[int, list[Site]],
    other: dict[int, str],
) -> None:
    """Follow each parameter leaf through ``jaxpr``; ``tags``: variable -> (leaf, layout chain)."""
    for index, eqn in enumerate(jaxpr.eqns):
        tagged = [(n, tags[v]) for n, v in enumerate(eqn.invars) if _is_var(v) and v in tags]
        if not tagged:
            continue
        name = eqn.primitive.name
        if name in _CALL_OPS and isinstance(eqn.params.get("jaxpr"), jax_core.ClosedJaxpr):
            inner = eqn.params["jaxpr"].jaxpr
            inner_tags = {inner.invars[n]: tag for n, tag in tagged}
            _find_uses(inner, inner_tags, (*path, index), uses, other)
        elif name in _LAYOUT_OPS and len(eqn.invars) == 1 and _keeps_values(eqn):
            leaf, chain = tagged[0][1]
            tags[eqn.outvars[0]] = (leaf, (*chain, eqn))
        elif _is_param_operand(eqn, tagged):
            operand, (leaf, chain) = tagged[0]
            uses[leaf].append(Site((*path, index), eqn, operand, chain))
        else:
            for _, (leaf, _) in tagged:
                other.setdefault(leaf, f"used by {name!r}")
    for var in jaxpr.outvars:
        if _is_var(var) and var in tags:
            other.setdefault(tags[var][0], "returned by a jitted function it is passed to")


def _keeps_values(eqn: Any) -> bool:
    """A layout op passes gradients through unchanged, except a cast to or from a non-float
    dtype (``w.astype(jnp.int8)``), whose gradient is zero."""
    if eqn.primitive.name != "convert_element_type":
        return True
    return all(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in (eqn.invars[0], eqn.outvars[0]))


def _is_param_operand(eqn: Any, tagged: list[tuple[int, Any]]) -> bool:
    name = eqn.primitive.name
    if name not in _CONTRACTIONS or len(tagged) != 1:
        return False
    operand = tagged[0][0]
    if name == "gather":  # an embedding lookup: whole rows of the table, by index
        return operand == 0 and _is_row_lookup(eqn)
    # A convolution's kernel is its second operand; a dense layer's weight may be either.
    return name == "dot_general" or operand == 1


def _is_row_lookup(eqn: Any) -> bool:
    """Whole rows of axis 0, one per id: ``table[ids]`` / ``jnp.take(table, ids, axis=0)``, or
    ``jax.vmap`` of ``table[id]`` (equinox's ``Embedding``), which clamps a start index for
    every axis of the table, all but the first covering the whole axis."""
    numbers = eqn.params["dimension_numbers"]
    table_shape = eqn.invars[0].aval.shape
    out_rank = len(eqn.outvars[0].aval.shape)
    starts = tuple(numbers.start_index_map)
    collapsed = tuple(numbers.collapsed_slice_dims)
    kept = len(table_shape) - len(collapsed)
    simple = starts == (0,) and collapsed == (0,)
    clamped = (
        set(starts) == set(range(len(table_shape)))
        and collapsed in ((), (0,))
        and eqn.params["mode"] == jax.lax.GatherScatterMode.CLIP
    )
    return (
        (simple or clamped)
        and not tuple(numbers.operand_batching_dims)
        and tuple(numbers.offset_dims) == tuple(range(out_rank - kept, out_rank))
        and tuple(eqn.params["slice_sizes"]) == (1, *table_shape[1:])
        and eqn.invars[1].aval.shape[-1:] == (len(starts),)
    )


def _is_var(atom: Any) -> bool:
    return not isinstance(atom, jax_core.Literal)


def flatten_inputs(closed: Any, diff: Sequence[Any], example: tuple[Any, ...]) -> list[Any]:
    inputs = list(diff) + list(example)
    if len(inputs) != len(closed.jaxpr.invars):
        raise Unsupported("the loss's inputs do not match its traced form")
    return inputs


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    path: tuple[int, ...],
    sites: dict[tuple[int, ...], Site],
    prefixes: frozenset[tuple[int, ...]],
    probes: dict[tuple[int, ...], Any],
    kept: dict[tuple[int, ...], Any],
) -> list[Any]:
    """``jax.core.eval_jaxpr`` that adds ``probes[path]`` to each site's output and keeps the
    site's other operand in ``kept[path]``."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, jax_core.Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for index, eqn in enumerate(jaxpr.eqns):
        here = (*path, index)
        invals = [read(v) for v in eqn.invars]
        if here in prefixes:
            inner = eqn.params["jaxpr"]
            outs = evaluate(inner.jaxpr, inner.consts, invals, here, sites, prefixes, probes, kept)
        else:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            site = sites.get(here)
            if site is not None:
                kept[here] = invals[1 - site.param_operand]
                outs = [outs[0] + probes[here]]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def apply_chain(site: Site, param: Any) -> Any:
    for eqn in site.chain:
        param = eqn.primitive.bind(param, **eqn.primitive.get_bind_params(eqn.params))
    return param


def contract(site: Site, layer_input: Any, operand: Any) -> Any:
    """The site's contraction of one example's input with the parameter operand."""
    pair = (layer_input, operand) if site.param_operand == 1 else (operand, layer_input)
    return site.eqn.primitive.bind(*pair, **site.eqn.primitive.get_bind_params(site.eqn.params))


def describe(ghost_plan: JaxGhostPlan, names: Sequence[str]) -> tuple[dict[str, str], dict]:
    """``({leaf name: "linear" | "conv" | "embedding"}, {leaf name: why not})`` for :class:`StrategyChoice`."""
    layers = {names[k]: site.family for k, site in sorted(ghost_plan.sites.items())}
    for k, group in sorted(ghost_plan.shared.items()):
        layers[names[k]] = "tied: " + " + ".join(site.family for site in group)
    other = {names[k]: why for k, why in sorted(ghost_plan.other.items())}
    return layers, other


@dataclass(frozen=True)
class JaxRecords:
    """What one batched pass recorded, by differentiated leaf (the core's flat order).

    Attributes:
      values: every differentiated leaf's value.
      sites: leaf -> its :class:`Site` (the leaves with a contraction).
      inputs: leaf -> the site's other operand, per example: ``(B, *operand_shape)``.
      cotangents: leaf -> the contraction's output cotangent, per example: ``(B, *out_shape)``.
      grads: leaf -> per-example gradients ``(B, *leaf_shape)`` of the leaves without a site.
      shared: leaf -> the sites of a tied table (``JaxGhostPlan.shared``), with
        ``shared_inputs`` and ``shared_cotangents`` in the same order.
    """

    values: tuple[Any, ...]
    sites: dict[int, Site]
    inputs: dict[int, Any]
    cotangents: dict[int, Any]
    grads: dict[int, Any]
    shared: dict[int, tuple[Site, ...]] = field(default_factory=dict)
    shared_inputs: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    shared_cotangents: dict[int, tuple[Any, ...]] = field(default_factory=dict)


def records(call: Call, ghost_plan: JaxGhostPlan) -> JaxRecords:
    """One vectorised forward and backward pass over the batch: each site's layer input and
    output cotangent per example, and the per-example gradients of the other leaves."""
    bk = call.backend
    batched = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    diff = bk.match_varying(tuple(call.leaves[i][j] for i, j in call.diff_positions), batched)
    site_leaves = sorted(ghost_plan.sites)
    other_leaves = sorted(ghost_plan.other)
    closed = ghost_plan.jaxpr
    site_paths = {site.path: site for site in ghost_plan.all_sites()}
    prefixes = ghost_plan.prefixes

    def loss_of_one(other_values: tuple[Any, ...], probes: dict, example: tuple) -> Any:
        values = list(diff)
        for k, value in zip(other_leaves, other_values):
            values[k] = value
        inputs = flatten_inputs(closed, values, example)
        kept: dict[tuple[int, ...], Any] = {}
        (loss,) = evaluate(
            closed.jaxpr, closed.consts, inputs, (), site_paths, prefixes, probes, kept
        )
        return loss, kept

    probes = {
        path: jnp.zeros(
            (call.batch_size, *site.eqn.outvars[0].aval.shape), site.eqn.outvars[0].aval.dtype
        )
        for path, site in site_paths.items()
    }
    grad_of_one = jax.grad(loss_of_one, argnums=(0, 1), has_aux=True)
    other_values = tuple(diff[k] for k in other_leaves)
    try:
        (other_grads, cotangents), inputs = jax.vmap(grad_of_one, in_axes=(None, 0, 0))(
            other_values, probes, batched
        )
    except Exception as err:  # noqa: BLE001 - any failure means "not this way"
        raise Unsupported(
            f"evaluating the traced loss failed ({type(err).__name__}: {err})"
        ) from err
    sites = {k: ghost_plan.sites[k] for k in site_leaves}
    shared = ghost_plan.shared
    return JaxRecords(
        values=tuple(diff),
        sites=sites,
        inputs={k: inputs[site.path] for k, site in sites.items()},
        cotangents={k: cotangents[site.path] for k, site in sites.items()},
        grads=dict(zip(other_leaves, other_grads)),
        shared=dict(shared),
        shared_inputs={k: tuple(inputs[s.path] for s in group) for k, group in shared.items()},
        shared_cotangents={
            k: tuple(cotangents[s.path] for s in group) for k, group in shared.items()
        },
    )
