"""Which arguments are batched: ``in_axes`` inference and validation.

This module is framework-free: it sees each argument as a list of leaves with a path and a shape
(``None`` for a leaf that is not an array) and decides, per leaf, the axis the batch runs along
(``None`` for shared). The rules of ``in_axes="auto"``:

1. Differentiated arguments are shared.
2. Scalars, 0-d arrays, ``None`` and other non-array leaves are never batched.
3. Every other argument is looked at as a whole. It is *uniform* when all its array leaves have
   at least one dimension and share one leading size, with no 0-d array beside them; it is *mixed*
   when its leaves disagree on the leading size or hold a 0-d array (the shape of model state:
   ``named_buffers()`` with BatchNorm's ``num_batches_tracked``, layers of different widths).
4. The batch size ``B`` is the leading size on which the uniform arguments agree. When they
   disagree, the bare-array arguments decide (``x``, ``y`` against a dict of state); when those
   disagree too, inference stops with an error that shows an explicit ``in_axes``.
5. Uniform arguments of leading size ``B`` are batched on axis 0; everything else is shared,
   mixed arguments included, even when one of their leaves happens to have leading size ``B``.
6. One case stays ambiguous and raises: a container of only 1-D arrays of length ``B`` beside
   other batched arguments (flax ``batch_stats`` when the channel count equals ``B``).

An explicit ``in_axes`` (JAX's pytree-prefix semantics) is validated leaf by leaf instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pergrad._src.errors import PergradTypeError, PergradValueError

Axis = int | None


@dataclass(frozen=True)
class LeafInfo:
    path: str
    shape: tuple[int, ...] | None  # None for a leaf that is not an array
    type_name: str


@dataclass(frozen=True)
class ArgInfo:
    index: int
    name: str | None
    leaves: tuple[LeafInfo, ...]
    differentiated: bool
    is_bare_array: bool

    @property
    def label(self) -> str:
        return f"argument {self.index} ({self.name!r})" if self.name else f"argument {self.index}"

    def leaf_label(self, leaf: LeafInfo) -> str:
        return f"{self.label}, leaf {leaf.path}" if leaf.path else self.label

    def sized_leaves(self) -> list[LeafInfo]:
        return [leaf for leaf in self.leaves if leaf.shape is not None and len(leaf.shape) >= 1]

    def has_0d_array(self) -> bool:
        return any(leaf.shape == () for leaf in self.leaves)

    def uniform_size(self) -> int | None:
        """The common leading size if the argument looks like a batch of data, else None."""
        sizes = {leaf.shape[0] for leaf in self.sized_leaves()}
        if len(sizes) == 1 and not self.has_0d_array():
            return sizes.pop()
        return None


@dataclass(frozen=True)
class Resolved:
    axes: tuple[tuple[Axis, ...], ...]  # one axis per leaf, per argument
    batch_size: int


def infer(func_name: str, args: Sequence[ArgInfo]) -> Resolved:
    """``in_axes="auto"``: the rules in this module's docstring."""
    candidates = [a for a in args if not a.differentiated and a.uniform_size() is not None]
    if not candidates:
        raise PergradValueError(
            f"{func_name}: no argument looks batched, so there is nothing to compute per "
            f"example. {_describe_all(args)} Batched data needs a leading batch axis (for a "
            f"single example, add one, e.g. x[None]); or pass in_axes explicitly."
        )
    batch_size = _agreed_batch_size(func_name, args, candidates)
    _refuse_state_shaped_data(func_name, args, batch_size)
    axes = []
    for arg in args:
        batched = not arg.differentiated and arg.uniform_size() == batch_size
        axes.append(tuple(_leaf_axis(leaf) if batched else None for leaf in arg.leaves))
    return Resolved(tuple(axes), batch_size)


def _leaf_axis(leaf: LeafInfo) -> Axis:
    return 0 if leaf.shape is not None and len(leaf.shape) >= 1 else None


def _agreed_batch_size(func_name: str, args: Sequence[ArgInfo], candidates: list[ArgInfo]) -> int:
    sizes = {a.uniform_size() for a in candidates}
    if len(sizes) == 1:
        return sizes.pop()  # type: ignore[return-value]
    bare_sizes = {a.uniform_size() for a in candidates if a.is_bare_array}
    if len(bare_sizes) == 1:
        return bare_sizes.pop()  # type: ignore[return-value]
    listing = "; ".join(f"{a.label} has leading size {a.uniform_size()}" for a in candidates)
    most_common = Counter(a.uniform_size() for a in candidates).most_common(1)[0][0]
    example = _format_in_axes(
        args, lambda a: not a.differentiated and a.uniform_size() == most_common
    )
    raise PergradValueError(
        f"{func_name}: cannot infer in_axes: the arguments disagree on the batch size "
        f"({listing}). Pass in_axes explicitly; if the batch size is {most_common}: "
        f"in_axes={example}."
    )


