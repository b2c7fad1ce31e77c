"""Top-k proponents and opponents of test examples, streamed over a training set.

The training set comes as an iterable of batches (a DataLoader, a generator reading shards), so
it never has to fit in memory: each batch's per-example gradients are scored against the test
side and only the running top-k survive.

A training set split over processes or devices is scored shard by shard: each shard runs
:func:`top_k` (or :func:`top_k_from_scores` on scores it computed itself, e.g. from projected
gradients) with ``offset=`` its first global index, and :func:`merge_top_k` combines the shards'
results into exactly what one process streaming the whole set would return, ties included
(equal scores rank by lower global index). :func:`all_gather_top_k` does the gathering and
merging over ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pergrad._src.backends import backend_of
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_loss import check_batch, check_same_arity
from pergrad._src.influence.influence_function import InfluenceFunction
from pergrad._src.influence.protocol import Estimator, Task, estimator_from

# top_k's options of the "influence" method, with their defaults.
_INFLUENCE_OPTIONS = {"regularizer": None, "hessian_batch": None, "damping": 0.0, "solver": "cg"}


class TopK(NamedTuple):
    """Per test example, the training examples with the highest and lowest scores.

    Attributes:
      proponents: ``(n_test, k)`` global training indices (``offset`` + position in the
        stream), highest score first, equal scores by lower index: the examples that help each
        test example most.
      proponent_scores: ``(n_test, k)`` their scores.
      opponents: ``(n_test, k)`` indices, lowest (most negative) score first.
      opponent_scores: ``(n_test, k)`` their scores.
      num_train: how many training examples were streamed (merged: over all shards).
      k: the k asked for; the arrays have ``min(k, num_train)`` columns.
    """

    proponents: np.ndarray
    proponent_scores: np.ndarray
    opponents: np.ndarray
    opponent_scores: np.ndarray
    num_train: int
    k: int


def top_k(
    fn: Callable[..., Any],
    params: Any,
    train_batches: Iterable[Sequence[Any]],
    test_batch: Sequence[Any],
    k: int = 10,
    method: str | Estimator = "influence",
    *,
    target_fn: Callable[..., Any] | None = None,
    regularizer: Callable[[Any], Any] | None = None,
    hessian_batch: Sequence[Any] | None = None,
    damping: float = 0.0,
    solver: Any = "cg",
    chunk_size: int | None = None,
    progress: bool | None = None,
    offset: int = 0,
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
        gradients, ``"tracin"`` (``params`` then a list of checkpoints, learning rate 1), or
        the name or an instance of any :class:`pergrad.influence.Estimator` that scores a
        training set batch by batch (it implements ``prepare``), which carries its own
        options.
      target_fn: the function of one test example whose gradient is scored; default ``fn``
        (as for :func:`influence_function`).
      regularizer: for ``"influence"`` by name, as for :func:`influence_function`.
      hessian_batch: for ``"influence"`` by name, as for :func:`influence_function`.
      damping: for ``"influence"`` by name, as for :func:`influence_function`.
      solver: for ``"influence"`` by name, as for :func:`influence_function` (the test side is
        solved once; any solver, K-FAC included).
      chunk_size: per-example gradients of this many examples at a time within a batch.
      progress: show a tqdm progress bar (default: when tqdm is installed).
      offset: the global index of the first streamed example, for a shard of a larger
        training set (``rank * shard_size``); the result's indices are ``offset`` + position.
        Merge the shards' results with :func:`merge_top_k`.

    Returns:
      A :class:`TopK` of numpy arrays. Memory: the test side ``(n_test, P)`` plus one batch's
      per-example gradients; never the training set's.

    Example (one shard of a training set split over processes)::

        mine = pergrad.influence.top_k(loss, params, my_batches, (X_test, Y_test), k=10,
                                       method="dot", offset=rank * shard_size)
        best = pergrad.influence.merge_top_k(results_of_every_rank)
    """
    name = "top_k"
    _check_k(name, k)
    _check_offset(name, offset)
    influence_options = {
        "regularizer": regularizer,
        "hessian_batch": hessian_batch,
        "damping": damping,
        "solver": solver,
    }
    estimator = _streaming_estimator(name, method, influence_options)
    task = Task(fn, params, target_fn, chunk_size, caller=name)
    score = estimator.prepare(task, test_batch)
    bk = task.backend()
    best = _Running(k, largest=True)
    worst = _Running(k, largest=False)
    seen = 0
    for batch in with_progress(train_batches, progress, name, "scoring training batches"):
        batch, count = check_batch(name, "each training batch", bk, batch)
        if target_fn is None:
            check_same_arity(name, batch, "a training batch", tuple(test_batch), "test_batch")
        scores = bk.to_numpy(score(batch, count))
        best.update(scores, offset + seen)
        worst.update(scores, offset + seen)
        seen += count
    if seen == 0:
        raise PergradValueError(f"{name}: train_batches yielded no examples.")
    return TopK(*best.result(), *worst.result(), num_train=seen, k=k)


