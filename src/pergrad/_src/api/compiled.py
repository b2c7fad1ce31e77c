"""XLA's temporary memory of a JAX norms or clipped-sum call under one strategy
(``ReduceRequest.compiled_bytes``), for the choice ``strategy="auto"`` makes between the ghost
norms and materialising (``strategies/ghost_jax.py``, ``capture/jax_cost.py``).

The call is compiled on its arguments' shapes alone, outside whatever ``jit`` the call is
traced in, with clip weights of its own (``1 / max(1, norm)``: the memory does not depend on
them). A loss that closes over a value of an enclosing trace cannot be compiled alone: the
error reaches the caller, which then keeps the ghost norms. Each answer is remembered per loss
and per shapes of its arguments (a step traced again, or ``choose_strategy`` before it, does not
compile again).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from pergrad._src.norms import per_example_norms
from pergrad._src.strategies import registry

_REMEMBERED: weakref.WeakKeyDictionary[Any, dict[Any, int]] = weakref.WeakKeyDictionary()


def compiled_bytes(
    func_name: str,
    fn: Any,
    args: tuple[Any, ...],
    argnums: Any,
    in_axes: Any,
    clipped: bool,
    setup: Callable[..., Any],
) -> Callable[[str], int]:
    """``strategy -> XLA's temporary bytes`` of this call's compiled program by that strategy;
    ``setup``: ``api/reductions.setup_reduce_request``."""

    def measure(strategy: str) -> int:
        import jax

        leaves, treedef = jax.tree.flatten(args)
        places = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        abstract = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in places]
        static = all(
            i in places or isinstance(leaf, (int, float, bool, str, type(None)))
            for i, leaf in enumerate(leaves)
        )
        key = (
            strategy,
            clipped,
            treedef,
            tuple((a.shape, str(a.dtype)) for a in abstract),
            tuple(leaf for i, leaf in enumerate(leaves) if i not in places) if static else None,
            repr(argnums),
            repr(in_axes),
        )
        remembered = _remembered(fn)
        if static and remembered is not None and key in remembered:
            return remembered[key]

        def step(*values: Any) -> Any:
            full = list(leaves)
            for i, value in zip(places, values):
                full[i] = value
            call_args = jax.tree.unflatten(treedef, full)
            request, chosen = setup(
                func_name, fn, call_args, argnums, in_axes, strategy, None, clipped
            )
            if clipped:
                request.weights_from = _unit_weights
            result, ran = registry.execute("reduce", request, strategy, chosen)
            if ran != "materialize":
                return result.squared_norms, result.weighted_sums
            norms = per_example_norms(result)
            if not clipped:
                return norms
            weights = 1.0 / jax.numpy.maximum(1.0, norms)
            return norms, [jax.numpy.tensordot(weights, g, 1) for g in jax.tree.leaves(result)]

        analysis = jax.jit(step).lower(*abstract).compile().memory_analysis()
        if analysis is None:
            raise NotImplementedError("this XLA backend gives no memory analysis")
        found = int(analysis.temp_size_in_bytes)
        if static and remembered is not None:
            if len(remembered) >= 16:  # (the oldest dropped)
                remembered.pop(next(iter(remembered)))
            remembered[key] = found
        return found

    return measure


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _unit_weights(squared: list[Any]) -> Any:
    import jax.numpy as jnp

    total = sum(squared[1:], squared[0])
    return 1.0 / jnp.maximum(1.0, jnp.sqrt(total))


def _remembered(fn: Any) -> dict[Any, int] | None:
    try:
        return _REMEMBERED.setdefault(fn, {})
    except TypeError:  # not weakly referable
        return None
