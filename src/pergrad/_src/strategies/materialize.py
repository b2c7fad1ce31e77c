"""The ``"materialize"`` strategy of norms and clipped sums: :func:`pergrad.per_example_grads`,
then ``pergrad.norms.per_example_norms`` / ``pergrad.dp.clipped_sum`` on them (the entry points
in ``api/reductions.py`` reduce what :func:`run` returns)."""

from __future__ import annotations

from typing import Any

from pergrad._src.strategies.protocol import Assessment, ReduceRequest, StrategyChoice


def assess(request: ReduceRequest, forced: bool, _: dict[str, Assessment]) -> Assessment:
    if request.call.batch_size == 0:
        why = "empty batch"
    elif forced:
        why = "requested"
    else:
        return Assessment("materialize", False, "only on request")
    return Assessment(
        "materialize", True, why, StrategyChoice("materialize", why, request.chunk_size)
    )


def run(request: ReduceRequest, _: Assessment) -> Any:
    """The per-example gradients, which the entry point reduces with ``pergrad.norms`` /
    ``pergrad.dp.clipped_sum`` (its documented meaning: exactly those functions' results)."""
    return request.materialize()
