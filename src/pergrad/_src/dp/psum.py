"""Clipped sums added over the devices of a JAX mesh axis, inside ``jax.shard_map``.

Each device clips and sums its own examples; :func:`psum_clipped` adds the sums, the example
counts and the clipped counts over the devices in one all-reduce, and refuses gradients that JAX
has already summed over them (which would not be per-example gradients any more). The DP
aggregate of ``clipping.py`` and ``optax_aggregate`` call it for ``axis_name=``; placing a batch
on a mesh is ``jax/sharding.py``'s. JAX is imported when a function here is called.
"""

from __future__ import annotations

from typing import Any

from pergrad._src.backends import backend_of
from pergrad._src.dp.types import ClippedSum
from pergrad._src.errors import PergradTypeError, PergradValueError


def check_axis_name(func_name: str, axis_name: Any) -> None:
    """Validate an ``axis_name=`` argument: None, a mesh axis name, or a tuple of them."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not (names and all(isinstance(n, str) for n in names)):
        raise PergradTypeError(
            f"{func_name}: axis_name must be None, a mesh axis name (str) or a tuple of them; "
            f"got {axis_name!r}."
        )


def psum_clipped(
    clipped: ClippedSum, axis_name: str | tuple[str, ...], *, func_name: str = "psum_clipped"
) -> ClippedSum:
    """Add up the clipped sums of all devices along ``axis_name``, inside ``jax.shard_map``.

    Each device clips and sums its own examples (:func:`pergrad.dp.clipped_sum` or
    :func:`pergrad.dp.clipped_sum_of` on the local shard); this adds the ``P``-sized sums,
    the example counts and the clipped counts over the devices in one all-reduce. Add noise
    AFTER it, with the same key on every device (:func:`pergrad.dp.add_noise`), so that the
    noise is added once, as for one device.

    Example (inside a function run by ``jax.shard_map`` over mesh axis ``"batch"``)::

        local = pergrad.dp.clipped_sum_of(loss, params, x, y, max_norm=1.0)
        total = pergrad.dp.psum_clipped(local, "batch")      # total.sum: same on all devices

    Args:
      clipped: a :class:`pergrad.dp.ClippedSum` of JAX arrays, from the local examples.
      axis_name: the mesh axis (or tuple of axes) the examples are split over.
      func_name: the public function to name in error messages.

    Returns:
      A :class:`pergrad.dp.ClippedSum` whose ``sum``, ``count``, ``clip_fraction`` and
      ``nonfinite`` cover every device's examples; ``norms`` stay the local examples' norms.
    """
    name = func_name
    check_axis_name(name, axis_name)
    if axis_name is None:
        raise PergradTypeError(f"{name}: axis_name must be a mesh axis name; got None.")
    if not isinstance(clipped, ClippedSum):
        raise PergradTypeError(
            f"{name}: clipped must be the ClippedSum that pergrad.dp.clipped_sum or "
            f"clipped_sum_of returns; got {type(clipped).__name__}."
        )
    if backend_of(clipped.sum, name, "clipped.sum").name != "jax":
        raise PergradTypeError(
            f"{name}: axis_name is a JAX mesh axis; clipped holds torch tensors. With "
            f"torch.distributed, all_reduce clipped.sum and clipped.count instead."
        )
    import jax
    import jax.numpy as jnp

    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    try:
        tracked = _varying_axes(jax.lax.axis_index(axes))
    except NameError as err:
        raise PergradValueError(
            f"{name}: axis_name={axis_name!r} is not a mapped axis here ({err}). It names the "
            f"mesh axis of an enclosing jax.shard_map that splits the examples; under plain "
            f"jax.jit with sharded inputs, leave axis_name=None: XLA adds up the devices' "
            f"sums by itself."
        ) from None
    _check_local(name, clipped.sum, axes, tracked)
    # clip_fraction * count is an integer up to rounding; round so the sum stays exact.
    num_clipped = jnp.round(clipped.clip_fraction * clipped.count.clip(min=1.0))
    total, count, num_clipped, nonfinite = jax.lax.psum(
        (clipped.sum, clipped.count, num_clipped, clipped.nonfinite), axes
    )
    return clipped._replace(
        sum=total,
        count=count,
        clip_fraction=num_clipped / count.clip(min=1.0),
        nonfinite=nonfinite,
    )


def _varying_axes(x: Any) -> frozenset[str] | None:
    """The ``shard_map`` mesh axes along which ``x`` may differ between devices, as JAX's
    type checking (``check_vma=True``) tracks them; None where this JAX does not say."""
    import jax

    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    varying = getattr(manual, "varying", None) if manual is not None else None
    return getattr(aval, "vma", None) if varying is None else varying


def _check_local(
    func_name: str, summed: Any, axes: tuple[str, ...], tracked: frozenset[str] | None
) -> None:
    """Refuse gradients that JAX has already summed over the devices.

    Inside ``shard_map`` with ``check_vma=True``, differentiating parameters that are the same
    on every device against device-local examples makes JAX add each gradient over the
    devices (the transpose of the implicit broadcast). Per-example gradients computed that way
    mix the examples at one position of every device, so clipping would not bound one
    example's influence. Such gradients are typed as equal on every device, which shows here.
    """
    if not tracked or not set(axes) <= tracked:
        return  # check_vma=False (or an older JAX): nothing is summed behind the user's back
    import jax

    leaves = jax.tree_util.tree_leaves(summed)
    if any(not set(axes) <= (_varying_axes(leaf) or frozenset()) for leaf in leaves):
        axis = axes[0] if len(axes) == 1 else axes
        raise PergradValueError(
            f"{func_name}: the clipped gradients are the same on every device of mesh axis "
            f"{axis!r}: JAX summed each example's gradient over the devices while "
            f"differentiating parameters that are replicated inside jax.shard_map, so they are "
            f"not per-example gradients any more. Mark the parameters as per-device before "
            f"differentiating: params = jax.lax.pcast(params, {axis!r}, to='varying') "
            f"(or run shard_map with check_vma=False)."
        )
