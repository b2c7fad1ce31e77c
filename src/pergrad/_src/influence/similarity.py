"""Gradient similarity as estimators: the dot product (``"dot"``) and the cosine (``"cosine"``)
of each training example's gradient with each test example's.

Each computes its score once, from pairs of ``(n_train, p)`` and ``(n_test, p)`` gradient
blocks: per leaf of per-example gradients you already have (:meth:`GradDot.between`, behind
:func:`pergrad.influence.grad_dot` / ``grad_cosine``), or one block of flat gradients per
training batch when streaming (:meth:`prepare`, behind :func:`pergrad.influence.top_k`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pergrad._src.backends import Backend
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.protocol import Estimator, Scorer, Task
from pergrad._src.norms import flat_leaves


class Similarity(Estimator):
    """What :class:`GradDot` and :class:`GradCosine` share: scores from ``(train, test)``
    gradient blocks, :meth:`of_pairs`."""

    def of_pairs(self, pairs: list[tuple[Any, Any]]) -> Any:
        """``(n_train, n_test)`` from blocks ``(n_train, p_l)``, ``(n_test, p_l)`` whose
        columns together make the gradients."""
        raise NotImplementedError

    def between(self, caller: str, train_grads: Any, test_grads: Any) -> Any:
        """``(n_train, n_test)`` scores of per-example gradient pytrees (leaves ``(n, ...)``),
        leaf by leaf: no ``(n, P)`` concatenation is made."""
        _, pairs = _paired_leaves(caller, train_grads, test_grads)
        return self.of_pairs(pairs)

    def prepare(self, task: Task, test_batch: Any) -> Scorer:
        loss = task.loss()
        test, _ = loss.check_batch("test_batch", test_batch)
        rows = loss.target(task.target_fn).grads(test)
        return lambda train, count: loss.map_grads(
            train, count, lambda grads: self.of_pairs([(grads, rows)])
        )


@dataclass(frozen=True)
class GradDot(Similarity, name="dot"):
    """``g_train_i . g_test_j``: positive when a gradient step on ``i`` lowers ``j``'s loss
    (to first order)."""

    def of_pairs(self, pairs: list[tuple[Any, Any]]) -> Any:
        products = [train @ test.T for train, test in pairs]
        return sum(products[1:], products[0])

    def self_scores(self, task: Task, train_batch: Any) -> Any:
        """``|g_i|^2`` for each training example."""
        loss = task.loss()
        train, count = loss.check_batch("train_batch", train_batch)
        return loss.map_grads(train, count, lambda grads: (grads * grads).sum(1))


@dataclass(frozen=True)
class GradCosine(Similarity, name="cosine"):
    """``g_train_i . g_test_j / (|g_train_i| |g_test_j| + eps)``, in ``[-1, 1]``: insensitive
    to how large an example's gradient is. ``eps`` guards zero gradients (a cosine of 0)."""

    eps: float = 1e-12

    def __post_init__(self) -> None:
        check_eps("GradCosine", self.eps)

    def of_pairs(self, pairs: list[tuple[Any, Any]]) -> Any:
        dots = GradDot().of_pairs(pairs)
        train_norms = sum((train**2).sum(1) for train, _ in pairs) ** 0.5
        test_norms = sum((test**2).sum(1) for _, test in pairs) ** 0.5
        n_train, n_test = train_norms.shape[0], test_norms.shape[0]
        return dots / (train_norms.reshape(n_train, 1) * test_norms.reshape(1, n_test) + self.eps)


def check_eps(owner: str, eps: Any) -> None:
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
        raise PergradValueError(f"{owner}: eps must be a number >= 0; got {eps!r}.")


def _paired_leaves(func_name: str, train_grads: Any, test_grads: Any) -> tuple[Backend, list]:
    """``(train (n, p), test (m, p))`` per leaf, after checking the two trees match."""
    bk, train_paths, train_flat, train_def, _ = flat_leaves(func_name, train_grads)
    test_bk, test_paths, test_flat, test_def, _ = flat_leaves(func_name, test_grads)
    if test_bk.name != bk.name:
        raise PergradTypeError(
            f"{func_name}: train_grads holds {bk.name} arrays and test_grads holds "
            f"{test_bk.name} arrays; pass both from one framework."
        )
    train_shapes = _leaf_shapes(bk, train_paths, train_grads)
    test_shapes = _leaf_shapes(bk, test_paths, test_grads)
    if train_def != test_def or train_shapes != test_shapes:
        raise PergradValueError(
            f"{func_name}: train_grads and test_grads must have the same structure and "
            f"per-example shapes (gradients of the same parameters); train_grads has "
            f"{_describe_shapes(train_shapes)} and test_grads has "
            f"{_describe_shapes(test_shapes)}."
        )
    return bk, list(zip(train_flat, test_flat))


def _leaf_shapes(bk: Backend, paths: list[str], grads: Any) -> list[tuple[str, tuple[int, ...]]]:
    _, leaves, _ = bk.flatten(grads)
    return [(path or "root", bk.shape(leaf)[1:]) for path, leaf in zip(paths, leaves)]


def _describe_shapes(shapes: list[tuple[str, tuple[int, ...]]]) -> str:
    listed = ", ".join(f"{path}: {shape}" for path, shape in shapes[:8])
    more = f", ... ({len(shapes)} leaves)" if len(shapes) > 8 else ""
    return "{" + listed + more + "}"
