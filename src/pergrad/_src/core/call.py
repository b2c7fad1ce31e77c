"""The analysed call: what every strategy receives, and the single-example function.

Two types carry a call of any pergrad entry point (``per_example_grads``, ``per_example_norms_of``,
``clipped_sum_of``...) to the strategy that computes it:

- :class:`Spec`, made once per wrapped function by :meth:`Spec.create`: the validated
  arguments of the wrapper (``fn``, ``argnums``, ``in_axes``, ``has_aux``, ``chunk_size``,
  ``backend``, ``randomness``, ``strategy``), plus what later calls reuse (the argument layouts
  seen so far, the vectorised transform, which strategy "auto" settled on).
- :class:`Call`, made per call by :func:`analyse_call`: the backend chosen from the arrays, every
  argument flattened to leaves, where the differentiated leaves sit (``diff_positions``) and
  the batched ones (``batched_positions``, batched on axis 0 after in_axes inference and
  validation), and the batch size. ``call.rebuild(diff_values, batched_values)`` gives the
  arguments back with new leaves in those places.

:func:`single_example_fn` turns them into the loss of ONE example over flat leaves,
``single(diff_values, example_values) -> loss`` (or ``(loss, aux)``), with its output checked;
:func:`rebuild_grads` turns per-leaf results back into the structure of the differentiated
argument(s). A strategy needs nothing else from the core.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pergrad._src.backends import (
    Backend,
    available_backend_names,
    framework_names_in,
    frameworks_in,
    get_backend,
    is_running_vectorised,
)
from pergrad._src.core import axes as axes_lib
from pergrad._src.errors import (
    PergradTypeError,
    PergradValueError,
    is_pergrad_error,
    shown,
)

_RANDOMNESS = ("error", "different", "same")


GRAD_STRATEGIES = ("auto", "vmap", "hooks", "loop")


@dataclass
class Spec:
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
    last_strategy: str | None = field(default=None)
    # Why the last call ran last_strategy, and why "auto" settled on `resolved` (the registry).
    last_reason: str | None = field(default=None)
    resolved_reason: str | None = field(default=None)
    # What analyse_call decided for each structure of the arguments seen so far (see analyse_call).
    layouts: dict[Any, _Layout] = field(default_factory=dict, repr=False, compare=False)
    # The vectorised function of each backend (see vectorised).
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
    ) -> Spec:
        if not callable(fn):
            raise PergradTypeError(
                f"{func_name}: fn must be a callable loss of one example, fn(params, x, ...) "
                f"-> scalar; got {type(fn).__name__}."
            )
        single = is_int(argnums)
        argnums_tuple = _check_argnums(func_name, argnums)
        _check_in_axes_type(func_name, in_axes)
        if not isinstance(has_aux, bool):
            raise PergradTypeError(
                f"{func_name}: has_aux must be True or False; got {shown(has_aux)}."
            )
        if chunk_size is not None and (not is_int(chunk_size) or chunk_size <= 0):
            raise PergradValueError(
                f"{func_name}: chunk_size must be a positive int or None; got {shown(chunk_size)}."
            )
        if backend is not None and backend not in available_backend_names():
            raise PergradValueError(
                f"{func_name}: backend must be one of {list(available_backend_names())} or "
                f"None (chosen from the arrays passed); got {shown(backend)}."
            )
        if randomness is not None and randomness not in _RANDOMNESS:
            raise PergradValueError(
                f"{func_name}: randomness must be one of {list(_RANDOMNESS)} or None; "
                f"got {shown(randomness)}."
            )
        if not isinstance(strategy, str) or strategy not in GRAD_STRATEGIES:
            raise PergradValueError(
                f"{func_name}: strategy must be one of {list(GRAD_STRATEGIES)}; got {shown(strategy)}."
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


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_argnums(func_name: str, argnums: Any) -> tuple[int, ...]:
    if is_int(argnums):
        argnums = (argnums,)
    elif not (isinstance(argnums, (tuple, list)) and argnums and all(map(is_int, argnums))):
        raise PergradTypeError(
            f"{func_name}: argnums must be an int or a non-empty tuple of ints; got {shown(argnums)}."
        )
    if any(a < 0 for a in argnums):
        raise PergradValueError(
            f"{func_name}: argnums must be non-negative positions; got {shown(argnums)}."
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
class Call:
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


def map_arrays(bk: Backend, f: Callable[[Any], Any], tree: Any) -> Any:
    _, leaves, treedef = bk.flatten(tree)
    return bk.unflatten(treedef, [f(x) if bk.is_array(x) else x for x in leaves])


def single_example_fn(
    spec: Spec, call: Call, kwargs: dict[str, Any]
) -> Callable[[tuple[Any, ...], tuple[Any, ...]], Any]:
    def single(diff_values: tuple[Any, ...], batched_values: tuple[Any, ...]) -> Any:
        return single_example(spec, call, kwargs, diff_values, batched_values)

    return single


def single_example(
    spec: Spec,
    call: Call,
    kwargs: dict[str, Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
) -> Any:
    """``fn`` on one example, with its output checked: the loss, or ``(loss, aux)``."""
    try:
        out = spec.fn(*call.rebuild(diff_values, batched_values), **kwargs)
    except Exception as err:
        explained = _one_example_shape_error(spec, call, err)
        if explained is None:
            raise
        raise explained from err
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


# Words of the frameworks' complaints about array shapes (JAX's TypeErrors, torch's
# RuntimeErrors, either's IndexErrors), lower case.
_SHAPE_WORDS = (
    "shape",
    "ndim",
    "dimension",
    "rank",
    "size",
    "broadcast",
    "too many indices",
    "index out of range",
)


def _one_example_shape_error(spec: Spec, call: Call, err: Exception) -> PergradValueError | None:
    """The error to raise when ``fn`` failed on one example with the framework's complaint
    about shapes, most often a loss of the whole batch given where the loss of one example is
    expected; None to let ``err`` through. Left through: pergrad's own errors, failures under
    a vmap (the strategies fall back to a loop, which meets the plain failure and explains
    it here), JAX's tracer errors, and ``module_loss`` losses (which add the batch axis back)."""
    message = str(err)
    if (
        is_pergrad_error(err)
        or is_running_vectorised()
        or not isinstance(err, (TypeError, ValueError, IndexError, RuntimeError))
        or type(err).__module__.startswith("jax")  # ConcretizationTypeError and the like
        or not any(word in message.lower() for word in _SHAPE_WORDS)
        or not call.batched_positions
        or _is_module_loss(spec.fn)
    ):
        return None
    bk = call.backend
    shapes = []
    for i, j in call.batched_positions[:3]:
        name = spec.arg_name(i)
        label = f"argument {i}" + (f" ({name!r})" if name else "")
        if len(call.leaves[i]) > 1:
            label += f" leaf {j}"
        full = tuple(bk.shape(call.leaves[i][j]))
        shapes.append(f"{label} of shape {full[1:]} (the batch's {full})")
    more = " ..." if len(call.batched_positions) > 3 else ""
    first_line = message.splitlines()[0][:300] if message else ""
    return PergradValueError(
        f"{spec.func_name}: fn failed on ONE example with a shape error "
        f"({type(err).__name__}: {first_line}). fn must be the loss of one example: it is called "
        f"with each batched argument WITHOUT its batch axis (axis 0, of size {call.batch_size}): "
        f"{', '.join(shapes)}{more}. A loss written for the whole batch fails this way. Write "
        f"the loss of one example, e.g. add the batch axis back inside it: "
        f"lambda params, x, y: batch_loss(params, x[None], y[None]); for a PyTorch nn.Module, "
        f"pergrad.module_loss(model, loss_fn) writes it for you."
    )


