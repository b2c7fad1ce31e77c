"""Assertions for your own test suite: is my per-example loss what I think it is?

    def test_per_example_loss_matches_training_loss():
        pergrad.testing.assert_mean_equals_batch_grad(loss_of_one, batch_loss, params, X, Y)

Each raises ``AssertionError`` naming the parameter leaf and the largest difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pergrad._src.api.grads import per_example_grads
from pergrad._src.backends import Backend, backend_of
from pergrad._src.core.call import map_arrays

__all__ = ["assert_matches_loop", "assert_mean_equals_batch_grad", "assert_sum_equals_batch_grad"]


def assert_matches_loop(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Vectorised per-example gradients equal a loop of single-example gradients."""
    vectorised = per_example_grads(fn, argnums=argnums, in_axes=in_axes)(*args)
    looped = per_example_grads(fn, argnums=argnums, in_axes=in_axes, strategy="loop")(*args)
    _assert_trees_close("per-example gradients vs the loop", vectorised, looped, rtol, atol)


def assert_mean_equals_batch_grad(
    fn: Callable[..., Any],
    batch_loss: Callable[..., Any],
    *args: Any,
    argnums: int = 0,
    in_axes: Any = "auto",
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """The mean of per-example gradients of ``fn`` equals the gradient of ``batch_loss``.

    ``batch_loss(*args)`` is your training loss of the whole batch, averaged over examples.
    """
    _assert_reduction_matches(fn, batch_loss, args, argnums, in_axes, "mean", rtol, atol)


def assert_sum_equals_batch_grad(
    fn: Callable[..., Any],
    batch_loss: Callable[..., Any],
    *args: Any,
    argnums: int = 0,
    in_axes: Any = "auto",
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """The sum of per-example gradients of ``fn`` equals the gradient of ``batch_loss``, a
    loss summed (not averaged) over the batch."""
    _assert_reduction_matches(fn, batch_loss, args, argnums, in_axes, "sum", rtol, atol)


def _assert_reduction_matches(fn, batch_loss, args, argnums, in_axes, reduction, rtol, atol):
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        raise TypeError(f"argnums must be one int here; got {argnums!r}.")
    per_example = per_example_grads(fn, argnums=argnums, in_axes=in_axes)(*args)
    bk = backend_of(args, "pergrad.testing", "args")
    reduced = map_arrays(bk, lambda g: getattr(g, reduction)(0), per_example)
    expected = _batch_gradient(bk, batch_loss, args, argnums)
    _assert_trees_close(
        f"{reduction} of per-example gradients vs the batch gradient", reduced, expected, rtol, atol
    )


def _batch_gradient(bk: Backend, batch_loss: Callable[..., Any], args: tuple, argnums: int) -> Any:
    _, leaves, treedef = bk.flatten(args[argnums])
    positions = [j for j, x in enumerate(leaves) if bk.is_array(x)]

    def loss_of(diff: tuple[Any, ...]) -> Any:
        rebuilt = list(leaves)
        for j, value in zip(positions, diff):
            rebuilt[j] = value
        call_args = list(args)
        call_args[argnums] = bk.unflatten(treedef, rebuilt)
        return batch_loss(*call_args)

    _, grads = bk.value_and_grad(loss_of, False)(tuple(leaves[j] for j in positions))
    out = [None] * len(leaves)
    for j, g in zip(positions, grads):
        out[j] = g
    return bk.unflatten(treedef, out)


def _assert_trees_close(what: str, actual: Any, expected: Any, rtol: float, atol: float) -> None:
    bk = backend_of(expected, "pergrad.testing", "the reference")
    paths, actual_leaves, _ = bk.flatten(actual)
    _, expected_leaves, _ = bk.flatten(expected)
    for path, a, e in zip(paths, actual_leaves, expected_leaves):
        if a is None or e is None:
            continue
        a_np, e_np = bk.to_numpy(a), bk.to_numpy(e)
        if a_np.shape != e_np.shape or not np.allclose(a_np, e_np, rtol=rtol, atol=atol):
            diff = np.abs(a_np - e_np).max() if a_np.shape == e_np.shape else "shapes differ"
            raise AssertionError(
                f"{what}: leaf {path or '(root)'} differs (max abs difference {diff}, "
                f"rtol={rtol}, atol={atol}; shapes {a_np.shape} vs {e_np.shape})."
            )
