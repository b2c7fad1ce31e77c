"""TracIn-CP (Pruthi et al. 2020) as an estimator: ``sum_c lr_c grad_c(train_i) .
grad_c(test_j)`` over checkpoints ``c`` saved during training.

The task's ``params`` is the list of checkpoints (parameter pytrees of one structure).
:func:`pergrad.influence.tracin` and ``top_k(method="tracin")`` are front ends over
:class:`TracIn`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_loss import FlatLoss, check_same_arity
from pergrad._src.influence.protocol import Estimator, Scorer, Task


@dataclass(frozen=True)
class TracIn(Estimator, name="tracin"):
    """TracIn over the checkpoints of ``task.params``.

    Attributes:
      learning_rates: the learning rate in effect at each checkpoint: one number for all
        (the default 1 ranks like any other constant), or one positive number per checkpoint.
    """

    learning_rates: float | Sequence[float] = 1.0

    def scores(self, task: Task, train_batch: Any, test_batch: Any) -> Any:
        """One checkpoint at a time: only one checkpoint's test gradients are held."""
        name, total = task.caller, None
        for loss, rate in self._checkpoints(task):
            train, n_train = loss.check_batch("train_batch", train_batch)
            test, _ = loss.check_batch("test_batch", test_batch)
            if task.target_fn is None:
                check_same_arity(name, train, "train_batch", test, "test_batch")
            term = loss.grads_dot(train, n_train, loss.target(task.target_fn).grads(test)) * rate
            total = term if total is None else total + term
        return total

    def prepare(self, task: Task, test_batch: Any) -> Scorer:
        """Every checkpoint's test gradients, held while the training set streams by."""
        sides = []
        for loss, rate in self._checkpoints(task):
            test, _ = loss.check_batch("test_batch", test_batch)
            sides.append((loss, loss.target(task.target_fn).grads(test), rate))

        def score(train: tuple, count: int) -> Any:
            terms = [loss.grads_dot(train, count, rows) * rate for loss, rows, rate in sides]
            return sum(terms[1:], terms[0])

        return score

    def self_scores(self, task: Task, train_batch: Any) -> Any:
        """``sum_c lr_c |grad_c(train_i)|^2``: TracIn's self-influence, which ranks mislabeled
        examples high (Pruthi et al. 2020)."""
        total = None
        for loss, rate in self._checkpoints(task):
            train, count = loss.check_batch("train_batch", train_batch)
            term = loss.map_grads(train, count, lambda grads: (grads * grads).sum(1)) * rate
            total = term if total is None else total + term
        return total

    def _checkpoints(self, task: Task) -> Iterator[tuple[FlatLoss, float]]:
        """Each checkpoint's loss (made when reached: one flat copy of the parameters at a
        time) and learning rate, all checked first."""
        rates = _check_checkpoints(task, self.learning_rates)
        return (
            (task.loss(params, arg_name=f"{task.params_name}[{index}]"), rate)
            for index, (params, rate) in enumerate(zip(task.params, rates))
        )


def _check_checkpoints(task: Task, learning_rates: Any) -> list[float]:
    name, checkpoints, arg = task.caller, task.params, task.params_name
    if not isinstance(checkpoints, (list, tuple)) or not checkpoints:
        raise PergradTypeError(
            f"{name}: {arg} must be a non-empty list of parameter pytrees (one per saved "
            f"checkpoint); got {type(checkpoints).__name__}"
            f"{' of length 0' if isinstance(checkpoints, (list, tuple)) else ''}."
        )
    if isinstance(learning_rates, (int, float)) and not isinstance(learning_rates, bool):
        rates = [learning_rates] * len(checkpoints)
    elif isinstance(learning_rates, (list, tuple)):
        rates = list(learning_rates)
    else:
        raise PergradTypeError(
            f"{name}: learning_rates must be a number or a sequence of numbers, one per "
            f"checkpoint; got {type(learning_rates).__name__}."
        )
    if len(rates) != len(checkpoints):
        raise PergradValueError(
            f"{name}: learning_rates has {len(rates)} entries but there are "
            f"{len(checkpoints)} checkpoints; give one learning rate per checkpoint."
        )
    bad = [r for r in rates if not (isinstance(r, (int, float)) and not isinstance(r, bool))]
    if bad or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise PergradValueError(
            f"{name}: learning_rates must be positive finite numbers; got {learning_rates!r}."
        )
    return [float(r) for r in rates]
