"""``per_example_norms_of``, ``choose_strategy`` and ``layer_reductions_of``: entry points.

They take the loss of ONE example and the batch, as :func:`pergrad.per_example_grads` does, and
return what :func:`pergrad.norms.per_example_norms` and :func:`pergrad.dp.clipped_sum` would
return on its per-example gradients, without keeping those ``B x P`` numbers. The strategy is
chosen and run by ``strategies/registry.py``; ``choose_strategy`` shows its choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pergrad._src.api.grads import per_example_grads
from pergrad._src.core.call import Spec, analyse_call, rebuild_grads
from pergrad._src.errors import (
    PergradTypeError,
    PergradValueError,
)
from pergrad._src.norms import per_example_norms
from pergrad._src.strategies import registry
from pergrad._src.strategies.protocol import Assessment, ReduceRequest, StrategyChoice

STRATEGIES = ("auto", "materialize", "chunked", "ghost", "ghost-lowmem")


def per_example_norms_of(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    per_layer: bool = False,
    strategy: str = "auto",
    chunk_size: int | None = None,
) -> Any:
    """Each example's gradient norm, without materialising the per-example gradients.

    Args:
      fn: the loss of ONE example, ``fn(params, x, y, ...) -> scalar`` (as for
        :func:`pergrad.per_example_grads`); in PyTorch, a :func:`pergrad.module_loss` loss for
        the ghost strategy; in JAX, any traceable loss.
      *args: the arguments of ``fn``, with the data batched: ``(params, X, Y)``.
      argnums: as for :func:`pergrad.per_example_grads`.
      in_axes: as for :func:`pergrad.per_example_grads`.
      per_layer: False for one norm per example; True for one per parameter array, in the
        structure of the differentiated argument (their squares sum to the global norm squared).
      strategy: ``"auto"`` (default: ``"ghost"`` for a ``module_loss`` whose every trainable
        parameter sits in a layer with a ghost rule, and for a JAX loss whose parameters outside
        contractions need at most 2**25 per-example numbers; else ``"chunked"``; for a
        ``module_loss`` whose per-example gradients fit in 2**25 numbers, ``"materialize"``
        where the cost model of ``choose_strategy`` finds it cheaper; for a JAX loss,
        ``"materialize"`` where that model finds it faster and XLA's compiled temporary memory
        of it is within 1/32 of the ghost norms'), ``"ghost"``,
        ``"ghost-lowmem"`` (PyTorch: each layer's norms in the backward pass, its records
        dropped there; a clipped sum then takes a second backward pass), ``"chunked"``, or
        ``"materialize"`` (per-example gradients, then their norms).
      chunk_size: examples per chunk for ``"chunked"`` / ``"materialize"``.

    Returns:
      ``(B,)`` norms (an array of the framework of ``args``), or with ``per_layer`` a pytree of
      them; equal to ``pergrad.norms.per_example_norms(pergrad.per_example_grads(fn)(*args))``.

    Example::

        loss = pergrad.module_loss(model, F.cross_entropy)
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), X, Y)   # (B,)
        # JAX: any loss of one example; jit it as you would jax.vmap(jax.grad(loss))
        norms = jax.jit(lambda p, x, y: pergrad.norms.per_example_norms_of(loss, p, x, y))(
            params, X, Y)

    Memory: ``"ghost"`` about that of one batch gradient plus every layer's output gradients,
    held to the end of the backward pass; ``"ghost-lowmem"`` about that of one batch gradient;
    ``"chunked"`` that of ``chunk_size`` per-example gradients.
    """
    if not isinstance(per_layer, bool):
        raise PergradTypeError(
            f"per_example_norms_of: per_layer must be True or False; got {per_layer!r}."
        )
    func_name = "per_example_norms_of"
    request, chosen = setup_reduce_request(
        func_name, fn, args, argnums, in_axes, strategy, chunk_size
    )
    spec, call = request.spec, request.call
    result, ran = registry.execute("reduce", request, strategy, chosen)
    if ran == "materialize":  # the per-example gradients themselves
        return per_example_norms(result, per_layer=per_layer)
    reduction = result
    if per_layer:
        return rebuild_grads(spec, call, [s**0.5 for s in reduction.squared_norms])
    return global_norms(reduction.squared_norms)


def layer_reductions_of(
    fn: Callable[..., Any],
    *args: Any,
    reduction: str,
    reduction_args: tuple[Any, ...] = (),
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
) -> list[Any]:
    """A plug-in per-layer reduction of each example's gradient, from one captured pass.

    Internal (the entry point of features built on plug-in reductions, such as a per-layer
    Kronecker projection for attribution). ``fn``, ``args``, ``argnums``, ``in_axes``: as for
    :func:`per_example_norms_of`. ``reduction``: the name a plug-in was registered under
    (``capture/rules.py`` for PyTorch layer families, ``capture/jax_rules.py`` for JAX
    contraction kinds), called with ``reduction_args`` after the records.

    Returns one :class:`~pergrad._src.strategies.protocol.LeafReduction` per differentiated
    leaf, in the core's flat order: the plug-in's values where the leaf's layer has it, else
    the leaf's per-example gradients.
    """
    if not isinstance(reduction, str):
        raise PergradTypeError(
            f"layer_reductions_of: reduction must be the name of a registered plug-in "
            f"reduction; got {type(reduction).__name__}."
        )
    spec = Spec.create("layer_reductions_of", fn, argnums, in_axes, False, None, None, None)
    call = analyse_call(spec, args)

    def materialize() -> Any:
        return per_example_grads(fn, argnums, in_axes)(*args)

    request = ReduceRequest(spec, call, fn, args, None, materialize)
    return registry.layerwise(request, reduction, tuple(reduction_args))


def choose_strategy(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    in_axes: Any = "auto",
    strategy: str = "auto",
    chunk_size: int | None = None,
    clipped_sum: bool = False,
) -> StrategyChoice:
    """The :class:`StrategyChoice` that :func:`per_example_norms_of` would make for this call
    (``clipped_sum=True``: that :func:`pergrad.dp.clipped_sum_of` and ``DPOptimizer`` make,
    whose ghost step may hold layers as their formed per-example gradients, which the cost
    model then counts).

    Computes nothing per example; validates like the real call (a bad ``strategy`` raises the
    same error). Under ``"auto"``, a PyTorch ``module_loss`` whose per-example gradients would
    fit in 2**25 numbers runs once on the batch's first example, without gradients and leaving
    the model and the random stream as they were, for the layer shapes of the cost model that
    chooses between the ghost norms and materialising (``reason`` gives its estimates). A JAX
    loss's shapes are traced; where materialising is estimated faster, both routes are
    compiled alone on the arguments' shapes (once per loss and shapes) for XLA's memory.

    Example::

        pergrad.norms.choose_strategy(loss, loss.params(), X, Y)
        # StrategyChoice(strategy='ghost', reason='every differentiated parameter ...',
        #                layers={'fc1': 'linear', 'fc2': 'linear'}, ...)
    """
    if not isinstance(clipped_sum, bool):
        raise PergradTypeError(
            f"choose_strategy: clipped_sum must be True or False; got {clipped_sum!r}."
        )
    _, chosen = setup_reduce_request(
        "choose_strategy", fn, args, argnums, in_axes, strategy, chunk_size, clipped_sum
    )
    assert chosen.choice is not None  # every "reduce" strategy reports its choice
    return chosen.choice


def setup_reduce_request(
    func_name: str,
    fn: Any,
    args: tuple[Any, ...],
    argnums: Any,
    in_axes: Any,
    strategy: Any,
    chunk_size: Any,
    clipped: bool = False,
) -> tuple[ReduceRequest, Assessment]:
    """The analysed call and the registry's choice for it (``strategies/registry.py``);
    ``clipped``: for a clipped sum (``ReduceRequest.clipped``)."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise PergradValueError(
            f"{func_name}: strategy must be one of {list(STRATEGIES)}; got {strategy!r}."
        )
    spec = Spec.create(func_name, fn, argnums, in_axes, False, chunk_size, None, None)
    call = analyse_call(spec, args)

    def materialize() -> Any:
        return per_example_grads(fn, argnums, in_axes, chunk_size=chunk_size)(*args)

    request = ReduceRequest(spec, call, fn, args, chunk_size, materialize, clipped=clipped)
    if strategy == "auto" and call.backend.name == "jax":
        from pergrad._src.api.compiled import compiled_bytes

        request.compiled_bytes = compiled_bytes(
            func_name, fn, args, argnums, in_axes, clipped, setup_reduce_request
        )
    chosen, _ = registry.select("reduce", request, strategy)
    return request, chosen


def global_norms(squared: list[Any]) -> Any:
    return sum(squared[1:], squared[0]) ** 0.5