def _refuse_state_shaped_data(func_name: str, args: Sequence[ArgInfo], batch_size: int) -> None:
    """Stop where a container could as well be per-channel state as a batch of data.

    A container of 1-D arrays of length B beside other batched data is what flax's
    ``batch_stats`` looks like when the channel count equals B; batching it would silently
    give each example one number of each statistic, so ask instead of guessing.
    """
    batched = [a for a in args if not a.differentiated and a.uniform_size() == batch_size]
    for arg in batched:
        sized = arg.sized_leaves()
        if arg.is_bare_array or len(batched) < 2 or any(len(leaf.shape) != 1 for leaf in sized):
            continue
        paths = ", ".join(leaf.path for leaf in sized[:4]) + (", ..." if len(sized) > 4 else "")
        as_state = _format_in_axes(args, lambda a, arg=arg: a in batched and a is not arg)
        as_data = _format_in_axes(args, lambda a: a in batched)
        raise PergradValueError(
            f"{func_name}: cannot infer in_axes for {arg.label}: its arrays ({paths}) are all "
            f"1-D of length {batch_size}, the batch size, so they could be per-channel model "
            f"state (e.g. BatchNorm statistics) as well as per-example data. Pass in_axes "
            f"explicitly: in_axes={as_state} if it is shared state, in_axes={as_data} if it "
            f"is data."
        )


def _format_in_axes(args: Sequence[ArgInfo], batched: Callable[[ArgInfo], bool]) -> str:
    entries = ["0" if batched(a) else "None" for a in args]
    return "(" + ", ".join(entries) + ("," if len(entries) == 1 else "") + ")"


def _describe_all(args: Sequence[ArgInfo]) -> str:
    parts = []
    for arg in args:
        if arg.differentiated:
            parts.append(f"{arg.label} is differentiated (shared)")
            continue
        sized = arg.sized_leaves()
        if not sized:
            parts.append(f"{arg.label} has no array with a batch axis")
        else:
            sizes = ", ".join(f"{leaf.path or 'the array'}: {leaf.shape[0]}" for leaf in sized[:4])
            more = ", ..." if len(sized) > 4 else ""
            zero_d = " and a 0-d array" if arg.has_0d_array() else ""
            parts.append(
                f"{arg.label} has leading sizes ({sizes}{more}){zero_d}, read as shared model state"
            )
    return "; ".join(parts) + "."


def validate_explicit(
    func_name: str, args: Sequence[ArgInfo], per_arg_axes: Sequence[Sequence[Any]]
) -> Resolved:
    """Check an explicit ``in_axes`` already broadcast to one entry per leaf."""
    normalized: list[tuple[Axis, ...]] = []
    sizes: list[tuple[str, int]] = []
    for arg, leaf_axes in zip(args, per_arg_axes):
        arg_axes = []
        for leaf, axis in zip(arg.leaves, leaf_axes):
            axis = _check_leaf_axis(func_name, arg, leaf, axis)
            if axis is not None:
                sizes.append((arg.leaf_label(leaf), leaf.shape[axis]))  # type: ignore[index]
            arg_axes.append(axis)
        normalized.append(tuple(arg_axes))
    if not sizes:
        raise PergradValueError(
            f"{func_name}: in_axes batches no argument (every entry is None), so there is "
            f"nothing to compute per example; put 0 on the data arguments, e.g. "
            f"in_axes={_format_in_axes(args, lambda a: not a.differentiated)}."
        )
    distinct = {size for _, size in sizes}
    if len(distinct) > 1:
        listing = "; ".join(f"{label}: {size}" for label, size in sizes)
        raise PergradValueError(
            f"{func_name}: the batched arguments disagree on the batch size ({listing}). "
            f"Every batched array needs the same size along its in_axes axis."
        )
    return Resolved(tuple(normalized), distinct.pop())


def _check_leaf_axis(func_name: str, arg: ArgInfo, leaf: LeafInfo, axis: Any) -> Axis:
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise PergradTypeError(
            f"{func_name}: in_axes entries must be an int or None; got {axis!r} "
            f"(type {type(axis).__name__}) for {arg.leaf_label(leaf)}."
        )
    if arg.differentiated:
        raise PergradValueError(
            f"{func_name}: {arg.label} is differentiated (in argnums), so it is shared by "
            f"every example and its in_axes entry must be None; got {axis} for "
            f"{arg.leaf_label(leaf)}."
        )
    if leaf.shape is None:
        raise PergradValueError(
            f"{func_name}: in_axes puts axis {axis} on {arg.leaf_label(leaf)}, which is a "
            f"{leaf.type_name}, not an array; only arrays can be batched (use None)."
        )
    ndim = len(leaf.shape)
    if not -ndim <= axis < ndim:
        raise PergradValueError(
            f"{func_name}: in_axes axis {axis} is out of range for {arg.leaf_label(leaf)} "
            f"of shape {leaf.shape} (valid: {-ndim} to {ndim - 1})"
            + (" -- a 0-d array cannot be batched, use None" if ndim == 0 else "")
            + "."
        )
    return axis % ndim
