"""The ghost strategy for JAX: per-example norms from each contraction's input and cotangent.

A JAX loss is a plain function, so there are no layers to hook. Instead the loss of one example
is traced to a jaxpr (:func:`plan`), and every parameter array that enters the computation
through exactly one contraction (``dot_general``: dense layers, attention projections, einsums;
``conv_general_dilated``: convolutions; a ``gather`` of whole rows: embedding lookups), possibly
after layout ops (``transpose``, ``reshape``, a dtype cast), is a *ghost parameter*. Then (:func:`ghost`), in one vectorised forward and
backward pass over the batch:

1. the jaxpr is evaluated with a zero "probe" added to the output of each ghost contraction and
   the contraction's other operand (the layer input ``a``) kept;
2. the per-example gradient with respect to each probe is the output cotangent ``dz`` of that
   contraction for that example; the ghost parameters themselves are not differentiated, so no
   ``B x P`` weight gradient is formed;
3. each ghost parameter's per-example squared norm follows from ``a`` and ``dz``: for a dense
   layer on one vector, ``|a|^2 |dz|^2`` (Goodfellow 2015); on a sequence, ``<a a^T, dz dz^T>``
   (the "ghost norm" of Li et al. 2021) or the formed ``a^T dz``, whichever costs less; for an
   embedding, ``sum_{t,s} [id_t = id_s] dz_t . dz_s``; for other contractions (convolutions,
   batched einsums), the contraction's own transpose applied to one example at a time (a
   kernel-sized gradient per example, not a model-sized one);
4. the weighted sum ``sum_i w_i g_i`` that a clipped sum needs is the same transpose applied
   once to the whole batch with cotangents ``w_i dz_i``: no second backward pass.

Parameters used any other way (biases, norm scales, a weight shared by two layers such as tied
embeddings, anything inside ``scan`` / ``cond`` / a ``custom_jvp``) get ordinary per-example
gradients in the same pass; ``strategy="auto"`` takes the ghost strategy
only when those stay small (:data:`MAX_MATERIALIZED_NUMBERS`).

Calls of ``jax.jit``-ed functions inside the loss are looked into; everything else is evaluated
as the primitive it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from pergrad._src.core.call import Call, Spec, single_example_fn
from pergrad._src.errors import GhostUnsupported, PergradValueError
from pergrad._src.strategies.chunked import Reduction, WeightsFn
from pergrad._src.strategies.protocol import Assessment, ReduceRequest, StrategyChoice

# Ops that move a parameter's numbers around without mixing them: the gradient through them
# has the same norm, and its transpose is cheap.
_LAYOUT_OPS = frozenset({"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims"})
# Calls whose body is looked into (a jax.jit-ed function called inside the loss).
_CALL_OPS = frozenset({"jit", "pjit", "closed_call", "core_call"})
_CONTRACTIONS = {"dot_general": "dense", "conv_general_dilated": "conv", "gather": "embedding"}

# "auto" takes the ghost strategy only if the parameters it cannot cover would not need more
# than this many per-example gradient numbers (B x their size); 128 MB in float32.
MAX_MATERIALIZED_NUMBERS = 2**25


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
    def kind(self) -> str:
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

    @property
    def prefixes(self) -> frozenset[tuple[int, ...]]:
        """Paths of the call equations that hold a site, so evaluation looks inside them."""
        return frozenset(s.path[:k] for s in self.sites.values() for k in range(1, len(s.path)))


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
    for k, found in uses.items():
        if k in other:
            continue
        if not found:
            other[k] = "does not enter the loss through a contraction"
        elif len(found) > 1:
            other[k] = f"used by {len(found)} contractions (a shared weight)"
        else:
            sites[k] = found[0]
    return JaxGhostPlan(sites, other, closed)


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


_EXACT = jax.lax.Precision.HIGHEST  # no TF32 / bfloat16 passes for the norms on a GPU or TPU


def _wide(x: Any) -> Any:
    """``x`` in at least float32 (integers and float16/bfloat16 included): squares and Gram
    matrices of activations overflow float16 and wrap in integer dtypes."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


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


def materialized_numbers(ghost_plan: JaxGhostPlan, call: Call) -> int:
    """How many per-example gradient numbers the leaves without a site need: ``B x size``."""
    leaves = [call.leaves[i][j] for i, j in call.diff_positions]
    size = sum(math.prod(call.backend.shape(leaves[k])) for k in ghost_plan.other)
    return call.batch_size * size


