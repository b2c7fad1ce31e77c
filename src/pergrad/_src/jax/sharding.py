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
   :func:`pergrad.dp.psum_clipped` on what :func:`pergrad.dp.clipped_sum_of` returns): the clipped sums
   are added across devices, then noise is added once, from the same key on every device.
   pergrad's own per-example gradients, norms and clipped sums make the replicated parameters
   per-device first (``jax.lax.pcast(..., to="varying")``): otherwise JAX (``check_vma=True``,
   the default) adds each example's gradient over the devices while differentiating, and the
   "per-example" gradients mix examples of different devices. A hand-written
   ``vmap(grad)`` needs that ``pcast`` too; :func:`pergrad.dp.psum_clipped` refuses gradients typed as
   summed.

``examples/sharded_dp_jax.py`` shows both.

Parameters too big for one device: :func:`shard_params` splits each parameter over a second
mesh axis (FSDP-style, ``NamedSharding``), the batch over the first. Under ``jax.jit`` the
ghost step (:func:`pergrad.dp.private_grad_of`, :func:`pergrad.dp.clipped_sum_of`) then runs
as it is: each device keeps ``1/N`` of every parameter, XLA gathers a layer's weights where
the layer runs (as for the plain step), the per-example norms come from the layers' inputs and
output cotangents, and the clipped sum and its noise come out sharded like the parameters (the
noise, from a partitionable key, equals the one-device noise).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

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
    check_auto_axis(name, mesh, axis_name)
    batch_size = _batch_size(name, batch)
    check_divisible(name, batch_size, mesh.shape[axis_name], axis_name)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))
    return jax.device_put(batch, sharding)


def shard_params(params: Any, mesh: jax.sharding.Mesh, axis_name: str = "model") -> Any:
    """Place parameters on ``mesh``, each split over ``axis_name`` (FSDP-style sharding).

    Every array leaf is split along its largest axis whose size is a multiple of the mesh
    axis's, and replicated where it has none (a bias of odd size, a scalar): each device then
    holds about ``1/N`` of the parameters. Use it with :func:`shard_batch` over another axis
    of the same mesh and call the jitted DP step as usual; its gradient (clipped sum and noise
    included) comes out with the parameters' sharding.

    Example::

        mesh = jax.make_mesh((2, 4), ("batch", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        params = pergrad.dp.shard_params(params, mesh)            # each leaf split 4 ways
        x, y = pergrad.dp.shard_batch((x, y), mesh)                # examples split 2 ways
        grad, stats = jax.jit(step)(params, x, y, key)            # step: private_grad_of(...)

    Args:
      params: a pytree of arrays (JAX or numpy).
      mesh: a ``jax.sharding.Mesh`` whose ``axis_name`` axis is ``AxisType.Auto``.
      axis_name: the mesh axis to split the parameters over.

    Returns:
      The same pytree of ``jax.Array``, sharded. Costs one host-to-device copy.
    """
    name = "shard_params"
    check_auto_axis(name, mesh, axis_name)
    size = mesh.shape[axis_name]

    def place(leaf: Any) -> Any:
        shape = jnp.shape(leaf)
        spec: list[str | None] = [None] * len(shape)
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % size == 0:
                spec[axis] = axis_name
                break
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.device_put(leaf, sharding)

    return jax.tree.map(place, params)


def check_auto_axis(func_name: str, mesh: Any, axis_name: str) -> None:
    """``mesh`` is a Mesh with an automatic axis ``axis_name``; raise otherwise."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise PergradTypeError(
            f"{func_name}: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4,), "
            f"('batch',))); got {type(mesh).__name__}."
        )
    if axis_name not in mesh.axis_names:
        raise PergradValueError(
            f"{func_name}: axis_name {axis_name!r} is not an axis of the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}."
        )
    axis_type = dict(zip(mesh.axis_names, mesh.axis_types))[axis_name]
    if axis_type == jax.sharding.AxisType.Explicit:
        raise PergradValueError(
            f"{func_name}: mesh axis {axis_name!r} has AxisType.Explicit (jax.make_mesh's "
            f"default), under which JAX refuses the sum over examples that DP-SGD needs without "
            f"an explicit output sharding. Make the mesh with automatic axes: "
            f"jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * "
            f"len(names)), or write the step inside jax.shard_map with axis_name=."
        )


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
