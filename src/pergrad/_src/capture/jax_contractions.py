"""The JAX contraction rules: per-example squared norms and weighted sums of a leaf, from the
layer input and output cotangent that the capture engine recorded at its contraction.

Registered by layer family in ``jax_rules.py`` (the PyTorch rules' names):

- ``"linear"`` (a ``dot_general`` without batch dimensions): for a layer on one vector,
  ``|a|^2 |dz|^2`` (Goodfellow 2015); on a sequence, the formed per-example ``A^T D``, or under
  ``jax_enable_x64`` the Gram form ``<A A^T, D D^T>`` (Li et al. 2021) in float64 when it costs
  less (in float32 it rounds badly where per-position gradients cancel);
- ``"embedding"`` (a row-lookup ``gather``): the cotangents of the positions reading the same row
  summed, then squared;
- ``"conv"``, and a ``dot_general`` with batch dimensions: the contraction's own transpose applied
  to one example at a time (a kernel-sized gradient per example, not a model-sized one).

The weighted sum ``sum_i w_i g_i`` of every family is the same transpose applied once to the whole
batch with cotangents ``w_i dz_i``: no second backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pergrad._src.capture import cost
from pergrad._src.capture.cost import gram_is_cheaper
from pergrad._src.capture.jax_engine import Site, apply_chain, contract, row_axis
from pergrad._src.capture.jax_rules import register, rule_for
from pergrad._src.capture.quantities import Lookups, Tokens

_EXACT = jax.lax.Precision.HIGHEST  # no TF32 / bfloat16 passes for the norms on a GPU or TPU


def _wide(x: Any) -> Any:
    """``x`` in at least float32 (integers and float16/bfloat16 included): squares and Gram
    matrices of activations overflow float16 and wrap in integer dtypes."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def weighted_sum(site: Site, param: Any, inputs: Any, cotangents: Any, weights: Any) -> Any:
    """``sum_i w_i g_i`` of one leaf: the contraction's transpose over the whole batch, with
    each example's cotangent scaled by its weight."""
    operand, chain_transpose = jax.vjp(lambda p: apply_chain(site, p), param)
    scaled = cotangents * weights.astype(cotangents.dtype).reshape(
        (-1,) + (1,) * (cotangents.ndim - 1)
    )
    batched = jax.vmap(lambda x, w: contract(site, x, w), in_axes=(0, None))
    # linear in w: its transpose without evaluating the contraction (jax.vjp would, which jit
    # drops as dead code but an eager call pays: a second forward pass of every layer)
    transpose = jax.linear_transpose(lambda w: batched(inputs, w), operand)
    (summed,) = transpose(scaled)
    (grad,) = chain_transpose(summed)
    return grad


def per_example(site: Site, param: Any, inputs: Any, cotangents: Any) -> Any:
    """``(B, *param.shape)``: the contraction's transpose applied to one example at a time."""
    operand, chain_transpose = jax.vjp(lambda p: apply_chain(site, p), param)

    def gradient_of_one(layer_input: Any, cotangent: Any) -> Any:
        transpose = jax.linear_transpose(lambda w: contract(site, layer_input, w), operand)
        (g,) = transpose(cotangent)
        (grad,) = chain_transpose(g)
        return grad

    return jax.vmap(gradient_of_one)(inputs, cotangents)


def per_example_squared_norms(site: Site, param: Any, inputs: Any, cotangents: Any) -> Any:
    """``(B,)`` squared norms from the contraction's transpose applied to one example at a time:
    a kernel-sized gradient per example (convolutions, batched einsums)."""
    operand = apply_chain(site, param)

    def gradient_of_one(layer_input: Any, cotangent: Any) -> Any:
        transpose = jax.linear_transpose(lambda w: contract(site, layer_input, w), operand)
        (g,) = transpose(cotangent)
        return (_wide(g) ** 2).sum()

    return jax.vmap(gradient_of_one)(inputs, cotangents).astype(param.dtype)


# Norms are computed in at least float32 and returned in the parameter's dtype, as the
# reference's (g**2).sum() of the parameter-dtype per-example gradients.


@register("linear", per_example, weighted_sum, tokens=lambda *r: linear_records(*r), held=True)
def dense_squared_norms(site: Site, param: Any, inputs: Any, cotangents: Any) -> Any:
    """A dense contraction: ``|A_i^T D_i|^2`` from the factors; with batch dimensions (an
    attention-style einsum over the parameter), one example at a time."""
    factors = dense_factors(site, inputs, cotangents)
    if factors is None:
        return per_example_squared_norms(site, param, inputs, cotangents)
    found = _dense_squared_norms(*(_wide(f) for f in factors))
    if isinstance(found, cost.Certified):
        return _in_dtype(found, param.dtype)
    return found.astype(param.dtype)


