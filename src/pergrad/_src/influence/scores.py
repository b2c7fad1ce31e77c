"""The public score functions, each a thin front end over an estimator or a solver.

All scores are ``(n_train, n_test)`` arrays of the framework they were computed in, with the
same sign convention: **positive means the training example helps the test example** (training
on it lowers the test loss; removing it would raise it).

* :func:`grad_dot` / :func:`grad_cosine`: from per-example gradients you already have
  (``similarity.py``).
* :func:`influence_function`: ``grad_test^T (H + damping I)^-1 grad_train`` (Koh & Liang
  2017), ``H`` the Hessian of the mean training loss; :func:`self_influence`: each training
  example against itself (``influence_function.py``, solvers from ``ihvp.py`` / ``kfac.py``).
* :func:`inverse_hvp`: the inverse-Hessian-vector products themselves (a solver alone).
* :func:`tracin`: TracIn over checkpoints (Pruthi et al. 2020, ``tracin.py``).
* :func:`trak`: TRAK over an ensemble (Park et al. 2023, ``trak.py``).

The loss ``fn`` is the one the core takes: the loss of ONE example, ``fn(params, *example)``.
Batches are tuples of ``fn``'s batched arguments (every array leaf batched on axis 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pergrad._src.errors import PergradValueError
from pergrad._src.influence.flat_loss import FlatLoss, check_batch
from pergrad._src.influence.ihvp import check_damping
from pergrad._src.influence.influence_function import InfluenceFunction
from pergrad._src.influence.protocol import Task, solver_from
from pergrad._src.influence.similarity import GradCosine, GradDot, check_eps
from pergrad._src.influence.tracin import TracIn
from pergrad._src.influence.trak import Trak

# --------------------------------------------------------------------------------------------
# Scores from per-example gradients.


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
    return GradDot().between("grad_dot", train_grads, test_grads)


def grad_cosine(train_grads: Any, test_grads: Any, eps: float = 1e-12) -> Any:
    """Cosine similarity of every training example's gradient with every test example's.

    Like :func:`grad_dot` (same arguments), normalised by both gradients' norms: ``(n_train,
    n_test)`` values in ``[-1, 1]``, insensitive to how large an example's gradient is (a
    mislabeled example's large gradient does not dominate). ``eps`` guards zero gradients,
    which get a cosine of 0.
    """
    check_eps("grad_cosine", eps)
    return GradCosine(eps).between("grad_cosine", train_grads, test_grads)


# --------------------------------------------------------------------------------------------
# Influence functions.


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
    estimator = InfluenceFunction(damping, solver, regularizer, hessian_batch)
    task = Task(fn, params, target_fn, chunk_size, caller="influence_function")
    return estimator.scores(task, train_batch, test_batch)


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
    estimator = InfluenceFunction(damping, solver, regularizer, hessian_batch)
    task = Task(fn, params, chunk_size=chunk_size, caller="self_influence")
    return estimator.self_scores(task, train_batch)


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
    solver = solver_from(name, solver)
    rows = _vectors_to_rows(name, loss, vectors)
    (solved,) = solver.inverse(name, loss, batch, count, rows, [damping])
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
# Estimators over several models: TracIn over checkpoints, TRAK over an ensemble.


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
    task = Task(fn, checkpoints, target_fn, chunk_size, "tracin", "checkpoints")
    return TracIn(learning_rates).scores(task, train_batch, test_batch)


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
      damping: ``>= 0``, added to ``Phi^T Phi``; 0 uses the pseudo-inverse where
        ``Phi^T Phi`` is singular (fewer examples than ``k``). ``traker``'s ``lambda_reg`` is
        on another scale: its features are divided by ``sqrt(P)`` (``P`` parameters) and
        projected with unit-variance entries, where pergrad's entries have variance ``1/k``,
        so a damping ``d`` here is ``lambda_reg = d * k / P`` there. A list of
        them (a grid to tune on) returns ``(len(damping), n_train, n_targets)`` scores from
        the same features and one eigendecomposition per model.
      seed: model ``m`` projects with seed ``seed + m`` (:func:`project`'s matrix, the same on
        both frameworks).
      kind: ``"rademacher"`` (default, as ``traker``'s fast_jl projector on a GPU) or
        ``"gaussian"`` (as ``traker``'s projector on a CPU) entries.
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
            return pergrad.influence.classification_margin(model(params, x), y)

        scores = pergrad.influence.trak(margin, [params_1, params_2, ...], (X_train, Y_train),
                                        (X_test, Y_test), damping=[1.0, 10.0, 100.0])

    On a well-fit model leave ``weight_fn`` out and damp on the kernel's scale: ``1 - p_y``
    (:func:`classification_weight`) hands every target's proponents to the few examples the
    model gets wrong (the influence guide has the measurement).

    Cost per model: per-example gradients of both sides, ``n x P x k`` for the projection, and
    a ``min(n_train, k)``-sized symmetric solve (in float64, on the host). For a training set
    that does not fit in memory, or targets that come later, see :class:`TRAK`.
    """
    estimator = Trak(weight_fn, proj_dim, damping, seed, kind, projection, factored_dims)
    task = Task(fn, checkpoints, target_fn, chunk_size, "trak", "checkpoints")
    return estimator.scores(task, train_batch, target_batch)
