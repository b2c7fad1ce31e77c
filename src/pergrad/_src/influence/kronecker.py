"""Factored random projections of per-example gradients (LoGra, Choe et al. 2024), never forming
a layer's per-example gradient.

A dense layer applied at ``T`` positions has the per-example weight gradient
``G = sum_t a_t d_t^T`` (input ``a_t``, output gradient ``d_t``). Projected by the Kronecker
product of two small random matrices, ``P_in^T G P_out = (A P_in)^T (D P_out)``: the
``k_in x k_out`` feature comes from projecting the layer's input and output gradient
separately, at ``B T (p k_in + q k_out)`` cost, where materialising ``G`` would cost ``B p q``
memory. An embedding table is such a layer with one-hot inputs: ``P_in^T G P_out = sum_t
P_in[r_t]^T (d_t P_out)``. It is one quantity of the capture kernel (``capture/quantities.py``),
written once for both frameworks over the records every linear-like family gives:
``nn.Linear``, Hugging Face's ``Conv1D``, ungrouped ``Conv1d`` / ``Conv2d`` (their patches) and
``nn.Embedding`` in PyTorch; a 2-D weight in ``x @ W`` or ``x @ W.T`` and a table read by rows
in JAX. One batched pass gives every layer's features. A table tied to other such layers
(GPT-2's token embedding and output layer, PyTorch) is projected in its own frame,
``P_rows^T G P_cols`` for the ``(rows, cols)`` weight, by every layer using it (the output
layer's share is ``(D P_rows)^T (A P_cols)``), and the shares add up to the projection of the
tied gradient, which is never formed. Every other parameter's per-example gradient (biases,
norms, grouped or 3-D convolutions, a JAX weight used through a reshape) is projected densely,
with :func:`pergrad.influence.project`'s seeded matrix, block by block.

``P_in`` and ``P_out`` of layer ``i`` are Gaussian with entries ``N(0, 1/k)``, drawn from
``numpy.random.default_rng([seed, i, side])``, where ``i`` numbers the projected weights: in
PyTorch the weights of the layers of ``model.named_modules()`` that have the projection, in
that order (fixed by the model, whatever a call reaches; a tied table has the number of its
first layer), in JAX the contractions in the order the engine meets them (for a simple MLP the
same numbers on both frameworks): so ``E[<P g, P h>] = <g, h>``, and a call on training data
and one on targets, with the same ``seed`` and model, land in the same space.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pergrad._src.api.reductions import layer_reductions_of
from pergrad._src.backends import backend_of
from pergrad._src.capture.quantities import Lookups, Tokens, register_quantity
from pergrad._src.errors import PergradValueError
from pergrad._src.influence.ihvp import as_backend_array
from pergrad._src.influence.projection import MAX_MATRIX_NUMBERS, SeededProjection

PLUG_IN = "pergrad.kronecker_projection"
# The dense projection of the other parameters uses project()'s matrix with seed + this.
OTHER_SEED_OFFSET = 1_000_003


class LayerMatrices:
    """``(P_in, P_out)`` per weight key, numpy float64: weight ``positions[key]``, or without
    ``positions`` the weights numbered in the order of first request. ``tied``: the keys of
    weights used by several projected layers, projected in the weight's own frame."""

    def __init__(
        self,
        seed: int,
        k_in: int,
        k_out: int,
        positions: dict[Any, int] | None = None,
        tied: frozenset[Any] = frozenset(),
    ) -> None:
        self.seed, self.k_in, self.k_out = seed, k_in, k_out
        self.positions, self.tied = positions, tied
        self.drawn: dict[Any, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, key: Any, width_in: int, width_out: int) -> tuple[np.ndarray, np.ndarray]:
        if key not in self.drawn:
            index = len(self.drawn) if self.positions is None else self.positions[key]
            self.drawn[key] = kronecker_matrices(
                self.seed, index, width_in, width_out, self.k_in, self.k_out
            )
        return self.drawn[key]