register("conv", per_example, weighted_sum, held=True)(per_example_squared_norms)


@register("embedding", per_example, weighted_sum, lookups=lambda *r: embedding_records(*r))
def embedding_squared_norms(site: Site, param: Any, inputs: Any, cotangents: Any) -> Any:
    """A row lookup: the cotangents of one example's positions reading one row, summed, squared."""
    return _embedding_squared_norms(site, inputs, cotangents).astype(param.dtype)


def dense_factor_shape(site: Site) -> tuple[int, int, int] | None:
    """``(T, K, F)`` of :func:`dense_factors` for one example of ``site``, from its traced
    shapes; None where it has none (a convolution, a contraction with batch dimensions)."""
    operand = site.eqn.invars[1 - site.param_operand].aval
    output = site.eqn.outvars[0].aval
    shapes = jax.eval_shape(
        lambda i, c: dense_factors(site, i, c),
        jax.ShapeDtypeStruct((1, *operand.shape), operand.dtype),
        jax.ShapeDtypeStruct((1, *output.shape), output.dtype),
    )
    if shapes is None:
        return None
    (_, positions, k), (_, _, f) = shapes[0].shape, shapes[1].shape
    return positions, k, f


def norm_route(site: Site) -> str:
    """How the ghost strategy computes the per-example norms of ``site``'s parameter, from the
    traced shapes (for ``choose_strategy``'s ``norm_routes``)."""
    if site.family == "embedding":
        return "each example's cotangents summed per row it looks up (nothing formed)"
    shape = dense_factor_shape(site)
    if shape is None:  # a convolution, or a contraction with batch dimensions
        return "the per-example gradient of the parameter formed, one example at a time"
    positions, k, f = shape
    if positions == 1:
        return "one position: |x|^2 |g|^2 (nothing formed)"
    gram_cheaper = gram_is_cheaper(positions, k, f)
    x64 = jax.config.jax_enable_x64
    if not cost.FAST_NORMS:
        if gram_cheaper and x64:
            return f"Gram matrices in float64 ({positions} x {positions} per example)"
        why = "Gram matrices would need float64" if gram_cheaper else "cheaper than Gram"
        return f"the {k} x {f} per-example gradient formed ({positions} positions: {why})"
    again = "float64" if x64 else "the gradient formed"
    certified = (
        f"certified: each squared norm with its rounding bound, added before clipping; an "
        f"example whose bound exceeds {cost.ROUNDING_TOLERANCE:g} of it computed again in {again}"
    )
    fast = cost.fast_gram_suffices(positions, (k, f), unit_roundoff(jnp.float32))
    if gram_cheaper and (fast or x64):
        precision = "float32" if fast else "float64"
        return f"Gram matrices in {precision} ({positions} x {positions} per example), {certified}"
    why = (
        "Gram matrices in float32 too loose, float64 needs jax_enable_x64"
        if gram_cheaper
        else ("cheaper than Gram matrices")
    )
    return f"the {k} x {f} per-example gradient formed in float32 ({positions} positions: {why}), {certified}"


def dense_factors(site: Site, inputs: Any, cotangents: Any) -> tuple[Any, Any] | None:
    """For a ``dot_general`` without batch dimensions: the input as ``(B, T, K)`` and the
    cotangent as ``(B, T, F)`` (``T``: the input's free positions, ``K``: contracted, ``F``: the
    parameter's free dimensions), whose per-example product ``A^T D`` is the gradient up to a
    permutation. None for any other contraction."""
    if site.family != "linear":
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


def linear_records(site: Site, param: Any, inputs: Any, cotangents: Any) -> Tokens | None:
    """A 2-D weight entering a ``dot_general`` as it is or transposed, contracted on one axis:
    its records as :class:`Tokens`, ``"in_out"`` for ``x @ W``, ``"out_in"`` for ``x @ W.T``.
    None for any other use (a reshape, a slice: the caller forms its per-example gradient)."""
    transposed = len(site.chain) == 1 and site.chain[0].primitive.name == "transpose"
    if (site.chain and not transposed) or param.ndim != 2:
        return None
    (lhs_contract, rhs_contract), _ = site.eqn.params["dimension_numbers"]
    contracted = tuple(rhs_contract if site.param_operand == 1 else lhs_contract)
    layouts = ("in_out", "out_in")[:: -1 if transposed else 1]
    layout = {(0,): layouts[0], (1,): layouts[1]}.get(contracted)
    factors = dense_factors(site, inputs, cotangents)
    if layout is None or factors is None:
        return None
    return Tokens(*factors, site.path, layout, tuple(param.shape))


