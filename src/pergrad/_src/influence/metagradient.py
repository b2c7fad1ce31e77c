"""Metagradients: exact attribution through a deterministic training run (MAGIC, Ilyas &
Engstrom 2025).

Step ``t`` of the run trains on ``batches[t]`` with the loss ``sum_{i in batches[t]} w_i *
loss_i / len(batches[t])`` (``normalize="kept"``: divided by ``sum_i w_i`` instead). The scores
are the derivatives of the targets at the end of the run with respect to each weight, at
``w = 1``. They come from one forward replay of the run (storing a checkpoint every
``checkpoint_every`` steps) and one reverse pass that carries the adjoint of the parameters and
of the optimizer state back through every update; at each step, one second-order pass gives
every example's term and the Hessian-vector product the adjoint needs, for all targets at once
(PyTorch: one vector-Jacobian product of the step, reverse-over-reverse, whose inputs include
the examples' scales in the batch loss; JAX: one forward-mode pass over the vector of the
batch's per-example losses along the adjoint of the gradient, forward-over-reverse).

This module holds what does not depend on the framework: the optimizers' arithmetic, the
validation, and the checkpointed forward / reverse schedule. The differentiation of one step is
framework-specific (``metagradient_jax.py``, ``metagradient_torch.py``, imported only when a
call needs one): a ``Replay`` object with ``init_state``, ``step`` (for :func:`replay`),
``target_rows`` and either ``reverse_step``, ``zero_scores``, ``add_scores`` and ``finish``
(PyTorch: the schedule below drives them step by step) or ``reverse_all`` (JAX: the schedule
compiled as scans).
"""

from __future__ import annotations

import importlib
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.backends import Backend, backend_of
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_loss import check_batch, check_fn
from pergrad._src.influence.flat_params import FlatParams
from pergrad._src.influence.protocol import Estimator, Task

_REPLAY_MODULES = {
    "jax": "pergrad._src.influence.metagradient_jax",
    "torch": "pergrad._src.influence.metagradient_torch",
}
NORMALIZATIONS = ("batch", "kept")

# --------------------------------------------------------------------------------------------
# Optimizers: pure arithmetic on flat (P,) vectors, differentiated by the framework.


def _check_number(caller: str, name: str, value: Any, low: float, high: float | None) -> None:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and value >= low and (high is None or value < high):
        return
    bound = f"in [{low}, {high})" if high is not None else f">= {low}"
    raise PergradValueError(f"{caller}: {name} must be a number {bound}; got {value!r}.")


def _check_learning_rate(caller: str, learning_rate: Any) -> None:
    if callable(learning_rate):
        return
    _check_number(caller, "learning_rate", learning_rate, 0.0, None)


def learning_rate_at(caller: str, learning_rate: Any, count: int) -> float:
    """The learning rate of the update that follows ``count`` updates (a schedule's value)."""
    if not callable(learning_rate):
        return float(learning_rate)
    value = learning_rate(count)
    try:
        rate = float(value)
    except (TypeError, ValueError) as err:
        raise PergradTypeError(
            f"{caller}: the learning-rate schedule must return a number for each step; "
            f"learning_rate({count}) returned {type(value).__name__}."
        ) from err
    if not math.isfinite(rate):
        raise PergradValueError(
            f"{caller}: learning_rate({count}) returned {rate}; a schedule must be finite."
        )
    return rate


@dataclass(frozen=True)
class SGD:
    """SGD with momentum in PyTorch's convention (made by :func:`sgd`): ``g <- g + weight_decay
    * p`` (L2, coupled), ``m <- momentum * m + g``, ``p <- p - lr * m``."""

    learning_rate: float | Callable[[int], float]
    momentum: float = 0.0
    weight_decay: float = 0.0

    def hyper(self, caller: str, count: int) -> tuple[float, ...]:
        return (learning_rate_at(caller, self.learning_rate, count),)

    def init(self, params: Any) -> tuple[Any, ...]:
        return (params * 0,) if self.momentum else ()

    def update(self, sqrt: Callable, hyper: Any, params: Any, state: tuple, grad: Any) -> Any:
        (lr,) = hyper
        if self.weight_decay:
            grad = grad + self.weight_decay * params
        if not self.momentum:
            return params - lr * grad, ()
        velocity = self.momentum * state[0] + grad
        return params - lr * velocity, (velocity,)


