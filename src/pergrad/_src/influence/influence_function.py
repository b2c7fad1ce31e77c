"""Influence functions (Koh & Liang 2017) as an estimator: ``grad_test^T (H + damping I)^-1
grad_train``, ``H`` the Hessian of the mean training loss, inverted by a solver
(``protocol.py``'s :class:`Solver`, named or an instance).

:func:`pergrad.influence.influence_function`, ``self_influence`` and ``top_k(method=
"influence")`` are front ends over :class:`InfluenceFunction`; the sign convention and the
derivation are in :func:`pergrad.influence.influence_function`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pergrad._src.errors import PergradValueError
from pergrad._src.influence.flat_loss import FlatLoss, check_same_arity
from pergrad._src.influence.ihvp import check_damping, check_dampings
from pergrad._src.influence.protocol import Estimator, Scorer, Task, solver_from


@dataclass(frozen=True, eq=False)
class InfluenceFunction(Estimator, name="influence"):
    """``scores[i, j] = grad target_j^T (H + damping I)^-1 grad fn_i``.

    Attributes:
      damping: ``>= 0``, added to the Hessian's diagonal; a list of them (a grid) gives
        ``(len(damping), n_train, n_test)`` scores (not when streaming).
      solver: a registered solver's name (``"exact"``, ``"cg"``, ...) or a :class:`Solver`.
      regularizer: ``regularizer(params) -> scalar``, whose Hessian is added to ``H``.
      hessian_batch: the examples whose mean loss defines ``H``; default the training batch
        (needed when streaming: the stream is read once).
    """

    damping: float | Sequence[float] = 0.0
    solver: Any = "exact"
    regularizer: Callable[[Any], Any] | None = None
    hessian_batch: Sequence[Any] | None = None

    def scores(self, task: Task, train_batch: Any, test_batch: Any) -> Any:
        """Solves for the smaller of the two sides (``H`` is symmetric), then streams the
        other side's gradients once against the solutions of every damping side by side."""
        name = task.caller
        loss = task.loss(regularizer=self.regularizer)
        target = loss.target(task.target_fn)
        train, n_train = loss.check_batch("train_batch", train_batch)
        test, n_test = loss.check_batch("test_batch", test_batch)
        if task.target_fn is None:
            check_same_arity(name, train, "train_batch", test, "test_batch")
        grid = check_dampings(name, self.damping)
        dampings = grid if grid is not None else [check_damping(name, self.damping)]
        solver = solver_from(name, self.solver)
        hessian, n_hessian = self._hessian_batch(name, loss, train, n_train)
        if n_test <= n_train:
            rows = target.grads(test)
            other, other_batch, other_count = loss, train, n_train
        else:
            rows = loss.grads(train)
            other, other_batch, other_count = target, test, n_test
        bk = loss.backend
        solved = solver.inverse(name, loss, hessian, n_hessian, rows, dampings)
        scores = other.grads_dot(other_batch, other_count, bk.concatenate(solved, axis=0))
        k = bk.shape(rows)[0]
        pieces = [scores[:, g * k : (g + 1) * k] for g in range(len(dampings))]
        if n_test > n_train:
            pieces = [piece.T for piece in pieces]
        return bk.stack(pieces) if grid is not None else pieces[0]

    def prepare(self, task: Task, test_batch: Any) -> Scorer:
        """The test side solved once against ``hessian_batch``; each training batch is then
        its gradients dotted with the solutions."""
        name = task.caller
        loss = task.loss(regularizer=self.regularizer)
        test, _ = loss.check_batch("test_batch", test_batch)
        grads = loss.target(task.target_fn).grads(test)
        if self.hessian_batch is None:
            raise PergradValueError(
                f"{name}: method='influence' needs hessian_batch, a batch of training examples "
                f"whose mean loss stands for the training set's Hessian (the stream is read "
                f"once)."
            )
        batch, count = loss.check_batch("hessian_batch", self.hessian_batch)
        damping = check_damping(name, self.damping)
        solver = solver_from(name, self.solver)
        (rows,) = solver.inverse(name, loss, batch, count, grads, [damping])
        return lambda train, n_train: loss.grads_dot(train, n_train, rows)

    def self_scores(self, task: Task, train_batch: Any) -> Any:
        """``grad_i^T (H + damping I)^-1 grad_i`` for each training example."""
        name = task.caller
        loss = task.loss(regularizer=self.regularizer)
        train, n_train = loss.check_batch("train_batch", train_batch)
        damping = check_damping(name, self.damping)
        solver = solver_from(name, self.solver)
        hessian, n_hessian = self._hessian_batch(name, loss, train, n_train)
        grads = loss.grads(train)
        (solved,) = solver.inverse(name, loss, hessian, n_hessian, grads, [damping])
        return (grads * solved).sum(1)

    def _hessian_batch(
        self, name: str, loss: FlatLoss, train: tuple, n_train: int
    ) -> tuple[tuple, int]:
        if self.hessian_batch is None:
            return train, n_train
        batch, count = loss.check_batch("hessian_batch", self.hessian_batch)
        check_same_arity(name, train, "train_batch", batch, "hessian_batch")
        return batch, count