def embedding_records(site: Site, param: Any, inputs: Any, cotangents: Any) -> Lookups | None:
    """A 2-D table read by whole rows: its records as :class:`Lookups` (a position that reads
    no row has a zero cotangent, whatever row it names). None for any other table."""
    if param.ndim != 2 or site.chain:
        return None
    rows, _, d = _lookups(site, inputs, cotangents)
    return Lookups(rows, d, site.path, tuple(param.shape))


def _dense_squared_norms(a: Any, d: Any) -> Any:
    """``|A_i^T D_i|_F^2`` per example, for ``a (B, T, K)`` and ``d (B, T, F)``, certified
    (``cost.Certified``; a plain array where ``cost.FAST_NORMS`` is off).

    Gram matrices (``T x T``, where ``cost.gram_is_cheaper``: ``T (K + F) <= K F``) or the
    formed gradient, in the operands' precision (the products at ``Precision.HIGHEST``: no
    TF32 or bfloat16 passes on a GPU or TPU), each with its rounding bound (as PyTorch's,
    ``torch_layers._gram_in`` / ``_formed_in``). The Gram sum cancels wherever the
    per-position gradients do (in float32 a gradient whose positions nearly cancel came out
    30% too small or negative); an example whose bound exceeds ``cost.ROUNDING_TOLERANCE`` of
    its estimate is computed again, in float64 under ``jax_enable_x64``, else formed (whose
    bound is relatively the square root of the Gram route's). A layer whose fast Gram route
    could not meet the tolerance takes float64 (under ``jax_enable_x64``) or the formed route.
    """
    _, positions, k = a.shape
    f = d.shape[2]
    if positions == 1:  # sums of squares: nothing cancels (as torch_layers._one_position)
        return (a[:, 0] ** 2).sum(axis=1) * (d[:, 0] ** 2).sum(axis=1)
    x64 = jax.config.jax_enable_x64
    gram = gram_is_cheaper(positions, k, f) and (cost.FAST_NORMS or x64)
    if not cost.FAST_NORMS:  # the route before certified norms: a benchmark's baseline
        if gram:
            return _gram(a.astype(jnp.float64), d.astype(jnp.float64)).estimate.astype(a.dtype)
        return _formed(a, d).estimate
    fast_gram = gram and cost.fast_gram_suffices(positions, (k, f), unit_roundoff(a.dtype))
    if gram and not fast_gram and x64:
        return _in_dtype(_gram(a.astype(jnp.float64), d.astype(jnp.float64)), a.dtype)
    found = _gram(a, d) if fast_gram else _formed(a, d)
    if x64:
        again = _gram if fast_gram else _formed
        return _tightened(found, lambda: _in_dtype(again(_wider(a), _wider(d)), a.dtype))
    if fast_gram:
        return _tightened(found, lambda: _formed(a, d))
    return found


def unit_roundoff(dtype: Any) -> float:
    """The unit roundoff of ``dtype``: half its machine epsilon."""
    return float(jnp.finfo(dtype).eps) / 2


def _wider(x: Any) -> Any:
    return x.astype(jnp.float64)


def _in_dtype(found: cost.Certified, dtype: Any) -> cost.Certified:
    """``found`` in ``dtype``, its bound raised to cover the conversion's rounding."""
    if found.estimate.dtype == dtype:
        return found
    unit = unit_roundoff(dtype)
    bound = (found.bound + unit * (found.estimate + found.bound)) * (1 + 2 * unit)
    return cost.Certified(found.estimate.astype(dtype), bound.astype(dtype))


def _tightened(found: cost.Certified, again: Any) -> cost.Certified:
    """``found``, with the examples whose bound exceeds ``cost.ROUNDING_TOLERANCE`` of their
    estimate taken from ``again()`` (a tighter route over the whole batch, computed only when
    some example needs it: ``lax.cond``)."""
    loose = found.bound > cost.ROUNDING_TOLERANCE * found.estimate

    def tighter() -> cost.Certified:
        other = again()
        return cost.Certified(
            jnp.where(loose, other.estimate, found.estimate),
            jnp.where(loose, other.bound, found.bound),
        )

    return jax.lax.cond(jnp.any(loose), tighter, lambda: found)