def module_positions(fn: Any) -> tuple[dict[Any, int] | None, frozenset[Any]]:
    """For a :func:`pergrad.module_loss`, ``(id(weight) -> i, the tied weights' ids)``: the
    ``i``-th distinct weight of the layers of ``model.named_modules()`` whose family has the
    projection (``nn.Linear``, ``Conv1D``, convolutions, ``nn.Embedding``), and those used by
    more than one
    of them. A weight's matrices then depend on the model alone, not on which layers a call
    reaches or in what order the engine meets them. ``(None, {})`` for any other ``fn``."""
    import sys

    if "torch" not in sys.modules:
        return None, frozenset()
    from pergrad._src.capture import torch_layers  # noqa: F401  (importing it registers the rules)
    from pergrad._src.capture.rules import rule_for
    from pergrad._src.core.module_loss import ModuleLoss

    if not isinstance(fn, ModuleLoss):
        return None, frozenset()
    positions: dict[Any, int] = {}
    tied = set()
    for _, module in fn.model.named_modules():
        rule = rule_for(module)
        if rule is not None and rule.reduction(PLUG_IN) is not None:
            key = id(module.weight)
            if key in positions:
                tied.add(key)
            positions.setdefault(key, len(positions))
    return positions, frozenset(tied)


def kronecker_matrices(
    seed: int, index: int, width_in: int, width_out: int, k_in: int, k_out: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``index``-th layer's ``(P_in (width_in, k_in), P_out (width_out, k_out))``."""
    p_in = np.random.default_rng([seed, index, 0]).standard_normal((width_in, k_in))
    p_out = np.random.default_rng([seed, index, 1]).standard_normal((width_out, k_out))
    return p_in / math.sqrt(k_in), p_out / math.sqrt(k_out)


def project_factored(
    fn: Callable[..., Any],
    params: Any,
    batch: Sequence[Any],
    *,
    k_in: int = 16,
    k_out: int = 16,
    other_dim: int = 256,
    seed: int = 0,
) -> Any:
    """Each example's gradient, projected layer by layer without forming it.

    Args:
      fn: the loss (or output) of ONE example, ``fn(params, *example) -> scalar``; in PyTorch a
        :func:`pergrad.module_loss` (then its ``nn.Linear``, Hugging Face ``Conv1D``,
        ungrouped ``Conv1d`` / ``Conv2d`` and ``nn.Embedding`` layers are projected from their
        records, a table tied to another
        layer (GPT-2's token embedding and output layer) in its own frame, from both uses;
        any other torch function gets every gradient projected densely, with a
        :class:`pergrad.FallbackWarning`); in JAX any
        traceable loss (its 2-D weights in ``x @ W`` / ``x @ W.T`` and its tables read by rows
        projected from their records).
      params: the parameters (``loss.params()`` in PyTorch).
      batch: tuple of ``fn``'s batched arguments.
      k_in: each dense layer's feature is ``k_in x k_out``: its input side.
      k_out: its output-gradient side.
      other_dim: the dimension the remaining parameters' gradients are projected to, together.
      seed: the projections' seed; the same for every call whose features are compared.

    Returns:
      ``(n, D)`` features, an array of the parameters' framework: the dense layers' ``k_in *
      k_out`` blocks in the order of the parameters, then ``other_dim`` columns (if any
      parameter is not a dense layer's weight). Dot products estimate those of the full
      per-example gradients.

    Cost: one forward and backward pass over the batch with the layers' records, ``B T (p k_in
    + q k_out)`` per dense layer, and per-example gradients of the other parameters, projected
    with a ``(P_other, other_dim)`` matrix drawn block by block (memory ``2**26`` numbers at a
    time). :func:`pergrad.influence.trak` with ``projection="factored"`` keeps the matrices
    between its calls.
    """
    for name, value in (("k_in", k_in), ("k_out", k_out), ("other_dim", other_dim)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise PergradValueError(
                f"project_factored: {name} must be a positive int; got {value!r}."
            )
    if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
        raise PergradValueError(f"project_factored: seed must be a non-negative int; got {seed!r}.")
    if not isinstance(batch, (tuple, list)):
        raise PergradValueError(
            f"project_factored: batch must be a tuple of fn's batched arguments, e.g. (X, Y); "
            f"got {type(batch).__name__}."
        )
    return FactoredProjection(seed, k_in, k_out, other_dim)(fn, params, batch)


class FactoredProjection:
    """:func:`project_factored` for one ``(seed, k_in, k_out, other_dim)``, the other
    parameters' dense matrix kept between calls while it holds at most ``matrix_budget``
    numbers (else drawn block by block per call); the layers' small ``(P_in, P_out)`` are
    drawn per call. Arguments are checked by the caller."""

    def __init__(
        self,
        seed: int,
        k_in: int,
        k_out: int,
        other_dim: int,
        matrix_budget: int = MAX_MATRIX_NUMBERS,
    ) -> None:
        self.seed, self.k_in, self.k_out = seed, k_in, k_out
        self.other_dim, self.matrix_budget = other_dim, matrix_budget
        self.others: SeededProjection | None = None

    def __call__(self, fn: Callable[..., Any], params: Any, batch: Sequence[Any]) -> Any:
        layers = LayerMatrices(self.seed, self.k_in, self.k_out, *module_positions(fn))
        results = layer_reductions_of(
            fn, params, *batch, reduction=PLUG_IN, reduction_args=(layers,)
        )
        bk = backend_of(results[0].value, "project_factored", "params")
        count = bk.shape(results[0].value)[0]
        blocks = [r.value.reshape(count, -1) for r in results if r.reduced]
        others = [r.value.reshape(count, -1) for r in results if not r.reduced]
        if others:
            flat = others[0] if len(others) == 1 else bk.concatenate(others, axis=1)
            size = bk.shape(flat)[1]
            if self.others is None or self.others.size != size:
                self.others = SeededProjection(
                    bk,
                    size,
                    self.other_dim,
                    self.seed + OTHER_SEED_OFFSET,
                    "gaussian",
                    size * self.other_dim <= self.matrix_budget,
                )
            blocks.append(self.others(flat))
        return blocks[0] if len(blocks) == 1 else bk.concatenate(blocks, axis=1)


def project_tokens(tokens: Tokens, matrices: LayerMatrices) -> Any:
    """``(A P_in)^T (D P_out)``, ``(B, k_in, k_out)``, for a weight of either framework; a tied
    weight stored ``(out, in)`` in its own frame, ``(D P_rows)^T (A P_cols)``."""
    a, d = tokens.a, tokens.d
    if tokens.layout == "out_in" and tokens.key in matrices.tied:
        a, d = d, a
    p_in, p_out = matrices(tokens.key, a.shape[-1], d.shape[-1])
    bk = backend_of(a, "project_factored", "params")
    return (a @ as_backend_array(bk, p_in, a)).mT @ (d @ as_backend_array(bk, p_out, d))


def project_lookups(lookups: Lookups, matrices: LayerMatrices) -> Any:
    """A table ``(V, D)`` read at rows ``r_t``: ``sum_t P_in[r_t]^T (d_t P_out)`` (its own
    frame)."""
    rows, d = lookups.rows, lookups.d
    p_in, p_out = matrices(lookups.key, *lookups.shape)
    bk = backend_of(d, "project_factored", "params")
    left = as_backend_array(bk, p_in, d)[rows]  # (B, N, k_in); rows reading none have d = 0
    return left.mT @ (d @ as_backend_array(bk, p_out, d))


# Both frameworks, every layer family with tokens or lookups (capture/quantities.py).
register_quantity(PLUG_IN, project_tokens, project_lookups, additive=True)
