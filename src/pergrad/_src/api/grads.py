"""``per_example_grads`` and ``value_and_per_example_grads``: the core of pergrad.

A call goes through four steps:

1. choose the backend from the arrays passed (or ``backend=``) and flatten every argument;
2. decide which leaves are batched (``axes.py``), validated at this boundary;
3. build a function of one example over flat leaves and hand it to the backend's
   ``vmap(value_and_grad(...))``;
4. rebuild the user's structures around the per-example results.

Working on flat leaves keeps the backends small (they only see tuples of arrays) and lets
non-array leaves (activation functions inside an equinox module, strings, ``None``) ride along
as constants instead of confusing the transforms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from pergrad._src.core.call import (
    Call,
    Spec,
    analyse_call,
    map_arrays,
    rebuild_grads,
    single_example_fn,
)
from pergrad._src.strategies import registry
from pergrad._src.strategies.protocol import GradsRequest


class LastStrategy(str):
    """The strategy the last call ran (``"vmap"``, ``"hooks"`` or ``"loop"``), a string, with
    ``reason``: why, in words (``"requested"``; what made "auto" fall back, say)."""

    reason: str

    def __new__(cls, name: str, reason: str) -> LastStrategy:
        value = super().__new__(cls, name)
        value.reason = reason
        return value

    @classmethod
    def of(cls, spec: Spec) -> LastStrategy | None:
        if spec.last_strategy is None:
            return None
        return cls(spec.last_strategy, spec.last_reason or "")


def per_example_grads(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    has_aux: bool = False,
    chunk_size: int | None = None,
    backend: str | None = None,
    randomness: str | None = None,
    strategy: str = "auto",
) -> Callable[..., Any]:
    """Turn the loss of one example into a function that returns each example's gradient.

    Args:
      fn: the loss of ONE example, ``fn(params, x, y, ...) -> scalar``. Written as if there were
        no batch: ``x`` has the shape of a single example.
      argnums: which positional argument(s) to differentiate: an int, or a tuple of ints.
      in_axes: ``"auto"`` (default) infers which arguments are batched: differentiated
        arguments are shared, data arguments whose arrays agree on a leading size ``B`` are
        batched on axis 0, model state (e.g. torch buffers) is shared. Or an explicit
        ``jax.vmap``-style value: one entry per positional argument, each an int axis, None, or
        a pytree prefix of that argument. Explicit values win and are validated the same way.
      has_aux: ``fn`` returns ``(loss, aux)``; the result is then ``(grads, aux)`` with ``aux``
        batched like the gradients.
      chunk_size: compute this many examples at a time to bound memory; the result is the same.
      backend: ``"jax"`` or ``"torch"`` to force a framework; by default it is chosen from the
        arrays passed.
      randomness: PyTorch only, passed to ``torch.func.vmap``: ``"error"`` (default),
        ``"different"`` (independent dropout masks per example) or ``"same"``. In JAX, pass
        per-example keys as a batched argument instead.

    Returns:
      A function with ``fn``'s signature. Called on a batch, it returns a pytree that mirrors
      the differentiated argument, each leaf with a leading axis of size ``B``: for
      ``params = {"w": (3, 2)}`` and ``x`` of shape ``(B, 3)``, ``{"w": (B, 3, 2)}``. With a
      tuple ``argnums`` it returns a tuple of such pytrees. Keyword arguments are passed
      through to ``fn`` unbatched.

    Example::

        def loss(w, x, y):                  # one example: x (3,), y ()
            return (x @ w - y) ** 2

        grads = pergrad.per_example_grads(loss)(w, X, Y)   # X (B, 3), Y (B,) -> grads (B, 3)

    Cost: one vectorised forward and backward pass (the framework's ``vmap(grad)``), plus the
    ``B x P`` output. For a :func:`pergrad.module_loss` whose every parameter is in a layer
    with a rule, ``"auto"`` takes the layer hooks instead: one plain forward and backward pass
    of the batch, no weight gradient formed, after a first call of each layout that also
    checks them. An empty batch (``B == 0``) returns empty arrays of the right shapes.
    """
    spec = Spec.create(
        "per_example_grads",
        fn,
        argnums,
        in_axes,
        has_aux,
        chunk_size,
        backend,
        randomness,
        strategy,
        returns_losses=False,
    )

    @functools.wraps(fn)
    def per_example_grads_fn(*args: Any, **kwargs: Any) -> Any:
        value, grads = _compute(spec, args, kwargs)
        per_example_grads_fn.last_strategy = LastStrategy.of(spec)  # type: ignore[attr-defined]
        return (grads, value[1]) if has_aux else grads

    per_example_grads_fn.last_strategy = None  # type: ignore[attr-defined]
    return per_example_grads_fn


def value_and_per_example_grads(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    has_aux: bool = False,
    chunk_size: int | None = None,
    backend: str | None = None,
    randomness: str | None = None,
    strategy: str = "auto",
) -> Callable[..., Any]:
    """Like :func:`per_example_grads`, but also return each example's loss.

    Returns a function giving ``(losses, grads)`` with ``losses`` of shape ``(B,)``; with
    ``has_aux=True``, ``((losses, aux), grads)`` as ``jax.value_and_grad`` does. The arguments
    are those of :func:`per_example_grads`.
    """
    spec = Spec.create(
        "value_and_per_example_grads",
        fn,
        argnums,
        in_axes,
        has_aux,
        chunk_size,
        backend,
        randomness,
        strategy,
    )

    @functools.wraps(fn)
    def value_and_per_example_grads_fn(*args: Any, **kwargs: Any) -> Any:
        out = _compute(spec, args, kwargs)
        value_and_per_example_grads_fn.last_strategy = LastStrategy.of(spec)  # type: ignore[attr-defined]
        return out

    value_and_per_example_grads_fn.last_strategy = None  # type: ignore[attr-defined]
    return value_and_per_example_grads_fn


def _compute(spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = analyse_call(spec, args)
    bk = call.backend
    single = single_example_fn(spec, call, kwargs)
    batched_values = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    diff_values = bk.match_varying(
        tuple(call.leaves[i][j] for i, j in call.diff_positions), batched_values
    )
    if call.batch_size == 0:
        # Run one dummy example to learn the output shapes, then return empty arrays.
        padded = tuple(bk.zeros_example(v) for v in batched_values)
        out = _run(spec, call, kwargs, single, diff_values, padded, 1)
        out = map_arrays(bk, bk.slice_empty, out)
    else:
        out = _run(spec, call, kwargs, single, diff_values, batched_values, call.batch_size)
    value, grad_leaves = out
    return value, rebuild_grads(spec, call, grad_leaves)


def _run(
    spec: Spec,
    call: Call,
    kwargs: dict[str, Any],
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
) -> Any:
    """``(value, grad leaves)`` by the requested strategy, or the one "auto" settles on
    (``strategies/registry.py``: layer hooks for a ``module_loss`` they cover, vmap, a
    loop)."""
    request = GradsRequest(spec, call, kwargs, single, diff_values, batched_values, batch_size)
    return registry.execute("grads", request, spec.strategy)[0]