def _nested_sum(x: Any) -> Any:
    """``(B, R, C) -> (B,)``, over columns, then rows, kept apart (``optimization_barrier``:
    XLA would merge the two reductions into one), so that every term passes through at most
    ``R + C`` additions whatever order each reduction takes."""
    return jax.lax.optimization_barrier(x.sum(axis=2)).sum(axis=1)


def _gram(a: Any, d: Any) -> cost.Certified:
    """``sum_{t,s} (a_t . a_s)(d_t . d_s)`` per example and its rounding bound, as
    ``torch_layers._gram_in`` (one block)."""
    _, positions, k = a.shape
    gram_a = jnp.einsum("btk,bsk->bts", a, a, precision=_EXACT)
    gram_d = jnp.einsum("btf,bsf->bts", d, d, precision=_EXACT)
    norms = jnp.linalg.norm(a, axis=2), jnp.linalg.norm(d, axis=2)
    terms = (norms[0] * norms[1]).sum(axis=1)  # sum_t |a_t| |d_t|
    widths = (k, d.shape[2])
    return certified_gram((gram_a, gram_d), norms, terms, widths, positions, _nested_sum)


def certified_gram(
    grams: tuple[Any, Any],
    norms: tuple[Any, Any],
    terms: Any,
    widths: tuple[int, int],
    count: int,
    reduce: Callable[[Any], Any],
) -> cost.Certified:
    """``reduce(gram_a * gram_d)`` and its rounding bound, from the ``(..., n, n)`` Gram
    matrices of the positions' inputs and output gradients (``grams``, of ``widths`` ``(k,
    f)``), the positions' norms (``norms``, ``(..., n)`` each), ``terms`` (``sum |a_t| |d_t|``
    of each result) and ``reduce``, which sums the pairs of each result (an example's; a user's,
    masked, in ``jax_users``) through at most ``2 count`` additions, each kept apart
    (:func:`_nested_sum`). Each Gram entry is within ``gamma_k |a_t| |a_s|`` (``f`` alike)."""
    gram_a, gram_d = grams
    norms_a, norms_d = norms
    k, f = widths
    unit = unit_roundoff(gram_a.dtype)
    product = gram_a * gram_d
    from_a = norms_a[..., :, None] * norms_a[..., None, :] * jnp.abs(gram_d)
    from_d = norms_d[..., :, None] * norms_d[..., None, :] * jnp.abs(gram_a)
    alpha, beta = cost.product_error(k, unit), cost.product_error(f, unit)
    depth = 2 * count
    bound = (
        cost.gamma(depth + 1, unit) * reduce(jnp.abs(product))
        + alpha * reduce(from_a)
        + beta * reduce(from_d)
        + alpha * beta * terms * terms
    )
    own = cost.gamma(depth + 2 * (k + f + count) + 16, unit)
    return cost.Certified(jnp.maximum(reduce(product), 0), bound * (1 + 2 * own))


def _formed(a: Any, d: Any) -> cost.Certified:
    """``|A^T D|_F^2`` per example from the formed ``K x F`` gradients and its rounding bound,
    as ``torch_layers._formed_in``: each entry within ``theta sum_t |a_tk| |d_tf|``."""
    _, positions, k = a.shape
    f = d.shape[2]
    unit = unit_roundoff(a.dtype)
    formed = jnp.einsum("btk,btf->bkf", a, d, precision=_EXACT)
    squared = _nested_sum(formed**2)
    terms = (jnp.linalg.norm(a, axis=2) * jnp.linalg.norm(d, axis=2)).sum(axis=1)
    error = cost.product_error(positions, unit) * terms
    return certified_sum_of_squares(squared, error, k + f + positions, unit)


