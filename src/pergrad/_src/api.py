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

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pergrad._src import axes as axes_lib
from pergrad._src.backends import (
    Backend,
    available_backend_names,
    framework_names_in,
    frameworks_in,
    get_backend,
)
from pergrad._src.errors import (
    FallbackWarning,
    PergradTypeError,
    PergradValueError,
    is_pergrad_error,
)

_RANDOMNESS = ("error", "different", "same")
STRATEGIES = ("auto", "vmap", "hooks", "loop")


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
    ``B x P`` output. An empty batch (``B == 0``) returns empty arrays of the right shapes.
    """
    spec = _Spec.create(
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
        per_example_grads_fn.last_strategy = spec.last_strategy  # type: ignore[attr-defined]
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
    spec = _Spec.create(
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
        value_and_per_example_grads_fn.last_strategy = spec.last_strategy  # type: ignore[attr-defined]
        return out

    value_and_per_example_grads_fn.last_strategy = None  # type: ignore[attr-defined]
    return value_and_per_example_grads_fn


@dataclass
class _Spec:
    """The validated arguments of one wrapped function (and its fallback decision)."""

    func_name: str
    fn: Callable[..., Any]
    argnums: tuple[int, ...]
    single_argnum: bool
    in_axes: Any
    has_aux: bool
    chunk_size: int | None
    backend: str | None
    randomness: str | None
    arg_names: tuple[str, ...]
    strategy: str = "auto"
    # False where the caller drops the losses: the vectorised path then leaves them inside the
    # transformed function and the value part of _compute's result is None (aux, if any, kept).
    returns_losses: bool = True
    # What "auto" settled on after a failure ("hooks" or "loop"): later calls go there directly.
    resolved: str | None = field(default=None)
    # Layouts (torch_checks.layout_key) whose first-call checks the hooks strategy has done.
    hooks_checked: set[Any] = field(default_factory=set, repr=False, compare=False)
    last_strategy: str | None = field(default=None)
    # What _prepare decided for each structure of the arguments seen so far (see _prepare).
    layouts: dict[Any, _Layout] = field(default_factory=dict, repr=False, compare=False)
    # The vectorised function of each backend (see _vectorised).
    vectorised: dict[str, Callable[..., Any]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def create(
        cls,
        func_name: str,
        fn: Any,
        argnums: Any,
        in_axes: Any,
        has_aux: Any,
        chunk_size: Any,
        backend: Any,
        randomness: Any,
        strategy: Any = "auto",
        returns_losses: bool = True,
    ) -> _Spec:
        if not callable(fn):
            raise PergradTypeError(
                f"{func_name}: fn must be a callable loss of one example, fn(params, x, ...) "
                f"-> scalar; got {type(fn).__name__}."
            )
        single = _is_int(argnums)
        argnums_tuple = _check_argnums(func_name, argnums)
        _check_in_axes_type(func_name, in_axes)
        if not isinstance(has_aux, bool):
            raise PergradTypeError(f"{func_name}: has_aux must be True or False; got {has_aux!r}.")
        if chunk_size is not None and (not _is_int(chunk_size) or chunk_size <= 0):
            raise PergradValueError(
                f"{func_name}: chunk_size must be a positive int or None; got {chunk_size!r}."
            )
        if backend is not None and backend not in available_backend_names():
            raise PergradValueError(
                f"{func_name}: backend must be one of {list(available_backend_names())} or "
                f"None (chosen from the arrays passed); got {backend!r}."
            )
        if randomness is not None and randomness not in _RANDOMNESS:
            raise PergradValueError(
                f"{func_name}: randomness must be one of {list(_RANDOMNESS)} or None; "
                f"got {randomness!r}."
            )
        if not isinstance(strategy, str) or strategy not in STRATEGIES:
            raise PergradValueError(
                f"{func_name}: strategy must be one of {list(STRATEGIES)}; got {strategy!r}."
            )
        return cls(
            func_name,
            fn,
            argnums_tuple,
            single,
            in_axes,
            has_aux,
            chunk_size,
            backend,
            randomness,
            _positional_names(fn),
            strategy,
            returns_losses,
        )

    def arg_name(self, index: int) -> str | None:
        return self.arg_names[index] if index < len(self.arg_names) else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_argnums(func_name: str, argnums: Any) -> tuple[int, ...]:
    if _is_int(argnums):
        argnums = (argnums,)
    elif not (isinstance(argnums, (tuple, list)) and argnums and all(map(_is_int, argnums))):
        raise PergradTypeError(
            f"{func_name}: argnums must be an int or a non-empty tuple of ints; got {argnums!r}."
        )
    if any(a < 0 for a in argnums):
        raise PergradValueError(
            f"{func_name}: argnums must be non-negative positions; got {argnums!r}."
        )
    if len(set(argnums)) != len(argnums):
        raise PergradValueError(f"{func_name}: argnums has repeated entries: {argnums!r}.")
    return tuple(argnums)


def _check_in_axes_type(func_name: str, in_axes: Any) -> None:
    if isinstance(in_axes, str) and in_axes != "auto":
        raise PergradValueError(
            f"{func_name}: in_axes must be 'auto', an int, None, or a tuple with one entry "
            f"per positional argument; got the string {in_axes!r}."
        )
    if isinstance(in_axes, dict):
        raise PergradTypeError(
            f"{func_name}: in_axes must be a tuple with one entry per positional argument "
            f"(a dict is allowed inside an entry, as a prefix of a dict argument); got a dict."
        )


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


@dataclass
class _Call:
    """One call's flattened arguments and where the differentiated / batched leaves sit."""

    backend: Backend
    treedefs: list[Any]
    leaves: list[list[Any]]
    diff_positions: list[tuple[int, int]]
    batched_positions: list[tuple[int, int]]
    batch_size: int

    def rebuild(self, diff_values: Sequence[Any], batched_values: Sequence[Any]) -> list[Any]:
        leaves = [list(arg_leaves) for arg_leaves in self.leaves]
        for (i, j), value in zip(self.diff_positions, diff_values):
            leaves[i][j] = value
        for (i, j), value in zip(self.batched_positions, batched_values):
            leaves[i][j] = value
        return [self.backend.unflatten(t, x) for t, x in zip(self.treedefs, leaves)]


