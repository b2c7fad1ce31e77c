"""Tied parameters held as their formed per-example gradients during the backward pass (the
one-pass ghost mode's DP step), as ``torch_held.py`` holds the layers that share none.

A parameter several layers use (GPT-2's token table ``wte``, reused as its LM head) has the
per-example gradient ``g = g_1 + ... + g_k``, one term per use. The one-pass mode holds every
use's records to the end of the backward pass and takes ``|g|^2`` from them through the cross
terms of ``torch_tied.py`` (in float64); an LM head's records are ``B T V`` output gradients.
Where the formed per-example gradient of the parameter (``B V D`` for GPT-2's table) is no more
numbers than the output gradients of the first use whose calls all have theirs (an LM head's,
the first of the backward pass), this module, in that use's tensor hook, has its rule form its
term (``per_example``), keeps it as the parameter's held per-example gradient
(``session.held``) and drops the use's records; each later use's term is added into it in the
use's own hook (a lookup table's rows scattered in place, ``rules.LayerRule.lookups``: no second
``B V D`` tensor), and its records dropped. Once every use the pass reaches is in, the squared
norms are those of the formed sum itself, certified (``torch_norms.formed_squared_norms``, as
for a held layer), and the clipped sum adds it with the clip weights
(``torch_quantities.add_formed_sums``).

Each example's contribution is then exactly the sum its norm was taken from, so the clip bound
holds of what is summed however the terms cancel: where ``g_1 ~ -g_2`` the rounded sum
``fl(g_1 + g_2)`` may be far from the exact ``g`` relative to its size, but its norm is a sum of
squares of its own numbers (no cancellation in it), bounded as any held layer's, and those very
numbers are what the clipped sum scales. The cross terms' float64 is not needed here.

For a tied parameter that every layer using it holds as its only parameter (a frozen bias
beside it, or a second parameter, keeps the cross terms); on a layout's first run too, its row
check then comparing the dropped output gradients' row summaries. Where the formed gradient
would take more numbers than the first use to complete has output gradients (the JAX step,
``strategies/ghost_jax._held``, compares with every use's, all known there at once; here the
later uses' have not arrived when the first decides, so the test is at most stricter), or its
rule fails there, the tie keeps every record and takes the cross terms as before. A use that
does not complete in its hook (a call off the loss's path, its rule failing there after an
earlier use was held) keeps its records, and :func:`finish` adds its term after the pass and
its checks (raising the rule's error, as the one-pass mode would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import cost, torch_checks, torch_norms
from pergrad._src.capture.quantities import Lookups
from pergrad._src.capture.rules import in_reduction_precision, layer_parameters, rule_for
from pergrad._src.capture.torch_engine import LayerRecord, layer_calls
from pergrad._src.capture.torch_layers import LayerCall
from pergrad._src.capture.torch_plan import Ownership
from pergrad._src.capture.torch_session import CapturedPass, CompleteFn, when_complete


def holdable_ties(owners: Ownership) -> dict[str, dict[str, str]]:
    """Name in ``params`` -> ``{layer name: attribute}`` of its uses, for each tied parameter
    that every layer using it holds as its only parameter (the held sum is then the whole of
    each use's gradient: no other parameter of the layer needs its records). None while
    ``cost.HOLD_TIED`` is off (a benchmark's baseline)."""
    if not cost.HOLD_TIED:
        return {}
    ties = {}
    for name, uses in owners.tied.items():
        if all(layer in owners.modules and _holds_only(owners, layer, name) for layer, _ in uses):
            ties[name] = dict(uses)
    return ties


def _holds_only(owners: Ownership, layer: str, name: str) -> bool:
    params = layer_parameters(owners.modules[layer])
    return bool(params) and all(owners.name_in_params(layer, p) == name for p, _ in params)


@dataclass
class _Tie:
    """One tied parameter's state in one backward pass: the uses the pass reaches
    (``expected``), those whose term is in the held sum (``added``), and whether the tie keeps
    its records (``declined``)."""

    name: str
    uses: dict[str, str]
    expected: set[str]
    added: set[str] = field(default_factory=set)
    declined: bool = False


def arm(
    session: CapturedPass,
    computed: dict[str, dict[str, Any]],
    summaries: dict[int, torch_checks.RowSummary] | None,
) -> None:
    """Arm the backward pass that follows for every :func:`holdable_ties` parameter: each use's
    term formed (or added) in its tensor hook, its records dropped (their output gradients'
    row summaries into ``summaries`` on a layout's first run, else None), the held sum in
    ``session.held`` and, once every use the pass reaches is in, its squared norms in
    ``computed`` under the last use's name."""
    owners = session.owners
    for name, uses in holdable_ties(owners).items():
        expected = {layer for layer in uses if any(r.hooked for r in session.records[layer])}
        if not expected:
            continue
        tie = _Tie(name, uses, expected)
        modules = {layer: owners.modules[layer] for layer in sorted(expected)}
        when_complete(modules, session.records, _held_term(session, computed, summaries, tie))


def _held_term(
    session: CapturedPass,
    computed: dict[str, dict[str, Any]],
    summaries: dict[int, torch_checks.RowSummary] | None,
    tie: _Tie,
) -> CompleteFn:
    def complete(module_name: str, module: nn.Module, layer_records: list[LayerRecord]) -> bool:
        if tie.declined:
            return False
        calls = layer_calls(module_name, layer_records)
        if not calls:
            return False
        attribute = tie.uses[module_name]
        total = session.held.get(tie.name)
        if total is None:  # the first use in: whether to hold at all
            outputs = sum(c.output_grad.numel() for c in calls)
            numbers = sum(p.numel() for _, p in layer_parameters(module))  # the tied one only
            if session.batch_size * numbers > outputs:
                tie.declined = True
                return False
            try:
                term = rule_for(module).per_example(module, calls)[attribute]
            except Exception:
                tie.declined = True  # nothing held yet: the cross terms, as before
                raise
            session.held[tie.name] = term.detach()
        else:
            add_term(total, module, attribute, calls)
        tie.added.add(module_name)
        drop_records(layer_records, summaries)
        if tie.added >= tie.expected:
            held = session.held[tie.name]
            computed[module_name] = {attribute: held_squared_norms(held)}
        return True

    return complete


def add_term(
    total: torch.Tensor, module: nn.Module, attribute: str, calls: list[LayerCall]
) -> None:
    """Add one use's per-example gradient of its ``attribute`` to ``total`` (``(B,
    *shape)``, in place): a lookup table's output gradients scattered into their rows where the
    sum is in at least float32 (no ``(B, *shape)`` temporary), else the rule's ``per_example``
    added. Raises before changing ``total`` where the term cannot be formed."""
    rule = rule_for(module)
    lookups = rule.lookups(module, calls) if rule.lookups is not None else None
    wide = total.dtype in (torch.float32, torch.float64)
    if isinstance(lookups, Lookups) and wide and tuple(lookups.shape) == tuple(total.shape[1:]):
        batch, rows, width = total.shape[0], total.shape[1], math.prod(total.shape[2:])
        example = torch.arange(batch, device=lookups.rows.device).unsqueeze(1)
        keys = (example * rows + lookups.rows.long()).reshape(-1)
        values = lookups.d.reshape(-1, width).to(total.dtype)
        total.view(batch * rows, width).index_add_(0, keys, values)
        return
    term = rule.per_example(module, calls)[attribute]
    total.add_(term.to(total.dtype))


def held_squared_norms(grads: torch.Tensor) -> Any:
    """``torch_norms.formed_squared_norms`` of held per-example gradients, autocast off: a
    CPU's backward pass runs the tensor hooks in the caller's thread, under its
    ``torch.autocast``, which would square them in bfloat16 (a bound far looser, and not of
    the numbers summed)."""
    with in_reduction_precision(grads.device):
        return torch_norms.formed_squared_norms(grads)


def drop_records(
    layer_records: list[LayerRecord], summaries: dict[int, torch_checks.RowSummary] | None
) -> None:
    """A held layer's records let go (their output gradients' row summaries into
    ``summaries`` first, on a layout's first run): its inputs are autograd's alone now."""
    if summaries is not None:
        for r in layer_records:
            if r.output_grad is not None:
                summaries[id(r)] = torch_checks.summarize_rows(r.output_grad)
    for r in layer_records:
        r.output_grad = None
        r.inputs, r.input_versions = (), ()


def finish(session: CapturedPass, computed: dict[str, dict[str, Any]]) -> None:
    """After the pass and its checks: each held tied parameter whose uses did not all complete
    in their hooks gets the terms of those still holding records (raising a rule's error: the
    other uses' records are gone, so no other route is left), and its squared norms into
    ``computed``."""
    if not session.held:
        return
    owners = session.owners
    for name, uses in holdable_ties(owners).items():
        total = session.held.get(name)
        if total is None or any(layer in computed for layer in uses):
            continue
        last = None
        for layer, attribute in uses.items():
            records = session.records[layer]
            calls = layer_calls(layer, records)
            if calls:
                with torch.no_grad():
                    add_term(total, owners.modules[layer], attribute, calls)
                drop_records(records, None)
            last = layer, attribute
        assert last is not None
        computed[last[0]] = {last[1]: held_squared_norms(total)}
