"""Data-parallel JAX: the batch split across devices, the per-example work kept where it lives.

Two ways to run a DP-SGD step (or per-example norms) over several devices:

1. ``jax.jit`` over sharded inputs. Place the batch with :func:`shard_batch` (batch axis split
   over a mesh axis) and the parameters replicated; :func:`pergrad.per_example_grads`, the
   norms, :func:`pergrad.dp.clipped_sum` and :func:`pergrad.dp.optax_aggregate` need nothing
   else. XLA's partitioner keeps the ``B x P`` per-example gradients split by example and sends
   only the ``P``-sized clipped sum across devices (one all-reduce); the noise, drawn from a
   replicated key, is added once to the summed gradient.
2. ``jax.shard_map``, where each device runs its own piece of the step. Everything inside sees
   only the local examples, so clip there and pass ``axis_name=`` to
   :func:`pergrad.dp.clipped_sum` / :func:`pergrad.dp.optax_aggregate` (or call
   :func:`psum_clipped` on what :func:`pergrad.dp.clipped_sum_of` returns): the clipped sums
   are added across devices, then noise is added once, from the same key on every device.
   pergrad's own per-example gradients, norms and clipped sums make the replicated parameters
   per-device first (``jax.lax.pcast(..., to="varying")``): otherwise JAX (``check_vma=True``,
   the default) adds each example's gradient over the devices while differentiating, and the
   "per-example" gradients mix examples of different devices. A hand-written
   ``vmap(grad)`` needs that ``pcast`` too; :func:`psum_clipped` refuses gradients typed as
   summed.

``examples/sharded_dp_jax.py`` shows both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pergrad._src.backends import backend_of
from pergrad._src.dp.types import ClippedSum
from pergrad._src.errors import PergradTypeError, PergradValueError


def shard_batch(batch: Any, mesh: jax.sharding.Mesh, axis_name: str = "batch") -> Any:
    """Place a batch on ``mesh`` with its leading (example) axis split over ``axis_name``.

    Every array leaf of ``batch`` goes to ``NamedSharding(mesh, PartitionSpec(axis_name))``:
    device ``d`` of the ``n``-device axis holds examples ``d * B / n`` to ``(d + 1) * B / n``.
    Put the parameters on ``NamedSharding(mesh, PartitionSpec())`` (replicated) and call the
    jitted step as usual.

    Example::

        mesh = jax.make_mesh((jax.device_count(),), ("batch",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        x, y, mask = pergrad.dp.shard_batch((x, y, mask), mesh)     # each (B, ...), split

    Args:
      batch: a pytree of arrays (JAX or numpy), each with the same leading size ``B``.
      mesh: a ``jax.sharding.Mesh`` whose ``axis_name`` axis is ``AxisType.Auto`` (the
        partitioner decides where sums go; ``jax.make_mesh`` makes Explicit axes unless told).
      axis_name: the mesh axis to split the examples over.

    Returns:
      The same pytree of ``jax.Array``, sharded. Costs one host-to-device copy.

    Raises:
      PergradValueError: ``B`` is not a multiple of the mesh axis size (the message says which
        padded size to use with :func:`pergrad.dp.pad_batch` and a mask), or the leaves
        disagree on ``B``.
    """
    name = "shard_batch"
    if not isinstance(mesh, jax.sharding.Mesh):
        raise PergradTypeError(
            f"{name}: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), ('batch',))); "
            f"got {type(mesh).__name__}."
        )
    if axis_name not in mesh.axis_names:
        raise PergradValueError(
            f"{name}: axis_name {axis_name!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}."
        )
    axis_type = dict(zip(mesh.axis_names, mesh.axis_types))[axis_name]
    if axis_type == jax.sharding.AxisType.Explicit:
        raise PergradValueError(
            f"{name}: mesh axis {axis_name!r} has AxisType.Explicit (jax.make_mesh's default), "
            f"under which JAX refuses the sum over examples that DP-SGD needs without an "
            f"explicit output sharding. Make the mesh with automatic axes: "
            f"jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * "
            f"len(names)), or write the step inside jax.shard_map with axis_name=."
        )
    batch_size = _batch_size(name, batch)
    check_divisible(name, batch_size, mesh.shape[axis_name], axis_name)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))
    return jax.device_put(batch, sharding)


def _batch_size(func_name: str, batch: Any) -> int:
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    sizes = {}
    for path, leaf in paths_and_leaves:
        where = f"batch{jax.tree_util.keystr(path)}"
        if jnp.ndim(leaf) == 0:
            raise PergradValueError(
                f"{func_name}: every leaf of batch needs a leading example axis; {where} is 0-d."
            )
        sizes[where] = jnp.shape(leaf)[0]
    if not sizes:
        raise PergradValueError(f"{func_name}: batch holds no arrays.")
    if len(set(sizes.values())) != 1:
        listing = ", ".join(f"{where}: {size}" for where, size in list(sizes.items())[:8])
        raise PergradValueError(
            f"{func_name}: the leaves of batch disagree on the number of examples (leading "
            f"sizes {listing})."
        )
    return next(iter(sizes.values()))


def check_divisible(func_name: str, batch_size: int, mesh_size: int, axis_name: str) -> None:
    """Raise when ``batch_size`` examples cannot be split evenly over ``mesh_size`` devices."""
    if batch_size % mesh_size:
        padded = -(-batch_size // mesh_size) * mesh_size
        raise PergradValueError(
            f"{func_name}: the batch has {batch_size} examples, which do not split evenly over "
            f"the {mesh_size} devices of mesh axis {axis_name!r}. Pad it to a multiple of "
            f"{mesh_size} (e.g. {padded}) and pass a mask marking the padding: "
            f"indices, mask = pergrad.dp.pad_batch(indices, {padded}); clipped_sum and "
            f"optax_aggregate take mask= and ignore padded examples."
        )


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
