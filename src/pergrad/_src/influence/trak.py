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

:class:`Trak`, the estimator (``protocol.py``) behind :func:`pergrad.influence.trak`, does it
all in memory in one call. The pieces it is made of (:class:`TrakOptions`,
:class:`ModelFeaturizer`, :func:`eigh_psd` / :func:`solve_eigh`) are shared with
``trak_store.py``, which streams the training features to disk and scores new targets later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_loss import FlatLoss, check_batch, check_fn, slice_batch
from pergrad._src.influence.ihvp import as_backend_array
from pergrad._src.influence.kronecker import FactoredProjection
from pergrad._src.influence.projection import KINDS, MAX_MATRIX_NUMBERS, SeededProjection
from pergrad._src.influence.protocol import Estimator, Task

# Examples whose (n, P) per-example gradients are formed at once, by default: n * P <= this.
DEFAULT_CHUNK_NUMBERS = 2**25
PROJECTIONS = ("dense", "factored")


@dataclass(frozen=True, eq=False)
class Trak(Estimator, name="trak"):
    """TRAK over the ensemble of ``task.params`` (a list of parameter pytrees); ``task.fn`` is
    the model OUTPUT of one example. The options are :func:`pergrad.influence.trak`'s.

    Its kernel needs every training example's features before any score, so it implements
    ``scores`` and not ``prepare``: :func:`pergrad.influence.top_k` refuses it; the store
    :class:`pergrad.influence.TRAK` featurises a stream once and ranks targets against it.
    """

    weight_fn: Callable[..., Any] | None = None
    proj_dim: int = 2048
    damping: float | Sequence[float] = 0.0
    seed: int = 0
    kind: str = "rademacher"
    projection: str = "dense"
    factored_dims: tuple[int, int] = (16, 16)

    @property
    def options(self) -> TrakOptions:
        return TrakOptions(self.proj_dim, self.seed, self.kind, self.projection, self.factored_dims)

    def scores(self, task: Task, train_batch: Any, test_batch: Any) -> Any:
        """``mean_m(s_m) * mean_m(Q_m)``, one model at a time (its projection matrix and
        features held while it is scored)."""
        name = task.caller
        check_checkpoints(name, task.params, task.params_name)
        grid = check_dampings(name, self.damping)
        options = self.options
        options.check(name)
        if self.weight_fn is not None:
            check_fn(name, self.weight_fn, "weight_fn")
        total_scores, total_weights = None, None
        for index, params in enumerate(task.params):
            model = ModelFeaturizer(name, task.fn, params, index, options, task.chunk_size)
            model.output.target(task.target_fn)  # validates target_fn before any work
            train, n_train = check_batch(name, "train_batch", model.backend, train_batch)
            targets, n_targets = check_batch(name, "target_batch", model.backend, test_batch)
            phi = model.features(train, n_train)
            phi_target = model.features(targets, n_targets, task.target_fn)
            scores = _kernel_scores(model.backend, phi, phi_target, grid)
            if self.weight_fn is not None:
                weights = model.weights(self.weight_fn, train, n_train)
                total_weights = weights if total_weights is None else total_weights + weights
            total_scores = scores if total_scores is None else total_scores + scores
        count = len(task.params)
        result = total_scores / count
        if total_weights is not None:
            result = result * (total_weights / count)[None, :, None]
        return result if isinstance(self.damping, (list, tuple)) else result[0]


@dataclass(frozen=True)
class TrakOptions:
    """How TRAK features are made; the same options give the same features on both
    frameworks (model ``m`` of an ensemble projects with seed ``seed + m``)."""

    proj_dim: int = 2048
    seed: int = 0
    kind: str = "rademacher"
    projection: str = "dense"
    factored_dims: tuple[int, int] = (16, 16)

    def check(self, name: str) -> None:
        if not (_is_int(self.proj_dim) and self.proj_dim > 0):
            raise PergradValueError(
                f"{name}: proj_dim must be a positive int; got {self.proj_dim!r}."
            )
        if not (_is_int(self.seed) and self.seed >= 0):
            raise PergradValueError(f"{name}: seed must be a non-negative int; got {self.seed!r}.")
        if self.kind not in KINDS:
            raise PergradValueError(
                f"{name}: kind must be one of {list(KINDS)}; got {self.kind!r}."
            )
        if self.projection not in PROJECTIONS:
            raise PergradValueError(
                f"{name}: projection must be 'dense' or 'factored'; got {self.projection!r}."
            )
        dims = self.factored_dims
        if not (
            isinstance(dims, (tuple, list))
            and len(dims) == 2
            and all(_is_int(d) and d > 0 for d in dims)
        ):
            raise PergradValueError(
                f"{name}: factored_dims must be a pair of positive ints (k_in, k_out); got "
                f"{dims!r}."
            )


