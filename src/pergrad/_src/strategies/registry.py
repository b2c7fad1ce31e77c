"""The strategy registry: every way pergrad computes something per example, in one table, and
the one place where ``strategy="auto"`` picks among them and falls back.

Two tasks share the table (:data:`ORDER` lists each task's strategies in the order "auto"
considers them):

- ``"grads"``, per-example gradients (:func:`pergrad.per_example_grads`): ``hooks`` (a PyTorch
  ``module_loss`` whose every parameter is in a layer with a rule: one plain pass of the batch,
  faster than vmap once its layout is checked), ``vmap``, ``loop``.
- ``"reduce"``, per-example squared norms and weighted sums without keeping the gradients
  (:func:`pergrad.norms.per_example_norms_of`, :func:`pergrad.dp.clipped_sum_of`,
  ``DPOptimizer``): ``ghost``, ``materialize`` (taken by "auto" for an empty batch, and where
  the ghost strategy refuses because the cost model finds materialising cheaper: a small
  PyTorch model with many examples per parameter, ``capture/cost.route_costs``), ``chunked``.

Each :class:`Strategy` answers two questions:

- ``assess(request, forced, refused)``: can it take this call, judged before running anything
  (the ghost strategy's cost model may run the model on one example, without gradients, to
  learn its layer shapes: ``capture/torch_probe.py``)?
  An :class:`Assessment` that accepts with a reason and details (the layers a ghost plan covers,
  the chunk size), or refuses with why not. ``forced`` is True when the user named the strategy
  (it may then accept a call it would not pick on cost); ``refused`` holds the refusals of the
  strategies before it (the chunked strategy's reason under "auto" is why ghost refused).
- ``run(request, assessment)``: compute; raise :class:`Unsupported` on finding, only while
  running, that it cannot take the call (``vmap`` meets an operator without a batching rule, a
  layer fails the capture's layout checks).

:func:`select` (runs nothing: ``choose_strategy``) and :func:`execute` hold the discipline, the
same for every strategy and task:

- "auto": a refusal moves on silently (the assessment records why); an :class:`Unsupported`
  moves on with a :class:`pergrad.FallbackWarning` that says what failed and what was taken,
  unless every strategy that failed is only tried ahead of the one that worked for speed
  (``Strategy.ahead``: the hooks, ahead of vmap): then nothing was lost, and the fallback is
  recorded in ``last_strategy``'s reason without a warning.
- A named strategy that refuses or fails raises a ``ValueError`` that names it, says why and
  what to pass instead; it never falls back.
- A ``"grads"`` fallback is remembered (``spec.resolved``): later calls of the same function
  start from the strategy that worked.

Framework-specific strategies import their framework only when assessed for a call that can be
theirs: a ``module_loss`` (which cannot exist without torch) or a JAX backend.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pergrad._src.errors import PergradValueError, Unsupported, warn_from_caller
from pergrad._src.strategies import chunked, loop, materialize, vmap
from pergrad._src.strategies.protocol import (
    Assessment,
    GradsRequest,
    LeafReduction,
    ReduceRequest,
    Reduction,
    StrategyChoice,
)


@dataclass(frozen=True)
class Strategy:
    """One way of computing per-example quantities (see the module docstring).

    Attributes:
      name: what users pass as ``strategy=``.
      task: ``"grads"`` or ``"reduce"``.
      assess: ``(request, forced, refused) -> Assessment``; runs nothing.
      run: ``(request, assessment) -> result``; may raise :class:`Unsupported`.
      instead: what to pass when it is named and cannot take a call (for the error).
      fallback_note: what the user gets when "auto" falls back to it (for the warning).
      failure: how its failure or refusal reads in a fallback warning, ``{why}`` filled in.
      fallback: whether "auto" tries it after a strategy before it in :data:`ORDER` failed
        while running (``materialize`` is chosen before running, by the cost model, or not).
      ahead: "auto" tries it ahead of the next strategy of :data:`ORDER` for speed only: its
        failure at run time, followed by the next one's success, is no fallback to warn of.
    """

    name: str
    task: str
    assess: Callable[[Any, bool, dict[str, Assessment]], Assessment]
    run: Callable[[Any, Assessment], Any]
    instead: str
    fallback_note: str
    failure: str
    fallback: bool = True
    ahead: bool = False


def select(task: str, request: Any, requested: str) -> tuple[Assessment, list[Assessment]]:
    """``(the assessment of the strategy a call will run, the refusals before it)``.

    "auto": the first strategy of :data:`ORDER` that accepts. A named strategy: its own
    assessment, or a ``ValueError`` when it refuses."""
    func_name = request.spec.func_name
    if requested != "auto":
        strategy = _BY_NAME[task][requested]
        verdict = strategy.assess(request, True, {})
        if not verdict.accepted:
            raise PergradValueError(
                f"{func_name}: strategy={requested!r} cannot handle this call: {verdict.why}. "
                f"{strategy.instead}"
            )
        return verdict, []
    refused: dict[str, Assessment] = {}
    for name in _start(task, request):
        verdict = _BY_NAME[task][name].assess(request, False, refused)
        if verdict.accepted:
            return verdict, list(refused.values())
        refused[name] = verdict
    raise AssertionError(
        f"the last {task} strategy of ORDER accepts every call"
    )  # pragma: no cover


def assess_named(task: str, request: Any, name: str) -> Assessment:
    """Strategy ``name``'s assessment of a call it was asked for by name (``forced``), without
    raising when it refuses: for callers that explain a refusal in their own terms."""
    return _BY_NAME[task][name].assess(request, True, {})


def execute(
    task: str, request: Any, requested: str, chosen: Assessment | None = None
) -> tuple[Any, str]:
    """``(result, the strategy that produced it)``: run the chosen strategy (``select``'s,
    unless given); under "auto", on :class:`Unsupported`, the next strategies of
    :data:`ORDER` that accept, with a :class:`pergrad.FallbackWarning` naming what failed."""
    refused: list[Assessment] = []
    if chosen is None:
        chosen, refused = select(task, request, requested)
    strategy = _BY_NAME[task][chosen.strategy]
    if task == "reduce" and chosen.strategy != "materialize" and request.call.batch_size == 0:
        # An empty Poisson batch is ordinary input; no strategy has anything to capture.
        return empty_reduction(request), chosen.strategy
    try:
        out = strategy.run(request, chosen)
    except Unsupported as err:
        if requested != "auto":
            raise PergradValueError(
                f"{request.spec.func_name}: strategy={requested!r} cannot handle this call: "
                f"{err}. {strategy.instead}"
            ) from err
        # (then why a strategy tried ahead for speed refused the call: the hooks on a layer
        # they cannot cover, or on a function that is not a module_loss itself)
        failures = [strategy.failure.format(why=err)] + [
            _BY_NAME[task][r.strategy].failure.format(why=r.why)
            for r in refused
            if _BY_NAME[task][r.strategy].ahead
        ]
        quiet = strategy.ahead
    else:
        spec = request.spec
        if task == "grads":
            settled = requested == "auto" and spec.resolved == chosen.strategy
            spec.last_reason = spec.resolved_reason if settled else chosen.why
        return out, chosen.strategy
    order = list(ORDER[task])
    for name in order[order.index(strategy.name) + 1 :]:
        candidate = _BY_NAME[task][name]
        if not candidate.fallback:
            continue
        verdict = candidate.assess(request, False, {})
        if not verdict.accepted:
            failures.append(candidate.failure.format(why=verdict.why))
            quiet = quiet and candidate.ahead
            continue
        try:
            out = candidate.run(request, _fallen_back(verdict, failures))
        except Unsupported as err:
            failures.append(candidate.failure.format(why=err))
            quiet = quiet and candidate.ahead
            continue
        if not quiet:
            warn_from_caller(
                f"{request.spec.func_name}: {'; '.join(failures)}. Took strategy {name!r} "
                f"instead: {candidate.fallback_note}"
            )
        if task == "grads":
            spec = request.spec
            spec.resolved, spec.last_reason = name, "; ".join(failures)
            spec.resolved_reason = "an earlier call of this function fell back to it: " + (
                spec.last_reason
            )
        return out, name
    raise AssertionError(f"the last {task} strategy of ORDER runs every call")  # pragma: no cover


def empty_reduction(request: ReduceRequest) -> Reduction:
    """A ``"reduce"`` strategy's answer for a batch of no examples: ``(0,)`` squared norms and
    zero sums, in the dtype and on the device the strategy's would have. The shapes come from
    :func:`pergrad.per_example_grads` of the empty batch (one example of zeros, run to learn
    them, then sliced away), so the answer is exactly the materialised one."""
    call = request.call
    bk = call.backend
    grads = bk.flatten(request.materialize())[1]
    squared = [(g.reshape(0, math.prod(bk.shape(g)[1:])) ** 2).sum(1) for g in grads]
    if request.weights_from is None:
        return Reduction(squared, None)
    request.weights_from(squared)  # the clip weights of no examples: validates as on any batch
    return Reduction(squared, [g.sum(0) for g in grads])


def _fallen_back(verdict: Assessment, failures: list[str]) -> Assessment:
    """The assessment a strategy runs with when "auto" reached it after failures."""
    return dataclasses.replace(verdict, why="; ".join(failures), fallback=True)


def _start(task: str, request: Any) -> list[str]:
    """The order "auto" tries, from the strategy an earlier call of this function settled on."""
    order = list(ORDER[task])
    resolved = request.spec.resolved if task == "grads" else None
    return order[order.index(resolved) :] if resolved in order else order


def _is_module_loss(fn: Any) -> bool:
    """Whether ``fn`` is a :func:`pergrad.module_loss` loss. Never imports torch: a
    ``ModuleLoss`` cannot exist unless its module has been imported."""
    torch_module = sys.modules.get("pergrad._src.core.module_loss")
    return torch_module is not None and isinstance(fn, torch_module.ModuleLoss)


# --- per-example gradients ------------------------------------------------------------------


def _assess_hooks(request: GradsRequest, forced: bool, _: dict[str, Assessment]) -> Assessment:
    if not _is_module_loss(request.spec.fn):
        return Assessment(
            "hooks",
            False,
            f"layer hooks take fn only when it is a pergrad.module_loss(model, loss_fn) loss "
            f"itself; this fn is a {type(request.spec.fn).__name__} on "
            f"{request.call.backend.name} (a function of its own, or a module_loss called from "
            f"inside another function)",
        )
    from pergrad._src.strategies import hooks_torch

    return hooks_torch.assess(request, forced)


def _run_hooks(request: GradsRequest, verdict: Assessment) -> Any:
    from pergrad._src.strategies import hooks_torch

    return hooks_torch.run(request, verdict)


# --- per-example norms and weighted sums ------------------------------------------------------


def _assess_ghost(request: ReduceRequest, forced: bool, _: dict[str, Assessment]) -> Assessment:
    if request.call.batch_size == 0 and not forced:  # nothing to capture: materialize's
        return Assessment(
            "ghost", False, "empty batch", StrategyChoice("materialize", "empty batch")
        )
    if request.call.backend.name == "jax":
        from pergrad._src.strategies import ghost_jax

        return ghost_jax.assess(request, forced)
    if not _is_module_loss(request.fn):
        return Assessment(
            "ghost",
            False,
            f"the ghost strategy needs a PyTorch pergrad.module_loss; fn is a "
            f"{type(request.fn).__name__} on {request.call.backend.name}",
            StrategyChoice("ghost", ""),
        )
    from pergrad._src.strategies import ghost_torch

    return ghost_torch.assess(request, forced)


def _run_ghost(request: ReduceRequest, verdict: Assessment) -> Reduction:
    choice = verdict.choice
    assert choice is not None
    if request.call.backend.name == "jax":
        from pergrad._src.strategies import ghost_jax

        return ghost_jax.ghost(
            request.spec, request.call, choice.plan, request.weights_from, request.users
        )
    from pergrad._src.strategies import ghost_torch

    return ghost_torch.ghost(
        request.spec,
        request.call,
        request.fn,
        choice.layers,
        request.weights_from,
        users=request.users,
    )


def _assess_ghost_lowmem(
    request: ReduceRequest, forced: bool, _: dict[str, Assessment]
) -> Assessment:
    name = "ghost-lowmem"
    if request.call.backend.name == "jax" or not _is_module_loss(request.fn):
        why = (
            "it is for PyTorch models (under jax.jit, XLA already schedules the ghost "
            "strategy's memory: use 'ghost')"
            if request.call.backend.name == "jax"
            else f"it needs a PyTorch pergrad.module_loss; fn is a {type(request.fn).__name__}"
        )
        return Assessment(name, False, why, StrategyChoice(name, why))
    from pergrad._src.strategies import ghost_torch

    return ghost_torch.assess(request, forced, name)


def _run_ghost_lowmem(request: ReduceRequest, verdict: Assessment) -> Reduction:
    choice = verdict.choice
    assert choice is not None
    from pergrad._src.strategies import ghost_torch

    return ghost_torch.ghost(
        request.spec, request.call, request.fn, choice.layers, request.weights_from, low_memory=True
    )


def layerwise(request: ReduceRequest, reduction: str, args: tuple[Any, ...]) -> list[Any]:
    """Plug-in reduction ``reduction`` of each differentiated leaf over one captured pass
    (:class:`LeafReduction` per leaf, in the core's flat order): the capture engine of the
    call's framework runs once, and each layer (PyTorch) or contraction (JAX) whose rule has
    the plug-in reduces its records; the other leaves come back as per-example gradients.
    Where the engine cannot take the call (a PyTorch loss not made by ``module_loss``, a layer
    it cannot capture), every leaf comes back as per-example gradients, with a
    :class:`pergrad.FallbackWarning` saying why."""
    call = request.call
    try:
        if call.backend.name == "jax":
            from pergrad._src.capture.jax_engine import plan
            from pergrad._src.strategies import ghost_jax

            return ghost_jax.layerwise(call, plan(request.spec, call), reduction, args)
        verdict = _assess_ghost(request, False, {})
        if (
            verdict.choice is not None
            and not verdict.choice.unsupported
            and _is_module_loss(request.fn)
        ):
            from pergrad._src.strategies import ghost_torch

            return ghost_torch.layerwise(
                request.spec, call, request.fn, verdict.choice.layers, reduction, args
            )
        why = verdict.why
    except Unsupported as err:
        why = str(err)
    warn_from_caller(
        f"{request.spec.func_name}: the capture engine cannot take this call ({why}); every "
        f"leaf comes back as per-example gradients, for the caller to reduce."
    )
    grads = request.materialize()
    return [LeafReduction(g, False) for g in call.backend.flatten(grads)[1]]


STRATEGIES: tuple[Strategy, ...] = (
    Strategy(
        "hooks",
        "grads",
        _assess_hooks,
        _run_hooks,
        "Use strategy='auto' (which takes vmap or a loop by itself) or 'loop'.",
        "per-example gradients from layer hooks over one forward and backward pass of the "
        "batch, checked against the batch gradient. Later calls of this function use it "
        "directly.",
        "layer hooks cannot take this call ({why})",
        ahead=True,
    ),
    Strategy(
        "vmap",
        "grads",
        vmap.assess,
        vmap.run,
        "Use strategy='auto', which takes layer hooks or a loop where vmap fails.",
        "the framework's vmap.",
        "{why}",
    ),
    Strategy(
        "loop",
        "grads",
        loop.assess,
        loop.run,
        "",
        "one example at a time: the same result, but slower. Later calls of this function "
        "use the loop directly.",
        "the loop failed ({why})",
    ),
    Strategy(
        "materialize",
        "reduce",
        materialize.assess,
        materialize.run,
        "Use strategy='auto'.",
        "per-example gradients, then reduced.",
        "materialising failed ({why})",
        fallback=False,
    ),
    Strategy(
        "ghost",
        "reduce",
        _assess_ghost,
        _run_ghost,
        "Use strategy='chunked', or 'auto', which falls back to it by itself.",
        "ghost norms.",
        "the ghost strategy cannot handle this call ({why})",
    ),
    Strategy(
        "ghost-lowmem",
        "reduce",
        _assess_ghost_lowmem,
        _run_ghost_lowmem,
        "Use strategy='ghost' (one backward pass, more memory), or 'chunked'.",
        "ghost norms computed during the backward pass, records released, then a second "
        "backward pass for the clipped sum.",
        "the low-memory ghost strategy cannot handle this call ({why})",
    ),
    Strategy(
        "chunked",
        "reduce",
        chunked.assess,
        chunked.run,
        "",
        "the same result, with more time and memory.",
        "the chunked strategy failed ({why})",
    ),
)

ORDER: dict[str, tuple[str, ...]] = {
    "grads": ("hooks", "vmap", "loop"),
    "reduce": ("ghost", "materialize", "chunked"),
}

_BY_NAME: dict[str, dict[str, Strategy]] = {
    task: {s.name: s for s in STRATEGIES if s.task == task} for task in ORDER
}
