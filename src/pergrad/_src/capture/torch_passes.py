"""The backward passes over a captured forward pass, in the order the checks need them.

:func:`capture` runs the model once over the batch (``torch_session.forward``) and one backward
pass of the summed losses, which fills each hooked layer's output gradients (examples do not
mix, so row ``b`` of the gradient of the sum is the gradient of loss ``b``). That pass
differentiates only what reaches each layer's output (``CapturedPass.light``), so the weight
gradients are never computed; the first run of a layout differentiates every parameter
instead, its batch gradient streamed (``torch_verify.batch_gradient``), and verifies the layout
(``torch_verify.py``) before any rule reads the records. Then the per-example gradients of the
generic units and tables are formed, and the norms reduced (``torch_quantities.py``).

The low-memory mode: each layer that shares no parameter has its norms computed in the tensor
hook of its last call and its output gradients dropped there (``torch_session.when_complete``);
with ``retain``, the graph is kept, and :func:`second_pass` runs the same backward pass again
for the weighted sums, each layer's in its hook, from output gradients checked (per row,
against summaries of the first pass's) to be the ones its norms came from.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pergrad._src.capture import (
    cost,
    torch_checks,
    torch_compiled,
    torch_held,
    torch_quantities,
    torch_verify,
)
from pergrad._src.capture.torch_engine import LayerRecord, layer_calls
from pergrad._src.capture.torch_session import (
    CapturedPass,
    CompleteFn,
    forward,
    reentrant_refused,
    when_complete,
)
from pergrad._src.core.call import Call, Spec
from pergrad._src.core.module_loss import ModuleLoss
from pergrad._src.errors import Unsupported


@torch_compiled.eager_until_checked
def capture(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    *,
    norms: bool = True,
    low_memory: bool = False,
    retain: bool = False,
    hold: bool = False,
) -> CapturedPass:
    """The model once over the batch with every layer of ``layers`` hooked, the first run of a
    layout verified; with ``norms`` (always on a first run, whose check needs them) each
    leaf's per-example squared norms (``CapturedPass.squared``).

    ``low_memory``: each layer that shares no parameter has its norms computed as soon as the
    backward pass has given all its output gradients, which it then drops
    (``torch_session.when_complete``); the first run's row check compares row summaries
    (``torch_checks.RowSummary``) for them. ``retain``: keep the graph for the second backward
    pass of :func:`second_pass`, whose first run checks its rows through that graph; otherwise
    a first run's row check runs the batch once before, weighted
    (``torch_verify.weighted_run``), so that no backward pass retains its graph. ``hold`` (a
    clipped sum follows, from the records): each layer whose per-example gradients are smaller
    than its output gradients is reduced to them in its tensor hook, its records dropped
    (``torch_held.py``; a first run's row check compares their summaries)."""
    # (a compiled model's whole-graph capture: later runs of a checked layout, one pass)
    session = forward(spec, call, loss, layers, compiled=not (low_memory or retain))
    key = torch_checks.layout_key(
        session.params, [x for xs in call.leaves[1:] for x in xs], call.batch_size
    )
    signature = session.signature  # (read by forward where it ran on the model's own parameters)
    if signature is None:
        signature = torch_checks.records_signature(session.captured(), call.batch_size)
    checked = torch_checks.is_checked(loss, "ghost", key, signature)
    weighted = None
    if not (checked or retain) and call.batch_size > 1:  # (one example: every row is its own)
        weighted = torch_verify.weighted_run(session)
        del session  # the plain pass from the same random-number state: the same dropout masks
        call.backend.set_rng_state(weighted.rng)
        session = forward(spec, call, loss, layers)
    computed: dict[str, dict[str, torch.Tensor]] = {}  # low memory: norms computed in hooks
    if low_memory:
        owners = session.owners
        unshared = {n: m for n, m in owners.modules.items() if n not in owners.sharing}
        when_complete(unshared, session.records, _norms_in_hook(computed, session.summaries))
    held = not low_memory and hold and cost.FAST_NORMS and cost.HOLD_FORMED
    if held:
        torch_held.arm(session, computed, first_run=not checked)
    # The first run of a layout differentiates every parameter, to check the norms against
    # the batch gradient; later ones only what reaches each layer's output, so the weight
    # gradients (a third of a training step's work) are never computed. (The low-memory
    # mode's first run leaves that to its second pass: the graph is freed along it.)
    batch = _first_backward(session, every_leaf=not (checked or retain), retain=retain)
    if held:
        torch_held.disarm(session)
    # an overflowed pass (a skipped mixed-precision step) is checked on a later one
    checking = not checked and torch_checks.records_finite(session.captured(), session.summaries)
    if checking and weighted is not None:
        # before any rule reads the records: a wrong layout can crash one
        torch_verify.check_rows_against_weighted(spec, call, session, weighted)
    measure = norms or not checked
    if retain:
        _reduce_before_layout_check(spec, call, session, computed, measure, checking)
        session.pending_key = (key, signature) if checking else None
    else:
        _reduce_records(session, computed, measure)
        if checking:
            assert batch is not None
            torch_verify.check_batch_gradient(session, batch.squared_norms, batch.kept)
            torch_checks.mark_checked(loss, "ghost", key, signature)
    session.release(keep_graph=retain)
    return session


def _first_backward(
    session: CapturedPass, every_leaf: bool, retain: bool
) -> torch_verify.BatchGradient | None:
    """The backward pass of the summed losses that fills the records: into every leaf
    (``every_leaf``, a first run: the batch gradient its checks need, streamed), or only into
    the light targets (``retain``: keep the graph for a second pass)."""
    losses = session.losses
    assert losses is not None
    with reentrant_refused(), torch.enable_grad():
        if every_leaf:  # the first run's checks: streamed, never all held at once
            keep = torch_verify.formed_positions(session)
            return torch_verify.batch_gradient(losses.sum(), session.diff, keep, retain=False)
        torch.autograd.grad(losses.sum(), session.light, allow_unused=True, retain_graph=retain)
    return None


def _reduce_records(
    session: CapturedPass, computed: dict[str, dict[str, torch.Tensor]], measure: bool
) -> None:
    """The per-example gradients of the units and tables; with ``measure``, every norm
    (``computed``: the layers' already reduced in their hooks)."""
    session.unit_grads = torch_quantities.formed_gradients(session)
    if measure:
        session.squared = torch_quantities.squared_norms(session, computed)


def _reduce_before_layout_check(
    spec: Spec,
    call: Call,
    session: CapturedPass,
    computed: dict[str, dict[str, torch.Tensor]],
    measure: bool,
    checking: bool,
) -> None:
    """The low-memory mode's end of the first pass, the graph retained: the records reduced,
    their output gradients summarised and dropped, then (``checking``) the layout verified.
    Rules read the records before the row check here (which then compares summaries): an error
    of a rule is raised after the check, which explains a wrong layout, and the values are used
    only once the check has passed."""
    try:
        _reduce_records(session, computed, measure)
        failure = None
    except Exception as err:  # noqa: BLE001
        failure = err
    session.summarize_and_drop_gradients()
    if checking:
        torch_verify.check_layout(spec, call, session, retain=True)
    if failure is not None:
        raise failure


def _norms_in_hook(
    computed: dict[str, dict[str, torch.Tensor]], summaries: dict[int, torch_checks.RowSummary]
) -> CompleteFn:
    """The first pass's ``complete``: the layer's squared norms (into ``computed``) and its
    records' row summaries (into ``summaries``)."""

    def complete(module_name: str, module: nn.Module, layer_records: list[LayerRecord]) -> bool:
        calls = layer_calls(module_name, layer_records)
        computed[module_name] = torch_quantities.layer_squared_norms(module, calls)
        for r in layer_records:
            if r.output_grad is not None:
                summaries[id(r)] = torch_checks.summarize_rows(r.output_grad)
        return True

    return complete


def second_pass(
    loss: ModuleLoss,
    session: CapturedPass,
    groups: torch_quantities.WeightGroups,
    clean: torch_quantities.CleanFn | None,
) -> list[torch.Tensor]:
    """The low-memory mode's weighted sums: the first pass's backward pass again, through its
    retained graph, and, in each layer's tensor hook, the layer's weighted sum from its inputs
    and these output gradients (as the one-pass mode computes it), after which they are
    dropped.

    The second pass gives the same output gradients as the first (the same graph, the same
    kernels), so each example's contribution is built from the gradient its norm was computed
    from, and the clip bound holds exactly, under ``torch.autocast`` too (where a backward pass
    of clip-weighted losses would round each example's gradient differently). This is checked:
    each record's row summaries must match the first pass's (within float32 rounding, for
    non-deterministic kernels), else :class:`Unsupported`. On a first run the pass also
    gives the batch gradient of every parameter, for the checks the one-pass mode makes there.
    ``clean``: as for ``torch_quantities.weighted_sums``.
    """
    losses, summaries = session.losses, session.summaries
    assert losses is not None
    sums: list[Any] = [None] * len(session.diff)
    mismatch: list[str] = []
    seen: set[int] = set()
    complete = _sums_in_hook(session, groups, clean, sums, seen, mismatch)
    for slot in (r for rs in session.records.values() for r in rs):
        slot.watch = None
    when_complete(session.owners.modules, session.records, complete, lambda r: id(r) in summaries)
    targets = session.diff if session.pending_key is not None else session.light
    with torch.enable_grad():
        batch_grads = torch.autograd.grad(losses.sum(), targets, allow_unused=True)
    del losses
    session.release_graph()  # the graph is freed
    for module_name, module in session.owners.modules.items():  # layers not completed in a hook
        layer_records = session.records[module_name]
        if any(r.output_grad is not None for r in layer_records):
            with torch.no_grad():
                complete(module_name, module, layer_records)
    missing = [
        name
        for name, rs in session.records.items()
        if any(id(r) in summaries and id(r) not in seen for r in rs)
    ]
    if missing:  # a forward pass rerun inside the backward pass, with no hooks of pergrad's
        raise Unsupported(
            f"the second backward pass did not reach layer {missing[0]!r}'s recorded output "
            f"(a forward pass rerun inside the backward pass): use strategy='ghost'"
        )
    if mismatch:
        raise Unsupported(
            f"the second backward pass gave layer {mismatch[0]!r} other output gradients than "
            f"the first (non-deterministic kernels): the low-memory mode cannot build the "
            f"clipped sum from the gradients its norms came from. Call "
            f"torch.use_deterministic_algorithms(True), or use strategy='ghost'"
        )
    torch_quantities.add_formed_sums(session, groups, sums)
    if session.pending_key is not None:
        torch_verify.check_batch_gradients(session, batch_grads)
        torch_checks.mark_checked(loss, "ghost", *session.pending_key)
    return torch_quantities.zeros_where_unreached(sums, session.diff)


def _sums_in_hook(
    session: CapturedPass,
    groups: torch_quantities.WeightGroups,
    clean: torch_quantities.CleanFn | None,
    sums: list[Any],
    seen: set[int],
    mismatch: list[str],
) -> CompleteFn:
    """The second pass's ``complete``: unless a record's output gradient differs from the
    first pass's (its layer then goes into ``mismatch``, and nothing is summed from it), the
    layer's weighted sums into ``sums``; ``seen``: the records the pass reached."""

    def complete(module_name: str, module: nn.Module, layer_records: list[LayerRecord]) -> bool:
        for r in layer_records:
            if r.output_grad is None:
                continue
            seen.add(id(r))
            first = session.summaries.get(id(r))
            if first is None or not torch_checks.same_rows(first, r.output_grad):
                mismatch.append(module_name)
                return True  # nothing is summed from it: the pass fails below
        calls = layer_calls(module_name, layer_records)
        torch_quantities.add_layer_sums(session, module_name, module, calls, groups, clean, sums)
        for r in layer_records:  # its sums are done: the inputs are autograd's alone now
            r.inputs, r.input_versions = (), ()
        return True

    return complete