@dataclass(frozen=True)
class Adam:
    """Adam (made by :func:`adam`), optax's and PyTorch's arithmetic: ``m <- b1 m + (1 - b1) g``,
    ``v <- b2 v + (1 - b2) g^2``, ``p <- p - lr * (m_hat / (sqrt(v_hat + eps_root) + eps) +
    weight_decay * p)`` with the bias corrections ``m_hat = m / (1 - b1^n)``, ``v_hat = v / (1 -
    b2^n)`` at the ``n``-th update; the weight decay is decoupled (AdamW)."""

    learning_rate: float | Callable[[int], float]
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: float = 0.0

    def hyper(self, caller: str, count: int) -> tuple[float, ...]:
        lr = learning_rate_at(caller, self.learning_rate, count)
        return (lr, 1.0 - self.b1 ** (count + 1), 1.0 - self.b2 ** (count + 1))

    def init(self, params: Any) -> tuple[Any, ...]:
        return (params * 0, params * 0)

    def update(self, sqrt: Callable, hyper: Any, params: Any, state: tuple, grad: Any) -> Any:
        lr, correction1, correction2 = hyper
        mu = self.b1 * state[0] + (1 - self.b1) * grad
        nu = self.b2 * state[1] + (1 - self.b2) * grad * grad
        direction = (mu / correction1) / (sqrt(nu / correction2 + self.eps_root) + self.eps)
        if self.weight_decay:
            direction = direction + self.weight_decay * params
        return params - lr * direction, (mu, nu)