def _is_module_loss(fn: Any) -> bool:
    """Whether ``fn`` is a :func:`pergrad.module_loss` loss, without importing torch."""
    module = sys.modules.get("pergrad._src.core.module_loss")
    return module is not None and isinstance(fn, module.ModuleLoss)


def _describe(bk: Backend, x: Any) -> str:
    if bk.is_array(x):
        return f"an array of shape {bk.shape(x)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"an object of type {type(x).__name__}"


def rebuild_grads(spec: Spec, call: Call, grad_leaves: Sequence[Any]) -> Any:
    if spec.single_argnum and len(call.diff_positions) == len(call.leaves[spec.argnums[0]]):
        return call.backend.unflatten(call.treedefs[spec.argnums[0]], grad_leaves)
    per_arg: dict[int, list[Any]] = {i: [None] * len(call.leaves[i]) for i in spec.argnums}
    for (i, j), g in zip(call.diff_positions, grad_leaves):
        per_arg[i][j] = g
    trees = tuple(call.backend.unflatten(call.treedefs[i], per_arg[i]) for i in spec.argnums)
    return trees[0] if spec.single_argnum else trees


# Leaves that are not arrays and hold nothing: their type alone is all analyse_call looks at.
_PLAIN_LEAF_TYPES = frozenset({bool, int, float, complex, str, type(None)})