class ModelFeaturizer:
    """Model ``index`` of an ensemble: its TRAK features and weights ``Q`` for batches.

    The dense projection's ``(P, k)`` matrix (and the factored projection's matrix for the
    parameters outside dense layers) is kept between calls when it holds at most
    ``matrix_budget`` numbers (callers holding several models give each a share of
    :data:`MAX_MATRIX_NUMBERS`); otherwise it is drawn block by block on each call."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        params: Any,
        index: int,
        options: TrakOptions,
        chunk_size: int | None,
        matrix_budget: int = MAX_MATRIX_NUMBERS,
    ) -> None:
        self.output = FlatLoss.create(
            name, fn, params, chunk_size, arg_name=f"checkpoints[{index}]"
        )
        self.backend = self.output.backend
        self.fn, self.params, self.options = fn, params, options
        self.seed = options.seed + index
        size = self.output.flat.size
        self.projection = SeededProjection(
            self.backend,
            size,
            options.proj_dim,
            self.seed,
            options.kind,
            size * options.proj_dim <= matrix_budget,
        )
        k_in, k_out = options.factored_dims
        self.factored = FactoredProjection(
            self.seed, k_in, k_out, options.proj_dim, matrix_budget=matrix_budget
        )

    def features(self, batch: tuple, count: int, target_fn: Any = None) -> Any:
        """``(count, D)`` features of ``target_fn`` (default ``fn``), an array of the
        parameters' framework; ``D = proj_dim`` for the dense projection."""
        if self.options.projection == "factored":
            return self._factored(target_fn or self.fn, batch, count)
        output = self.output.target(target_fn)
        step = output.chunk_size or max(1, DEFAULT_CHUNK_NUMBERS // max(output.flat.size, 1))
        bk = self.backend
        pieces = [
            self.projection(output.grads(slice_batch(bk, batch, start, min(start + step, count))))
            for start in range(0, count, step)
        ]
        return pieces[0] if len(pieces) == 1 else bk.concatenate(pieces, axis=0)

    def _factored(self, fn: Any, batch: tuple, count: int) -> Any:
        """:func:`project_factored` features, ``chunk_size`` (default 256) examples at a time,
        with the same matrices for every call (kept between calls)."""
        step = self.output.chunk_size or 256
        pieces = [
            self.factored(
                fn, self.params, slice_batch(self.backend, batch, start, min(start + step, count))
            )
            for start in range(0, count, step)
        ]
        return pieces[0] if len(pieces) == 1 else self.backend.concatenate(pieces, axis=0)

    def weights(self, weight_fn: Any, batch: tuple, count: int) -> Any:
        """``(count,)`` ``weight_fn`` of each example at the model's parameters."""
        bk = self.backend
        unravel = self.output.flat.unravel

        def one(vector: Any, example: tuple[Any, ...]) -> Any:
            return weight_fn(unravel(vector), *example)

        values = bk.vmap(one, (None, 0), self.output.chunk_size, None)(
            self.output.flat.vector, batch
        )
        if tuple(bk.shape(values)) != (count,):
            raise PergradValueError(
                f"{self.output.func_name}: weight_fn must return a scalar for one example; got "
                f"shape {tuple(bk.shape(values))[1:]} per example."
            )
        return bk.stop_gradient(values)


def _kernel_scores(bk: Any, phi: Any, phi_target: Any, dampings: list[float]) -> Any:
    """``Phi (Phi^T Phi + d I)^-1 phi_target^T`` for each damping ``d``, ``(len, n, m)``,
    solved in float64 on the smaller side from one eigendecomposition; a pseudo-inverse
    (eigenvalues below rounding dropped) where the system is singular."""
    train = bk.to_numpy(phi).astype(np.float64)
    target = bk.to_numpy(phi_target).astype(np.float64)
    n, k = train.shape
    if n <= k:  # (Phi Phi^T + d I)^-1 Phi phi^T: an n x n system
        solved = solve_eigh(eigh_psd(train @ train.T), train @ target.T, dampings)
    else:  # (len, n, m)
        solved = train @ solve_eigh(eigh_psd(train.T @ train), target.T, dampings)
    return as_backend_array(bk, solved, phi)


def eigh_psd(gram: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Eigenvalues, eigenvectors and the rounding cutoff of a symmetric PSD matrix (float64)."""
    values, vectors = np.linalg.eigh(gram)
    cutoff = len(values) * np.finfo(np.float32).eps * max(float(np.abs(values).max()), 1e-300)
    return values, vectors, cutoff


def solve_eigh(
    eigh: tuple[np.ndarray, np.ndarray, float], right: np.ndarray, dampings: list[float]
) -> np.ndarray:
    """``(G + d I)^-1 right`` for each damping ``d``, stacked ``(len, *right.shape)``, from
    :func:`eigh_psd` of ``G``; eigenvalues ``+ d`` below the cutoff count as zero (a
    pseudo-inverse)."""
    values, vectors, cutoff = eigh
    projected = vectors.T @ right
    solutions = []
    for damping in dampings:
        shifted = values + damping
        inverse = np.where(shifted > cutoff, 1.0 / np.where(shifted > cutoff, shifted, 1.0), 0.0)
        solutions.append(vectors @ (inverse[:, None] * projected))
    return np.stack(solutions)


def check_checkpoints(name: str, checkpoints: Any, arg_name: str = "checkpoints") -> None:
    if not isinstance(checkpoints, (list, tuple)) or not checkpoints:
        raise PergradTypeError(
            f"{name}: {arg_name} must be a non-empty list of parameter pytrees (one per model of "
            f"the ensemble); got {type(checkpoints).__name__}"
            f"{' of length 0' if isinstance(checkpoints, (list, tuple)) else ''}."
        )


def check_dampings(name: str, damping: Any) -> list[float]:
    """``damping`` (a number or a non-empty list of them) as a list of finite numbers >= 0."""
    grid = list(damping) if isinstance(damping, (list, tuple)) else [damping]
    if not grid:
        raise PergradValueError(f"{name}: damping must be a number or a non-empty list of them.")
    for value in grid:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value >= 0):
            raise PergradValueError(f"{name}: damping must be a finite number >= 0; got {value!r}.")
    return [float(value) for value in grid]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