def _streaming_estimator(name: str, method: Any, influence_options: dict[str, Any]) -> Estimator:
    """``method`` as an estimator that streams: ``"influence"`` made from top_k's options, any
    other name with its defaults, an instance as it is (top_k's options of ``"influence"``
    left at their defaults: the instance carries its own)."""
    if isinstance(method, str) and method.lower() == "influence":
        return InfluenceFunction(**influence_options)
    if isinstance(method, Estimator):
        given = [
            f"{key}="
            for key, value in influence_options.items()
            if not _is_default(value, _INFLUENCE_OPTIONS[key])
        ]
        if given:
            raise PergradValueError(
                f"{name}: {', '.join(given)} {'sets' if len(given) == 1 else 'set'} the "
                f"options of method='influence' by name; method={type(method).__name__}(...) "
                f"is an estimator object, which carries its own options: pass them to it, not "
                f"to top_k."
            )
    return estimator_from(name, method, streaming=True)


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(default, float):  # damping: 0 is 0.0
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return isinstance(value, str) and value == default


class _Running:
    """The k best (or worst) scores per test column seen so far, with global indices."""

    def __init__(self, k: int, largest: bool) -> None:
        self.k, self.largest = k, largest
        self.scores: np.ndarray | None = None
        self.indices: np.ndarray | None = None

    def update(self, scores: np.ndarray, offset: int) -> None:
        indices = np.broadcast_to(np.arange(offset, offset + len(scores))[:, None], scores.shape)
        if self.scores is not None:
            scores = np.concatenate([self.scores, scores])
            indices = np.concatenate([self.indices, indices])
        self.scores, self.indices = _select(scores, indices, self.k, self.largest)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self.indices.T.copy(), self.scores.T.copy()