_MAX_LAYOUTS = 16  # structures remembered per wrapped function (batch sizes, shapes, ...)


@dataclass(frozen=True)
class _Layout:
    """What :func:`analyse_call` decided for one structure of the arguments."""

    backend: Backend
    diff_positions: tuple[tuple[int, int], ...]
    batched_positions: tuple[tuple[int, int], ...]
    moved_axes: tuple[tuple[int, int, int], ...]  # (argument, leaf, axis): batched off axis 0
    float_positions: tuple[tuple[int, int], ...]  # Python floats in differentiated arguments
    batch_size: int

    def apply(self, treedefs: list[Any], leaves: list[list[Any]]) -> Call:
        bk = self.backend
        for i, j in self.float_positions:
            leaves[i][j] = bk.as_differentiable(leaves[i][j])
        for i, j, axis in self.moved_axes:
            leaves[i][j] = bk.moveaxis_to_front(leaves[i][j], axis)
        return Call(
            bk,
            treedefs,
            leaves,
            list(self.diff_positions),
            list(self.batched_positions),
            self.batch_size,
        )


def analyse_call(spec: Spec, args: tuple[Any, ...]) -> Call:
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
    """The structure :func:`analyse_call`'s decisions depend on, hashable; None if a leaf is an
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


def _analyse(spec: Spec, args: tuple[Any, ...]) -> Call:
    """:func:`analyse_call` for a structure not seen before: validate, infer, and remember."""
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
    float_positions: list[tuple[int, int]] = []
    for index, arg in enumerate(args):
        paths, arg_leaves, treedef = bk.flatten(arg)
        treedefs.append(treedef)
        raw_leaves.append(arg_leaves)
        differentiated = index in spec.argnums
        if differentiated:
            constant = bk.constant_leaves(arg)
            floats = {j for j, x in enumerate(arg_leaves) if _is_float(x) and j not in constant}
            float_positions.extend((index, j) for j in floats)
            arg_leaves = [
                bk.as_differentiable(x) if j in floats else x for j, x in enumerate(arg_leaves)
            ]
        leaves.append(arg_leaves)
        infos.append(_arg_info(spec, bk, index, arg, paths, arg_leaves, differentiated))
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
        tuple(float_positions),
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
    spec: Spec,
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
    spec: Spec, bk: Backend, infos: list[axes_lib.ArgInfo], leaves: list[list[Any]]
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
    spec: Spec, bk: Backend, args: tuple[Any, ...], infos: list[axes_lib.ArgInfo]
) -> axes_lib.Resolved:
    if isinstance(spec.in_axes, str):  # "auto", checked when the function was made
        return axes_lib.infer(spec.func_name, infos)
    if spec.in_axes is None or is_int(spec.in_axes):
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


def _select_backend(spec: Spec, args: tuple[Any, ...]) -> Backend:
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
