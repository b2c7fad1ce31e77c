"""Influence and data attribution: scores between training and test examples.

All scores are ``(n_train, n_test)`` arrays of the framework they were computed in, with the
same sign convention: **positive means the training example helps the test example** (training
on it lowers the test loss; removing it would raise it).

* :func:`grad_dot` / :func:`grad_cosine`: from per-example gradients you already have.
* :func:`influence_function`: ``grad_test^T (H + damping I)^-1 grad_train`` (Koh & Liang
  2017), ``H`` the Hessian of the mean training loss; inverse-Hessian-vector products from
  ``ihvp.py``.
* :func:`self_influence`: each training example against itself.
* :func:`inverse_hvp`: the inverse-Hessian-vector products themselves.
* :func:`tracin`: TracIn over checkpoints (Pruthi et al. 2020).

The loss ``fn`` is the one the core takes: the loss of ONE example, ``fn(params, *example)``.
Batches are tuples of ``fn``'s batched arguments (every array leaf batched on axis 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pergrad._src.backends import Backend, backend_of
from pergrad._src.core.api import per_example_grads
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_params import FlatParams
from pergrad._src.influence.ihvp import (
    CURVATURE_SOLVERS,
    HessianOperator,
    Solver,
    check_damping,
    check_dampings,
    check_solver,
    solve,
    solve_grid,
)
from pergrad._src.influence.kfac import factorize
from pergrad._src.norms import flat_leaves

# --------------------------------------------------------------------------------------------
# Scores from per-example gradients.


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


def grad_dot(train_grads: Any, test_grads: Any) -> Any:
    """Dot products of every training example's gradient with every test example's.

    Args:
      train_grads: per-example gradients of the training examples, leaves
        ``(n_train, *param_shape)`` (what :func:`pergrad.per_example_grads` returns).
      test_grads: the same for the test examples, leaves ``(n_test, *param_shape)``, with the
        same structure and per-example shapes.

    Returns:
      ``(n_train, n_test)`` scores ``g_train_i . g_test_j``, an array of the gradients'
      framework. Positive: a gradient step on train example ``i`` lowers test example ``j``'s
      loss (to first order), i.e. ``i`` helps ``j``.

    Example::

        scores = pergrad.influence.grad_dot(g(params, X_train, Y_train), g(params, X_test, Y_test))
        scores.shape   # (n_train, n_test)

    The product is taken leaf by leaf, so no ``(n, P)`` concatenation is made.
    """
    _, pairs = _paired_leaves("grad_dot", train_grads, test_grads)
    return _dot_pairs(pairs)


def _dot_pairs(pairs: list[tuple[Any, Any]]) -> Any:
    products = [train @ test.T for train, test in pairs]
    return sum(products[1:], products[0])


def grad_cosine(train_grads: Any, test_grads: Any, eps: float = 1e-12) -> Any:
    """Cosine similarity of every training example's gradient with every test example's.

    Like :func:`grad_dot` (same arguments), normalised by both gradients' norms: ``(n_train,
    n_test)`` values in ``[-1, 1]``, insensitive to how large an example's gradient is (a
    mislabeled example's large gradient does not dominate). ``eps`` guards zero gradients,
    which get a cosine of 0.
    """
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
        raise PergradValueError(f"grad_cosine: eps must be a number >= 0; got {eps!r}.")
    _, pairs = _paired_leaves("grad_cosine", train_grads, test_grads)
    dots = _dot_pairs(pairs)
    train_norms = sum((train**2).sum(1) for train, _ in pairs) ** 0.5
    test_norms = sum((test**2).sum(1) for _, test in pairs) ** 0.5
    n_train, n_test = train_norms.shape[0], test_norms.shape[0]
    return dots / (train_norms.reshape(n_train, 1) * test_norms.reshape(1, n_test) + eps)


# --------------------------------------------------------------------------------------------
# Validation of fn, params and batches.


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


def _check_chunk_size(func_name: str, chunk_size: Any) -> int | None:
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
        chunk_size = _check_chunk_size(func_name, chunk_size)
        return cls(func_name, bk, flat, fn, chunk_size, regularizer)

    def target(self, target_fn: Any) -> FlatLoss:
        """The same parameters with ``target_fn`` (None: ``fn``) as the function of one example
        whose gradients are taken: the test side of a score."""
        if target_fn is None:
            return self
        check_fn(self.func_name, target_fn, "target_fn")
        return dataclasses.replace(self, fn=target_fn, regularizer=None)

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

    def grads_dot(self, batch: tuple[Any, ...], count: int, rows: Any) -> Any:
        """``(n, k)``: each example's gradient dotted with ``rows`` ``(k, P)``, computed
        ``chunk_size`` examples at a time so that ``(n, P)`` is never held at once."""
        step = self.chunk_size or count
        pieces = [
            self.grads(slice_batch(self.backend, batch, start, start + step)) @ rows.T
            for start in range(0, count, step)
        ]
        return pieces[0] if len(pieces) == 1 else self.backend.concatenate(pieces, axis=0)

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


def slice_batch(bk: Backend, batch: tuple[Any, ...], start: int, stop: int) -> tuple[Any, ...]:
    _, leaves, treedef = bk.flatten(batch)
    return bk.unflatten(treedef, [leaf[start:stop] for leaf in leaves])


# --------------------------------------------------------------------------------------------
# Influence functions.


def _hessian_batch(
    func_name: str, loss: FlatLoss, train_batch: tuple, n_train: int, hessian_batch: Any
) -> tuple[tuple, int]:
    if hessian_batch is None:
        return train_batch, n_train
    batch, count = check_batch(func_name, "hessian_batch", loss.backend, hessian_batch)
    check_same_arity(func_name, train_batch, "train_batch", batch, "hessian_batch")
    return batch, count


def _curvature_inverse(
    func_name: str,
    loss: FlatLoss,
    batch: tuple,
    count: int,
    rows: Any,
    solver: Solver,
    dampings: list[float],
) -> list[Any]:
    """``(F + d I)^-1 rows`` for each damping ``d``, ``F`` the K-FAC / EK-FAC curvature over
    ``batch`` (one factorisation for the grid)."""
    if loss.regularizer is not None:
        raise PergradValueError(
            f"{func_name}: solver={type(solver).__name__} builds its curvature from per-example "
            f"gradients, so it cannot add a regularizer's Hessian; got regularizer="
            f"{getattr(loss.regularizer, '__name__', loss.regularizer)!r}. An L2 penalty "
            f"l2 / 2 * |params|^2 is damping=l2 (add it to your damping); else use solver="
            f"'cg' or 'exact'."
        )
    step = loss.chunk_size or count
    chunks = [slice_batch(loss.backend, batch, s, s + step) for s in range(0, count, step)]
    curvature = factorize(func_name, loss.fn, loss.flat, chunks, count, solver)
    return curvature.solve(func_name, rows, dampings)


def influence_function(
    fn: Callable[..., Any],
    params: Any,
    train_batch: Sequence[Any],
    test_batch: Sequence[Any],
    damping: float = 0.0,
    solver: Any = "exact",
    *,
    target_fn: Callable[..., Any] | None = None,
    regularizer: Callable[[Any], Any] | None = None,
    hessian_batch: Sequence[Any] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """Influence of each training example on each test example's loss (Koh & Liang 2017).

    ``scores[i, j] = grad target_j^T (H + damping I)^-1 grad fn_i``: ``grad fn_i`` the gradient
    of training example ``i``'s loss at ``params``, ``grad target_j`` that of test example
    ``j``'s target (by default its loss, ``fn``), ``H`` the Hessian of the MEAN of ``fn`` over
    ``hessian_batch`` (by default ``train_batch``) plus that of ``regularizer``.

    Write ``fn`` as the DATA loss of one example, without the training regulariser, and pass
    the regulariser separately: an L2 penalty ``l2 / 2 * |params|^2`` as ``damping=l2`` (its
    Hessian is ``l2 I``), anything else as ``regularizer=``. Removing an example removes its
    data loss, not the regulariser; a regulariser inside ``fn`` adds the same ``l2 * params`` to
    every gradient, which swamps the ranking (on digits, an MLP's linear datamodeling score fell
    from 0.80 to 0.45 that way).

    Sign: a positive score means train example ``i`` helps test example ``j``: removing ``i``
    and retraining would RAISE ``j``'s loss. To first order, the change in test loss from
    removing ``i`` from the ``n_train`` training examples is ``+scores[i, j] / n_train``
    (Koh & Liang's ``I_up,loss`` is ``-scores``). Why: upweighting example ``i`` by ``eps``
    in the mean training loss moves the minimum by ``-eps H^-1 grad_train_i``; removing it is
    ``eps = -1 / n_train``, so the parameters move by ``+H^-1 grad_train_i / n_train`` and the
    test loss by ``grad_test_j`` dotted with that. This assumes ``params`` minimise the mean
    training loss over ``train_batch`` (then ``H`` is positive definite). With a ``target_fn``
    the same holds for the target: removing ``i`` changes ``target_j`` by about
    ``+scores[i, j] / n_train``, so for a quantity you want high (a margin, a log-likelihood),
    pass its negative to keep "positive helps".

    Args:
      fn: the data loss of ONE example, ``fn(params, *example) -> scalar``, as for
        :func:`pergrad.per_example_grads`; no regulariser (see above).
      params: the trained parameters, any pytree of JAX arrays or torch tensors; its
        floating-point leaves are differentiated.
      train_batch: tuple of ``fn``'s batched arguments for the training examples, e.g.
        ``(X_train, Y_train)``; every array leaf has the leading size ``n_train``.
      test_batch: the same for the test examples (``n_test``).
      damping: ``>= 0``, added to the Hessian's diagonal. Needed when ``H`` is singular (more
        parameters than the data pins down) or indefinite (not at a minimum); it shrinks the
        scores of directions with curvature below ``damping``. A list of them (a grid to tune
        it on) returns ``(len(damping), n_train, n_test)`` scores; the exact solver then builds
        the Hessian and its eigendecomposition once for the whole grid.
      solver: ``"exact"`` (default; materialises the ``P x P`` Hessian: small models),
        ``"cg"`` (conjugate gradient) or ``"lissa"``, or an :class:`Exact` / :class:`CG` /
        :class:`LiSSA` instance to set its options. ``"kfac"`` / ``"ekfac"`` (or a
        :class:`KFAC` / :class:`EKFAC` instance) replace ``H`` by a Kronecker-factored
        curvature per dense / conv layer, from one (K-FAC) or two (EK-FAC) captured passes
        over ``hessian_batch``: large models, one factorisation for a whole damping grid. That
        curvature is the EMPIRICAL Fisher, the mean of ``g g^T`` over ``hessian_batch`` with
        ``g`` each example's gradient of ``fn`` at its own labels; it is positive
        semi-definite (no negative curvature) but weights each example by its squared
        residual, so it is small along directions the model already fits and large along
        those of badly fit examples, unlike the Gauss-Newton matrix of a likelihood loss. For
        that one (the true Fisher), pass as ``hessian_batch`` the inputs with labels sampled
        from the model's predictive distribution, several draws per input. No
        ``regularizer`` (fold an L2 penalty into ``damping``); in PyTorch, ``fn`` must be a
        :func:`pergrad.module_loss` for its layers to be factored.
      target_fn: ``target_fn(params, *example) -> scalar`` of one test example, whose gradient
        is scored (a test loss, a margin); default ``fn``. Takes the same arguments as ``fn``.
      regularizer: ``regularizer(params) -> scalar``, the training regulariser; its Hessian is
        added to ``H``, and it is in no gradient. Default None.
      hessian_batch: the examples whose mean loss defines ``H``; default ``train_batch``.
      chunk_size: compute per-example gradients and the Hessian's loss this many examples at
        a time (bounds memory; the side not solved for is streamed, never held as ``(n, P)``).

    Returns:
      ``(n_train, n_test)`` scores, an array of the parameters' framework; for a list of
      dampings, ``(len(damping), n_train, n_test)``.

    Example::

        scores = pergrad.influence.influence_function(
            loss, params, (X_train, Y_train), (X_test, Y_test), damping=1e-3, solver="cg")
        helpful = scores[:, 0].argsort()[::-1][:10]   # the 10 most helpful for test example 0

    Cost: one inverse-Hessian-vector product per example of the smaller of the two batches
    (``H`` is symmetric, so either side can be solved for), plus per-example gradients of both.
    With ``"kfac"`` / ``"ekfac"``: one or two forward and backward passes over
    ``hessian_batch`` (``chunk_size`` examples at a time) and two eigendecompositions per
    layer (``p^3 + q^3`` for a ``q x p`` weight), then a product with the factors per vector.
    """
    name = "influence_function"
    loss = FlatLoss.create(name, fn, params, chunk_size, regularizer=regularizer)
    target = loss.target(target_fn)
    train, n_train = check_batch(name, "train_batch", loss.backend, train_batch)
    test, n_test = check_batch(name, "test_batch", loss.backend, test_batch)
    if target_fn is None:
        check_same_arity(name, train, "train_batch", test, "test_batch")
    grid = check_dampings(name, damping)
    dampings = grid if grid is not None else [check_damping(name, damping)]
    solver = check_solver(name, solver)
    hessian, n_hessian = _hessian_batch(name, loss, train, n_train, hessian_batch)
    # H is symmetric: solve for the smaller side, then stream the other side's gradients once
    # against the solutions of every damping side by side.
    if n_test <= n_train:
        rows = target.grads(test)
        other, other_batch, other_count = loss, train, n_train
    else:
        rows = loss.grads(train)
        other, other_batch, other_count = target, test, n_test
    bk = loss.backend
    if isinstance(solver, CURVATURE_SOLVERS):
        solved = _curvature_inverse(name, loss, hessian, n_hessian, rows, solver, dampings)
    else:
        operator = loss.hessian(hessian, n_hessian, dampings[0])
        solved = solve_grid(name, operator, rows, solver, dampings)
    scores = other.grads_dot(other_batch, other_count, bk.concatenate(solved, axis=0))
    k = bk.shape(rows)[0]
    pieces = [scores[:, g * k : (g + 1) * k] for g in range(len(dampings))]
    if n_test > n_train:
        pieces = [piece.T for piece in pieces]
    return bk.stack(pieces) if grid is not None else pieces[0]


def self_influence(
    fn: Callable[..., Any],
    params: Any,
    train_batch: Sequence[Any],
    damping: float = 0.0,
    solver: Any = "exact",
    *,
    regularizer: Callable[[Any], Any] | None = None,
    hessian_batch: Sequence[Any] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """Each training example's influence on its own loss, ``grad_i^T (H + damping I)^-1
    grad_i``: the diagonal of ``influence_function(fn, params, train_batch, train_batch)``.

    Large values mark examples the model had to bend to fit (mislabeled, atypical): removing
    one would raise its own loss the most. ``n_train * (change in its own loss)`` to first
    order. Arguments as for :func:`influence_function`.

    Returns:
      ``(n_train,)`` scores, an array of the parameters' framework.
    """
    name = "self_influence"
    loss = FlatLoss.create(name, fn, params, chunk_size, regularizer=regularizer)
    train, n_train = check_batch(name, "train_batch", loss.backend, train_batch)
    damping = check_damping(name, damping)
    solver = check_solver(name, solver)
    hessian, n_hessian = _hessian_batch(name, loss, train, n_train, hessian_batch)
    grads = loss.grads(train)
    if isinstance(solver, CURVATURE_SOLVERS):
        (solved,) = _curvature_inverse(name, loss, hessian, n_hessian, grads, solver, [damping])
    else:
        solved = solve(name, loss.hessian(hessian, n_hessian, damping), grads, solver)
    return (grads * solved).sum(1)


def inverse_hvp(
    fn: Callable[..., Any],
    params: Any,
    batch: Sequence[Any],
    vectors: Any,
    damping: float = 0.0,
    solver: Any = "exact",
    *,
    regularizer: Callable[[Any], Any] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """``(H + damping I)^-1 v`` for each of ``k`` vectors ``v``, ``H`` the Hessian of the mean
    of ``fn`` over ``batch`` at ``params`` (plus that of ``regularizer``, if given).

    Args:
      fn: the loss of ONE example, as for :func:`influence_function`.
      params: the parameters, as for :func:`influence_function`.
      batch: tuple of ``fn``'s batched arguments whose mean loss defines ``H``.
      vectors: a pytree like ``params`` with a leading axis ``k`` on every float leaf, e.g.
        per-example gradients of ``k`` test examples.
      damping: as for :func:`influence_function`.
      solver: as for :func:`influence_function`.
      regularizer: as for :func:`influence_function`.
      chunk_size: as for :func:`influence_function`.

    Returns:
      A pytree like ``vectors``; non-float leaves of ``params`` come back as None.
    """
    name = "inverse_hvp"
    loss = FlatLoss.create(name, fn, params, chunk_size, regularizer=regularizer)
    batch, count = check_batch(name, "batch", loss.backend, batch)
    damping = check_damping(name, damping)
    solver = check_solver(name, solver)
    rows = _vectors_to_rows(name, loss, vectors)
    if isinstance(solver, CURVATURE_SOLVERS):
        (solved,) = _curvature_inverse(name, loss, batch, count, rows, solver, [damping])
    else:
        solved = solve(name, loss.hessian(batch, count, damping), rows, solver)
    return loss.flat.rows_to_tree(solved)


def _vectors_to_rows(func_name: str, loss: FlatLoss, vectors: Any) -> Any:
    bk, flat = loss.backend, loss.flat
    paths, leaves, _ = bk.flatten(vectors)
    expected = [(flat.paths[i], shape) for i, shape in zip(flat.positions, flat.shapes)]
    picked = [(p, x) for p, x in zip(paths, leaves) if bk.is_array(x)]
    got = [(p, bk.shape(x)[1:]) for p, x in picked]
    counts = {bk.shape(x)[0] for _, x in picked if len(bk.shape(x)) > 0}
    if got != expected or len(counts) != 1 or any(len(bk.shape(x)) == 0 for _, x in picked):
        raise PergradValueError(
            f"{func_name}: vectors must be a pytree like params with one leading axis k on "
            f"every float leaf; params' float leaves are {expected}, vectors' leaves are "
            f"{[(p, bk.shape(x)) for p, x in picked]}."
        )
    count = counts.pop()
    return bk.concatenate(
        [x.reshape(count, math.prod(shape)) for (_, x), (_, shape) in zip(picked, expected)],
        axis=1,
    )


# --------------------------------------------------------------------------------------------
# TracIn.


def tracin(
    fn: Callable[..., Any],
    checkpoints: Sequence[Any],
    learning_rates: float | Sequence[float],
    train_batch: Sequence[Any],
    test_batch: Sequence[Any],
    *,
    target_fn: Callable[..., Any] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """TracIn-CP (Pruthi et al. 2020): ``scores[i, j] = sum_c lr_c grad_c(train_i) .
    grad_c(test_j)`` over checkpoints ``c`` saved during training.

    Each term approximates how much the SGD steps on train example ``i`` around checkpoint
    ``c`` lowered test example ``j``'s loss; positive means ``i`` helps ``j``, as in
    :func:`influence_function`.

    Args:
      fn: the loss of ONE example, ``fn(params, *example)``.
      checkpoints: a non-empty sequence of parameter pytrees (same structure), e.g. saved every
        epoch.
      learning_rates: the learning rate in effect at each checkpoint: one number for all, or a
        sequence with one positive number per checkpoint.
      train_batch: tuple of ``fn``'s batched arguments for the training examples.
      test_batch: the same for the test examples.
      target_fn: ``target_fn(params, *example) -> scalar`` of one test example, whose gradient
        is scored instead of its loss (as for :func:`influence_function`); default ``fn``.
      chunk_size: compute train gradients this many examples at a time.

    Returns:
      ``(n_train, n_test)`` scores, an array of the checkpoints' framework.
    """
    name = "tracin"
    rates = _check_checkpoints(name, checkpoints, learning_rates)
    total = None
    for index, (params, rate) in enumerate(zip(checkpoints, rates)):
        loss = FlatLoss.create(name, fn, params, chunk_size, arg_name=f"checkpoints[{index}]")
        train, n_train = check_batch(name, "train_batch", loss.backend, train_batch)
        test, _ = check_batch(name, "test_batch", loss.backend, test_batch)
        if target_fn is None:
            check_same_arity(name, train, "train_batch", test, "test_batch")
        term = loss.grads_dot(train, n_train, loss.target(target_fn).grads(test)) * rate
        total = term if total is None else total + term
    return total


def _check_checkpoints(name: str, checkpoints: Any, learning_rates: Any) -> list[float]:
    if not isinstance(checkpoints, (list, tuple)) or not checkpoints:
        raise PergradTypeError(
            f"{name}: checkpoints must be a non-empty list of parameter pytrees (one per saved "
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
