"""K-FAC and EK-FAC curvature: ``(F + damping I)^-1`` through per-layer eigendecompositions.

``F`` is block diagonal, one block per float leaf of the parameters, built from the capture
engine's records (two quantities of ``capture/quantities.py``, written once for both
frameworks) over the Hessian batch, ``chunk_size`` examples per captured pass:

* a dense layer's or convolution's weight, ``G_i = sum_t g_t a_t^T`` per example (``a_t`` the
  input at position ``t``, ``g_t`` the gradient at the output): the Kronecker block
  ``A (x) S`` with ``A = mean_i (1/T) sum_t a_t a_t^T`` and ``S = mean_i sum_t g_t g_t^T`` (for
  ``T = 1`` the K-FAC factors; for ``T > 1`` the "expand" scaling of Eschenhagen et al. 2023,
  which makes ``A (x) S`` exact when positions are independent). Eigendecompositions
  ``A = Q_A diag(l_A) Q_A^T`` and ``S = Q_S diag(l_S) Q_S^T`` give the inverse; K-FAC's
  eigenvalues are ``l_S l_A^T``, EK-FAC's a second pass's ``mean_i (Q_S^T G_i Q_A)^2``,
  computed per example as ``sum_t (Q_S^T g_t)(Q_A^T a_t)^T``.
* any other leaf: its per-example gradients' ``mean g g^T`` eigendecomposed (at most
  ``dense_limit`` entries) or their ``mean g^2`` (a diagonal).

Every eigendecomposition is taken once, in float64 numpy, and serves every damping of a grid.
:class:`KFAC` and :class:`EKFAC` are the two solvers (``protocol.py``'s :class:`Solver`) made of
it: ``prepare`` factors the curvature, ``solve`` applies its inverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from pergrad._src.api.reductions import layer_reductions_of
from pergrad._src.backends import Backend, backend_of
from pergrad._src.capture.quantities import register_quantity
from pergrad._src.errors import PergradValueError, warn_from_caller
from pergrad._src.influence.flat_loss import FlatLoss
from pergrad._src.influence.flat_params import FlatParams
from pergrad._src.influence.ihvp import as_backend_array
from pergrad._src.influence.protocol import Solver

FACTORS = "pergrad.kfac_factors"
EIGENVALUES = "pergrad.ekfac_eigenvalues"


@dataclass(frozen=True)
class KroneckerSolver(Solver):
    """What :class:`KFAC` and :class:`EKFAC` share: ``prepare`` factors the curvature of the
    Hessian batch (:func:`factorize`), ``solve`` applies its inverse for every damping."""

    dense_limit: int = 2048
    # EK-FAC: replace the Kronecker eigenvalues by a second pass's (George et al. 2018)
    corrects_eigenvalues: ClassVar[bool] = False

    def __post_init__(self) -> None:
        ok = isinstance(self.dense_limit, int) and not isinstance(self.dense_limit, bool)
        if not (ok and self.dense_limit >= 0):
            raise PergradValueError(
                f"{type(self).__name__}: dense_limit must be an int >= 0; got {self.dense_limit!r}."
            )

    def prepare(self, caller: str, loss: FlatLoss, batch: tuple, count: int) -> Curvature:
        if loss.regularizer is not None:
            raise PergradValueError(
                f"{caller}: solver={type(self).__name__} builds its curvature from "
                f"per-example gradients, so it cannot add a regularizer's Hessian; got "
                f"regularizer={getattr(loss.regularizer, '__name__', loss.regularizer)!r}. An "
                f"L2 penalty l2 / 2 * |params|^2 is damping=l2 (add it to your damping); else "
                f"use solver='cg' or 'exact'."
            )
        return factorize(caller, loss.fn, loss.flat, loss.chunks(batch, count), count, self)

    def solve(self, caller: str, prepared: Curvature, rows: Any, dampings: list) -> list[Any]:
        return prepared.solve(caller, rows, dampings)


@dataclass(frozen=True)
class KFAC(KroneckerSolver, name="kfac"):
    """Kronecker-factored curvature (K-FAC: Martens & Grosse 2015; convolutions: Grosse &
    Martens 2016), inverted through two small eigendecompositions per layer.

    Each weight of a dense layer (``nn.Linear``, Hugging Face's ``Conv1D``, a JAX ``x @ W``
    or ``W @ x``) or convolution (PyTorch ``nn.Conv1d`` / ``nn.Conv2d``, ``groups=1``) gets the
    block ``A (x) S``, from one pass over the Hessian batch: ``A`` the mean over examples and
    positions of ``a a^T`` (``a``: the layer's input at a position, a conv patch), ``S`` the
    mean over examples of ``sum_t g_t g_t^T`` (``g_t``: the gradient of ``fn`` at the layer's
    output). ``(A (x) S + damping I)^-1`` costs a ``p x p`` and a ``q x q`` eigendecomposition
    per ``q x p`` weight, shared by every damping of a grid. Every other parameter (biases,
    norms' scales, embeddings, bare parameters, JAX convolutions) gets a block of its own: the
    exact one (the mean of ``g g^T`` of its per-example gradients, eigendecomposed) when it has
    at most ``dense_limit`` numbers, else the diagonal (the mean of ``g^2``). Blocks do not
    interact: a weight and its bias are two blocks.

    The curvature is the empirical Fisher of the Hessian batch (``g`` from ``fn`` at each
    example's own labels), see :func:`pergrad.influence.influence_function`.

    Args:
      dense_limit: the largest parameter (number of entries) that gets an exact block rather
        than a diagonal when no layer factors it; its block costs ``dense_limit^2`` memory.
    """


@dataclass(frozen=True)
class EKFAC(KroneckerSolver, name="ekfac"):
    """Eigenvalue-corrected K-FAC (George et al. 2018), as Kronfluence uses it (Grosse et al.
    2023): K-FAC's eigenbasis, with each Kronecker eigenvalue replaced by the mean squared
    per-example gradient in that basis, ``mean_i (Q_S^T G_i Q_A)^2``.

    The corrected eigenvalues are the exact diagonal of the empirical Fisher in K-FAC's
    eigenbasis, so EK-FAC is never further from it than K-FAC (in Frobenius norm). Cost: one
    more pass over the Hessian batch than :class:`KFAC`, forming each example's gradient in
    the rotated basis (``q x p`` per example and layer, ``chunk_size`` examples at a time; for
    a layer applied at one position, never formed).

    Args:
      dense_limit: as for :class:`KFAC`.
    """

    corrects_eigenvalues: ClassVar[bool] = True


@dataclass
class KroneckerRecord:
    """What the plug-ins return for a factored weight, summed over a chunk's examples.

    Attributes:
      key: identifies the layer across passes (the PyTorch module's id, the JAX site's path).
      layout: ``"out_in"`` when the weight flattens like ``G`` ``(q, p)``, ``"in_out"`` when
        like ``G^T`` ``(p, q)``.
      shape: the weight's shape.
      first: the factor pass: ``sum_i (1/T) sum_t a_t a_t^T`` ``(p, p)``; the eigenvalue pass:
        ``sum_i (Q_S^T G_i Q_A)^2`` ``(q, p)``.
      second: the factor pass: ``sum_i sum_t g_t g_t^T`` ``(q, q)``; else None.
    """

    key: Any
    layout: str
    shape: tuple[int, ...]
    first: Any
    second: Any = None


def factor_record(key: Any, layout: str, shape: Any, a: Any, g: Any) -> KroneckerRecord:
    """The factor pass of a layer with inputs ``a`` ``(B, T, p)`` and output gradients ``g``
    ``(B, T, q)`` (either framework)."""
    positions = a.shape[1]
    flat_a, flat_g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    return KroneckerRecord(
        key, layout, tuple(shape), (flat_a.T @ flat_a) / positions, flat_g.T @ flat_g
    )


def eigenvalue_record(
    key: Any, layout: str, shape: Any, a: Any, g: Any, bases: dict[Any, Any]
) -> KroneckerRecord:
    """The eigenvalue pass: ``sum_i (Q_S^T G_i Q_A)^2`` ``(q, p)`` with ``(Q_A, Q_S) =
    bases[key]`` (numpy), never forming ``G_i`` for a layer applied at one position."""
    bk = backend_of(a, "EKFAC", "params")
    q_in, q_out = (as_backend_array(bk, m, a) for m in bases[key])
    rotated_a, rotated_g = a @ q_in, g @ q_out
    if a.shape[1] == 1:
        squared = (rotated_g[:, 0] ** 2).T @ (rotated_a[:, 0] ** 2)
    else:
        squared = ((rotated_g.mT @ rotated_a) ** 2).sum(0)
    return KroneckerRecord(key, layout, tuple(shape), squared)


# --------------------------------------------------------------------------------------------
# The blocks of the factored inverse.


@dataclass
class KroneckerBlock:
    """``(Q_S (x) Q_A) diag(eigenvalues) (Q_S (x) Q_A)^T`` for a weight's slice of the rows.

    ``left`` and ``right`` are the eigenvectors that act on the weight's rows and columns
    (``Q_S, Q_A`` for ``"out_in"``, ``Q_A, Q_S`` for ``"in_out"``), ``eigenvalues`` shaped
    like the weight seen as a matrix."""

    name: str
    left: np.ndarray
    right: np.ndarray
    eigenvalues: np.ndarray

    def solve(self, bk: Backend, rows: Any, dampings: list[float]) -> list[Any]:
        count = bk.shape(rows)[0]
        left, right = (as_backend_array(bk, m, rows) for m in (self.left, self.right))
        matrices = rows.reshape(count, *self.eigenvalues.shape)
        rotated = left.T @ matrices @ right
        return [
            (left @ (rotated / as_backend_array(bk, self.eigenvalues + d, rows)) @ right.T).reshape(
                count, self.eigenvalues.size
            )
            for d in dampings
        ]


@dataclass
class DenseBlock:
    """``Q diag(eigenvalues) Q^T``, the exact block of a small leaf no layer factors."""

    name: str
    vectors: np.ndarray
    eigenvalues: np.ndarray

    def solve(self, bk: Backend, rows: Any, dampings: list[float]) -> list[Any]:
        vectors = as_backend_array(bk, self.vectors, rows)
        rotated = rows @ vectors
        return [
            (rotated / as_backend_array(bk, self.eigenvalues + d, rows)) @ vectors.T
            for d in dampings
        ]


@dataclass
class DiagonalBlock:
    """``diag(eigenvalues)``, the mean squared per-example gradient of a large leaf."""

    name: str
    eigenvalues: np.ndarray

    def solve(self, bk: Backend, rows: Any, dampings: list[float]) -> list[Any]:
        return [rows / as_backend_array(bk, self.eigenvalues + d, rows) for d in dampings]


Block = KroneckerBlock | DenseBlock | DiagonalBlock


@dataclass
class Curvature:
    """The factored curvature, one block per float leaf in the flat parameters' order."""

    method: str
    backend: Backend
    blocks: list[Block]
    sizes: list[int]

    def solve(self, func_name: str, rows: Any, dampings: list[float]) -> list[Any]:
        """``(F + d I)^-1 rows`` for each damping ``d``, rows ``(k, P)``."""
        bk = self.backend
        for damping in dampings:
            self._check_invertible(func_name, damping, bk.dtype_name(rows))
        pieces: list[list[Any]] = [[] for _ in dampings]
        start = 0
        for block, size in zip(self.blocks, self.sizes):
            for piece, solved in zip(
                pieces, block.solve(bk, rows[:, start : start + size], dampings)
            ):
                piece.append(solved)
            start += size
        return [p[0] if len(p) == 1 else bk.concatenate(p, axis=1) for p in pieces]

    def _check_invertible(self, func_name: str, damping: float, dtype_name: str) -> None:
        """Refuse a singular ``F + damping I``: an eigenvalue within the rounding of the
        largest in the rows' dtype, where the solve runs (``F`` is positive semi-definite, its
        factors summed and decomposed in float64, so none is negative beyond rounding). A
        condition number up to ``1 / (16 eps)`` (about 5e5 in float32) is solved to a relative
        ``16 eps`` of it; the eigendecomposition's own error, float64's, is far below."""
        largest = max(float(np.abs(b.eigenvalues).max(initial=0.0)) for b in self.blocks)
        resolution = 16 * np.finfo(np.dtype(dtype_name)).eps * largest
        smallest, where = min(
            (float(b.eigenvalues.min(initial=np.inf)) + damping, b.name) for b in self.blocks
        )
        if smallest > resolution:
            return
        suggested = max(1e-3 * largest, 1e-8)
        raise PergradValueError(
            f"{func_name}: the {self.method} curvature F + damping*I is singular (smallest "
            f"eigenvalue {smallest:.3g}, in the block of {where}; largest {largest:.3g}), so "
            f"its inverse does not exist. Its factors are singular when a layer has more inputs "
            f"than the Hessian batch has examples (times positions), or units that never "
            f"activate; pass {'damping > 0' if damping == 0 else 'a larger damping'}, e.g. "
            f"damping={suggested:.2g}."
        )


# --------------------------------------------------------------------------------------------
# Building it.


@dataclass
class _Sums:
    """Running sums over the chunks of the Hessian batch, per leaf (numpy float64)."""

    records: dict[int, KroneckerRecord] = field(default_factory=dict)
    dense: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, k: int, value: Any, bk: Backend, dense_limit: int) -> None:
        if isinstance(value, KroneckerRecord):
            first = bk.to_numpy(value.first).astype(np.float64)
            second = None if value.second is None else bk.to_numpy(value.second).astype(np.float64)
            if k in self.records:
                old = self.records[k]
                first = old.first + first
                second = None if second is None else old.second + second
            self.records[k] = KroneckerRecord(value.key, value.layout, value.shape, first, second)
            return
        count = bk.shape(value)[0]
        grads = value.reshape(count, -1)
        size = bk.shape(grads)[1]
        total = grads.T @ grads if size <= dense_limit else (grads * grads).sum(0)
        total = bk.to_numpy(total).astype(np.float64)
        self.dense[k] = self.dense[k] + total if k in self.dense else total


def factorize(
    func_name: str,
    fn: Callable[..., Any],
    flat: FlatParams,
    chunks: Sequence[tuple[Any, ...]],
    count: int,
    solver: KroneckerSolver,
) -> Curvature:
    """The K-FAC / EK-FAC curvature of ``fn`` over ``chunks`` (the Hessian batch, ``count``
    examples, split into captured passes), at the parameters ``flat``."""
    params = flat.unravel(flat.vector)
    names = [flat.paths[i] or "the parameters" for i in flat.positions]
    sums = _Sums()
    for chunk in chunks:
        results = layer_reductions_of(fn, params, *chunk, reduction=FACTORS)
        _check_leaves(func_name, flat, results, names)
        for k, result in enumerate(results):
            sums.add(k, result.value, flat.backend, solver.dense_limit)
    bases = {
        record.key: (_eigh(record.first / count), _eigh(record.second / count))
        for record in sums.records.values()
    }
    corrected: dict[int, np.ndarray] = {}
    if solver.corrects_eigenvalues and sums.records:
        arguments = ({key: (a[1], s[1]) for key, (a, s) in bases.items()},)
        for chunk in chunks:
            results = layer_reductions_of(
                fn, params, *chunk, reduction=EIGENVALUES, reduction_args=arguments
            )
            for k in sums.records:
                squared = flat.backend.to_numpy(results[k].value.first).astype(np.float64)
                corrected[k] = corrected[k] + squared if k in corrected else squared
    if not sums.records:
        warn_from_caller(
            f"{func_name}: {type(solver).__name__} found no layer whose weight it can factor "
            f"(dense layers and convolutions the capture engine records; in PyTorch a loss made "
            f"by pergrad.module_loss), so every parameter gets a block of its own: exact up to "
            f"dense_limit={solver.dense_limit} entries, diagonal beyond."
        )
    blocks = []
    for k, name in enumerate(names):
        if k in sums.records:
            record = sums.records[k]
            (l_in, q_in), (l_out, q_out) = bases[record.key]
            eigenvalues = corrected[k] / count if k in corrected else np.outer(l_out, l_in)
            blocks.append(_kronecker_block(name, record.layout, q_in, q_out, eigenvalues))
        elif sums.dense[k].ndim == 2:
            eigenvalues, vectors = _eigh(sums.dense[k] / count)
            blocks.append(DenseBlock(name, vectors, eigenvalues))
        else:
            blocks.append(DiagonalBlock(name, sums.dense[k] / count))
    sizes = [math.prod(shape) for shape in flat.shapes]
    return Curvature(type(solver).__name__, flat.backend, blocks, sizes)


def _kronecker_block(
    name: str, layout: str, q_in: np.ndarray, q_out: np.ndarray, eigenvalues: np.ndarray
) -> KroneckerBlock:
    """``eigenvalues`` ``(q, p)``, in the weight's layout."""
    if layout == "out_in":
        return KroneckerBlock(name, q_out, q_in, eigenvalues)
    return KroneckerBlock(name, q_in, q_out, eigenvalues.T)


def _eigh(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (clipped at 0: the factors are positive semi-definite) and eigenvectors of
    a symmetrised ``matrix``."""
    eigenvalues, eigenvectors = np.linalg.eigh((matrix + matrix.T) * 0.5)
    return np.clip(eigenvalues, 0.0, None), eigenvectors


def _check_leaves(func_name: str, flat: FlatParams, results: list[Any], names: list[str]) -> None:
    """The engine's leaves must be the flat parameters' (same order and shapes)."""
    bk = flat.backend
    shapes = [
        r.value.shape if isinstance(r.value, KroneckerRecord) else tuple(bk.shape(r.value)[1:])
        for r in results
    ]
    if [tuple(s) for s in shapes] != [tuple(s) for s in flat.shapes]:
        raise PergradValueError(
            f"{func_name}: the capture engine saw parameters of shapes {shapes}, but params' "
            f"float leaves ({names}) have shapes {list(flat.shapes)}; K-FAC needs fn to "
            f"differentiate exactly the float leaves of params."
        )


# --------------------------------------------------------------------------------------------
# The plug-ins.

# Both frameworks, every layer family with tokens (capture/quantities.py): linear layers,
# Hugging Face's Conv1D and ungrouped convolutions in PyTorch, 2-D weights in JAX's x @ W.
register_quantity(FACTORS, lambda t: factor_record(t.key, t.layout, t.shape, t.a, t.d))
register_quantity(
    EIGENVALUES, lambda t, bases: eigenvalue_record(t.key, t.layout, t.shape, t.a, t.d, bases)
)