def sgd(
    learning_rate: float | Callable[[int], float],
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> SGD:
    """SGD for :func:`metagradient` and :func:`replay`, either framework.

    PyTorch's convention (``torch.optim.SGD`` without dampening or Nesterov): ``g <- g +
    weight_decay * p`` (an L2 penalty, coupled), ``m <- momentum * m + g``, ``p <- p - lr * m``.
    ``learning_rate`` is a number or a schedule ``learning_rate(count) -> number``, ``count`` the
    number of updates made before this one (0, 1, ...), as optax's schedules are called.
    """
    _check_learning_rate("sgd", learning_rate)
    _check_number("sgd", "momentum", momentum, 0.0, 1.0)
    _check_number("sgd", "weight_decay", weight_decay, 0.0, None)
    return SGD(learning_rate, float(momentum), float(weight_decay))


def adam(
    learning_rate: float | Callable[[int], float],
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
) -> Adam:
    """Adam / AdamW for :func:`metagradient` and :func:`replay`, either framework.

    optax's ``adam`` (``adamw`` with ``weight_decay``, decoupled: ``p <- p - lr * (update +
    weight_decay * p)``, which is PyTorch's ``AdamW``). The normaliser ``sqrt(v_hat + eps_root)``
    is differentiated, not frozen. Where ``v`` is exactly 0 (a parameter no example has moved
    yet) the square root's derivative is taken as 0, its one-sided limit along the run, so the
    scores stay finite with ``eps_root=0``. ``learning_rate``: a number or a schedule, as for
    :func:`sgd`.
    """
    _check_learning_rate("adam", learning_rate)
    for name, value in (("b1", b1), ("b2", b2)):
        _check_number("adam", name, value, 0.0, 1.0)
    for name, value in (("eps", eps), ("eps_root", eps_root), ("weight_decay", weight_decay)):
        _check_number("adam", name, value, 0.0, None)
    return Adam(
        learning_rate, float(b1), float(b2), float(eps), float(eps_root), float(weight_decay)
    )


def check_optimizer(caller: str, optimizer: Any, bk: Backend) -> Any:
    """``optimizer`` if it can be differentiated on ``bk``'s framework, else a teaching error."""
    if isinstance(optimizer, (SGD, Adam)):
        return optimizer
    module = type(optimizer).__module__ or ""
    is_optax = callable(getattr(optimizer, "init", None)) and callable(
        getattr(optimizer, "update", None)
    )
    if is_optax and not module.startswith("torch") and bk.name == "jax":
        return optimizer
    if module.startswith("torch") or (isinstance(optimizer, type) and "torch" in module):
        hint = (
            "a torch.optim optimizer updates the parameters in place and cannot be "
            "differentiated through; pass pergrad.influence.sgd(lr, momentum=...) or "
            "pergrad.influence.adam(lr, ...), which follow torch.optim's arithmetic"
        )
    elif is_optax:
        hint = (
            "an optax transformation is differentiated only with JAX parameters; with "
            f"{bk.name} parameters pass pergrad.influence.sgd(...) or pergrad.influence.adam(...)"
        )
    else:
        hint = (
            "pass pergrad.influence.sgd(learning_rate, momentum=0.0), "
            "pergrad.influence.adam(learning_rate, ...) or, with JAX parameters, an optax "
            "GradientTransformation"
        )
    raise PergradTypeError(f"{caller}: optimizer cannot be replayed: {hint}; got {optimizer!r}.")


# --------------------------------------------------------------------------------------------
# Validation of the run.


def check_batches(caller: str, batches: Any, num_train: int) -> list[np.ndarray]:
    """``batches`` as a list of int64 index arrays, each in ``[0, num_train)``."""
    if hasattr(batches, "detach"):
        batches = batches.detach().cpu().numpy()
    if isinstance(batches, (str, bytes, dict)) or not hasattr(batches, "__iter__"):
        raise PergradTypeError(
            f"{caller}: batches must be a list of index arrays, one per training step (the "
            f"examples of data that step trains on); got {type(batches).__name__}."
        )
    if getattr(batches, "ndim", 2) == 1:
        raise PergradValueError(
            f"{caller}: batches must be a list of index arrays, one per step; got a 1-D array "
            f"of shape {np.shape(batches)}. For a single step pass [indices]."
        )
    checked = [
        _check_indices(caller, step, indices, num_train) for step, indices in enumerate(batches)
    ]
    if not checked:
        raise PergradValueError(f"{caller}: batches is empty; a run needs at least one step.")
    return checked


def _check_indices(caller: str, step: int, indices: Any, num_train: int) -> np.ndarray:
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu()
    try:
        array = np.asarray(indices)
    except Exception as err:
        raise PergradTypeError(
            f"{caller}: batches[{step}] must be an array of example indices; got "
            f"{type(indices).__name__}."
        ) from err
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype == bool:
        raise PergradTypeError(
            f"{caller}: batches[{step}] is a boolean mask; pass the indices of the examples, "
            f"e.g. np.flatnonzero(mask)."
        )
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise PergradValueError(
            f"{caller}: batches[{step}] must be a 1-D array of integer indices into data; got "
            f"shape {array.shape} of {array.dtype}."
        )
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= num_train:
        raise PergradValueError(
            f"{caller}: batches[{step}] holds index {low if low < 0 else high}, out of range "
            f"for data of {num_train} examples (indices must be in [0, {num_train}))."
        )
    return array.astype(np.int64)


def _check_positive_int(caller: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PergradValueError(f"{caller}: {name} must be a positive int; got {value!r}.")
    return int(value)


def _check_normalize(caller: str, normalize: Any) -> str:
    if normalize not in NORMALIZATIONS:
        raise PergradValueError(
            f"{caller}: normalize must be 'batch' (the batch loss divided by the batch's size) "
            f"or 'kept' (divided by the sum of the batch's weights); got {normalize!r}."
        )
    return normalize


@dataclass(frozen=True)
class Run:
    """A checked training run: what the framework's ``Replay`` replays.

    Attributes:
      caller: the public function, named in errors.
      loss: the loss of one example, ``loss(params, *example) -> scalar``.
      flat: the initial parameters as a flat vector.
      data: the tuple of batched training arguments.
      num_train: the number of training examples.
      batches: one int64 index array per step.
      counts: ``counts[t]``, the number of updates made before step ``t`` (empty steps make none).
      optimizer: an :class:`SGD`, :class:`Adam` or (JAX) optax transformation.
      normalize: ``"batch"`` or ``"kept"``.
    """

    caller: str
    loss: Callable[..., Any]
    flat: FlatParams
    data: tuple[Any, ...]
    num_train: int
    batches: list[np.ndarray]
    counts: list[int]
    optimizer: Any
    normalize: str

    @property
    def backend(self) -> Backend:
        return self.flat.backend

    def hyper(self, step: int) -> tuple[float, ...]:
        hyper = getattr(self.optimizer, "hyper", None)
        return hyper(self.caller, self.counts[step]) if hyper is not None else ()


def check_run(
    caller: str, loss: Any, params0: Any, data: Any, batches: Any, optimizer: Any, normalize: Any
) -> Run:
    check_fn(caller, loss, "loss")
    bk = backend_of(params0, caller, "params0")
    flat = FlatParams.create(caller, "params0", bk, params0)
    data, num_train = check_batch(caller, "data", bk, data)
    checked = check_batches(caller, batches, num_train)
    counts = list(np.cumsum([0] + [len(b) > 0 for b in checked[:-1]]))
    optimizer = check_optimizer(caller, optimizer, bk)
    normalize = _check_normalize(caller, normalize)
    return Run(
        caller, loss, flat, data, num_train, checked, [int(c) for c in counts], optimizer, normalize
    )


def replay_for(run: Run) -> Any:
    """The framework's ``Replay`` of ``run`` (it steps and differentiates the run)."""
    module = importlib.import_module(_REPLAY_MODULES[run.backend.name])
    return module.Replay(run)


# --------------------------------------------------------------------------------------------
# The public functions.


def metagradient(
    loss: Callable[..., Any],
    params0: Any,
    data: Sequence[Any],
    batches: Any,
    optimizer: Any,
    target: Callable[[Any], Any],
    *,
    checkpoint_every: int = 1,
    normalize: str = "batch",
) -> Any:
    """Exact attribution of ``target`` at the end of a training run to each training example.

    Step ``t`` trains on ``batches[t]`` with the loss ``sum_{i in batches[t]} w_i * loss_i /
    len(batches[t])``; ``scores[i, j] = d target_j(final params) / d w_i`` at ``w = 1``: the
    first-order change of target ``j`` when example ``i`` is up-weighted (dropping it is
    ``w_i = 0``: about ``-scores[i, j]``).

    Args:
      loss: the loss of ONE example, ``loss(params, x, y) -> scalar``; in PyTorch usually
        ``pergrad.module_loss(model, F.cross_entropy)`` with ``params0 = loss.params()``. The
        run must be deterministic: a module with dropout (or BatchNorm) in training mode is
        refused; in JAX, randomness comes only from keys you pass.
      params0: the initial parameters: a pytree of JAX arrays (flax params, an equinox module)
        or a dict of torch tensors. Never modified.
      data: the tuple of ``loss``'s batched arguments, e.g. ``(X, Y)``, each leaf ``(n_train,
        ...)``.
      batches: one index array per step (numpy, list, torch or JAX ints in ``[0, n_train)``),
        or a ``(steps, batch_size)`` int array. An empty batch makes no update (the step is
        skipped; the optimizer's count does not advance); an index twice in a batch counts twice.
      optimizer: :func:`sgd`, :func:`adam` (either framework) or, with JAX parameters, any optax
        ``GradientTransformation`` (its update differentiated by ``jax.vjp``).
      target: ``target(params) -> scalar or (k,)``, e.g. minus a test loss or a margin.
      checkpoint_every: the forward replay keeps the parameters and optimizer state every this
        many steps; the reverse pass recomputes each segment from its checkpoint. Memory:
        ``(ceil(steps / c) + c)`` copies of the parameters and optimizer state, plus ``k``
        adjoints of each, for ``c = checkpoint_every``; time: one extra replay of the run when
        ``c > 1``. ``c ~ sqrt(steps)`` minimises memory; the default 1 keeps every step.
      normalize: ``"batch"`` (above); ``"kept"``: the batch loss is ``sum w_i loss_i / sum w_i``,
        the mean over the examples kept (a batch whose weights are all 0 makes no update).

    Returns:
      ``(n_train, k)`` scores (``k = 1`` for a scalar target), an array of the parameters'
      framework and dtype. Examples in no batch score 0.

    Cost: a replay of the run, then per step one second-order pass vectorised over the ``k``
    targets: in PyTorch one reverse-over-reverse vector-Jacobian product of the step (about two
    training steps for one target); in JAX one gradient, one vector-Jacobian product of the
    optimizer update and one forward-over-reverse pass over the batch's per-example losses, the
    whole run compiled as two scans (replay, reverse pass) that later calls with the same loss,
    optimizer and parameters' structure reuse: about 3 training runs for one target.

    Example::

        loss = pergrad.module_loss(model.eval(), F.cross_entropy)
        order = [rng.permutation(n)[i:i + 32] for _ in range(epochs) for i in range(0, n, 32)]
        scores = pergrad.influence.metagradient(
            loss, loss.params(), (X, Y), order, pergrad.influence.sgd(0.1, momentum=0.9),
            target=lambda p: -loss(p, X_test[0], Y_test[0]))
        scores.shape   # (n, 1)
    """
    caller = "metagradient"
    run = check_run(caller, loss, params0, data, batches, optimizer, normalize)
    checkpoint_every = _check_positive_int(caller, "checkpoint_every", checkpoint_every)
    replay = replay_for(run)
    replay.check_target(target)
    return _reverse(run, replay, checkpoint_every)


def replay(
    loss: Callable[..., Any],
    params0: Any,
    data: Sequence[Any],
    batches: Any,
    optimizer: Any,
    weights: Any = None,
    *,
    normalize: str = "batch",
) -> Any:
    """The run :func:`metagradient` differentiates, with example weights: the final parameters.

    Step ``t`` trains on ``batches[t]`` with ``sum_{i in batches[t]} weights[i] * loss_i /
    len(batches[t])`` (``normalize="kept"``: over ``sum weights[i]``). ``weights=None`` is all
    ones; a 0/1 mask retrains without the dropped examples but with the same initialisation,
    order and batch sizes: the ground truth of the same-seed linear datamodeling score::

        scores = metagradient(loss, params0, (X, Y), batches, opt, target)      # (n, k)
        masks = pergrad.influence.lds_subsets(n, 32, fraction=0.9)              # 10% dropped
        outputs = np.stack([np.asarray(target(replay(loss, params0, (X, Y), batches, opt,
                                                     weights=mask))) for mask in masks])
        pergrad.influence.lds(scores, masks, outputs.reshape(len(masks), -1))

    Returns a pytree like ``params0`` (torch: a dict of new tensors; ``params0`` is not
    modified). The arguments are those of :func:`metagradient`; ``weights``: ``(n_train,)``
    non-negative numbers (numpy, a list, or an array of either framework).
    """
    caller = "replay"
    run = check_run(caller, loss, params0, data, batches, optimizer, normalize)
    weights = check_weights(caller, weights, run.num_train)
    return replay_run(run, replay_for(run), weights)


def replay_run(run: Run, machine: Any, weights: np.ndarray) -> Any:
    """The final parameters (a pytree like ``params0``) of ``run`` with example ``weights``
    (``(n_train,)``, checked), replayed step by step by ``machine`` (:func:`replay_for`)."""
    params, state = run.flat.vector, machine.init_state()
    for step, indices in enumerate(run.batches):
        params, state = machine.step(step, params, state, weights[indices])
    return run.flat.unravel(params)


def check_weights(caller: str, weights: Any, num_train: int) -> np.ndarray:
    if weights is None:
        return np.ones(num_train)
    if hasattr(weights, "detach"):
        weights = weights.detach().cpu()
    array = np.asarray(weights, dtype=np.float64) if _numeric(weights) else None
    if array is None or array.shape != (num_train,):
        got = f"shape {array.shape}" if array is not None else type(weights).__name__
        raise PergradValueError(
            f"{caller}: weights must be (n_train,) = ({num_train},) numbers, one per training "
            f"example; got {got}."
        )
    if not np.isfinite(array).all() or (array < 0).any():
        raise PergradValueError(f"{caller}: weights must be finite and non-negative.")
    return array


def _numeric(value: Any) -> bool:
    try:
        return np.issubdtype(np.asarray(value).dtype, np.number) or np.asarray(value).dtype == bool
    except Exception:
        return False


def _reverse(run: Run, machine: Any, checkpoint_every: int) -> Any:
    """The forward replay keeping checkpoints, then the reverse pass segment by segment (a
    framework that compiles the whole schedule, JAX's, does it in ``reverse_all``)."""
    whole = getattr(machine, "reverse_all", None)
    if whole is not None:
        return whole(checkpoint_every)
    steps = len(run.batches)
    ones = [np.ones(len(b)) for b in run.batches]
    checkpoints = {}
    params, state = run.flat.vector, machine.init_state()
    for step in range(steps):
        if step % checkpoint_every == 0:
            checkpoints[step] = (params, state)
        params, state = machine.step(step, params, state, ones[step])
    adjoint_params, adjoint_state = machine.target_rows(params, state)
    scores = machine.zero_scores()
    for start in reversed(range(0, steps, checkpoint_every)):
        stop = min(start + checkpoint_every, steps)
        segment = [checkpoints.pop(start)]
        for step in range(start, stop - 1):
            segment.append(machine.step(step, *segment[-1], ones[step]))
        for step in reversed(range(start, stop)):
            if len(run.batches[step]) == 0:
                continue
            adjoint_params, adjoint_state, terms = machine.reverse_step(
                step, *segment[step - start], adjoint_params, adjoint_state
            )
            scores = machine.add_scores(scores, step, terms)
    return machine.finish(scores)


# --------------------------------------------------------------------------------------------
# The attribution protocol's view: an estimator whose "model" is the training run.


@dataclass(frozen=True)
class Metagradient(Estimator, name="metagradient"):
    """The :class:`Estimator` view of :func:`metagradient`: it scores the training examples
    against test examples through the training run, so ``task.params`` are the INITIAL
    parameters and ``train_batch`` the whole training set that ``batches`` index.

    The target of test example ``j`` is ``-target_fn(params, *test_j)`` (``task.target_fn``,
    default the loss) at the end of the run, so positive scores help, as for every estimator::

        estimator = pergrad.influence.Metagradient(batches=order, optimizer=sgd(0.1, 0.9))
        scores = estimator.scores(Task(loss, params0), (X, Y), (X_test, Y_test))  # (n, n_test)

    It needs the whole run at once, so :func:`top_k` refuses it.
    """

    batches: Any = None
    optimizer: Any = None
    checkpoint_every: int = 1
    normalize: str = "batch"

    def scores(self, task: Task, train_batch: Any, test_batch: Any) -> Any:
        if self.batches is None or self.optimizer is None:
            raise PergradValueError(
                f"{task.caller}: the 'metagradient' estimator needs the training run: "
                f"Metagradient(batches=..., optimizer=...); got batches={self.batches!r}, "
                f"optimizer={self.optimizer!r}."
            )
        bk = task.backend()
        test, _ = check_batch(task.caller, "test_batch", bk, test_batch)
        target_fn = task.target_fn or task.fn
        check_fn(task.caller, target_fn, "target_fn")
        per_test = bk.vmap(lambda p, example: target_fn(p, *example), (None, 0), None, None)

        def target(params: Any) -> Any:
            return operator.neg(per_test(params, test))

        return metagradient(
            task.fn,
            task.params,
            train_batch,
            self.batches,
            self.optimizer,
            target,
            checkpoint_every=self.checkpoint_every,
            normalize=self.normalize,
        )