def assess(request: ReduceRequest, forced: bool) -> Assessment:
    """The registry's question for a JAX loss: does any parameter enter through a contraction,
    and (under "auto") do the per-example gradients of the others stay small?"""
    spec, call = request.spec, request.call
    found = plan(spec, call)
    layers, materialized = describe(found, _leaf_names(spec, call, request.args))
    numbers = materialized_numbers(found, call)
    if forced:
        if not found.sites:
            raise PergradValueError(
                f"{spec.func_name}: strategy='ghost' found no parameter that enters the loss "
                f"through a contraction (a dense layer, a convolution or an embedding lookup), "
                f"so there is nothing to compute without per-example gradients "
                f"({_listing(materialized)}). Use strategy='chunked', or 'auto', which picks it "
                f"for such losses."
            )
        choice = StrategyChoice("ghost", "requested", None, layers, materialized, found)
        return Assessment("ghost", True, "requested", choice)
    if found.sites and numbers <= MAX_MATERIALIZED_NUMBERS:
        why = (
            "every differentiated parameter enters the loss through a contraction"
            if not materialized
            else f"the parameters outside contractions need only {numbers:,} per-example numbers"
        )
        return Assessment(
            "ghost", True, why, StrategyChoice("ghost", why, None, layers, materialized, found)
        )
    why = (
        "no differentiated parameter enters the loss through a contraction"
        if not found.sites
        else f"the parameters outside contractions would need {numbers:,} per-example numbers "
        f"(more than {MAX_MATERIALIZED_NUMBERS:,}): {_listing(materialized)}"
    )
    return Assessment("ghost", False, why, StrategyChoice("ghost", why, None, layers, materialized))


def _leaf_names(spec: Spec, call: Call, args: tuple[Any, ...]) -> list[str]:
    """A readable name for each differentiated leaf: its path, after the argument's index when
    several arguments are differentiated."""
    paths = {i: call.backend.flatten(args[i])[0] for i in spec.argnums}
    names = []
    for i, j in call.diff_positions:
        path = paths[i][j] or "(the whole argument)"
        names.append(path if spec.single_argnum else f"argument {i} {path}")
    return names


def _listing(reasons: dict[str, str]) -> str:
    items = list(reasons.items())
    text = "; ".join(f"{name}: {why}" for name, why in items[:4])
    return text + (f"; and {len(items) - 4} more" if len(items) > 4 else "")


