"""One step of a training run, replayed and differentiated in JAX (``metagradient.py``).

The optimizer state is a list of leaves; the float ones carry adjoints, the others (optax's
integer counts) are carried along as they come out of each update. Each step's functions are
jitted once per batch size.
"""

from __future__ import annotations

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
        leaves, self.state_def = jax.tree_util.tree_flatten(state)
        self.floats = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
        self._step = jax.jit(self._step_fn)
        self._reverse_step = jax.jit(self._reverse_step_fn)

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

    def _batch(self, step: int) -> tuple[tuple[Any, ...], int]:
        """The examples of ``batches[step]`` padded with example 0 to the largest batch (one
        compilation for all steps), and the number of real ones."""
        indices = self.run.batches[step]
        padded = np.zeros(self.width, dtype=np.int64)
        padded[: len(indices)] = indices
        index = jnp.asarray(padded)
        return jax.tree_util.tree_map(lambda x: x[index], self.data), len(indices)

    def _scale(self, values: np.ndarray, dtype: Any) -> Any:
        padded = np.zeros(self.width)
        padded[: len(values)] = values
        return jnp.asarray(padded, dtype=dtype)

    def _losses(self, params: Any, batch: Any) -> Any:
        return jax.vmap(lambda example: self.run.loss(self.unravel(params), *example))(batch)

    def _update(self, hyper: Any, params: Any, leaves: list[Any], grad: Any) -> Any:
        state = jax.tree_util.tree_unflatten(self.state_def, leaves)
        params, state = self.optimizer.update(safe_sqrt, hyper, params, state, grad)
        return params, jax.tree_util.tree_leaves(state)

    def _step_fn(self, hyper: Any, params: Any, leaves: list[Any], batch: Any, scale: Any):
        grad = jax.grad(lambda p: jnp.sum(scale * self._losses(p, batch)))(params)
        return self._update(hyper, params, leaves, grad)

    def step(self, step: int, params: Any, leaves: list[Any], weights: np.ndarray) -> Any:
        total = len(weights) if not self.kept else float(np.sum(weights))
        if len(weights) == 0 or total == 0:
            return params, leaves
        batch, _ = self._batch(step)
        scale = self._scale(weights / total, params.dtype)
        return self._step(self.run.hyper(step), params, leaves, batch, scale)

    def target_rows(self, params: Any, leaves: list[Any]) -> Any:
        def target(p: Any) -> Any:
            return jnp.atleast_1d(self.target(self.unravel(p)))

        rows = jax.jacrev(target)(params)
        zeros = [
            jnp.zeros((rows.shape[0], *x.shape), x.dtype) if f else None
            for x, f in zip(leaves, self.floats)
        ]
        return rows, zeros

    def _reverse_step_fn(self, hyper, params, leaves, batch, scale, adjoint_params, adjoint_state):
        # scale: 1 / len(batch) for the real examples, 0 for the padding

        def mean_and_losses(p: Any) -> Any:
            losses = self._losses(p, batch)
            return jnp.sum(scale * losses), losses

        grad_and_losses = jax.grad(mean_and_losses, has_aux=True)
        grad, _ = grad_and_losses(params)
        floats = [x for x, f in zip(leaves, self.floats) if f]

        def update(p: Any, float_leaves: list[Any], g: Any) -> Any:
            it = iter(float_leaves)
            merged = [next(it) if f else x for x, f in zip(leaves, self.floats)]
            new_params, new_leaves = self._update(hyper, p, merged, g)
            return new_params, [x for x, f in zip(new_leaves, self.floats) if f]

        _, update_vjp = jax.vjp(update, params, floats, grad)
        adjoint_floats = [a for a, f in zip(adjoint_state, self.floats) if f]
        a_params, a_floats, a_grad = jax.vmap(update_vjp)((adjoint_params, adjoint_floats))

        def fused(tangent: Any) -> Any:
            return jax.jvp(grad_and_losses, (params,), (tangent,))[1]

        hessian_rows, directional = jax.vmap(fused)(a_grad)  # (k, P), (k, B)
        if self.kept:  # d/dw_i of sum w loss / sum w: each loss minus the batch's mean
            directional = directional - jnp.sum(scale * directional, axis=1, keepdims=True)
        terms = scale * directional
        it = iter(a_floats)
        new_state = [next(it) if f else None for f in self.floats]
        return a_params + hessian_rows, new_state, terms

    def reverse_step(self, step, params, leaves, adjoint_params, adjoint_state):
        batch, size = self._batch(step)
        scale = self._scale(np.full(size, 1.0 / size), params.dtype)
        hyper = self.run.hyper(step)
        return self._reverse_step(
            hyper, params, leaves, batch, scale, adjoint_params, adjoint_state
        )

    def zero_scores(self) -> Any:
        k = jnp.atleast_1d(self.target(self.unravel(self.run.flat.vector))).shape[0]
        return jnp.zeros((self.run.num_train, k), self.run.flat.vector.dtype)

    def add_scores(self, scores: Any, step: int, terms: Any) -> Any:
        indices = self.run.batches[step]
        return scores.at[jnp.asarray(indices)].add(terms[:, : len(indices)].T)

    def finish(self, scores: Any) -> Any:
        return scores
