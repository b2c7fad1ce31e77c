"""One step of a training run, replayed and differentiated in JAX (``metagradient.py``).

The optimizer state is a list of leaves; the float ones carry adjoints, the others (optax's
integer counts) are carried along as they come out of each update.

:func:`metagradient` runs as two programs, each one ``lax.scan`` over the whole run (a step a
dispatch cost as much as the step itself on a small model): the forward replay, which keeps a
checkpoint at the start of every segment of ``checkpoint_every`` steps, and the reverse pass,
which recomputes each segment from its checkpoint and carries the adjoints back through it,
giving every step's per-example terms. The batches are padded with example 0 (scale 0) to the
largest batch, the run with empty steps to whole segments; an empty step is skipped by
``lax.cond``. The programs are compiled once and kept (:class:`_Program`, the last few): a later
call with the same loss, optimizer and parameters' structure (a loop over targets, one per
call) reuses them. :func:`replay` steps one jitted update at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pergrad._src.errors import PergradTypeError, PergradValueError


def safe_sqrt(x: Any) -> Any:
    """``sqrt(x)`` whose derivative at 0 is 0 instead of infinity (see ``adam``)."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


class _Optax:
    """An optax transformation on the flat parameter vector: unravelled for ``update``."""

    def __init__(self, transformation: Any, flat: Any) -> None:
        self.transformation = transformation
        self.flat = flat

    def tree(self, vector: Any) -> Any:
        """The parameters' pytree of float arrays only (constants as None, as an equinox
        module filtered by ``eqx.is_array``), read from ``vector``."""
        return jax.tree_util.tree_map(lambda x: x[0], self.flat.rows_to_tree(vector[None]))

    def init(self, params: Any) -> Any:
        return self.transformation.init(self.tree(params))

    def update(self, sqrt: Any, hyper: Any, params: Any, state: Any, grad: Any) -> Any:
        tree = self.tree(params)
        updates, state = self.transformation.update(self.tree(grad), state, tree)
        flat_updates, _ = jax.flatten_util.ravel_pytree(updates)
        return params + flat_updates.astype(params.dtype), state


