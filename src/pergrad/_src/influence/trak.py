"""TRAK (Park et al. 2023, "TRAK: Attributing Model Behavior at Scale"), on both frameworks.

For each model ``m`` of an ensemble (independently trained, or checkpoints of one run):

1. features: each example's gradient of the model OUTPUT function ``f`` (for classification
   the margin, ``logit_y - logsumexp(other logits)``), randomly projected to ``k`` dimensions
   with a seeded matrix (``projection.py``): ``Phi_m`` ``(n_train, k)``, ``phi_m`` for targets;
2. the kernel: ``s_m = Phi_m (Phi_m^T Phi_m + damping I)^-1 phi_m^T`` ``(n_train, n_targets)``,
   solved on the smaller side (``(Phi Phi^T + damping I)^-1 Phi phi^T`` when ``n_train < k``:
   the same matrix, by the push-through identity);
3. the weighting ``Q``: each training example's derivative of its loss with respect to its
   output, in magnitude (``1 - p_y`` for the cross-entropy and the margin).

The scores are ``mean_m(s_m) * mean_m(Q_m)`` per training example, as ``traker`` computes
them. Positive: the training example raises the target's output (helps it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.ihvp import as_backend_array
from pergrad._src.influence.kronecker import project_factored
from pergrad._src.influence.projection import KINDS, matrix_rows
from pergrad._src.influence.scores import FlatLoss, check_batch, check_fn, slice_batch

# The (P, k) projection matrix is drawn once per model when it holds at most this many numbers
# (256 MB in float32); otherwise each chunk of examples is projected block by block.
MAX_MATRIX_NUMBERS = 2**26
# Examples whose (n, P) per-example gradients are formed at once, by default: n * P <= this.
DEFAULT_CHUNK_NUMBERS = 2**25


def trak(
    fn: Callable[..., Any],
    checkpoints: Sequence[Any],
    train_batch: Sequence[Any],
    target_batch: Sequence[Any],
    *,
    weight_fn: Callable[..., Any] | None = None,
    target_fn: Callable[..., Any] | None = None,
    proj_dim: int = 2048,
    damping: float = 0.0,
    seed: int = 0,
    kind: str = "rademacher",
    projection: str = "dense",
    factored_dims: tuple[int, int] = (16, 16),
    chunk_size: int | None = None,
) -> Any:
    """TRAK attribution scores of each training example for each target.

    Args:
      fn: the model OUTPUT of one example, ``fn(params, *example) -> scalar``: for
        classification the margin ``logits[y] - logsumexp(logits without y)``.
      checkpoints: a non-empty list of parameter pytrees, one per model of the ensemble
        (independently trained models work best; checkpoints of one run are cheaper).
      train_batch: tuple of ``fn``'s batched arguments for the training examples.
      target_batch: the same for the targets (or ``target_fn``'s, if given).
      weight_fn: ``weight_fn(params, *example) -> scalar`` ``Q``, how much the example's loss
        moves with its output; for the cross-entropy and the margin, ``1 - p_y`` (the softmax
        probability of the true class). Default: 1 for every example.
      target_fn: the output of one target, if not ``fn``.
      proj_dim: ``k``, the projected dimension (TRAK uses 2048 to 20480).
      damping: ``>= 0``, added to ``Phi^T Phi`` (``lambda`` in ``traker``); 0 uses the
        pseudo-inverse where ``Phi^T Phi`` is singular (fewer examples than ``k``). A list of
        them (a grid to tune on) returns ``(len(damping), n_train, n_targets)`` scores from
        the same features and one eigendecomposition per model.
      seed: model ``m`` projects with seed ``seed + m`` (:func:`project`'s matrix, the same on
        both frameworks).
      kind: ``"rademacher"`` (default, as ``traker``) or ``"gaussian"`` entries.
      projection: ``"dense"`` (default: the per-example gradient formed, then projected to
        ``proj_dim``) or ``"factored"`` (:func:`project_factored`: each dense layer's
        ``k_in x k_out`` block from its input and output gradient, never forming its gradient,
        ``factored_dims = (k_in, k_out)``; the other parameters projected to ``proj_dim``
        together). In PyTorch ``"factored"`` needs ``fn`` made by :func:`pergrad.module_loss`.
      chunk_size: per-example gradients of this many examples at a time (default: as many as
        keep ``chunk_size x P`` under 2**25 numbers).

    Returns:
      ``(n_train, n_targets)`` scores, an array of the parameters' framework (for a list of
      dampings, one such matrix per damping, stacked).

    Example (classification)::

        def margin(params, x, y):
            logits = model(params, x)
            return logits[y] - jax.nn.logsumexp(jnp.where(jnp.arange(10) == y, -jnp.inf, logits))

        def weight(params, x, y):
            return 1 - jax.nn.softmax(model(params, x))[y]

        scores = pergrad.influence.trak(margin, [params_1, params_2, ...], (X_train, Y_train),
                                        (X_test, Y_test), weight_fn=weight)

    Cost per model: per-example gradients of both sides, ``n x P x k`` for the projection, and
    a ``min(n_train, k)``-sized symmetric solve (in float64, on the host).
    """
    name = "trak"
    if not isinstance(checkpoints, (list, tuple)) or not checkpoints:
        raise PergradTypeError(
            f"{name}: checkpoints must be a non-empty list of parameter pytrees (one per model of "
            f"the ensemble); got {type(checkpoints).__name__}"
            f"{' of length 0' if isinstance(checkpoints, (list, tuple)) else ''}."
        )
    grid = list(damping) if isinstance(damping, (list, tuple)) else [damping]
    if not grid:
        raise PergradValueError(f"{name}: damping must be a number or a non-empty list of them.")
    for value in grid:
        _check_options(name, proj_dim, value, seed, kind)
    if projection not in ("dense", "factored"):
        raise PergradValueError(
            f"{name}: projection must be 'dense' or 'factored'; got {projection!r}."
        )
    if weight_fn is not None:
        check_fn(name, weight_fn, "weight_fn")
    total_scores, total_weights = None, None
    for index, params in enumerate(checkpoints):
        arg_name = f"checkpoints[{index}]"
        output = FlatLoss.create(name, fn, params, chunk_size, arg_name=arg_name)
        target = output.target(target_fn)
        bk = output.backend
        train, n_train = check_batch(name, "train_batch", bk, train_batch)
        targets, n_targets = check_batch(name, "target_batch", bk, target_batch)
        if projection == "factored":
            options = (factored_dims, proj_dim, seed + index, chunk_size or 256)
            phi = _factored_features(bk, fn, params, train, n_train, options)
            phi_target = _factored_features(
                bk, target_fn or fn, params, targets, n_targets, options
            )
        else:
            matrix = _Projection(bk, output.flat.size, proj_dim, seed + index, kind)
            phi = _features(output, train, n_train, matrix)
            phi_target = _features(target, targets, n_targets, matrix)
        scores = _kernel_scores(bk, phi, phi_target, grid)
        weights = _weights(output, weight_fn, train, n_train) if weight_fn is not None else None
        total_scores = scores if total_scores is None else total_scores + scores
        if weights is not None:
            total_weights = weights if total_weights is None else total_weights + weights
    count = len(checkpoints)
    result = total_scores / count
    if total_weights is not None:
        result = result * (total_weights / count)[None, :, None]
    return result if isinstance(damping, (list, tuple)) else result[0]


class _Projection:
    """The ``(P, k)`` matrix of :func:`project` for one seed, drawn once when it is small."""

    def __init__(self, bk: Any, size: int, k: int, seed: int, kind: str) -> None:
        self.bk, self.size, self.k, self.seed, self.kind = bk, size, k, seed, kind
        self.matrix: Any = None

    def __call__(self, grads: Any) -> Any:
        if self.size * self.k <= MAX_MATRIX_NUMBERS:
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


def _features(output: FlatLoss, batch: tuple, count: int, projection: _Projection) -> Any:
    """``(count, k)`` projected per-example gradients of ``output``'s function, in chunks."""
    step = output.chunk_size or max(1, DEFAULT_CHUNK_NUMBERS // max(output.flat.size, 1))
    bk = output.backend
    pieces = [
        projection(output.grads(slice_batch(bk, batch, start, min(start + step, count))))
        for start in range(0, count, step)
    ]
    return pieces[0] if len(pieces) == 1 else bk.concatenate(pieces, axis=0)


def _factored_features(
    bk: Any, fn: Any, params: Any, batch: tuple, count: int, options: tuple
) -> Any:
    """``(count, D)`` :func:`project_factored` features, ``step`` examples at a time."""
    (k_in, k_out), other_dim, seed, step = options
    pieces = [
        project_factored(
            fn,
            params,
            slice_batch(bk, batch, start, min(start + step, count)),
            k_in=k_in,
            k_out=k_out,
            other_dim=other_dim,
            seed=seed,
        )
        for start in range(0, count, step)
    ]
    return pieces[0] if len(pieces) == 1 else bk.concatenate(pieces, axis=0)


def _kernel_scores(bk: Any, phi: Any, phi_target: Any, dampings: list[float]) -> Any:
    """``Phi (Phi^T Phi + d I)^-1 phi_target^T`` for each damping ``d``, ``(len, n, m)``,
    solved in float64 on the smaller side from one eigendecomposition; a pseudo-inverse
    (eigenvalues below rounding dropped) where the system is singular."""
    train = bk.to_numpy(phi).astype(np.float64)
    target = bk.to_numpy(phi_target).astype(np.float64)
    n, k = train.shape
    if n <= k:  # (Phi Phi^T + d I)^-1 Phi phi^T: an n x n system
        solved = _solve_psd(train @ train.T, train @ target.T, dampings)
    else:
        solved = train @ _solve_psd(train.T @ train, target.T, dampings)  # (len, n, m)
    return as_backend_array(bk, solved, phi)


def _solve_psd(gram: np.ndarray, right: np.ndarray, dampings: list[float]) -> np.ndarray:
    values, vectors = np.linalg.eigh(gram)
    cutoff = len(values) * np.finfo(np.float32).eps * max(float(np.abs(values).max()), 1e-300)
    projected = vectors.T @ right
    solutions = []
    for damping in dampings:
        shifted = values + damping
        inverse = np.where(shifted > cutoff, 1.0 / np.where(shifted > cutoff, shifted, 1.0), 0.0)
        solutions.append(vectors @ (inverse[:, None] * projected))
    return np.stack(solutions)


def _weights(output: FlatLoss, weight_fn: Any, batch: tuple, count: int) -> Any:
    """``(n,)`` ``weight_fn`` of each training example at the model's parameters."""
    bk = output.backend
    unravel = output.flat.unravel

    def one(vector: Any, example: tuple[Any, ...]) -> Any:
        return weight_fn(unravel(vector), *example)

    values = bk.vmap(one, (None, 0), output.chunk_size, None)(output.flat.vector, batch)
    if tuple(bk.shape(values)) != (count,):
        raise PergradValueError(
            f"trak: weight_fn must return a scalar for one example; got shape "
            f"{tuple(bk.shape(values))[1:]} per example."
        )
    return bk.stop_gradient(values)


def _check_options(name: str, proj_dim: Any, damping: Any, seed: Any, kind: Any) -> None:
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (is_int(proj_dim) and proj_dim > 0):
        raise PergradValueError(f"{name}: proj_dim must be a positive int; got {proj_dim!r}.")
    ok = isinstance(damping, (int, float)) and not isinstance(damping, bool)
    if not (ok and math.isfinite(damping) and damping >= 0):
        raise PergradValueError(f"{name}: damping must be a finite number >= 0; got {damping!r}.")
    if not (is_int(seed) and seed >= 0):
        raise PergradValueError(f"{name}: seed must be a non-negative int; got {seed!r}.")
    if kind not in KINDS:
        raise PergradValueError(f"{name}: kind must be one of {list(KINDS)}; got {kind!r}.")
