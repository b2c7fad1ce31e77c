"""The noise of the DP step on an FSDP2 model (``DPOptimizer``, strategy ``"ghost-fsdp"``): each
parameter's noise drawn at its full shape on rank 0 of its mesh and scattered shard by shard, so
that the sharded step's noise is the single-process step's; correlated noise's recursion run on
each process's shards. Split from ``fsdp.py``, which computes the clipped sum.
"""

from __future__ import annotations

from typing import Any

import torch

from pergrad._src.backends import backend_of
from pergrad._src.dp.correlated import CorrelatedNoise
from pergrad._src.dp.noise import NoiseMechanism, add_independent_gaussian
from pergrad._src.errors import PergradValueError


def add_noise(
    summed: dict[str, torch.Tensor],
    std: float,
    generator: Any,
    noise: NoiseMechanism,
    state: Any,
) -> tuple[dict[str, Any], Any]:
    """``(summed plus the step's noise, in place; the mechanism's next state)``.

    ``summed``: each parameter's DTensor shard of the clipped sum, in the single-process
    order. Independent Gaussian noise: ``std * z`` drawn on rank 0 of the parameters' mesh
    from its ``generator`` (the other ranks' are not used), at each parameter's full shape in
    ``summed``'s order, and scattered shard by shard. Correlated noise: ``z`` drawn and
    scattered the same way, and the mechanism's recursion run on this process's shards;
    ``state`` (None at the first step) holds its buffers for these shards only. Collective;
    a step past the mechanism's run is refused on every process before the noise's scatter."""
    if isinstance(noise, CorrelatedNoise):
        return _add_correlated(summed, std, generator, noise, state)
    for name, shard in summed.items():

        def scaled_draw(full: torch.Tensor, name: str = name) -> torch.Tensor:
            return add_independent_gaussian({name: full}, std, generator, owned=True)[name]

        shard.to_local().add_(_scattered(name, shard, scaled_draw))
    return summed, state


def _add_correlated(
    summed: dict[str, Any], std: float, generator: Any, noise: CorrelatedNoise, state: Any
) -> tuple[dict[str, Any], Any]:
    shards = {name: shard.to_local() for name, shard in summed.items()}
    if state is None:
        state = noise.init(shards)
    names = list(summed)

    def draw(index: int, local: torch.Tensor) -> torch.Tensor:
        name = names[index]
        # (the draw is rank 0's, then scattered: the backend's draw, as add() would make it)
        bk = backend_of(local, "DPOptimizer", "noise")
        return _scattered(name, summed[name], lambda full: bk.standard_normal(generator, full))

    _, state = noise.add_draws(shards, draw, std, state, owned=True)
    return summed, state


def _scattered(name: str, shard: Any, fill: Any) -> torch.Tensor:
    """This process's shard (a local tensor shaped like ``shard``'s) of ``fill(zeros)``,
    computed on rank 0 of the mesh at the parameter's full shape and scattered."""
    from torch.distributed.tensor import distribute_tensor

    mesh, local = shard.device_mesh, shard.to_local()
    full = torch.zeros(shard.shape, dtype=shard.dtype, device=local.device)
    if mesh.get_local_rank() == 0:  # distribute_tensor scatters mesh rank 0's values
        full = fill(full)
    values = distribute_tensor(full, mesh, shard.placements).to_local()
    del full
    if values.shape != local.shape:
        raise PergradValueError(
            f"DPOptimizer: parameter {name!r}'s shard has shape {tuple(local.shape)} but "
            f"distribute_tensor gives its noise the shape {tuple(values.shape)}; this FSDP "
            f"layout is not supported yet."
        )
    return values
