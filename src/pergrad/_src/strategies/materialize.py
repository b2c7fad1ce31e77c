"""The ``"materialize"`` strategy of norms and clipped sums: :func:`pergrad.per_example_grads`,
then ``pergrad.norms.per_example_norms`` / ``pergrad.dp.clipped_sum`` on them (the entry points
in ``api/reductions.py`` reduce what :func:`run` returns). "auto" takes it for a PyTorch
``module_loss`` where the cost model finds it cheaper than the ghost norms (small models with
many examples per parameter: ``capture/cost.route_costs``)."""

from __future__ import annotations

from typing import Any

from pergrad._src.strategies.protocol import Assessment, ReduceRequest, StrategyChoice


def assess(request: ReduceRequest, forced: bool, refused: dict[str, Assessment]) -> Assessment:
    """Taken on request, for an empty batch, and under "auto" where the ghost strategy
    refused because materialising is cheaper (its refusal carries this choice and why:
    ``ghost_torch.assess``, the cost model of ``capture/cost.route_costs``)."""
    ghost = refused.get("ghost")
    if ghost is not None and ghost.choice is not None and ghost.choice.strategy == "materialize":
        return Assessment("materialize", True, ghost.why, ghost.choice)
    if request.call.batch_size == 0:
        why = "empty batch"
    elif forced:
        why = "requested"
    else:
        return Assessment("materialize", False, "only on request, or where cheaper")
    return Assessment(
        "materialize", True, why, StrategyChoice("materialize", why, request.chunk_size)
    )


def run(request: ReduceRequest, _: Assessment) -> Any:
    """The per-example gradients, which the entry point reduces with ``pergrad.norms`` /
    ``pergrad.dp.clipped_sum`` (its documented meaning: exactly those functions' results)."""
    return request.materialize()
