"""The JAX backend: ``jax.vmap`` / ``jax.value_and_grad`` and JAX's pytrees.

JAX's pytree registry is used for flattening, so registered pytrees (flax structures, equinox
modules, dataclasses registered with ``jax.tree_util``) work as parameters and as data.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pergrad._src.backends import runs_vectorised
from pergrad._src.backends.secure import is_secure


class JaxBackend:
    name = "jax"
    supports_randomness = False

    def is_array(self, x: Any) -> bool:
        return isinstance(x, (jax.Array, np.ndarray, np.generic))

    def owns(self, x: Any) -> bool:
        return isinstance(x, jax.Array)

    def flatten(self, tree: Any) -> tuple[list[str], list[Any], Any]:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths = [jax.tree_util.keystr(path) for path, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        return paths, leaves, treedef

    def leaves(self, tree: Any) -> list[Any]:
        return jax.tree_util.tree_leaves(tree)

    def flatten_leaves(self, tree: Any) -> tuple[list[Any], Any]:
        return jax.tree_util.tree_flatten(tree)

    def unflatten(self, treedef: Any, leaves: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, list(leaves))

    def broadcast_prefix(self, prefix: Any, tree: Any) -> list[Any] | None:
        per_leaf: list[Any] = []

        def extend(axis: Any, subtree: Any) -> None:
            per_leaf.extend([axis] * len(jax.tree_util.tree_leaves(subtree)))

        try:
            jax.tree_util.tree_map(extend, prefix, tree, is_leaf=lambda x: x is None)
        except (ValueError, TypeError):
            return None
        return per_leaf

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(np.shape(x))

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype)

    def is_inexact(self, x: Any) -> bool:
        return bool(jnp.issubdtype(x.dtype, jnp.inexact))

    def as_differentiable(self, x: Any) -> Any:
        return jnp.asarray(x, dtype=jnp.result_type(float))

    def constant_leaves(self, tree: Any) -> frozenset[int]:
        """The Python floats inside equinox modules: ``eqx.filter_grad`` differentiates
        inexact arrays only, so a float field is configuration (``eqx.nn.Dropout``'s ``p``,
        which it compares with a literal 0), not a parameter."""
        equinox = sys.modules.get("equinox")  # no module of it can exist unless imported
        if equinox is None:
            return frozenset()
        constant: set[int] = set()
        offset = 0
        is_module = lambda x: isinstance(x, equinox.Module)  # noqa: E731
        for subtree in jax.tree_util.tree_leaves(tree, is_leaf=is_module):
            leaves = jax.tree_util.tree_leaves(subtree) if is_module(subtree) else [subtree]
            if is_module(subtree):
                constant.update(offset + k for k, x in enumerate(leaves) if isinstance(x, float))
            offset += len(leaves)
        return frozenset(constant)

    def moveaxis_to_front(self, x: Any, axis: int) -> Any:
        return jnp.moveaxis(x, axis, 0)

    def value_and_grad(self, fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        return jax.value_and_grad(fn, argnums=0, has_aux=has_aux)

    def loop_value_and_grad(self, fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        return self.value_and_grad(fn, has_aux)

    def match_varying(self, diff: tuple[Any, ...], batched: tuple[Any, ...]) -> tuple[Any, ...]:
        """Inside ``shard_map`` (``check_vma=True``), make the parameters vary over the mesh axes
        the examples vary over. Otherwise JAX reads parameters that are the same on every device
        as shared by all examples of all devices, and sums each example's gradient over the
        devices: example i would get the sum of the i-th gradients of every device."""
        axes: frozenset[str] = frozenset()
        for x in batched:
            axes |= _varying_axes(x)
        if not axes:
            return diff
        return tuple(
            jax.lax.pcast(d, tuple(sorted(missing)), to="varying")
            if (missing := axes - _varying_axes(d))
            else d
            for d in diff
        )

    def rng_state(self) -> Any:
        return None  # JAX has no global random state: keys are arguments

    def set_rng_state(self, state: Any) -> None:
        del state

    def rng_state_changed(self, state: Any) -> bool:
        return False

    def vmap(
        self,
        fn: Callable[..., Any],
        in_axes: tuple[Any, ...],
        chunk_size: int | None,
        randomness: str | None,
    ) -> Callable[..., Any]:
        del randomness  # validated away by the API: JAX randomness comes in as batched keys
        fn = runs_vectorised(fn)
        if chunk_size is None:
            return jax.vmap(fn, in_axes=in_axes)
        return _chunked_vmap(fn, in_axes, chunk_size)

    def take(self, x: Any, index: int) -> Any:
        return x[index]

    def stack(self, xs: Sequence[Any]) -> Any:
        return jnp.stack(list(xs))

    def zeros_example(self, x: Any) -> Any:
        return jnp.zeros((1, *np.shape(x)[1:]), dtype=x.dtype)

    def slice_empty(self, x: Any) -> Any:
        return x[:0]

    def explain_failure(self, err: Exception) -> Exception | None:
        return None

    def to_numpy(self, x: Any) -> Any:
        return np.asarray(x)

    def from_numpy(self, x: Any, like: Any) -> Any:
        del like  # JAX places it on the default device, as the rest of the computation
        return jnp.asarray(x)

    def standard_normal(self, rng: Any, like: Any) -> Any:
        shape, dtype = jnp.shape(like), jnp.result_type(like)
        if is_secure(rng):
            # An ordered io_callback runs on the host at every execution, also under jax.jit
            # (a numpy draw at trace time would be one constant reused by every step).
            from jax.experimental import io_callback

            def draw() -> Any:
                return rng.normal(shape).astype(dtype)

            return io_callback(draw, jax.ShapeDtypeStruct(shape, dtype), ordered=True)
        return jax.random.normal(rng, shape, dtype)

    def add_scaled(
        self, xs: Sequence[Any], noises: Sequence[Any], scale: float, in_place: Sequence[bool]
    ) -> list[Any]:
        del in_place  # JAX arrays are immutable; under jit XLA reuses buffers by itself
        return [x + scale * noise for x, noise in zip(xs, noises)]

    def split_key(self, rng: Any, num: int) -> Any:
        if is_secure(rng):
            return [rng] * num
        return list(jax.random.split(rng, num))

    def scalar_loss_problem(self, loss: Any) -> str | None:
        if not hasattr(loss, "shape") or not hasattr(loss, "dtype"):
            return f"an object of type {type(loss).__name__}"
        if loss.shape != ():
            return f"an array of shape {tuple(loss.shape)}"
        if not jnp.issubdtype(loss.dtype, jnp.floating):
            return f"a scalar of dtype {loss.dtype}"
        return None

    def hvp(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # Forward-over-reverse; jitted because iterative solvers call it hundreds of times.
        def hvp_rows(x: Any, tangents: Any, *args: Any) -> Any:
            def one(tangent: Any) -> Any:
                return jax.jvp(lambda y: jax.grad(fn)(y, *args), (x,), (tangent,))[1]

            return jax.vmap(one)(tangents)

        return jax.jit(hvp_rows)

    def eye(self, n: int, like: Any) -> Any:
        return jnp.eye(n, dtype=jnp.result_type(like))

    def eigh(self, matrix: Any) -> tuple[Any, Any]:
        return jnp.linalg.eigh(matrix)

    def cholesky(self, matrix: Any) -> Any | None:
        factor = jnp.linalg.cholesky(matrix)  # NaN where not positive definite
        return factor if bool(jnp.isfinite(factor).all()) else None

    def cholesky_solve(self, factor: Any, rows: Any) -> Any:
        from jax.scipy.linalg import cho_solve

        return cho_solve((factor, True), rows.T).T

    def concatenate(self, xs: Sequence[Any], axis: int) -> Any:
        return jnp.concatenate(list(xs), axis=axis)

    def stop_gradient(self, x: Any) -> Any:
        return jax.lax.stop_gradient(x)

    def isfinite(self, x: Any) -> Any:
        return jnp.isfinite(x)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return jnp.where(condition, x, y)

    def known_all(self, condition: Any) -> bool | None:
        if isinstance(condition, jax.core.Tracer):
            return None
        return bool(jnp.all(condition))


def _varying_axes(x: Any) -> frozenset[str]:
    """The ``shard_map`` mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    manual = getattr(aval, "manual_axis_type", None)
    varying = getattr(manual, "varying", None) if manual is not None else None
    return frozenset(getattr(aval, "vma", ()) if varying is None else varying)


