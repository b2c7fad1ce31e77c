"""Top-k proponents and opponents of test examples, streamed over a training set.

The training set comes as an iterable of batches (a DataLoader, a generator reading shards), so
it never has to fit in memory: each batch's per-example gradients are scored against the test
side and only the running top-k survive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pergrad._src.errors import PergradValueError
from pergrad._src.ihvp import check_damping, check_solver, solve
from pergrad._src.influence import _check_batch, _check_same_arity, _Loss

_METHODS = ("influence", "dot", "cosine")


class TopK(NamedTuple):
    """Per test example, the training examples with the highest and lowest scores.

    Attributes:
      proponents: ``(n_test, k)`` global training indices (position in the stream), highest
        score first: the examples that help each test example most.
      proponent_scores: ``(n_test, k)`` their scores.
      opponents: ``(n_test, k)`` indices, lowest (most negative) score first.
      opponent_scores: ``(n_test, k)`` their scores.
      num_train: how many training examples were streamed.
    """

    proponents: np.ndarray
    proponent_scores: np.ndarray
    opponents: np.ndarray
    opponent_scores: np.ndarray
    num_train: int


def top_k(
    fn: Callable[..., Any],
    params: Any,
    train_batches: Iterable[Sequence[Any]],
    test_batch: Sequence[Any],
    k: int = 10,
    method: str = "influence",
    *,
    hessian_batch: Sequence[Any] | None = None,
    damping: float = 0.0,
    solver: Any = "cg",
    chunk_size: int | None = None,
    progress: bool | None = None,
) -> TopK:
    """Stream over training batches and keep each test example's top-k proponents/opponents.

    Args:
      fn: the loss of ONE example, as for :func:`pergrad.per_example_grads`.
      params: the trained parameters (pytree of JAX arrays or torch tensors).
      train_batches: an iterable of tuples of ``fn``'s batched arguments, e.g. a DataLoader
        yielding ``(x, y)``. Indices in the result count examples in the order streamed.
      test_batch: tuple of the test examples' batched arguments.
      k: how many proponents and opponents to keep per test example (``> 0``).
      method: ``"influence"`` (scores of :func:`influence_function`; needs ``hessian_batch``,
        a batch that stands for the training set's Hessian), ``"dot"`` or ``"cosine"`` of the
        gradients.
      hessian_batch, damping, solver: for ``"influence"`` (the test side is solved once).
      chunk_size: per-example gradients of this many examples at a time within a batch.
      progress: show a tqdm progress bar (default: when tqdm is installed).

    Returns:
      A :class:`TopK` of numpy arrays. Memory: the test side ``(n_test, P)`` plus one batch's
      per-example gradients; never the training set's.
    """
    name = "top_k"
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise PergradValueError(f"{name}: k must be a positive int; got {k!r}.")
    if method not in _METHODS:
        raise PergradValueError(f"{name}: method must be one of {list(_METHODS)}; got {method!r}.")
    loss = _Loss.create(name, fn, params, chunk_size)
    test, _ = _check_batch(name, "test_batch", loss.backend, test_batch)
    rows = _test_rows(name, loss, test, method, hessian_batch, damping, solver)
    best = _Running(k, largest=True)
    worst = _Running(k, largest=False)
    seen = 0
    for batch in _with_progress(train_batches, progress):
        batch, count = _check_batch(name, "each training batch", loss.backend, batch)
        _check_same_arity(name, batch, "a training batch", test, "test_batch")
        scores = loss.backend.to_numpy(_scores(loss, batch, count, rows, method))
        best.update(scores, seen)
        worst.update(scores, seen)
        seen += count
    if seen == 0:
        raise PergradValueError(f"{name}: train_batches yielded no examples.")
    return TopK(*best.result(), *worst.result(), num_train=seen)


def _test_rows(name, loss, test, method, hessian_batch, damping, solver) -> Any:
    grads = loss.grads(test)
    if method == "cosine":
        return grads / ((grads**2).sum(1, keepdims=True) ** 0.5 + 1e-12)
    if method == "dot":
        return grads
    if hessian_batch is None:
        raise PergradValueError(
            f"{name}: method='influence' needs hessian_batch, a batch of training examples "
            f"whose mean loss stands for the training set's Hessian (the stream is read once)."
        )
    batch, count = _check_batch(name, "hessian_batch", loss.backend, hessian_batch)
    operator = loss.hessian(batch, count, check_damping(name, damping))
    return solve(name, operator, grads, check_solver(name, solver))


def _scores(loss: _Loss, batch: tuple, count: int, rows: Any, method: str) -> Any:
    if method != "cosine":
        return loss.grads_dot(batch, count, rows)
    grads = loss.grads(batch)
    norms = (grads**2).sum(1, keepdims=True) ** 0.5 + 1e-12
    return (grads / norms) @ rows.T


class _Running:
    """The k best (or worst) scores per test column seen so far, with global indices."""

    def __init__(self, k: int, largest: bool) -> None:
        self.k, self.sign = k, (1.0 if largest else -1.0)
        self.scores: np.ndarray | None = None
        self.indices: np.ndarray | None = None

    def update(self, scores: np.ndarray, offset: int) -> None:
        indices = np.broadcast_to(np.arange(offset, offset + len(scores))[:, None], scores.shape)
        if self.scores is not None:
            scores = np.concatenate([self.scores, scores])
            indices = np.concatenate([self.indices, indices])
        keep = np.argsort(-self.sign * scores, axis=0, kind="stable")[: self.k]
        self.scores = np.take_along_axis(scores, keep, axis=0)
        self.indices = np.take_along_axis(indices, keep, axis=0)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.indices.T.copy(), self.scores.T.copy()


def _with_progress(batches: Iterable[Any], progress: bool | None) -> Iterable[Any]:
    if progress is False:
        return batches
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError("top_k(progress=True) needs tqdm: pip install tqdm") from None
        return batches
    return tqdm(batches, desc="scoring training batches", unit="batch")