def ghost(
    spec: Spec, call: Call, ghost_plan: JaxGhostPlan, weights_from: WeightsFn | None
) -> Reduction:
    """Squared norms of every differentiated leaf (and, with ``weights_from``, the weighted sums)
    from one vectorised forward and backward pass; see the module docstring."""
    bk = call.backend
    batched = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    diff = bk.match_varying(tuple(call.leaves[i][j] for i, j in call.diff_positions), batched)
    ghost_leaves = sorted(ghost_plan.sites)
    other_leaves = sorted(ghost_plan.other)
    closed = ghost_plan.jaxpr
    site_paths = {ghost_plan.sites[k].path: ghost_plan.sites[k] for k in ghost_leaves}
    prefixes = ghost_plan.prefixes

    def loss_of_one(other_values: tuple[Any, ...], probes: dict, example: tuple) -> Any:
        values = list(diff)
        for k, value in zip(other_leaves, other_values):
            values[k] = value
        inputs = _flatten_inputs(closed, values, example)
        kept: dict[tuple[int, ...], Any] = {}
        (loss,) = _evaluate(
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
        raise GhostUnsupported(
            f"evaluating the traced loss failed ({type(err).__name__}: {err})"
        ) from err

    squared: list[Any] = [None] * len(diff)
    for k, g in zip(other_leaves, other_grads):
        squared[k] = (g.reshape(g.shape[0], -1) ** 2).sum(axis=1)
    for k in ghost_leaves:
        site = ghost_plan.sites[k]
        squared[k] = _site_squared_norms(site, diff[k], inputs[site.path], cotangents[site.path])
    if weights_from is None:
        return Reduction(squared, None)
    weights = weights_from(squared)
    per_leaf = weights if isinstance(weights, list) else [weights] * len(diff)
    per_leaf = [jax.lax.stop_gradient(w) for w in per_leaf]
    sums: list[Any] = [None] * len(diff)
    for k, g in zip(other_leaves, other_grads):
        sums[k] = jnp.tensordot(per_leaf[k].astype(g.dtype), g, axes=1)
    for k in ghost_leaves:
        site = ghost_plan.sites[k]
        sums[k] = _site_weighted_sum(
            site, diff[k], inputs[site.path], cotangents[site.path], per_leaf[k]
        )
    return Reduction(squared, sums)


def _flatten_inputs(closed: Any, diff: Sequence[Any], example: tuple[Any, ...]) -> list[Any]:
    inputs = list(diff) + list(example)
    if len(inputs) != len(closed.jaxpr.invars):
        raise GhostUnsupported("the loss's inputs do not match its traced form")
    return inputs


def _evaluate(
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
            outs = _evaluate(inner.jaxpr, inner.consts, invals, here, sites, prefixes, probes, kept)
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


def _apply_chain(site: Site, param: Any) -> Any:
    for eqn in site.chain:
        param = eqn.primitive.bind(param, **eqn.primitive.get_bind_params(eqn.params))
    return param


def _contract(site: Site, layer_input: Any, operand: Any) -> Any:
    """The site's contraction of one example's input with the parameter operand."""
    pair = (layer_input, operand) if site.param_operand == 1 else (operand, layer_input)
    return site.eqn.primitive.bind(*pair, **site.eqn.primitive.get_bind_params(site.eqn.params))


def _site_squared_norms(site: Site, param: Any, inputs: Any, cotangents: Any) -> Any:
    """``(B,)`` squared norms of one ghost leaf's per-example gradients."""
    # computed in at least float32, returned in the parameter's dtype, as the reference's
    # (g**2).sum() of the parameter-dtype per-example gradients
    if site.kind == "embedding":
        return _embedding_squared_norms(site, inputs, cotangents).astype(param.dtype)
    factors = _dense_factors(site, inputs, cotangents)
    if factors is not None:
        return _dense_squared_norms(*(_wide(f) for f in factors)).astype(param.dtype)
    operand = _apply_chain(site, param)

    def gradient_of_one(layer_input: Any, cotangent: Any) -> Any:
        _, transpose = jax.vjp(lambda w: _contract(site, layer_input, w), operand)
        (g,) = transpose(cotangent)
        return (_wide(g) ** 2).sum()

    return jax.vmap(gradient_of_one)(inputs, cotangents).astype(param.dtype)


def _site_weighted_sum(site: Site, param: Any, inputs: Any, cotangents: Any, weights: Any) -> Any:
    """``sum_i w_i g_i`` of one ghost leaf: the contraction's transpose over the whole batch."""
    operand, chain_transpose = jax.vjp(lambda p: _apply_chain(site, p), param)
    scaled = cotangents * weights.astype(cotangents.dtype).reshape(
        (-1,) + (1,) * (cotangents.ndim - 1)
    )
    batched = jax.vmap(lambda x, w: _contract(site, x, w), in_axes=(0, None))
    _, transpose = jax.vjp(lambda w: batched(inputs, w), operand)
    (summed,) = transpose(scaled)
    (grad,) = chain_transpose(summed)
    return grad


def _dense_factors(site: Site, inputs: Any, cotangents: Any) -> tuple[Any, Any] | None:
    """For a ``dot_general`` without batch dimensions: the input as ``(B, T, K)`` and the
    cotangent as ``(B, T, F)`` (``T``: the input's free positions, ``K``: contracted, ``F``: the
    parameter's free dimensions), whose per-example product ``A^T D`` is the gradient up to a
    permutation. None for any other contraction."""
    if site.kind != "dense":
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = site.eqn.params["dimension_numbers"]
    if lhs_batch or rhs_batch:
        return None
    input_rank = inputs.ndim - 1
    contracted = lhs_contract if site.param_operand == 1 else rhs_contract
    free = [d for d in range(input_rank) if d not in contracted]
    order = [0] + [1 + d for d in free] + [1 + d for d in contracted]
    positions = math.prod(inputs.shape[1 + d] for d in free)
    a = inputs.transpose(order).reshape(inputs.shape[0], positions, -1)
    # dot_general's output: the lhs's free dimensions, then the rhs's.
    n_free = len(free)
    out_rank = cotangents.ndim - 1
    if site.param_operand == 1:
        d = cotangents
    else:
        param_free = out_rank - n_free
        order = [0] + list(range(1 + param_free, 1 + out_rank)) + list(range(1, 1 + param_free))
        d = cotangents.transpose(order)
    d = d.reshape(cotangents.shape[0], positions, -1)
    return a, d


def _dense_squared_norms(a: Any, d: Any) -> Any:
    """``|A_i^T D_i|_F^2`` per example, for ``a (B, T, K)`` and ``d (B, T, F)``.

    Gram matrices (``T x T``, cheaper than the ``K x F`` gradient when ``T (K + F) <= K F``)
    are used only in float64, that is with ``jax_enable_x64`` on: their sum
    ``sum_{t,s} (a_t . a_s)(d_t . d_s)`` rounds with an error of ``eps (sum_t |a_t| |d_t|)^2``,
    and in float32 (TF32 on a GPU by default) a gradient whose positions nearly cancel came out
    30% too small or negative, which lets a clipped example exceed the bound. Otherwise the
    gradient is formed, with the rounding of the materialised per-example gradients.
    """
    _, positions, k = a.shape
    f = d.shape[2]
    if positions == 1:
        return (a[:, 0] ** 2).sum(axis=1) * (d[:, 0] ** 2).sum(axis=1)
    if positions * (k + f) <= k * f and jax.config.jax_enable_x64:
        wide_a, wide_d = a.astype(jnp.float64), d.astype(jnp.float64)
        gram_a = jnp.einsum("btk,bsk->bts", wide_a, wide_a, precision=_EXACT)
        gram_d = jnp.einsum("btf,bsf->bts", wide_d, wide_d, precision=_EXACT)
        return (gram_a * gram_d).sum(axis=(1, 2)).astype(a.dtype)
    formed = jnp.einsum("btk,btf->bkf", a, d, precision=_EXACT)
    return (formed**2).sum(axis=(1, 2))


def _embedding_squared_norms(site: Site, ids: Any, cotangents: Any) -> Any:
    """``(B,)`` squared norms of a looked-up table's gradients: rows read at positions ``t`` and
    ``s`` add up when the ids are equal, so ``|g|^2 = sum_{t,s} [id_t = id_s] dz_t . dz_s``."""
    batch = ids.shape[0]
    rows = site.eqn.invars[0].aval.shape[0]
    row_column = tuple(site.eqn.params["dimension_numbers"].start_index_map).index(0)
    ids = ids[..., row_column].reshape(batch, -1)
    if jnp.dtype(ids.dtype).itemsize < 4:  # rows - 1 may not fit in int8 / uint8 / int16
        ids = ids.astype(jnp.int32)
    d = _wide(cotangents.reshape(batch, ids.shape[1], -1))
    mode = site.eqn.params["mode"]
    if mode in (
        jax.lax.GatherScatterMode.FILL_OR_DROP,
        jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    ):
        # FILL_OR_DROP reads the fill value; PROMISE_IN_BOUNDS reads a clamped row, but the
        # gradient's scatter-add (same mode) drops out-of-range updates: no row either way.
        # Selected, not multiplied: the cotangent of a dropped position may be inf or nan
        # (a zero fill row under a norm or a sqrt), which the scatter drops but 0 * nan is not
        valid = (ids >= 0) & (ids < rows)
        d = jnp.where(valid[:, :, None], d, 0)
    else:
        ids = jnp.clip(ids, 0, rows - 1)
    # The cotangents of the positions that read the same row of one example are summed (sorted
    # by (example, row), one segment per distinct pair), then squared: no Gram matrix
    # sum_{t,s} [id_t = id_s] dz_t . dz_s, whose rounding can exceed the norm when they cancel.
    positions = ids.shape[1]
    example = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape).reshape(-1)
    ids = ids.reshape(-1)
    order = jnp.lexsort((ids, example))
    ids, example = ids[order], example[order]
    starts = jnp.concatenate(
        [jnp.ones(1, bool), (ids[1:] != ids[:-1]) | (example[1:] != example[:-1])]
    )
    segment = jnp.cumsum(starts) - 1
    count = batch * positions
    sums = jax.ops.segment_sum(d.reshape(count, -1)[order], segment, num_segments=count)
    owner = jnp.zeros(count, example.dtype).at[segment].set(example)
    return jax.ops.segment_sum((sums**2).sum(axis=1), owner, num_segments=batch)


def describe(ghost_plan: JaxGhostPlan, names: Sequence[str]) -> tuple[dict[str, str], dict]:
    """``({leaf name: "dense" | "conv"}, {leaf name: why not})`` for :class:`StrategyChoice`."""
    layers = {names[k]: site.kind for k, site in sorted(ghost_plan.sites.items())}
    other = {names[k]: why for k, why in sorted(ghost_plan.other.items())}
    return layers, other