def _compute(spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = _prepare(spec, args)
    bk = call.backend
    single = _single_example_fn(spec, call, kwargs)
    batched_values = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    diff_values = bk.match_varying(
        tuple(call.leaves[i][j] for i, j in call.diff_positions), batched_values
    )
    if call.batch_size == 0:
        # Run one dummy example to learn the output shapes, then return empty arrays.
        padded = tuple(bk.zeros_example(v) for v in batched_values)
        out = _run(spec, call, kwargs, single, diff_values, padded, 1)
        out = _map_arrays(bk, bk.slice_empty, out)
    else:
        out = _run(spec, call, kwargs, single, diff_values, batched_values, call.batch_size)
    value, grad_leaves = out
    return value, _rebuild_grads(spec, call, grad_leaves)


def _run(
    spec: _Spec,
    call: _Call,
    kwargs: dict[str, Any],
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
) -> Any:
    """``(value, grad leaves)`` by the requested strategy, or the one "auto" settled on."""
    bk = call.backend
    strategy = spec.resolved or spec.strategy
    if strategy == "loop":
        spec.last_strategy = "loop"
        return _loop(spec, bk, single, diff_values, batched_values, batch_size)
    if strategy == "hooks":
        out, why_not = _hooks(spec, call, single, diff_values, batched_values, batch_size)
        if out is not None:
            return out
        if spec.strategy == "hooks":
            raise PergradValueError(
                f"{spec.func_name}: strategy='hooks' cannot handle this call: {why_not}. Use "
                f"strategy='auto' (which falls back to a loop by itself) or 'loop'."
            )
        return _fall_back_to_loop(
            spec,
            bk,
            single,
            diff_values,
            batched_values,
            batch_size,
            f"layer hooks cannot take this call ({why_not})",
        )
    try:
        out = _vectorised(spec, bk)(diff_values, batched_values, _Context(call, kwargs))
    except Exception as err:
        cause = vmap_failure(bk, err)
        if spec.strategy == "vmap":
            raise PergradValueError(
                f"{spec.func_name}: strategy='vmap': {bk.name} could not vectorise fn "
                f"({cause}). Use strategy='auto', which then takes layer hooks or a loop."
            ) from err
        failed = err
    else:
        spec.last_strategy = "vmap"
        if spec.returns_losses:
            return out
        return ((None, out[0]), out[1]) if spec.has_aux else (None, out)
    cause = f"{bk.name} could not vectorise fn ({vmap_failure(bk, failed)})"
    out, why_not = _hooks(spec, call, single, diff_values, batched_values, batch_size)
    if out is not None:
        warnings.warn(
            f"{spec.func_name}: {cause}. Took strategy 'hooks' instead: per-example gradients "
            f"from layer hooks over one forward and backward pass of the batch, checked "
            f"against the batch gradient. Later calls of this function use it directly.",
            FallbackWarning,
            stacklevel=4,
        )
        spec.resolved = "hooks"
        return out
    return _fall_back_to_loop(
        spec,
        bk,
        single,
        diff_values,
        batched_values,
        batch_size,
        f"{cause}; layer hooks cannot take it either ({why_not})",
    )


def _without_losses(value_and_grad: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``value_and_grad`` returning the gradients only, or ``(aux, grads)``: losses nobody reads
    stay inside the vectorised function instead of being batched as an output (a few percent
    of the time on small models)."""
    if has_aux:

        def aux_and_grads(*args: Any) -> Any:
            (_, aux), grads = value_and_grad(*args)
            return aux, grads

        return aux_and_grads

    def grads_only(*args: Any) -> Any:
        return value_and_grad(*args)[1]

    return grads_only


def vmap_failure(bk: Backend, err: Exception) -> str:
    """Why ``bk.vmap`` failed, in one line; re-raises what a fallback would not fix (pergrad's
    own errors, and failures the backend explains, such as dropout without ``randomness``)."""
    if is_pergrad_error(err):
        raise err
    explained = bk.explain_failure(err)
    if explained is not None:
        raise explained from err
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"


def _fall_back_to_loop(
    spec: _Spec,
    bk: Backend,
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
    cause: str,
) -> Any:
    # If one example fails on its own, the problem is in fn and its own error is the clearest.
    _loop(spec, bk, single, diff_values, batched_values, 1, stacked=False)
    warnings.warn(
        f"{spec.func_name}: {cause}. Falling back to strategy 'loop', one example at a time: "
        f"the same result, but slower. Later calls of this function use the loop directly.",
        FallbackWarning,
        stacklevel=5,
    )
    spec.resolved = "loop"
    spec.last_strategy = "loop"
    return _loop(spec, bk, single, diff_values, batched_values, batch_size)


def _hooks(
    spec: _Spec,
    call: _Call,
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
) -> tuple[Any, str | None]:
    """``(out, None)`` by the hooks strategy, or ``(None, why not)``. Never imports torch: a
    ``module_loss`` cannot exist unless its module has been imported."""
    torch_module = sys.modules.get("pergrad._src.torch_module")
    if torch_module is None or not isinstance(spec.fn, torch_module.ModuleLoss):
        return None, (
            f"layer hooks need a PyTorch loss made with pergrad.module_loss(model, loss_fn); "
            f"fn is a {type(spec.fn).__name__} on {call.backend.name}"
        )
    from pergrad._src import torch_hooks

    params = call.backend.unflatten(call.treedefs[0], call.leaves[0])
    plan = torch_hooks.plan(spec, spec.fn, params)
    try:
        if plan.unsupported:
            raise torch_hooks.HooksUnsupported(torch_hooks.listing(plan.unsupported))
        losses, grads = torch_hooks.value_and_grads(
            spec, call, plan, single, diff_values, batched_values, batch_size
        )
    except torch_hooks.HooksUnsupported as err:
        return None, str(err)
    except Exception as err:
        if is_pergrad_error(err) or spec.strategy == "hooks":
            raise
        # The batch through the model failed (a model written for one example): under "auto"
        # that is a reason to loop, which checks that one example runs on its own.
        return None, f"the batched pass failed: {vmap_failure(call.backend, err)}"
    spec.last_strategy = "hooks"
    return (losses, tuple(grads)), None


def _loop(
    spec: _Spec,
    bk: Backend,
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
    stacked: bool = True,
) -> Any:
    """Per-example gradients one example at a time, with the framework's plain autodiff.

    Randomness follows ``spec.randomness`` as the vectorised path would: "same" replays one
    random state for every example; "error" (the default) refuses a loss that draws.
    """
    value_and_grad = bk.loop_value_and_grad(single, spec.has_aux)
    start_state = bk.rng_state()
    outs = []
    for i in range(batch_size):
        if spec.randomness == "same":
            bk.set_rng_state(start_state)
        outs.append(value_and_grad(diff_values, tuple(bk.take(v, i) for v in batched_values)))
        if spec.randomness in (None, "error") and bk.rng_state_changed(start_state):
            raise PergradValueError(
                f"{spec.func_name}: fn draws random numbers (e.g. dropout). Pass "
                f"randomness='different' for independent randomness per example, "
                f"randomness='same' for one draw shared by the batch, or switch it off "
                f"(model.eval())."
            )
    if not stacked:
        return outs
    _, _, treedef = bk.flatten(outs[0])
    per_example = [bk.flatten(out)[1] for out in outs]
    return bk.unflatten(treedef, [bk.stack(column) for column in zip(*per_example)])


def _map_arrays(bk: Backend, f: Callable[[Any], Any], tree: Any) -> Any:
    _, leaves, treedef = bk.flatten(tree)
    return bk.unflatten(treedef, [f(x) if bk.is_array(x) else x for x in leaves])


def _single_example_fn(
    spec: _Spec, call: _Call, kwargs: dict[str, Any]
) -> Callable[[tuple[Any, ...], tuple[Any, ...]], Any]:
    def single(diff_values: tuple[Any, ...], batched_values: tuple[Any, ...]) -> Any:
        return _single_example(spec, call, kwargs, diff_values, batched_values)

    return single


def _single_example(
    spec: _Spec,
    call: _Call,
    kwargs: dict[str, Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
) -> Any:
    """``fn`` on one example, with its output checked: the loss, or ``(loss, aux)``."""
    out = spec.fn(*call.rebuild(diff_values, batched_values), **kwargs)
    if spec.has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise PergradValueError(
                f"{spec.func_name}: has_aux=True needs fn to return a pair (loss, aux); "
                f"it returned {_describe(call.backend, out)}."
            )
        loss = out[0]
    else:
        loss = out
    problem = call.backend.scalar_loss_problem(loss)
    if problem is not None:
        hint = (
            " With has_aux=False, return only the loss (or pass has_aux=True)."
            if isinstance(out, (tuple, list)) and not spec.has_aux
            else " fn sees ONE example (no batch axis) and must reduce to a scalar; a "
            "loss of the whole batch gives no per-example gradients."
        )
        raise PergradValueError(
            f"{spec.func_name}: fn must return a real scalar loss for one example; for a "
            f"single example it returned {problem}.{hint}"
        )
    return (loss, out[1]) if spec.has_aux else loss


class _Context:
    """A call and its keyword arguments, handed to :func:`_vectorised`'s function as one
    unbatched argument: an object that no framework's pytree looks into."""

    __slots__ = ("call", "kwargs")

    def __init__(self, call: _Call, kwargs: dict[str, Any]) -> None:
        self.call = call
        self.kwargs = kwargs


def _vectorised(spec: _Spec, bk: Backend) -> Callable[..., Any]:
    """``vmap(value_and_grad(one example's loss))`` as ``f(diff_values, batched_values,
    context)``, made once per wrapped function and backend: building the transforms on every
    call costs as much as a small model's gradients."""
    vectorised = spec.vectorised.get(bk.name)
    if vectorised is None:

        def single(diff_values: Any, batched_values: Any, context: _Context) -> Any:
            return _single_example(spec, context.call, context.kwargs, diff_values, batched_values)

        value_and_grad = bk.value_and_grad(single, spec.has_aux)
        if not spec.returns_losses:
            value_and_grad = _without_losses(value_and_grad, spec.has_aux)
        vectorised = bk.vmap(value_and_grad, (None, 0, None), spec.chunk_size, spec.randomness)
        spec.vectorised[bk.name] = vectorised
    return vectorised


def _describe(bk: Backend, x: Any) -> str:
    if bk.is_array(x):
        return f"an array of shape {bk.shape(x)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"an object of type {type(x).__name__}"


def _rebuild_grads(spec: _Spec, call: _Call, grad_leaves: Sequence[Any]) -> Any:
    if spec.single_argnum and len(call.diff_positions) == len(call.leaves[spec.argnums[0]]):
        return call.backend.unflatten(call.treedefs[spec.argnums[0]], grad_leaves)
    per_arg: dict[int, list[Any]] = {i: [None] * len(call.leaves[i]) for i in spec.argnums}
    for (i, j), g in zip(call.diff_positions, grad_leaves):
        per_arg[i][j] = g
    trees = tuple(call.backend.unflatten(call.treedefs[i], per_arg[i]) for i in spec.argnums)
    return trees[0] if spec.single_argnum else trees


# Leaves that are not arrays and hold nothing: their type alone is all _prepare looks at.
_PLAIN_LEAF_TYPES = frozenset({bool, int, float, complex, str, type(None)})
_MAX_LAYOUTS = 16  # structures remembered per wrapped function (batch sizes, shapes, ...)


@dataclass(frozen=True)
class _Layout:
    """What :func:`_prepare` decided for one structure of the arguments."""

    backend: Backend
    diff_positions: tuple[tuple[int, int], ...]
    batched_positions: tuple[tuple[int, int], ...]
    moved_axes: tuple[tuple[int, int, int], ...]  # (argument, leaf, axis): batched off axis 0
    float_positions: tuple[tuple[int, int], ...]  # Python floats in differentiated arguments
    batch_size: int

    def apply(self, treedefs: list[Any], leaves: list[list[Any]]) -> _Call:
        bk = self.backend
        for i, j in self.float_positions:
            leaves[i][j] = bk.as_differentiable(leaves[i][j])
        for i, j, axis in self.moved_axes:
            leaves[i][j] = bk.moveaxis_to_front(leaves[i][j], axis)
        return _Call(
            bk,
            treedefs,
            leaves,
            list(self.diff_positions),
            list(self.batched_positions),
            self.batch_size,
        )


def _prepare(spec: _Spec, args: tuple[Any, ...]) -> _Call:
    """Flatten the arguments, choose the backend and place the differentiated and batched leaves.

    Everything decided here (backend, in_axes, batch size, and every check) depends only on the
    arguments' structure: per argument its treedef, and each leaf's type, with shape and dtype
    for arrays. So a call with the structure of an earlier successful call reuses its
    :class:`_Layout` and skips the analysis, which costs as much as the computation on small
    models. A leaf of any other type (an object the pytree does not look into, which could
    hold arrays of any framework) always takes the full analysis.
    """
    if spec.layouts:
        bk = next(reversed(spec.layouts.values())).backend  # the most recent one
        flat = [bk.flatten_leaves(arg) for arg in args]
        treedefs = [treedef for _, treedef in flat]
        leaves = [arg_leaves for arg_leaves, _ in flat]
        layout = _lookup(spec.layouts, _structure_key(bk, treedefs, leaves))
        if layout is not None:
            return layout.apply(treedefs, leaves)
    return _analyse(spec, args)


def _lookup(layouts: dict[Any, _Layout], key: Any) -> _Layout | None:
    if key is None:
        return None
    try:
        return layouts.get(key)
    except (TypeError, ValueError):  # a custom pytree node whose metadata cannot be compared
        return None


def _structure_key(bk: Backend, treedefs: list[Any], leaves: list[list[Any]]) -> Any:
    """The structure :func:`_prepare`'s decisions depend on, hashable; None if a leaf is an
    object whose type does not tell."""
    key: list[Any] = [bk.name]
    for treedef, arg_leaves in zip(treedefs, leaves):
        signature = []
        for x in arg_leaves:
            kind = type(x)
            if bk.is_array(x):
                signature.append((kind, bk.shape(x), x.dtype))
            elif kind in _PLAIN_LEAF_TYPES:
                signature.append(kind)
            else:
                return None
        key.append((treedef, tuple(signature)))
    return tuple(key)


def _analyse(spec: _Spec, args: tuple[Any, ...]) -> _Call:
    """:func:`_prepare` for a structure not seen before: validate, infer, and remember."""
    name = spec.func_name
    if not args:
        raise PergradValueError(
            f"{name}: called with no positional arguments; expected fn's arguments, e.g. "
            f"(params, x_batch, y_batch)."
        )
    out_of_range = [a for a in spec.argnums if a >= len(args)]
    if out_of_range:
        raise PergradValueError(
            f"{name}: argnums={spec.argnums if not spec.single_argnum else spec.argnums[0]} "
            f"points past the {len(args)} positional argument(s) passed (valid positions: "
            f"0 to {len(args) - 1})."
        )
    bk = _select_backend(spec, args)
    if spec.randomness is not None and not bk.supports_randomness:
        raise PergradValueError(
            f"{name}: randomness={spec.randomness!r} is a PyTorch option; with {bk.name}, pass "
            f"one random key per example as a batched argument (e.g. jax.random.split(key, B))."
        )
    treedefs, raw_leaves, leaves, infos = [], [], [], []
    for index, arg in enumerate(args):
        paths, arg_leaves, treedef = bk.flatten(arg)
        treedefs.append(treedef)
        raw_leaves.append(arg_leaves)
        differentiated = index in spec.argnums
        if differentiated:
            arg_leaves = [bk.as_differentiable(x) if _is_float(x) else x for x in arg_leaves]
        leaves.append(arg_leaves)
        infos.append(_arg_info(spec, bk, index, arg, paths, arg_leaves, differentiated))
    float_positions = tuple(
        (i, j) for i in spec.argnums for j, x in enumerate(raw_leaves[i]) if _is_float(x)
    )
    diff_positions = _differentiable_positions(spec, bk, infos, leaves)
    resolved = _resolve_axes(spec, bk, args, infos)
    batched = [
        (i, j, axis)
        for i, arg_axes in enumerate(resolved.axes)
        for j, axis in enumerate(arg_axes)
        if axis is not None
    ]
    layout = _Layout(
        bk,
        tuple(diff_positions),
        tuple((i, j) for i, j, _ in batched),
        tuple((i, j, axis) for i, j, axis in batched if axis != 0),
        float_positions,
        resolved.batch_size,
    )
    _remember(spec.layouts, _structure_key(bk, treedefs, raw_leaves), layout)
    return layout.apply(treedefs, raw_leaves)


def _remember(layouts: dict[Any, _Layout], key: Any, layout: _Layout) -> None:
    if key is None:
        return
    if len(layouts) >= _MAX_LAYOUTS:
        layouts.pop(next(iter(layouts)), None)  # the oldest
    with contextlib.suppress(TypeError, ValueError):  # as in _lookup
        layouts[key] = layout


def _is_float(x: Any) -> bool:
    return isinstance(x, float)


def _arg_info(
    spec: _Spec,
    bk: Backend,
    index: int,
    arg: Any,
    paths: list[str],
    arg_leaves: list[Any],
    differentiated: bool,
) -> axes_lib.ArgInfo:
    leaf_infos = tuple(
        axes_lib.LeafInfo(path, bk.shape(x) if bk.is_array(x) else None, type(x).__name__)
        for path, x in zip(paths, arg_leaves)
    )
    return axes_lib.ArgInfo(
        index=index,
        name=spec.arg_name(index),
        leaves=leaf_infos,
        differentiated=differentiated,
        is_bare_array=bk.is_array(arg),
    )


def _differentiable_positions(
    spec: _Spec, bk: Backend, infos: list[axes_lib.ArgInfo], leaves: list[list[Any]]
) -> list[tuple[int, int]]:
    positions = []
    for i in spec.argnums:
        info = infos[i]
        arrays = [(j, x) for j, x in enumerate(leaves[i]) if bk.is_array(x)]
        if not arrays:
            raise PergradTypeError(
                f"{spec.func_name}: argnums points at {info.label}, which holds no "
                f"floating-point array to differentiate (got {_describe(bk, _first(leaves[i]))})."
                f" Pass the parameters as float arrays."
            )
        for j, x in arrays:
            if not bk.is_inexact(x):
                raise PergradTypeError(
                    f"{spec.func_name}: argnums points at {info.leaf_label(info.leaves[j])}, "
                    f"an array of dtype {bk.dtype_name(x)}; only floating-point arrays can be "
                    f"differentiated. Is argnums pointing at the data instead of the "
                    f"parameters?"
                )
            positions.append((i, j))
    return positions


def _first(xs: list[Any]) -> Any:
    return xs[0] if xs else None


def _resolve_axes(
    spec: _Spec, bk: Backend, args: tuple[Any, ...], infos: list[axes_lib.ArgInfo]
) -> axes_lib.Resolved:
    if isinstance(spec.in_axes, str):  # "auto", checked when the function was made
        return axes_lib.infer(spec.func_name, infos)
    if spec.in_axes is None or _is_int(spec.in_axes):
        per_arg = [spec.in_axes] * len(args)
    elif isinstance(spec.in_axes, (tuple, list)):
        if len(spec.in_axes) != len(args):
            raise PergradValueError(
                f"{spec.func_name}: in_axes has {len(spec.in_axes)} entries but fn was called "
                f"with {len(args)} positional arguments; give one entry per argument, e.g. "
                f"in_axes=({', '.join(['None'] + ['0'] * (len(args) - 1))})."
            )
        per_arg = list(spec.in_axes)
    else:
        raise PergradTypeError(
            f"{spec.func_name}: in_axes must be 'auto', an int, None, or a tuple with one "
            f"entry per positional argument; got {type(spec.in_axes).__name__}."
        )
    per_leaf = []
    for info, arg, entry in zip(infos, args, per_arg):
        broadcast = bk.broadcast_prefix(entry, arg)
        if broadcast is None or len(broadcast) != len(info.leaves):
            raise PergradValueError(
                f"{spec.func_name}: in_axes entry {entry!r} for {info.label} is not a prefix "
                f"of its structure (leaves: {[leaf.path for leaf in info.leaves][:6]}); use an "
                f"int or None for the whole argument, or a matching container."
            )
        per_leaf.append(broadcast)
    return axes_lib.validate_explicit(spec.func_name, infos, per_leaf)


def _select_backend(spec: _Spec, args: tuple[Any, ...]) -> Backend:
    names = set().union(*(framework_names_in(arg) for arg in args))
    if len(names) == 1 and spec.backend in (None, *names):  # the common case, without paths
        return get_backend(next(iter(names)))
    owners: dict[str, list[str]] = {}
    for index, arg in enumerate(args):
        for framework, path, kind in frameworks_in(arg):
            label = f"argument {index}" + (
                f" ({spec.arg_name(index)!r})" if spec.arg_name(index) else ""
            )
            where = f"{label}{' at ' + path if path else ''}"
            owners.setdefault(framework, []).append(f"{where} ({kind.__module__}.{kind.__name__})")
    if len(owners) > 1:
        listing = "; ".join(f"{fw}: {', '.join(places[:3])}" for fw, places in owners.items())
        raise PergradTypeError(
            f"{spec.func_name}: the arguments mix arrays of different frameworks ({listing}). "
            f"Pass arrays of one framework."
        )
    if spec.backend is not None:
        if owners and spec.backend not in owners:
            found = next(iter(owners))
            raise PergradTypeError(
                f"{spec.func_name}: backend={spec.backend!r} was asked for, but the arguments "
                f"hold {found} arrays ({owners[found][0]})."
            )
        return get_backend(spec.backend)
    if not owners:
        raise PergradTypeError(
            f"{spec.func_name}: cannot tell the framework: no argument holds a JAX array or a "
            f"torch tensor. Pass backend='jax' or backend='torch' (numpy arrays work with "
            f"backend='jax'), or convert the inputs."
        )
    return get_backend(next(iter(owners)))