def formed_squared_norms(grads: Any) -> cost.Certified:
    """``|g_b|^2`` of formed ``(B, *shape)`` per-example gradients, certified as the squared
    norms of exactly these numbers (what a clipped sum of them adds: the held leaves of
    ``ghost_jax.py``), as ``torch_norms.formed_squared_norms``: in float32 at least, summed over
    the last axis, then over the one before, and so on, each sum kept apart
    (``optimization_barrier``: XLA would merge them into one), so that each square passes
    through at most the sum of the axes' lengths of additions. Each axis is first split in two
    where its length factors (``(256, 8192)`` summed as ``(16, 16, 128, 64)``: 224 additions,
    not 8448, so a bound ``40x`` tighter: a vocabulary-sized output layer's came to ``5e-4``
    of its squared norm, clipping that much below the bound). In the gradients' dtype, the
    bound raised to cover the conversion."""
    axes = cost.split_axes(grads.shape[1:])
    squared = (_wide(grads) ** 2).reshape(grads.shape[0], *axes)
    while squared.ndim > 2:
        squared = jax.lax.optimization_barrier(squared.sum(axis=-1))
    if squared.ndim == 2:
        squared = squared.sum(axis=1)
    unit = unit_roundoff(squared.dtype)
    depth = max(sum(axes), 1)
    found = certified_sum_of_squares(squared, jnp.zeros((), squared.dtype), depth, unit)
    return _in_dtype(found, grads.dtype)


def certified_sum_of_squares(squared: Any, error: Any, depth: int, unit: float) -> cost.Certified:
    """As ``torch_norms.certified_sum_of_squares``: the certified squared norm of a computed
    vector within ``error`` (Euclidean) of the exact one, its squares summed through at most
    ``depth`` additions in unit roundoff ``unit``."""
    relative = cost.gamma(depth + 1, unit)
    upper = jnp.sqrt(squared * (1 + 2 * relative)) + error
    own = cost.gamma(2 * depth + 16, unit)
    bound = jnp.maximum(upper * upper - squared, 0) * (1 + 2 * own) + 4 * unit * squared
    return cost.Certified(squared, bound)


def _embedding_squared_norms(site: Site, ids: Any, cotangents: Any) -> Any:
    """``(B,)`` squared norms of a looked-up table's gradients: rows read at positions ``t`` and
    ``s`` add up when the ids are equal, so ``|g|^2 = sum_{t,s} [id_t = id_s] dz_t . dz_s``."""
    rows, valid, d = _lookups(site, ids, cotangents)
    return _row_sums_squared(rows, d, ids.shape[0])


def _lookups(site: Site, ids: Any, cotangents: Any) -> tuple[Any, Any, Any]:
    """One lookup site's ``(rows (B, T) int32, valid (B, T) bool, d (B, T, F) wide)``: the row
    each position reads (clamped for the CLIP mode; -1 where it reads none), whether it reads
    one, and its cotangent (zero where it reads none)."""
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
        valid = jnp.ones(ids.shape, bool)
    # A position that reads no row gets the row -1: its own segment, never merged with a row.
    return jnp.where(valid, jnp.clip(ids, 0, rows - 1), -1), valid, d


def _segments(ids: Any) -> tuple[Any, Any, Any, Any]:
    """Positions grouped by (example, row): ``(order, segment, starts, owner)`` for ``ids (B,
    T)``: the sort order of the flattened positions, each sorted position's segment, whether it
    starts one, and each segment's example (segments past the last are empty, owned by 0)."""
    batch, positions = ids.shape
    example = jnp.broadcast_to(jnp.arange(batch)[:, None], ids.shape).reshape(-1)
    flat = ids.reshape(-1)
    order = jnp.lexsort((flat, example))
    flat, example = flat[order], example[order]
    starts = jnp.concatenate(
        [jnp.ones(1, bool), (flat[1:] != flat[:-1]) | (example[1:] != example[:-1])]
    )
    segment = jnp.cumsum(starts) - 1
    owner = jnp.zeros(batch * positions, example.dtype).at[segment].set(example)
    return order, segment, starts, owner


def _row_sums_squared(rows: Any, d: Any, batch: int) -> Any:
    # The cotangents of the positions that read the same row of one example are summed (sorted
    # by (example, row), one segment per distinct pair), then squared: no Gram matrix
    # sum_{t,s} [id_t = id_s] dz_t . dz_s, whose rounding can exceed the norm when they cancel.
    order, segment, _, owner = _segments(rows)
    count = rows.size
    sums = jax.ops.segment_sum(d.reshape(count, -1)[order], segment, num_segments=count)
    return jax.ops.segment_sum((sums**2).sum(axis=1), owner, num_segments=batch)