def _select(
    scores: np.ndarray, indices: np.ndarray, k: int, largest: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` rows of ``(n, n_test)`` scores to keep per column: by score (highest first if
    ``largest``), equal scores by lower index, so any split of the rows gives the same result."""
    order = np.lexsort((indices, -scores if largest else scores), axis=0)[:k]
    return np.take_along_axis(scores, order, axis=0), np.take_along_axis(indices, order, axis=0)


def _check_k(func_name: str, k: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise PergradValueError(f"{func_name}: k must be a positive int; got {k!r}.")


def _check_offset(func_name: str, offset: Any) -> None:
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise PergradValueError(
            f"{func_name}: offset must be a non-negative int, the global index of the shard's "
            f"first training example; got {offset!r}."
        )


def top_k_from_scores(scores: Any, k: int = 10, offset: int = 0) -> TopK:
    """Each test example's top-k proponents and opponents from a score matrix you computed.

    For scores that :func:`top_k` does not compute itself, e.g. dot products of projected
    gradients (:func:`pergrad.influence.project`) or TracIn scores of one shard of the training
    set. Ranks exactly as :func:`top_k` does.

    Example::

        train_small = pergrad.influence.project(shard_grads, k=256, seed=0)   # (n_shard, 256)
        test_small = pergrad.influence.project(test_grads, k=256, seed=0)     # (n_test, 256)
        scores = pergrad.influence.grad_dot(train_small, test_small)          # (n_shard, n_test)
        mine = pergrad.influence.top_k_from_scores(scores, k=10, offset=rank * shard_size)

    Args:
      scores: ``(n_train, n_test)`` scores (numpy, JAX or torch), positive = helps.
      k: how many proponents and opponents to keep per test example (``> 0``).
      offset: the global index of row 0, for one shard of a larger training set.

    Returns:
      A :class:`TopK` of numpy arrays, ``num_train = n_train``.
    """
    name = "top_k_from_scores"
    _check_k(name, k)
    _check_offset(name, offset)
    if isinstance(scores, np.ndarray):
        values = scores
    else:
        values = backend_of(scores, name, "scores").to_numpy(scores)
    if values.ndim != 2 or values.shape[0] == 0:
        raise PergradValueError(
            f"{name}: scores must be a (n_train, n_test) matrix with n_train >= 1; got shape "
            f"{values.shape}."
        )
    best, worst = _Running(k, largest=True), _Running(k, largest=False)
    best.update(values, offset)
    worst.update(values, offset)
    return TopK(*best.result(), *worst.result(), num_train=values.shape[0], k=k)


def merge_top_k(results: Sequence[TopK], k: int | None = None) -> TopK:
    """Combine the :class:`TopK` of disjoint shards of a training set into the top-k of all.

    Each shard's result must carry global indices (``offset=`` in :func:`top_k` /
    :func:`top_k_from_scores`) and be scored against the same test examples (same test
    gradients, projection seed and method). The result equals what :func:`top_k` streaming
    the whole training set in one process returns: the same indices in the same order, equal
    scores ranked by lower global index.

    Example::

        shards = [pergrad.influence.top_k(loss, params, batches_of(part), test, k=10,
                                          method="dot", offset=start)
                  for part, start in zip(parts, starts)]
        merged = pergrad.influence.merge_top_k(shards)   # as if the parts were one stream

    Args:
      results: the shards' :class:`TopK`, in any order.
      k: entries to keep per test example; default the smallest ``k`` the shards were run
        with. Every shard must have kept at least ``min(k, its num_train)``, or examples that
        belong in the merged top-k could be missing.

    Returns:
      A :class:`TopK`; ``num_train`` is the sum over shards. Cost: sorting
      ``n_test x (shards x k)`` numbers.

    Raises:
      PergradValueError: no results, shards scored against different numbers of test
        examples, a shard that kept too few, or an index in two shards (``offset`` forgotten).
    """
    name = "merge_top_k"
    is_many = isinstance(results, Iterable) and not isinstance(results, TopK)
    results = list(results) if is_many else None
    if not results or not all(isinstance(r, TopK) for r in results):
        raise PergradTypeError(
            f"{name}: results must be a non-empty list of TopK (one per shard, from top_k or "
            f"top_k_from_scores); got {results!r:.200}."
        )
    if k is None:
        k = min(int(r.k) for r in results)
    _check_k(name, k)
    _check_shards(name, results, k)
    best = _merge_side(name, [(r.proponents, r.proponent_scores) for r in results], k, True)
    worst = _merge_side(name, [(r.opponents, r.opponent_scores) for r in results], k, False)
    return TopK(*best, *worst, num_train=sum(int(r.num_train) for r in results), k=k)


def _check_shards(func_name: str, results: list[TopK], k: int) -> None:
    test_counts = {r.proponents.shape[0] for r in results}
    if len(test_counts) != 1:
        raise PergradValueError(
            f"{func_name}: the shards were scored against different numbers of test examples "
            f"({sorted(test_counts)}); score every shard against the same test batch."
        )
    for position, result in enumerate(results):
        needed = min(k, int(result.num_train))
        if result.proponents.shape[1] < needed or result.opponents.shape[1] < needed:
            raise PergradValueError(
                f"{func_name}: results[{position}] kept {result.proponents.shape[1]} entries "
                f"per test example out of {result.num_train} training examples, fewer than "
                f"k={k}; run every shard with at least the k you merge to, or merge to "
                f"k={result.k}."
            )


def _merge_side(
    func_name: str, sides: list[tuple[np.ndarray, np.ndarray]], k: int, largest: bool
) -> tuple[np.ndarray, np.ndarray]:
    indices = np.concatenate([index for index, _ in sides], axis=1).T  # (candidates, n_test)
    scores = np.concatenate([score for _, score in sides], axis=1).T
    ranked = np.sort(indices, axis=0)
    if (ranked[1:] == ranked[:-1]).any():
        duplicate = int(ranked[1:][ranked[1:] == ranked[:-1]][0])
        raise PergradValueError(
            f"{func_name}: training index {duplicate} appears in more than one shard's result; "
            f"the shards must hold global indices of disjoint examples. Pass offset= (the "
            f"shard's first global index) to top_k / top_k_from_scores."
        )
    kept_scores, kept_indices = _select(scores, indices, k, largest)
    return kept_indices.T.copy(), kept_scores.T.copy()


def all_gather_top_k(result: TopK, group: Any = None) -> TopK:
    """Merge every process's :class:`TopK` over ``torch.distributed``; every rank gets it all.

    Call it on every rank of ``group`` after scoring the local shard with global indices::

        mine = pergrad.influence.top_k(loss, model_params, my_loader, test, k=10,
                                       method="dot", offset=rank * shard_size)
        merged = pergrad.influence.all_gather_top_k(mine)     # identical on every rank

    Args:
      result: this rank's :class:`TopK`.
      group: the ``torch.distributed`` process group (default: the whole world).

    Returns:
      :func:`merge_top_k` of all ranks' results. Cost: one ``all_gather_object`` of
      ``4 x n_test x k`` numbers per rank.
    """
    name = "all_gather_top_k"
    if not isinstance(result, TopK):
        raise PergradTypeError(f"{name}: result must be a TopK; got {type(result).__name__}.")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise PergradValueError(
            f"{name}: torch.distributed is not initialised; call "
            f"torch.distributed.init_process_group first (or merge results you gathered "
            f"yourself with merge_top_k)."
        )
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, result, group=group)
    return merge_top_k(gathered)


def with_progress(
    batches: Iterable[Any], progress: bool | None, func_name: str, description: str
) -> Iterable[Any]:
    """``batches`` under a tqdm progress bar: always if ``progress`` is True (tqdm must be
    installed), never if False, and when tqdm is installed if None."""
    if progress is False:
        return batches
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError(f"{func_name}(progress=True) needs tqdm: pip install tqdm") from None
        return batches
    return tqdm(batches, desc=description, unit="batch")
