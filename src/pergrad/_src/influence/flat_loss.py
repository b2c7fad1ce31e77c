"""The loss of one example over the flat parameter vector, and the checks of what goes into it.

Solvers and estimators (``protocol.py``) work on rows: ``k`` vectors over the ``P`` float
parameters are a ``(k, P)`` array. :class:`FlatLoss` gives them the two things they are made of:
per-example gradients as rows (:meth:`FlatLoss.grads`, or streamed against fixed rows with
:meth:`FlatLoss.grads_dot`) and the Hessian of the mean loss over a batch as an operator on rows
(:meth:`FlatLoss.hessian`, a :class:`HessianOperator`).

Batches are tuples of ``fn``'s batched arguments (every array leaf batched on axis 0), checked
once by :func:`check_batch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.api.grads import per_example_grads
from pergrad._src.backends import Backend, backend_of
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_params import FlatParams

# --------------------------------------------------------------------------------------------
# Validation of fn and batches.


def check_fn(func_name: str, fn: Any, arg_name: str = "fn") -> None:
    if not callable(fn):
        what = {"fn": "the loss", "target_fn": "the target"}.get(arg_name, "a function")
        raise PergradTypeError(
            f"{func_name}: {arg_name} must be {what} of ONE example, "
            f"{arg_name}(params, *example) -> scalar; got {type(fn).__name__}."
        )


def check_regularizer(func_name: str, regularizer: Any, params: Any, bk: Backend) -> Any:
    """``regularizer(params) -> scalar`` (or None), checked by one call at ``params``."""
    if regularizer is None:
        return None
    if not callable(regularizer):
        raise PergradTypeError(
            f"{func_name}: regularizer must be a function of the parameters, "
            f"regularizer(params) -> scalar (its Hessian is added to H); got "
            f"{type(regularizer).__name__}."
        )
    value = regularizer(params)
    if not (bk.is_array(value) and bk.shape(value) == ()) and not (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    ):
        got = f"shape {bk.shape(value)}" if bk.is_array(value) else type(value).__name__
        raise PergradValueError(
            f"{func_name}: regularizer(params) must return a scalar; got {got}."
        )
    return regularizer


def check_chunk_size(func_name: str, chunk_size: Any) -> int | None:
    ok = chunk_size is None or (
        isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0
    )
    if not ok:
        raise PergradValueError(
            f"{func_name}: chunk_size must be a positive int or None; got {chunk_size!r}."
        )
    return chunk_size


def check_batch(func_name: str, arg_name: str, bk: Backend, batch: Any) -> tuple[tuple, int]:
    """``batch`` as a tuple of batched arguments, and its number of examples."""
    if not isinstance(batch, (tuple, list)):
        raise PergradTypeError(
            f"{func_name}: {arg_name} must be a tuple of fn's batched arguments, e.g. (X, Y) "
            f"for fn(params, x, y); got {type(batch).__name__}. For a single argument pass "
            f"(X,)."
        )
    if not batch:
        raise PergradValueError(
            f"{func_name}: {arg_name} is an empty tuple; pass fn's batched arguments, e.g. (X, Y)."
        )
    sizes = []
    for index, argument in enumerate(batch):
        paths, leaves, _ = bk.flatten(argument)
        for path, leaf in zip(paths, leaves):
            where = f"{arg_name}[{index}]{path}"
            if not bk.is_array(leaf):
                raise PergradTypeError(
                    f"{func_name}: {where} is a {type(leaf).__module__}.{type(leaf).__name__}; "
                    f"every leaf of {arg_name} must be a {bk.name} array batched on axis 0 "
                    f"(the parameters are {bk.name}). Shared arguments belong inside fn."
                )
            if len(bk.shape(leaf)) == 0:
                raise PergradValueError(
                    f"{func_name}: {where} is 0-d; every leaf of {arg_name} must have a "
                    f"leading batch axis."
                )
            sizes.append((where, bk.shape(leaf)[0]))
    if not sizes:
        raise PergradValueError(f"{func_name}: {arg_name} holds no arrays.")
    if len({size for _, size in sizes}) != 1:
        listing = ", ".join(f"{where}: {size}" for where, size in sizes[:8])
        raise PergradValueError(
            f"{func_name}: the arrays of {arg_name} disagree on the number of examples "
            f"(leading sizes {listing}); every leaf must be batched on axis 0."
        )
    count = sizes[0][1]
    if count == 0:
        raise PergradValueError(
            f"{func_name}: {arg_name} is an empty batch (0 examples); scores need at least one."
        )
    return tuple(batch), count


def check_same_arity(func_name: str, batch: tuple, name: str, other: tuple, other_name: str):
    if len(batch) != len(other):
        raise PergradValueError(
            f"{func_name}: {other_name} has {len(other)} argument(s) but {name} has "
            f"{len(batch)}; both are tuples of fn's batched arguments, e.g. (X, Y)."
        )


def slice_batch(bk: Backend, batch: tuple[Any, ...], start: int, stop: int) -> tuple[Any, ...]:
    _, leaves, treedef = bk.flatten(batch)
    return bk.unflatten(treedef, [leaf[start:stop] for leaf in leaves])


# --------------------------------------------------------------------------------------------
# The Hessian of the mean loss, as an operator on rows.


@dataclass
class HessianOperator:
    """``rows -> rows @ (H + damping I)`` for the mean loss over a batch, ``rows`` ``(k, P)``.

    Attributes:
      backend: the framework.
      hvp: the backend's Hessian-vector product of ``mean_loss(vector, batch)``.
      vector: ``(P,)`` the parameters at which the Hessian is taken.
      batch: the tuple of batched arguments the mean loss runs over.
      batch_size: the number of examples in ``batch``.
      damping: added to the diagonal.
    """

    backend: Backend
    hvp: Callable[..., Any]
    vector: Any
    batch: tuple[Any, ...]
    batch_size: int
    damping: float

    @classmethod
    def create(
        cls,
        bk: Backend,
        example_loss: Callable[[Any, tuple[Any, ...]], Any],
        vector: Any,
        batch: tuple[Any, ...],
        batch_size: int,
        damping: float,
        chunk_size: int | None,
    ) -> HessianOperator:
        """``example_loss(vector, example)`` is the loss of one example (a tuple of its
        arguments) as a function of the flat parameters."""
        per_example = bk.vmap(example_loss, (None, 0), chunk_size, None)

        def mean_loss(flat: Any, examples: tuple[Any, ...]) -> Any:
            return per_example(flat, examples).mean()

        return cls(bk, bk.hvp(mean_loss), vector, batch, batch_size, damping)

    @property
    def size(self) -> int:
        return self.backend.shape(self.vector)[0]

    def with_damping(self, damping: float) -> HessianOperator:
        return dataclasses.replace(self, damping=damping)

    def __call__(self, rows: Any, batch: tuple[Any, ...] | None = None) -> Any:
        product = self.hvp(self.vector, rows, self.batch if batch is None else batch)
        return product + self.damping * rows if self.damping else product

    def sample(self, rng: np.random.Generator, size: int) -> tuple[Any, ...]:
        """``size`` examples of the batch drawn without replacement (all, if fewer)."""
        bk = self.backend
        chosen = np.sort(rng.choice(self.batch_size, min(size, self.batch_size), replace=False))
        index = bk.from_numpy(chosen, self.vector)
        _, leaves, treedef = bk.flatten(self.batch)
        return bk.unflatten(treedef, [leaf[index] for leaf in leaves])


# --------------------------------------------------------------------------------------------
# The loss as a function of the flat parameter vector.


@dataclass
class FlatLoss:
    """``fn`` over the flat parameters: per-example gradients as ``(n, P)`` rows."""

    func_name: str
    backend: Backend
    flat: FlatParams
    fn: Callable[..., Any]
    chunk_size: int | None
    # regularizer(params) -> scalar: part of the Hessian's loss only (never of a gradient)
    regularizer: Callable[[Any], Any] | None = None

    @classmethod
    def create(
        cls,
        func_name: str,
        fn: Any,
        params: Any,
        chunk_size: Any,
        arg_name: str = "params",
        regularizer: Any = None,
    ) -> FlatLoss:
        check_fn(func_name, fn)
        bk = backend_of(params, func_name, arg_name)
        flat = FlatParams.create(func_name, arg_name, bk, params)
        regularizer = check_regularizer(func_name, regularizer, params, bk)
        chunk_size = check_chunk_size(func_name, chunk_size)
        return cls(func_name, bk, flat, fn, chunk_size, regularizer)

    def target(self, target_fn: Any) -> FlatLoss:
        """The same parameters with ``target_fn`` (None: ``fn``) as the function of one example
        whose gradients are taken: the test side of a score."""
        if target_fn is None:
            return self
        check_fn(self.func_name, target_fn, "target_fn")
        return dataclasses.replace(self, fn=target_fn, regularizer=None)

    def check_batch(self, arg_name: str, batch: Any) -> tuple[tuple, int]:
        """``batch`` checked as a tuple of ``fn``'s batched arguments (:func:`check_batch`),
        and its number of examples."""
        return check_batch(self.func_name, arg_name, self.backend, batch)

    def example_loss(self, vector: Any, example: tuple[Any, ...]) -> Any:
        return self.fn(self.flat.unravel(vector), *example)

    def grads(self, batch: tuple[Any, ...]) -> Any:
        """``(n, P)``: each example's gradient, flattened."""
        per_example = per_example_grads(
            self.example_loss,
            in_axes=(None, 0),
            chunk_size=self.chunk_size,
            backend=self.backend.name,
        )
        return per_example(self.flat.vector, batch)

    def chunks(self, batch: tuple[Any, ...], count: int) -> list[tuple[Any, ...]]:
        """``batch`` cut into pieces of ``chunk_size`` examples (one piece without it)."""
        step = self.chunk_size or count
        return [
            slice_batch(self.backend, batch, start, start + step) for start in range(0, count, step)
        ]

    def map_grads(self, batch: tuple[Any, ...], count: int, reduce: Callable[[Any], Any]) -> Any:
        """``reduce(grads)`` of each chunk's ``(c, P)`` gradients, concatenated on axis 0: the
        ``(n, P)`` gradients of the whole batch are never held at once."""
        pieces = [reduce(self.grads(chunk)) for chunk in self.chunks(batch, count)]
        return pieces[0] if len(pieces) == 1 else self.backend.concatenate(pieces, axis=0)

    def grads_dot(self, batch: tuple[Any, ...], count: int, rows: Any) -> Any:
        """``(n, k)``: each example's gradient dotted with ``rows`` ``(k, P)``, computed
        ``chunk_size`` examples at a time so that ``(n, P)`` is never held at once."""
        return self.map_grads(batch, count, lambda grads: grads @ rows.T)

    def hessian(self, batch: tuple[Any, ...], count: int, damping: float) -> HessianOperator:
        """``H + damping I``, ``H`` the Hessian of the mean of ``fn`` over ``batch`` plus the
        regularizer's (added to each example's loss: the mean then carries it once)."""
        example_loss = self.example_loss
        if self.regularizer is not None:
            regularizer, unravel = self.regularizer, self.flat.unravel

            def example_loss(vector: Any, example: tuple[Any, ...]) -> Any:
                return self.example_loss(vector, example) + regularizer(unravel(vector))

        return HessianOperator.create(
            self.backend,
            example_loss,
            self.flat.vector,
            batch,
            count,
            damping,
            self.chunk_size,
        )
