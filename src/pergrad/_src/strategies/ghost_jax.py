"""The ghost strategy for JAX: per-example norms from each contraction's input and cotangent.

``capture/jax_engine.py`` traces the loss of one example and finds each differentiated leaf's
contraction (its *site*); a leaf with one site is a *ghost parameter*. Then (:func:`ghost`), in
one vectorised forward and backward pass over the batch:

1. the jaxpr is evaluated (``jax_engine.evaluate``) with a zero "probe" added to the output of
   each site and the site's other operand (the layer input ``a``) kept;
2. the per-example gradient with respect to each probe is the output cotangent ``dz`` of that
   contraction for that example; the ghost parameters themselves are not differentiated, so no
   ``B x P`` weight gradient is formed;
3. each ghost parameter's per-example squared norm follows from ``a`` and ``dz``: for a dense
   layer on one vector, ``|a|^2 |dz|^2`` (Goodfellow 2015); on a sequence, the formed ``a^T dz``,
   or under ``jax_enable_x64`` the Gram form ``<a a^T, dz dz^T>`` (Li et al. 2021) in float64
   when it costs less (in float32 it rounds badly where per-position gradients cancel); for an
   embedding, the cotangents of the positions reading the same row summed, then squared; for
   other contractions (convolutions, batched einsums), the contraction's own transpose applied
   to one example at a time (a kernel-sized gradient per example, not a model-sized one);
4. the weighted sum ``sum_i w_i g_i`` that a clipped sum needs is the same transpose applied
   once to the whole batch with cotangents ``w_i dz_i``: no second backward pass.

Parameters used any other way (biases, norm scales, a weight shared by two layers such as tied
embeddings, anything inside ``scan`` / ``cond`` / a ``custom_jvp``) get ordinary per-example
gradients in the same pass; ``strategy="auto"`` takes the ghost strategy
only when those stay small (:data:`MAX_MATERIALIZED_NUMBERS`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pergrad._src.capture.jax_engine import (
    JaxGhostPlan,
    Site,
    apply_chain,
    contract,
    describe,
    evaluate,
    flatten_inputs,
    plan,
)
from pergrad._src.core.call import Call, Spec
from pergrad._src.errors import GhostUnsupported, PergradValueError
from pergrad._src.strategies.protocol import (
    Assessment,
    ReduceRequest,
    Reduction,
    StrategyChoice,
    WeightsFn,
)

# "auto" takes the ghost strategy only if the parameters it cannot cover would not need more
# than this many per-example gradient numbers (B x their size); 128 MB in float32.
MAX_MATERIALIZED_NUMBERS = 2**25


_EXACT = jax.lax.Precision.HIGHEST  # no TF32 / bfloat16 passes for the norms on a GPU or TPU


def _wide(x: Any) -> Any:
    """``x`` in at least float32 (integers and float16/bfloat16 included): squares and Gram
    matrices of activations overflow float16 and wrap in integer dtypes."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


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


def _site_squared_norms(site: Site, param: Any, inputs: Any, cotangents: Any) -> Any:
    """``(B,)`` squared norms of one ghost leaf's per-example gradients."""
    # computed in at least float32, returned in the parameter's dtype, as the reference's
    # (g**2).sum() of the parameter-dtype per-example gradients
    if site.kind == "embedding":
        return _embedding_squared_norms(site, inputs, cotangents).astype(param.dtype)
    factors = _dense_factors(site, inputs, cotangents)
    if factors is not None:
        return _dense_squared_norms(*(_wide(f) for f in factors)).astype(param.dtype)
    operand = apply_chain(site, param)

    def gradient_of_one(layer_input: Any, cotangent: Any) -> Any:
        _, transpose = jax.vjp(lambda w: contract(site, layer_input, w), operand)
        (g,) = transpose(cotangent)
        return (_wide(g) ** 2).sum()

    return jax.vmap(gradient_of_one)(inputs, cotangents).astype(param.dtype)


def _site_weighted_sum(site: Site, param: Any, inputs: Any, cotangents: Any, weights: Any) -> Any:
    """``sum_i w_i g_i`` of one ghost leaf: the contraction's transpose over the whole batch."""
    operand, chain_transpose = jax.vjp(lambda p: apply_chain(site, p), param)
    scaled = cotangents * weights.astype(cotangents.dtype).reshape(
        (-1,) + (1,) * (cotangents.ndim - 1)
    )
    batched = jax.vmap(lambda x, w: contract(site, x, w), in_axes=(0, None))
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