def _chunked_vmap(
    fn: Callable[..., Any], in_axes: tuple[Any, ...], chunk_size: int
) -> Callable[..., Any]:
    """vmap that runs about ``chunk_size`` examples at a time through ``lax.map``.

    ``lax.map`` lowers to a loop, so under ``jit`` only one chunk's intermediates are live at
    once. Chunks are strided (chunk ``j`` holds examples ``j, j + n, j + 2n, ...``), not
    contiguous: with the batch sharded over devices, every chunk then has examples on every
    device, and each device works on its own examples instead of gathering the batch. The number
    of chunks ``n`` is ``ceil(B / chunk_size)``, raised until it divides ``B``. Batched arguments
    must be on axis 0 (the core moves them there).
    """

    def chunked(*args: Any) -> Any:
        mapped = [a for a, ax in zip(args, in_axes) if ax is not None]
        batch = jax.tree_util.tree_leaves(mapped)[0].shape[0]
        chunks = max(1, -(-batch // chunk_size))
        while batch % chunks:
            chunks += 1

        def strided(x: Any) -> Any:  # (B, ...) -> (n, B / n, ...), row j = examples j::n
            return x.reshape(batch // chunks, chunks, *x.shape[1:]).swapaxes(0, 1)

        def unstrided(y: Any) -> Any:
            return y.swapaxes(0, 1).reshape(batch, *y.shape[2:])

        def one_chunk(mapped_chunk: list[Any]) -> Any:
            def one_example(mapped_example: list[Any]) -> Any:
                it = iter(mapped_example)
                full = [next(it) if ax is not None else a for a, ax in zip(args, in_axes)]
                return fn(*full)

            return jax.vmap(one_example)(mapped_chunk)

        out = jax.lax.map(one_chunk, jax.tree_util.tree_map(strided, mapped))
        return jax.tree_util.tree_map(unstrided, out)

    return chunked


BACKEND = JaxBackend()
