"""The ``"loop"`` strategy: one example at a time, with the framework's plain autodiff."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pergrad._src.backends import (
    Backend,
)
from pergrad._src.core.call import Spec
from pergrad._src.errors import (
    PergradValueError,
)
from pergrad._src.strategies.protocol import Assessment, GradsRequest


def loop(
    spec: Spec,
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


def assess(request: GradsRequest, forced: bool, refused: dict[str, Assessment]) -> Assessment:
    """Takes every call: one example at a time needs nothing of the framework but a gradient."""
    return Assessment("loop", True, "requested" if forced else "one example at a time")


def run(request: GradsRequest, verdict: Assessment) -> Any:
    spec, bk = request.spec, request.call.backend
    args = (request.single, request.diff_values, request.batched_values)
    if verdict.fallback:
        # reached by a fallback: if one example fails on its own, the problem is in fn, and
        # its own error is the clearest
        loop(spec, bk, *args, 1, stacked=False)
    spec.last_strategy = "loop"
    return loop(spec, bk, *args, request.batch_size)