def tied_squared_norms(
    sites: tuple[Site, ...], param: Any, inputs: tuple[Any, ...], cotangents: tuple[Any, ...]
) -> Any:
    """``(B,)`` squared norms of a table tied across uses (``jax_engine.is_tied_table``): read
    by embedding lookups and by at most one dense contraction (an output projection).

    Each example's gradient is the sum of its uses'. The lookups only touch the rows they read
    (``S_r``, the cotangents of the positions reading row ``r``, summed over every lookup), so
    ``|G|^2 = sum_{r read} |S_r + D_r|^2 + (|D|^2 - sum_{r read} |D_r|^2)`` with ``D`` the dense
    use's gradient: its rows ``D_r`` at the rows read come from the dense contraction applied
    to those rows alone (``T x T`` work per example, never the ``rows x width`` gradient), its
    whole norm from the dense rule. Every term but the last bracket is a sum of squares; that
    bracket, ``D``'s mass on the rows not read, is clamped at 0 against rounding, so the norm is
    never below that of the rows read."""
    lookups = [k for k, site in enumerate(sites) if site.family == "embedding"]
    parts = [_lookups(sites[k], inputs[k], cotangents[k]) for k in lookups]
    rows = jnp.concatenate([p[0] for p in parts], axis=1)
    valid = jnp.concatenate([p[1] for p in parts], axis=1)
    d = jnp.concatenate([p[2] for p in parts], axis=1)
    batch = rows.shape[0]
    dense = [k for k, site in enumerate(sites) if site.family == "linear"]
    if not dense:
        return _row_sums_squared(rows, d, batch).astype(param.dtype)
    (k,) = dense
    # the dense use's whole norm brings its rounding bound (the segment sums add none)
    whole, whole_bound = cost.split(dense_squared_norms(sites[k], param, inputs[k], cotangents[k]))
    read = _dense_rows(sites[k], param, inputs[k], cotangents[k], rows)  # (B, T, F)
    order, segment, starts, owner = _segments(rows)
    count = rows.size
    summed = jax.ops.segment_sum(d.reshape(count, -1)[order], segment, num_segments=count)
    # One copy of D_r per (example, row) read through a valid position: the segment's first.
    first = jnp.where(starts, 1.0, 0.0) * valid.reshape(-1)[order]
    dense_rows = jax.ops.segment_sum(
        read.reshape(count, -1)[order] * first[:, None], segment, num_segments=count
    )
    touched = jax.ops.segment_sum(
        ((summed + dense_rows) ** 2).sum(axis=1), owner, num_segments=batch
    )
    dense_touched = jax.ops.segment_sum((dense_rows**2).sum(axis=1), owner, num_segments=batch)
    rest = jnp.maximum(_wide(whole) - dense_touched, 0.0)
    total = (touched + rest).astype(param.dtype)
    return total if whole_bound is None else cost.Certified(total, whole_bound)


def _dense_rows(site: Site, param: Any, inputs: Any, cotangents: Any, rows: Any) -> Any:
    """``(B, T, F)``: each example's gradient of the dense use, at the rows ``rows (B, T)``:
    the contraction applied to a table of those rows alone (each output column depends on its
    own row only), transposed against the cotangent's columns at those rows."""
    axis = row_axis(site, param.shape, param.dtype)

    def of_one(layer_input: Any, cotangent: Any, ids: Any) -> Any:
        ids = jnp.clip(ids, 0, param.shape[0] - 1)  # rows -1 (none read) are masked by the caller
        table = _wide(param)[ids]

        def apply(t: Any) -> Any:
            return contract(site, _wide(layer_input), apply_chain(site, t))

        _, transpose = jax.vjp(apply, table)
        (g,) = transpose(jnp.take(_wide(cotangent), ids, axis=axis))
        return g.reshape(ids.shape[0], -1)

    return jax.vmap(of_one)(inputs, cotangents, rows)


def tied_per_example(
    sites: tuple[Site, ...], param: Any, inputs: tuple[Any, ...], cotangents: tuple[Any, ...]
) -> Any:
    """``(B, *param.shape)``: the tied table's per-example gradients, every use's summed."""
    return sum(
        rule_for(s).per_example(s, param, a, d) for s, a, d in zip(sites, inputs, cotangents)
    )


def tied_weighted_sum(
    sites: tuple[Site, ...],
    param: Any,
    inputs: tuple[Any, ...],
    cotangents: tuple[Any, ...],
    weights: Any,
) -> Any:
    """``sum_i w_i g_i`` of a tied table: every use's weighted sum, added."""
    return sum(
        rule_for(s).weighted_sum(s, param, a, d, weights)
        for s, a, d in zip(sites, inputs, cotangents)
    )
