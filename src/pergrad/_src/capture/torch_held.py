"""Layers reduced to their formed per-example gradients during the backward pass, where those
are smaller than the layer's output gradients (the one-pass ghost mode's DP step).

The one-pass mode holds each hooked layer's inputs and output gradients from the backward pass
until every layer's norm is known, then forms the clipped sum from them
(``torch_quantities.weighted_sums``): ``B T (p + q)`` numbers held per dense layer, and, where
its norms took the formed route, the products of its weight gradient computed twice. Where a
layer's per-example gradients (``B`` times its parameter count: ``B p q`` for a dense layer) are
no more numbers than its output gradients (``B T q``: long sequences over narrow layers,
convolutions, norm layers), this module has the layer's rule form them (``per_example``) in the
tensor hook where its last output gradient arrives, takes the layer's squared norms from them
(certified: ``torch_norms.formed_squared_norms``) and drops its records there, so that its
inputs are autograd's alone again, freed once its backward node has run. The clipped sum adds
the held gradients with the clip weights (``torch_quantities.add_formed_sums``): ``B p q``
multiply-adds instead of the ``B T p q`` of a weight gradient. Each example's contribution is
the formed gradient its norm was taken from, so the clip bound holds of what is summed, however
forming it rounded.

For layers that share no parameter and whose every parameter is differentiated (a frozen
weight's gradient would be formed for nothing); on a layout's first run too, its row check then
comparing the dropped output gradients' row summaries, so that the first step's peak is the
later steps'. A layer whose rule fails here keeps its records and is reduced
after the pass as in the one-pass mode, which raises the error. A tied parameter (GPT-2's token
table and LM head) is held likewise, its uses' terms summed into one per-example gradient as
each use completes (``torch_held_tied.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pergrad._src.capture import torch_checks, torch_held_tied
from pergrad._src.capture.rules import layer_parameters, rule_for
from pergrad._src.capture.torch_engine import LayerRecord, layer_calls
from pergrad._src.capture.torch_plan import Ownership
from pergrad._src.capture.torch_session import CapturedPass, CompleteFn, when_complete


def arm(session: CapturedPass, computed: dict[str, dict[str, Any]], first_run: bool) -> None:
    """Arm the backward pass that follows: each candidate layer whose formed per-example
    gradients are no larger than its output gradients is reduced to them in its tensor hook
    (into ``session.held``, its norms into ``computed``) and its records dropped, and each tied
    parameter likewise as its uses complete (``torch_held_tied.arm``). On a
    layout's ``first_run`` each dropped output gradient leaves its row summary in
    ``session.summaries``, which the layout's row check then compares (as the low-memory
    mode's do); the held values are used only once the checks have passed."""
    owners = session.owners
    alone = {n: m for n, m in candidate_layers(owners).items() if n not in owners.sharing}
    summaries = session.summaries if first_run else None
    when_complete(alone, session.records, _held_if_smaller(session, computed, summaries))
    torch_held_tied.arm(session, computed, summaries)


def disarm(session: CapturedPass) -> None:
    """After the backward pass: the records' watches let go (a layer left to the one-pass mode
    keeps its watch, which refers to its record: a cycle the collector would have to break)."""
    for layer_records in session.records.values():
        for record in layer_records:
            record.watch = None


def candidate_layers(owners: Ownership) -> dict[str, nn.Module]:
    """The layers a DP step may hold as their formed per-example gradients (also the route
    choice's question, ``cost.route_costs``): those that share no parameter and whose every
    parameter is differentiated, and the uses of each tied parameter that every layer using
    it holds as its only parameter (``torch_held_tied.holdable_ties``: held together, as one
    per-example gradient)."""
    tied = {layer for uses in torch_held_tied.holdable_ties(owners).values() for layer in uses}
    return {
        name: module
        for name, module in owners.modules.items()
        if name in tied
        or (name not in owners.sharing and _all_differentiated(owners, name, module))
    }


def _all_differentiated(owners: Ownership, module_name: str, module: nn.Module) -> bool:
    params = layer_parameters(module)
    return bool(params) and all(
        owners.name_in_params(module_name, name) is not None for name, _ in params
    )


def formed_numbers(module: nn.Module, batch_size: int) -> int:
    """How many numbers the layer's formed per-example gradients take: ``B`` times its
    parameter count."""
    return batch_size * sum(p.numel() for _, p in layer_parameters(module))


def _held_if_smaller(
    session: CapturedPass,
    computed: dict[str, dict[str, Any]],
    summaries: dict[int, torch_checks.RowSummary] | None,
) -> CompleteFn:
    def complete(module_name: str, module: nn.Module, layer_records: list[LayerRecord]) -> bool:
        calls = layer_calls(module_name, layer_records)
        if not calls:
            return False
        held = sum(c.output_grad.numel() for c in calls)  # (calls: those with a gradient)
        if formed_numbers(module, session.batch_size) > held:
            return False
        grads = rule_for(module).per_example(module, calls)
        norms = {attr: torch_held_tied.held_squared_norms(g) for attr, g in grads.items()}
        named = dict(session.owners.named(module_name, grads))
        # all at once, nothing before: a failure above leaves the layer to the one-pass mode
        computed[module_name] = norms
        session.held.update({name: g.detach() for name, g in named.items()})
        torch_held_tied.drop_records(layer_records, summaries)
        return True

    return complete
