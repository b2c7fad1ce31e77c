"""Random projections of per-example gradients to ``k`` dimensions, for datasets whose ``(n, P)``
gradients do not fit.

``project(grads, k)`` returns ``grads_flat @ R`` with ``R`` a ``(P, k)`` random matrix scaled
so that dot products are preserved in expectation (Johnson-Lindenstrauss): scores such as
:func:`pergrad.influence.grad_dot` of projected gradients approximate those of the full ones.

``R`` is never materialised whole: its rows are drawn in seeded chunks of :data:`ROWS_PER_DRAW`
(chunk ``c`` from ``numpy.random.default_rng([seed, c])``) and consumed ``block_size`` rows at a
time. ``R`` therefore depends only on ``(seed, k, kind, P)``: not on ``block_size``, not on how
the parameters are split into leaves, and not on the framework, so JAX and PyTorch gradients
projected with the same seed land in the same space.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pergrad._src.backends import Backend
from pergrad._src.errors import PergradValueError
from pergrad._src.influence.ihvp import as_backend_array
from pergrad._src.norms import flat_leaves

ROWS_PER_DRAW = 512
KINDS = ("gaussian", "rademacher")
# A (P, k) projection matrix is drawn once and kept when it holds at most this many numbers
# (256 MB in float32); a larger one is drawn block by block on each call, in blocks of this many.
MAX_MATRIX_NUMBERS = 2**26


def project(
    grads: Any, k: int, seed: int = 0, kind: str = "gaussian", block_size: int = 8192
) -> Any:
    """Project each example's gradient to ``k`` dimensions with a seeded random matrix.

    Args:
      grads: per-example gradients, a pytree with leaves ``(n, *param_shape)``, JAX or torch.
      k: the dimension to project to, a positive int.
      seed: a non-negative int; the same seed gives the same matrix (project train and test
        gradients with the same seed, ``k`` and ``kind``).
      kind: ``"gaussian"`` (entries N(0, 1/k)) or ``"rademacher"`` (entries +-1/sqrt(k)).
      block_size: rows of the ``(P, k)`` matrix made at once; memory is ``block_size * k``
        numbers. Does not change the result.

    Returns:
      ``(n, k)`` array of the gradients' framework, with ``E[project(a) @ project(b).T] =
      a_flat @ b_flat.T``.

    Example::

        train_small = pergrad.influence.project(train_grads, k=256, seed=0)
        test_small = pergrad.influence.project(test_grads, k=256, seed=0)
        scores = pergrad.influence.grad_dot(train_small, test_small)   # (n_train, n_test)

    Cost: ``n * P * k`` multiply-adds and drawing ``P * k`` random numbers (in numpy, so
    that both frameworks see the same matrix).
    """
    name = "project"
    bk, _, flat, _, count = flat_leaves(name, grads)
    _check_options(k, seed, kind, block_size)
    total = sum(bk.shape(leaf)[1] for leaf in flat)
    result = None
    for start in range(0, total, block_size):
        stop = min(start + block_size, total)
        rows = matrix_rows(seed, k, kind, start, stop)
        slab = _columns(bk, flat, start, stop)
        term = slab @ as_backend_array(bk, rows, slab)
        result = term if result is None else result + term
    if result is None:  # every leaf has zero parameters
        return as_backend_array(bk, np.zeros((count, k)), flat[0])
    return result


class SeededProjection:
    """``grads (n, size) -> grads @ R`` with :func:`project`'s ``(size, k)`` matrix ``R`` for one
    ``(seed, kind)``, kept between calls when ``cache`` (it holds ``size * k`` numbers), else
    drawn block by block (``MAX_MATRIX_NUMBERS`` numbers at a time) on each call."""

    def __init__(self, bk: Backend, size: int, k: int, seed: int, kind: str, cache: bool) -> None:
        self.bk, self.size, self.k, self.seed, self.kind = bk, size, k, seed, kind
        self.cache = cache
        self.matrix: Any = None

    def __call__(self, grads: Any) -> Any:
        if self.cache:
            if self.matrix is None:
                rows = matrix_rows(self.seed, self.k, self.kind, 0, self.size)
                self.matrix = as_backend_array(self.bk, rows, grads)
            return grads @ self.matrix
        block = max(1, MAX_MATRIX_NUMBERS // self.k)
        result = None
        for start in range(0, self.size, block):
            stop = min(start + block, self.size)
            rows = matrix_rows(self.seed, self.k, self.kind, start, stop)
            term = grads[:, start:stop] @ as_backend_array(self.bk, rows, grads)
            result = term if result is None else result + term
        return result


def _check_options(k: Any, seed: Any, kind: Any, block_size: Any) -> None:
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (is_int(k) and k > 0):
        raise PergradValueError(f"project: k must be a positive int; got {k!r}.")
    if not (is_int(seed) and seed >= 0):
        raise PergradValueError(f"project: seed must be a non-negative int; got {seed!r}.")
    if kind not in KINDS:
        raise PergradValueError(f"project: kind must be one of {list(KINDS)}; got {kind!r}.")
    if not (is_int(block_size) and block_size > 0):
        raise PergradValueError(f"project: block_size must be a positive int; got {block_size!r}.")


def matrix_rows(seed: int, k: int, kind: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of the ``(P, k)`` projection matrix, float64."""
    first, last = start // ROWS_PER_DRAW, (stop - 1) // ROWS_PER_DRAW
    draws = [_draw(seed, k, kind, chunk) for chunk in range(first, last + 1)]
    offset = first * ROWS_PER_DRAW
    return np.concatenate(draws, axis=0)[start - offset : stop - offset]


def _draw(seed: int, k: int, kind: str, chunk: int) -> np.ndarray:
    rng = np.random.default_rng([seed, chunk])
    shape = (ROWS_PER_DRAW, k)
    if kind == "gaussian":
        values = rng.standard_normal(shape)
    else:
        values = rng.integers(0, 2, size=shape) * 2.0 - 1.0
    return values / math.sqrt(k)


def _columns(bk: Backend, flat: list[Any], start: int, stop: int) -> Any:
    """Columns ``start:stop`` of the gradients laid side by side, ``(n, stop - start)``."""
    pieces, offset = [], 0
    for leaf in flat:
        width = bk.shape(leaf)[1]
        low, high = max(start - offset, 0), min(stop - offset, width)
        if low < high:
            pieces.append(leaf[:, low:high])
        offset += width
    return pieces[0] if len(pieces) == 1 else bk.concatenate(pieces, axis=1)