class Replay:
    """The JAX side of a :class:`~pergrad._src.influence.metagradient.Run`."""

    def __init__(self, run: Any) -> None:
        import jax.flatten_util  # noqa: F401  (used by _Optax)

        self.run = run
        self.unravel = run.flat.unravel
        optimizer = run.optimizer
        if not hasattr(optimizer, "hyper"):
            optimizer = _Optax(optimizer, run.flat)
        self.optimizer = optimizer
        self.data = tuple(jax.tree_util.tree_map(jnp.asarray, run.data))
        self.kept = run.normalize == "kept"
        self.width = max(len(indices) for indices in run.batches)
        self._check_loss()
        state = self._init_state()
        leaves, state_def = jax.tree_util.tree_flatten(state)
        floats = tuple(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)
        self.floats = list(floats)
        self.program = _Program.of(run, self.optimizer, state_def, floats, self.kept)

    # -- checks ---------------------------------------------------------------------------

    def _check_loss(self) -> None:
        example = jax.tree_util.tree_map(lambda x: x[0], self.data)
        value = self.run.loss(self.unravel(self.run.flat.vector), *example)
        problem = self.run.backend.scalar_loss_problem(value)
        if problem is not None:
            raise PergradValueError(
                f"{self.run.caller}: loss must return a scalar for one example; got {problem}."
            )

    def _init_state(self) -> Any:
        try:
            return self.optimizer.init(self.run.flat.vector)
        except Exception as err:
            raise PergradTypeError(
                f"{self.run.caller}: optimizer.init(params) failed ({type(err).__name__}: "
                f"{err}); the optimizer must be an optax GradientTransformation."
            ) from err

    def check_target(self, target: Any) -> None:
        if not callable(target):
            raise PergradTypeError(
                f"{self.run.caller}: target must be a function target(params) -> scalar or "
                f"(k,); got {type(target).__name__}."
            )
        value = target(self.unravel(self.run.flat.vector))
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        if shape is None or len(shape) > 1 or not jnp.issubdtype(dtype, jnp.floating):
            got = f"shape {shape} of {dtype}" if shape is not None else type(value).__name__
            raise PergradValueError(
                f"{self.run.caller}: target(params) must return a float scalar or a (k,) "
                f"vector; got {got}."
            )
        self.target = target

    # -- the pieces of one step -----------------------------------------------------------

    def init_state(self) -> list[Any]:
        return jax.tree_util.tree_leaves(self._init_state())

    def _batch(self, step: int) -> tuple[Any, ...]:
        """The examples of ``batches[step]`` padded with example 0 to the largest batch (one
        compilation for all steps)."""
        indices = self.run.batches[step]
        padded = np.zeros(self.width, dtype=np.int64)
        padded[: len(indices)] = indices
        return _take(self.data, padded)

    def _scale(self, values: np.ndarray, dtype: Any) -> Any:
        # numpy, converted by the jitted step itself (an eager jnp.asarray costs a dispatch)
        padded = np.zeros(self.width, dtype=np.dtype(dtype))
        padded[: len(values)] = values
        return padded

    def step(self, step: int, params: Any, leaves: list[Any], weights: np.ndarray) -> Any:
        total = len(weights) if not self.kept else float(np.sum(weights))
        if len(weights) == 0 or total == 0:
            return params, leaves
        batch = self._batch(step)
        scale = self._scale(weights / total, params.dtype)
        return self.program.step(self.run.hyper(step), params, leaves, batch, scale)

    def target_rows(self, params: Any, leaves: list[Any]) -> Any:
        """The adjoints at the end of the run: the target's Jacobian ``(k, P)`` for the
        parameters, zeros for the optimizer state's float leaves."""

        def target(p: Any) -> Any:
            return jnp.atleast_1d(self.target(self.unravel(p)))

        values, pullback = jax.vjp(target, params)
        basis = jnp.eye(values.shape[0], dtype=values.dtype)
        # one target without vmap: in eager mode vmap formats the pullback's residuals for its
        # debug information (about 8 ms a call on a small MLP, more than the whole replay)
        rows = pullback(basis[0])[0][None] if len(basis) == 1 else jax.vmap(pullback)(basis)[0]
        zeros = [
            jnp.zeros((len(basis), *x.shape), x.dtype) for x, f in zip(leaves, self.floats) if f
        ]
        return rows, zeros

    # -- the whole run as two scans ---------------------------------------------------------

    def schedule(self, checkpoint_every: int) -> tuple[Any, ...]:
        """The run's steps as arrays ``(segments, checkpoint_every, ...)``: each step's padded
        indices, its examples' scales (1 / its size; 0 for the padding), its optimizer
        hyperparameters and whether it trains (empty steps and the last segment's padding
        do not)."""
        steps = len(self.run.batches)
        padded = -(-steps // checkpoint_every) * checkpoint_every
        dtype = np.dtype(self.run.flat.vector.dtype)
        index = np.zeros((padded, self.width), dtype=np.int64)
        scale = np.zeros((padded, self.width), dtype=dtype)
        active = np.zeros(padded, dtype=bool)
        hyper = np.zeros((padded, len(self.run.hyper(0))), dtype=dtype)
        for step, indices in enumerate(self.run.batches):
            index[step, : len(indices)] = indices
            scale[step, : len(indices)] = 1.0 / max(len(indices), 1)
            active[step] = len(indices) > 0
            hyper[step] = self.run.hyper(step)
        shape = (padded // checkpoint_every, checkpoint_every)
        return tuple(x.reshape(shape + x.shape[1:]) for x in (index, scale, hyper, active))

    def reverse_all(self, checkpoint_every: int) -> Any:
        """The scores: the forward replay, the target's rows, the reverse pass."""
        schedule = self.schedule(checkpoint_every)
        params, leaves = self.run.flat.vector, self.init_state()
        (final, final_leaves), checkpoints = self.program.forward(
            params, leaves, self.data, schedule
        )
        adjoint_params, adjoint_floats = self.target_rows(final, final_leaves)
        return self.program.backward(
            checkpoints, self.data, schedule, adjoint_params, adjoint_floats, self.run.num_train
        )


class _Program:
    """The jitted step functions of a run, which read only the loss, the optimizer, the
    parameters' structure (constants included) and the optimizer state's: kept in
    :data:`_PROGRAMS` (the last :data:`_KEPT`) and shared by the runs that have the same."""

    def __init__(self, run: Any, optimizer: Any, state_def: Any, floats: tuple, kept: bool):
        self.loss, self.flat, self.optimizer = run.loss, run.flat, optimizer
        self.state_def, self.floats, self.kept = state_def, list(floats), kept
        self.user_optimizer = run.optimizer  # (its identity is part of the key)
        self.step = jax.jit(self._step_fn)
        self.forward = jax.jit(self._forward_fn)
        self.backward = jax.jit(self._backward_fn, static_argnums=5)

    @classmethod
    def of(cls, run: Any, optimizer: Any, state_def: Any, floats: tuple, kept: bool) -> _Program:
        key = _program_key(run, state_def, floats, kept)
        if key is None:  # a constant that cannot be compared: compiled for this run alone
            return cls(run, optimizer, state_def, floats, kept)
        found = _PROGRAMS.get(key)
        # the loss and the optimizer are compared by identity (a closure's constants, an
        # optimizer's settings are not seen by ==): the entry holds them, so no id is reused
        if found is None or found.loss is not run.loss or found.user_optimizer is not run.optimizer:
            found = cls(run, optimizer, state_def, floats, kept)
            _PROGRAMS[key] = found
        _PROGRAMS.move_to_end(key)
        while len(_PROGRAMS) > _KEPT:
            _PROGRAMS.popitem(last=False)
        return found

    def _losses(self, params: Any, batch: Any) -> Any:
        return jax.vmap(lambda example: self.loss(self.flat.unravel(params), *example))(batch)

    def _update(self, hyper: Any, params: Any, leaves: list[Any], grad: Any) -> Any:
        state = jax.tree_util.tree_unflatten(self.state_def, leaves)
        params, state = self.optimizer.update(safe_sqrt, hyper, params, state, grad)
        return params, jax.tree_util.tree_leaves(state)

    def _step_fn(self, hyper: Any, params: Any, leaves: list[Any], batch: Any, scale: Any):
        grad = jax.grad(lambda p: jnp.sum(scale * self._losses(p, batch)))(params)
        return self._update(hyper, params, leaves, grad)

    def _reverse_step_fn(self, hyper, params, leaves, batch, scale, adjoint_params, adjoint_floats):
        """The adjoints before a step from those after it (parameters ``(k, P)``, the state's
        float leaves), and the step's per-example terms ``(k, width)``. ``scale``: 1 / the
        batch's size for its examples, 0 for the padding."""

        def mean_and_losses(p: Any) -> Any:
            losses = self._losses(p, batch)
            return jnp.sum(scale * losses), losses

        grad_and_losses = jax.grad(mean_and_losses, has_aux=True)
        grad, _ = grad_and_losses(params)
        floats = [x for x, f in zip(leaves, self.floats) if f]

        def update(p: Any, float_leaves: list[Any], g: Any) -> Any:
            merged = _merge(float_leaves, leaves, self.floats)
            new_params, new_leaves = self._update(hyper, p, merged, g)
            return new_params, [x for x, f in zip(new_leaves, self.floats) if f]

        _, update_vjp = jax.vjp(update, params, floats, grad)
        a_params, a_floats, a_grad = jax.vmap(update_vjp)((adjoint_params, adjoint_floats))

        def fused(tangent: Any) -> Any:
            return jax.jvp(grad_and_losses, (params,), (tangent,))[1]

        hessian_rows, directional = jax.vmap(fused)(a_grad)  # (k, P), (k, B)
        if self.kept:  # d/dw_i of sum w loss / sum w: each loss minus the batch's mean
            directional = directional - jnp.sum(scale * directional, axis=1, keepdims=True)
        return a_params + hessian_rows, a_floats, scale * directional

    # -- the whole run: scans over segments of steps, then over a segment's steps -------------

    def _train(self, carry: Any, data: Any, step: tuple[Any, ...]) -> Any:
        """One step of the forward replay inside a scan (``step``: one row of the schedule)."""
        index, scale, hyper, active = step
        batch = jax.tree_util.tree_map(lambda x: x[index], data)

        def train(state: Any) -> Any:
            params, leaves = state
            return self._step_fn(tuple(hyper), params, leaves, batch, scale)

        return jax.lax.cond(active, train, lambda state: state, carry)

    def _forward_fn(self, params: Any, leaves: list[Any], data: Any, schedule: tuple) -> Any:
        def segment(carry: Any, steps: tuple[Any, ...]) -> Any:
            end, _ = jax.lax.scan(lambda c, step: (self._train(c, data, step), None), carry, steps)
            return end, carry  # the checkpoint: the state at the segment's start

        return jax.lax.scan(segment, (params, leaves), schedule)

    def _backward_fn(self, checkpoints, data, schedule, adjoint_params, adjoint_floats, num_train):
        k = adjoint_params.shape[0]
        width = schedule[0].shape[-1]

        def reverse(adjoint: Any, inputs: tuple[Any, ...]) -> Any:
            (params, leaves), (index, scale, hyper, active) = inputs
            batch = jax.tree_util.tree_map(lambda x: x[index], data)

            def differentiate(adjoint: Any) -> Any:
                a_params, a_floats, terms = self._reverse_step_fn(
                    tuple(hyper), params, leaves, batch, scale, *adjoint
                )
                return (a_params, a_floats), terms

            def skip(adjoint: Any) -> Any:
                return adjoint, jnp.zeros((k, width), adjoint_params.dtype)

            return jax.lax.cond(active, differentiate, skip, adjoint)

        def segment(adjoint: Any, inputs: tuple[Any, ...]) -> Any:
            start, steps = inputs
            # the states before each of the segment's steps: the checkpoint, then recomputed
            head = jax.tree_util.tree_map(lambda x: x[:-1], steps)

            def train(c: Any, step: Any) -> Any:
                c = self._train(c, data, step)
                return c, c

            _, later = jax.lax.scan(train, start, head)
            states = jax.tree_util.tree_map(
                lambda first, rest: jnp.concatenate([first[None], rest]), start, later
            )
            return jax.lax.scan(reverse, adjoint, (states, steps), reverse=True)

        _, terms = jax.lax.scan(
            segment, (adjoint_params, adjoint_floats), (checkpoints, schedule), reverse=True
        )
        # terms: (segments, steps, k, width); the padding's are 0, added to example 0's row
        rows = jnp.swapaxes(terms, -1, -2).reshape(-1, k)
        scores = jnp.zeros((num_train, k), adjoint_params.dtype)
        return scores.at[schedule[0].reshape(-1)].add(rows)


def _merge(floats: list[Any], leaves: list[Any], is_float: list[bool]) -> list[Any]:
    """``leaves`` with its float ones (``is_float``) replaced by ``floats``, in order."""
    it = iter(floats)
    return [next(it) if f else x for x, f in zip(leaves, is_float)]


# Per step, jitted: JAX's eager indexing costs about 0.5 ms a call in Python (a 320-step replay
# spent more than half its time gathering its batches that way).
@jax.jit
def _take(data: Any, index: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x[index], data)


# The programs of the last few runs: a loop of one-target calls compiles once.
_KEPT = 4
_PROGRAMS: OrderedDict[tuple, _Program] = OrderedDict()


def _program_key(run: Any, state_def: Any, floats: tuple, kept: bool) -> tuple | None:
    """What a run's step functions read, as a key (None when a constant leaf cannot be
    compared): the loss's and optimizer's identities, the parameters' structure, shapes and
    constant leaves (their values: ``unravel`` puts them in the program), the optimizer
    state's structure, and the normalisation."""
    flat = run.flat
    constants = []
    for i, leaf in enumerate(flat.leaves):
        if i in flat.positions:
            continue
        if isinstance(leaf, (jax.Array, np.ndarray)):
            value = np.asarray(leaf)
            constants.append((value.shape, str(value.dtype), value.tobytes()))
        else:
            constants.append(leaf)
    key = (
        id(run.loss),
        id(run.optimizer),
        flat.treedef,
        flat.positions,
        flat.shapes,
        str(flat.vector.dtype),
        tuple(constants),
        state_def,
        floats,
        kept,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key
