"""The ghost strategy for PyTorch models wrapped by :func:`pergrad.module_loss`.

One call:

1. the model runs ONCE on the whole batch (``functional_call`` with fresh leaf tensors for the
   parameters, so the model's own tensors, ``.grad`` fields and flags are never touched), with a
   forward hook on every layer that owns a differentiated parameter; the hook keeps the layer's
   inputs and puts a tensor hook on its output;
2. each example's loss is ``loss_fn`` on its row of the output (``torch.func.vmap`` over the rows,
   the ``unsqueeze(0)`` that ``module_loss`` does), and one backward pass of their sum gives, at
   each hooked output, the per-example output gradients (examples do not mix, so row ``b`` of the
   gradient of the sum is the gradient of loss ``b``). That pass differentiates only each layer's
   smallest parameter (its bias), so the weight gradients are never computed; the first run of a
   ``module_loss`` differentiates every parameter instead, for the check below;
3. each layer's rule (``torch_layers.py``) turns inputs and output gradients into per-example
   squared norms of its parameters;
4. for a clipped sum, the same inputs and output gradients, each example's scaled by its clip
   factor ``c_i``, give ``sum_i c_i g_i`` (the rule's ``weighted_sum``: for a linear layer one
   matrix product, the cost of its ordinary weight gradient). No second backward pass (the
   "book-keeping" of Bu et al. 2023, "Differentially private optimization on large model at
   small cost"). An example of weight 0 (padding, or a gradient that is not finite) has its
   output gradients zeroed and the non-finite entries of its inputs replaced by 0 first
   (:func:`weighted_calls`; ``0 * nan`` would be nan), so it adds exactly nothing.

The low-memory mode (``strategy="ghost-lowmem"``, :func:`_second_pass`): step 2 holds every
layer's output gradients until step 3, where a non-private backward pass frees each layer's
saved tensors as it goes; that is the one-pass mode's extra memory. Instead, each layer's tensor
hook computes its norms as soon as all its calls' output gradients are in, and drops them (a
layer sharing a tied parameter, or whose calls are not all reached, waits for the end of the
pass); the graph is retained. For the clipped sum, a second backward pass through the same graph
gives the same output gradients again (checked, per row, against summaries of the first's), and
each layer's hook turns them into its weighted sum (step 4) and drops them. The sums come from
the very gradients the norms did, so the bound holds as exactly as in one pass (a backward pass
of the clip-weighted losses would not: under autocast it rounds each example differently).
Cost: one more backward pass without weight gradients.

Tensor hooks (not ``autograd.grad`` with respect to the outputs) because they see the gradient
of the value the layer produced even when a later in-place op (``ReLU(inplace=True)``) rewrites
it. Module hooks are removed in ``finally``; tensor hooks live on this call's own tensors.

What the hooks cannot see, and how it is handled:

- a parameter no layer rule owns (an ``nn.MultiheadAttention``'s, a ViT embedding's class token
  beside its patch convolution, a learnable scale of the model itself): found before running
  (:func:`plan`); its module (or the rule-less block around it) is run alone over the examples
  with only such parameters differentiated (``torch_generic.py``), while the layers with a rule
  inside it stay ghost. ``strategy="auto"`` takes the chunked strategy only when these
  per-example gradients would be large, or when no layer of the model has a rule;
- a parameter shared by several layers (tied weights: GPT-2's input embedding reused as its
  output projection): its per-example gradient is the sum of each layer's, so its squared norm
  adds each layer's and twice the inner product of every pair, which a *cross rule* for the
  two layer families gives from their calls (``torch_tied.py``: the cross terms in float64,
  and where some example's uses nearly cancel, every term from float64 copies of the calls),
  and its clipped sum adds each layer's. A tie between families without a
  cross rule, or with a layer without a rule, is found before running and takes the chunked
  strategy, as above;
- where the batch is. A layer is hooked only if axis 0 of its input and output has the batch
  size, but a size is not a layout (a time-first layer with ``T == B``, a table shared by the
  batch with ``T == B`` rows), so the first run of each layout (``torch_checks.layout_key``:
  the arguments' shapes, batch size included) establishes it: every hooked output gradient must
  be row-local (the backward pass of the losses weighted per example, compared row by row with
  the plain pass's: :func:`_weighted_run` runs the batch once before the plain pass for it and
  keeps only summaries of its rows, so that no backward pass retains its graph and nothing of
  the plain pass is held through the other: the first step needs no more memory than the
  others) and the first examples run alone must get their batched losses
  (``torch_checks.py``). A rule reads the records only after the check has passed (in the
  low-memory mode's sums, before it: its values are used, and its errors raised, only after
  the check). A layer run alone must also reproduce its
  batched output from each example's slice of its inputs. Any failure is
  :class:`GhostUnsupported`, and ``"auto"`` takes the chunked strategy with a warning;
- a layer called with keyword arguments, or an input changed in place after the layer read it:
  found while running, reported the same way;
- activation checkpointing with ``use_reentrant=True`` (Hugging Face's default for
  ``gradient_checkpointing_enable()``): its backward pass refuses ``torch.autograd.grad``,
  found by the first backward pass and reported the same way (``use_reentrant=False`` runs
  here: the recomputation happens outside the capture);
- a parameter used outside its layer's ``forward`` (``F.linear(x, self.fc.weight)`` in a parent):
  only partly detectable. On the first run of each layout it is caught when the batch gradient
  is larger than the per-example norms allow (``|sum_i g_i|^2 <= B sum_i |g_i|^2``), e.g. when
  the layer itself is never called; a parameter used both inside and outside its layer may go
  unnoticed, and a model whose later calls of the same shapes take another path than its first
  is not checked again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import (
    torch_checks,
    torch_generic,
    torch_position_bias,
    torch_tied,
)
from pergrad._src.capture.rules import (
    in_reduction_precision,
    is_additive,
    layer_parameters,
    parameter_owners,
    rule_for,
)
from pergrad._src.capture.torch_engine import (
    LayerRecord,
    capturing,
    layer_calls,
    model_and_loss_arguments,
    per_example_losses,
)
from pergrad._src.capture.torch_layers import LayerCall  # importing it registers the rules
from pergrad._src.core.call import Call, Spec, single_example_fn
from pergrad._src.core.module_loss import ModuleLoss, refuse_batch_mixing_layers
from pergrad._src.errors import GhostUnsupported, is_pergrad_error
from pergrad._src.strategies.protocol import (
    Assessment,
    LeafReduction,
    ReduceRequest,
    Reduction,
    StrategyChoice,
    WeightsFn,
    weight_groups,
)

# The rule name of a layer without a rule, handled by torch_generic.py.
GENERIC = "generic"
# The kind of a position-bias table (T5's relative attention bias), torch_position_bias.py.
POSITION_BIAS = torch_position_bias.POSITION_BIAS

# Slack of the check |sum_i g_i|^2 <= B sum_i |g_i|^2 for float rounding (under autocast, for
# bfloat16 / float16 rounding: the norms come from the records, the batch gradient was rounded).
_CONSISTENCY_SLACK = {torch.float32: 1e-3, torch.float64: 1e-3}
_LOW_PRECISION_SLACK = 3e-2

# Why reentrant activation checkpointing cannot take the ghost path (found by its first backward
# pass): "auto" takes the chunked strategy, whose layer hooks run it with .backward().
REENTRANT = (
    "the model uses activation checkpointing with use_reentrant=True, which torch cannot "
    "differentiate with torch.autograd.grad, and the ghost strategy's backward pass reaches "
    "each layer's output gradient that way. Use use_reentrant=False, PyTorch's "
    "recommendation, to keep the ghost path (torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=False); Hugging Face: model.gradient_checkpointing_enable("
    "gradient_checkpointing_kwargs={'use_reentrant': False}))"
)


@dataclass(frozen=True)
class GhostPlan:
    """Which layers own the differentiated parameters and whether each has a ghost rule.

    Attributes:
      layers: module name -> rule name (``"linear"``, ``"conv"``, ...) for the covered layers.
      unsupported: module name (or parameter name) -> why the ghost strategy cannot handle it.
      generic_size: how many numbers the parameters of ``"generic"`` layers and position-bias
        tables hold (their per-example gradients are formed: ``B x generic_size`` numbers).
      tied: parameter name (as in ``params``) -> the ``(module name, attribute)`` of each layer
        sharing it, for the covered tied parameters (``{"emb.weight": [("emb", "weight"),
        ("head", "weight")]}``).
    """

    layers: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    generic_size: int = 0
    tied: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def plan(loss: ModuleLoss, params: Any) -> GhostPlan:
    """Check, without running anything, whether every parameter in ``params`` can go ghost."""
    if not (
        isinstance(params, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items())
    ):
        return GhostPlan(
            unsupported={"params": "the ghost strategy needs a dict[str, Tensor] of parameters"}
        )
    model = loss.model
    uses, canonical = _uses_and_aliases(model, params)
    layers, unsupported, tied = {}, {}, {}
    generic_size = 0
    for name in params:
        if name not in uses:
            unsupported[name] = "not a parameter of the model"
            continue
        module_name = uses[name][0][0]  # the layer reducing it (out_proj's: its attention)
        others = [alias for alias, of in canonical.items() if of == name and alias != name]
        given = [other for other in others if other in params]
        if given:
            unsupported[name] = f"the same parameter is passed twice, as {name!r} and {given}"
            continue
        if len(uses[name]) > 1:
            problem = _tie_problem(model, name, others, uses[name])
            if problem is not None:
                unsupported[module_name] = problem
                continue
            tied[name] = uses[name]
            for owner, _ in uses[name]:
                layers[owner] = rule_for(model.get_submodule(owner)).name
            continue
        module = model.get_submodule(module_name)
        rule = rule_for(module)
        problem = rule.problem(module) if rule is not None else None
        if problem is None and torch_position_bias.is_position_bias(model, module_name):
            layers[module_name] = POSITION_BIAS  # looked up once for the whole batch
            generic_size += params[name].numel()
        elif rule is None:
            unit = torch_generic.find_unit(model, module_name)
            if unit is None:
                unsupported[module_name or name] = f"no ghost rule for {type(module).__name__}"
            else:  # per-example gradients of its unit run alone (torch_generic.py)
                layers[unit] = GENERIC
                generic_size += params[name].numel()
        elif problem is not None:
            unsupported[module_name] = f"{type(module).__name__}: {problem}"
        else:
            layers[module_name] = rule.name
    return GhostPlan(layers, unsupported, generic_size, tied)


def _uses_and_aliases(
    model: nn.Module, params: dict[str, torch.Tensor]
) -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
    """For each name in ``params`` that names a parameter of ``model``, the layers using that
    parameter, ``(module name, attribute)``; and every name of those parameters in the model
    (``"head.weight"`` for a weight tied to ``"emb.weight"``) -> its name in ``params``.

    A module registered under two names is one layer (its hooks see every call): it is listed
    once, under its first name.
    """
    by_name: dict[str, torch.Tensor] = {}
    names_of: dict[int, list[str]] = {}
    uses_of: dict[int, list[tuple[str, str]]] = {}
    seen = set()
    owners = parameter_owners(model)
    for full, param in model.named_parameters(remove_duplicate=False):
        module_name, attribute = owners[full]
        by_name[full] = param
        names_of.setdefault(id(param), []).append(full)
        layer = (id(model.get_submodule(module_name)), attribute)
        if layer not in seen:
            seen.add(layer)
            uses_of.setdefault(id(param), []).append((module_name, attribute))
    uses, canonical = {}, {}
    for name in params:
        if name in by_name:
            uses[name] = uses_of[id(by_name[name])]
            canonical.update(dict.fromkeys(names_of[id(by_name[name])], name))
    return uses, canonical


def _tie_problem(
    model: nn.Module, name: str, others: list[str], uses: list[tuple[str, str]]
) -> str | None:
    """Why the ghost strategy cannot take parameter ``name`` shared by the layers ``uses``
    (None: every layer has a rule and every pair of them a cross rule, ``torch_tied.py``)."""
    shared = f"{name!r} is shared with {others} (tied weights)"
    families = []
    for owner, attribute in uses:
        module = model.get_submodule(owner)
        rule = rule_for(module)
        if rule is None:
            return f"{shared} and layer {owner!r} ({type(module).__name__}) has no ghost rule"
        problem = rule.problem(module)
        if problem is not None:
            return f"{shared} and layer {owner!r} ({type(module).__name__}): {problem}"
        families.append((rule.name, attribute))
    pair = torch_tied.missing_cross(families)
    if pair is not None:
        return f"{shared} and pergrad has no cross rule for {pair}"
    return None


def assess(request: ReduceRequest, forced: bool, name: str = "ghost") -> Assessment:
    """The registry's question for a ``module_loss``: every differentiated parameter in a layer
    with a rule (or in a unit run alone whose per-example gradients stay small under "auto")?
    ``name``: the strategy asking (``"ghost"`` or ``"ghost-lowmem"``, whose plan is the same)."""
    spec = request.spec
    if spec.argnums != (0,) or not spec.single_argnum:
        found = GhostPlan(
            unsupported={"argnums": "the ghost strategy differentiates the parameters only"}
        )
    else:
        found = plan(request.fn, request.args[0])
    layers, unsupported = dict(found.layers), dict(found.unsupported)
    if unsupported:
        listing = "; ".join(f"{layer!r}: {problem}" for layer, problem in unsupported.items())
        why = listing if forced else "layers without a ghost rule: " + listing
        return Assessment(name, False, why, StrategyChoice(name, why, None, layers, unsupported))
    generic = request.call.batch_size * found.generic_size
    limit = torch_generic.MAX_MATERIALIZED_NUMBERS
    if forced:
        why = "requested"
    elif generic > limit:
        why = (
            f"the layers without a ghost rule would need {generic:,} per-example numbers "
            f"(more than {limit:,}) to {_formed(layers)}"
        )
        return Assessment(name, False, why, StrategyChoice(name, why, None, layers))
    else:
        why = "every differentiated parameter belongs to a layer with a ghost rule" + (
            f" or has its per-example gradients formed: {_formed(layers)} ({generic:,} "
            f"per-example numbers)"
            if generic
            else ""
        )
        if found.tied:
            ties = "; ".join(
                f"{tied!r} by layers {[owner for owner, _ in uses]}"
                for tied, uses in found.tied.items()
            )
            why += f"; tied weights, each use's norms and their cross terms: {ties}"
    routes = {layer: _norm_route(request.fn.model, layer, rule) for layer, rule in layers.items()}
    return Assessment(name, True, why, StrategyChoice(name, why, None, layers, norm_routes=routes))


def _norm_route(model: nn.Module, layer: str, rule: str) -> str:
    """How the ghost strategy computes the norms of ``layer`` (for ``StrategyChoice``)."""
    if rule == GENERIC:
        return "per-example gradients formed, the unit run alone on each example"
    if rule == POSITION_BIAS:
        return "per-example gradients of the table formed, its bias expanded to the batch"
    module = model.get_submodule(layer)
    return rule_for(module).route(module)


def _formed(layers: dict[str, str]) -> str:
    """Where per-example gradients are formed, for a message: ``"run 'embed', the model itself
    alone"``, ``"expand the bias of the position-bias table 'rel' to the batch"``."""
    units = [repr(n) if n else "the model itself" for n, r in layers.items() if r == GENERIC]
    tables = [repr(n) for n, r in layers.items() if r == POSITION_BIAS]
    parts = [f"run {', '.join(units)} alone"] if units else []
    if tables:
        parts.append(
            f"expand the bias of the position-bias table{'s' * (len(tables) > 1)} "
            f"{', '.join(tables)} to the batch"
        )
    return " and ".join(parts)


@dataclass
class Captured:
    """One batched pass of a ``module_loss`` under the hooks, its first-run checks done.

    Attributes:
      diff: the differentiated leaves (fresh tensors), in the core's flat order.
      params: the parameter dict the model ran with (its values are ``diff``).
      position: ``id(leaf) -> index`` in ``diff``.
      modules: the hooked layers with a rule, by module name; ``records`` their calls.
      unit_grads: full name -> ``(B, *shape)`` per-example gradients of the generic units'
        parameters.
      tied: name -> the layers sharing it; ``canonical``: every name of a parameter in the
        model -> its name in ``params``.
      squared: per leaf ``(B,)`` squared norms, or None when not asked for.
      second: what the low-memory mode's second backward pass needs (when a weighted sum
        follows), else None.
    """

    diff: list[torch.Tensor]
    params: dict[str, torch.Tensor]
    position: dict[int, int]
    modules: dict[str, nn.Module]
    records: dict[str, list[LayerRecord]]
    unit_grads: dict[str, torch.Tensor]
    tied: dict[str, list[tuple[str, str]]]
    canonical: dict[str, str]
    squared: list[Any] | None
    second: SecondPass | None = None


@dataclass
class SecondPass:
    """The low-memory mode's state between its two backward passes.

    Attributes:
      losses: ``(B,)`` per-example losses, their graph retained.
      light: what the first pass differentiated (biases, recorded outputs).
      summaries: ``id(record) -> RowSummary`` of each record's first-pass output gradient:
        the second pass must reproduce them.
      pending: a first run's batch-gradient checks, left to the second pass (which then
        differentiates every parameter): the layout key, the units and tables to check.
    """

    losses: torch.Tensor
    light: list[torch.Tensor]
    summaries: dict[int, torch_checks.RowSummary]
    pending: tuple[Any, dict[str, dict[str, str]], dict[str, str]] | None = None


@dataclass
class BatchedPass:
    """The model's forward pass over the batch under the hooks (steps 1-2): the leaves it ran
    with, the layers, units and tables hooked, their records, and the per-example losses."""

    diff: list[torch.Tensor]
    params: dict[str, torch.Tensor]
    modules: dict[str, nn.Module]
    units: dict[str, nn.Module]
    assigned: dict[str, dict[str, str]]
    tables: dict[str, str]
    tied: dict[str, list[tuple[str, str]]]
    canonical: dict[str, str]
    records: dict[str, list[LayerRecord]]
    unit_records: dict[str, list[Any]]
    bias_records: dict[str, list[Any]]
    losses: torch.Tensor
    light: list[torch.Tensor]
    rng: Any

    def captured(self) -> dict[str, list[Any]]:
        """Every record with a gradient slot: layers, units, tables."""
        return {**self.records, **self.unit_records, **self.bias_records}


def _forward(spec: Spec, call: Call, loss: ModuleLoss, layers: dict[str, str]) -> BatchedPass:
    """The batched forward pass with every layer of ``layers`` hooked, and the losses."""
    model = loss.model
    refuse_batch_mixing_layers(model, spec.func_name)
    batch_size = call.batch_size
    diff = [call.leaves[i][j].detach().requires_grad_(True) for i, j in call.diff_positions]
    batched = [call.leaves[i][j] for i, j in call.batched_positions]
    args = call.rebuild(diff, batched)
    params = args[0]
    inputs, targets, target_dims = model_and_loss_arguments(call, args, loss.num_inputs, batch_size)
    modules = {
        name: model.get_submodule(name)
        for name, r in layers.items()
        if r not in (GENERIC, POSITION_BIAS)
    }
    units = {name: model.get_submodule(name) for name, r in layers.items() if r == GENERIC}
    assigned = _unit_parameters(model, units, params)
    uses, canonical = _uses_and_aliases(model, params)
    # each position-bias table -> the name of its weight in params
    tables = {
        name: canonical[_full_name(name, "weight")]
        for name, r in layers.items()
        if r == POSITION_BIAS
    }
    tied = {name: owners for name, owners in uses.items() if len(owners) > 1}
    # Each generic unit's smallest parameter (and below, each layer's bias or output):
    # differentiating these reaches every output gradient at almost no cost of its own.
    unit_light = [
        min((params[full] for full in names.values()), key=lambda p: p.numel())
        for names in assigned.values()
    ] + [params[weight] for weight in tables.values()]  # a table: buckets x heads numbers
    rng = call.backend.rng_state()
    with torch.enable_grad():
        with (
            capturing(modules, batch_size) as records,
            torch_generic.capturing_units(units, batch_size) as unit_records,
            torch_position_bias.capturing(model, list(tables), batch_size) as bias_records,
        ):
            output = loss.forward(params, inputs)
        losses = per_example_losses(spec, loss, output, targets, target_dims, batch_size)
    light = _light_targets(modules, records, params, canonical) + unit_light
    for layer_records in records.values():
        for record in layer_records:  # the output is the graph's now (or a light target): an
            record.output = record.light_input = None  # LM head's logits are freed early
    return BatchedPass(
        diff,
        params,
        modules,
        units,
        assigned,
        tables,
        tied,
        canonical,
        records,
        unit_records,
        bias_records,
        losses,
        light,
        rng,
    )


def capture(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    norms: bool = True,
    low_memory: bool = False,
    retain: bool = False,
) -> Captured:
    """The model once over the batch with every layer of ``layers`` hooked (steps 1-2 of the
    module docstring), the first run of a layout checked; with ``norms`` (always on a first
    run, whose check needs them) each leaf's per-example squared norms (step 3).

    ``low_memory``: each layer that shares no parameter has its norms computed as soon as the
    backward pass has given all its output gradients, which it then drops
    (:func:`_when_complete`); the first run's row check compares row summaries
    (``torch_checks.RowSummary``) for them. ``retain``: keep the graph for the second backward
    pass of :func:`_second_pass` (``Captured.second``), whose first run checks its rows
    through that graph; otherwise a first run's row check runs the batch once before, weighted
    (:func:`_weighted_run`), so that no backward pass retains its graph."""
    batch_size = call.batch_size
    run = _forward(spec, call, loss, layers)
    key = torch_checks.layout_key(run.params, [x for xs in call.leaves[1:] for x in xs])
    checked = key in loss.ghost_checked
    weighted = None
    if not (checked or retain) and batch_size > 1:  # (one example: every row is its own)
        weighted = _weighted_run(spec, call, run)
        del run  # the plain pass from the same random-number state: the same dropout masks
        call.backend.set_rng_state(weighted.rng)
        run = _forward(spec, call, loss, layers)
    diff, params, modules, records = run.diff, run.params, run.modules, run.records
    units, assigned, tables, tied, canonical = (
        run.units,
        run.assigned,
        run.tables,
        run.tied,
        run.canonical,
    )
    # The first run of a layout differentiates every parameter, to check the norms against
    # the batch gradient; later ones only what reaches each layer's output, so the weight
    # gradients (a third of a training step's work) are never computed. (The low-memory
    # mode's first run leaves that to its second pass: the graph is freed along it.)
    deferred = retain and not checked  # (retain: the low-memory mode's sums follow)
    wanted = run.light if checked or deferred else diff
    sharing = {owner for owners in tied.values() for owner, _ in owners}
    early: dict[str, dict[str, torch.Tensor]] = {}  # low memory: norms computed in hooks
    summaries: dict[int, torch_checks.RowSummary] = {}
    if low_memory:
        unshared = {n: m for n, m in modules.items() if n not in sharing}
        _when_complete(unshared, records, _norms_in_hook(early, summaries))
    position = {id(leaf): k for k, leaf in enumerate(diff)}
    batch = BatchGradient([None] * len(diff), {})
    try:
        with torch.enable_grad():
            if wanted is diff:  # the first run's checks: streamed, never all held at once
                keep = {
                    position[id(params[n])] for names in assigned.values() for n in names.values()
                }
                keep |= {position[id(params[weight])] for weight in tables.values()}
                batch = _batch_gradient(run.losses.sum(), diff, keep, retain=False)
            else:
                torch.autograd.grad(
                    run.losses.sum(),
                    wanted,
                    allow_unused=True,
                    retain_graph=retain,
                )
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise GhostUnsupported(REENTRANT) from err
    del wanted
    # an overflowed pass (a skipped mixed-precision step) is checked on a later one
    checking = not checked and torch_checks.records_finite(run.captured(), summaries)
    if checking and weighted is not None:  # before any rule reads the records: a wrong
        torch_checks.check_rows_against(  # layout can crash one
            run.captured(), weighted.summaries, weighted.weights, summaries
        )
        _check_losses_alone(spec, call, run)
    found = Captured(diff, params, position, modules, records, {}, tied, canonical, None)

    def reduce() -> None:
        """Per-example gradients of the units and tables; with ``norms``, every norm."""
        found.unit_grads = _unit_grads(
            units, assigned, run.unit_records, params, canonical, batch_size
        )
        for table, weight in tables.items():
            found.unit_grads[weight] = torch_position_bias.per_example(
                loss.model.get_submodule(table), run.bias_records[table], batch_size
            )
        if not (norms or not checked):
            return
        squared: list[Any] = [None] * len(diff)
        rest = {n: m for n, m in modules.items() if n not in sharing and n not in early}
        for name, values in _per_layer(rest, records, params, _squared_norms_of, canonical):
            squared[position[id(params[name])]] = values
        for module_name, values in early.items():
            layer_calls(module_name, records[module_name])  # raises for an unread output grad
            for name, value in _named(module_name, values, params, canonical):
                squared[position[id(params[name])]] = value
        for name, values in _tied_squared_norms(modules, records, params, tied, canonical).items():
            squared[position[id(params[name])]] = values
        for name, grads in found.unit_grads.items():
            squared[position[id(params[name])]] = (grads**2).reshape(batch_size, -1).sum(1)
        _fill_zeros(params, position, squared, batch_size)
        found.squared = squared

    if not retain:
        reduce()
    else:
        # Rules read the records before the row check here (which then compares summaries):
        # an error of a rule is raised after the check, which explains a wrong layout, and
        # the values are used only once the check has passed.
        try:
            reduce()
            failure = None
        except Exception as err:  # noqa: BLE001
            failure = err
        for slot in (r for rs in run.captured().values() for r in rs):
            if slot.output_grad is not None:
                summaries[id(slot)] = torch_checks.summarize_rows(slot.output_grad)
        # the records' gradients are read: drop them; the units' and tables' sums come from
        # their per-example gradients, so drop their next ones too
        for slot in (r for rs in run.captured().values() for r in rs):
            slot.output_grad = None
        for rs in (*run.unit_records.values(), *run.bias_records.values()):
            for r in rs:
                r.watch = _drop
        if checking:
            _check_layout(spec, call, run, summaries, retain=True)
        if failure is not None:
            raise failure
        pending = (key, {u: assigned[u] for u in units}, tables) if checking else None
        found.second = SecondPass(run.losses, run.light, summaries, pending)
    if checking and not deferred:
        assert found.squared is not None
        by_name = {name: batch.kept.get(position[id(leaf)]) for name, leaf in params.items()}
        _check_unit_sums(units, assigned, tables, found.unit_grads, by_name)
        _check_consistency(params, position, found.squared, batch.squared_norms, batch_size)
        loss.ghost_checked.add(key)
    return found


@dataclass(frozen=True)
class WeightedRun:
    """The first half of a first run's row check (:func:`_weighted_run`): the random-number
    state before it, the per-example weights, and each record's summary of its weighted
    output gradient (None: it got none), by name, in the order of the calls."""

    rng: Any
    weights: torch.Tensor
    summaries: dict[str, list[torch_checks.RowSummary | None]]


def _weighted_run(spec: Spec, call: Call, run: BatchedPass) -> WeightedRun:
    """The backward pass of ``sum_b w_b loss_b`` through ``run`` (only to the layers' outputs,
    no weight gradient), each hooked output gradient summarised row by row and dropped as it
    comes, the graph freed. The plain pass that follows, from the same random-number state
    (the same dropout masks), checks its rows against these summaries
    (``torch_checks.check_rows_against``) where its records are finite. Costs one
    forward and one light backward pass, once per layout, at about the memory of a
    non-private step, with nothing of the plain pass alive beside it."""
    weights = torch_checks.row_weights(call.batch_size, run.losses)

    def weighted_backward(weights: torch.Tensor) -> None:
        try:
            with torch.enable_grad():
                torch.autograd.grad((run.losses * weights).sum(), run.light, allow_unused=True)
        except RuntimeError as err:
            if "use_reentrant=True" not in str(err):
                raise
            raise GhostUnsupported(REENTRANT) from err

    summaries = torch_checks.weighted_summaries(run.captured(), weighted_backward, weights)
    return WeightedRun(run.rng, weights, summaries)


def _check_unit_sums(
    units: Any,
    assigned: dict[str, dict[str, str]],
    tables: dict[str, str],
    unit_grads: dict[str, torch.Tensor],
    by_name: dict[str, Any],
) -> None:
    """A first run: the formed per-example gradients (generic units, position-bias tables)
    add up to the batch gradient."""
    for unit in units:
        owned = {full: unit_grads[full] for full in assigned[unit].values() if full in unit_grads}
        torch_generic.check_sums(unit, owned, by_name)
    for table, weight in tables.items():
        torch_generic.check_sums(table, {weight: unit_grads[weight]}, by_name)


def _drop(grad: torch.Tensor) -> None:
    """A gradient slot's watch that drops what it is given."""


def _named(
    module_name: str,
    values: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's ``{parameter: value}`` named as in ``params`` (those it holds)."""
    for param_name, value in values.items():
        name = canonical.get(_full_name(module_name, param_name))
        if name in params:
            yield name, value


CompleteFn = Callable[[str, nn.Module, list[LayerRecord]], bool]


def _when_complete(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    complete: CompleteFn,
    reached: Callable[[LayerRecord], bool] = lambda r: r.hooked,
) -> None:
    """Arm the low-memory mode for the backward pass that follows: when every recorded call of
    a layer that the pass reaches (``reached``: an output that requires grad; in a second
    pass, a call the first reached) has its output gradient, ``complete(name, layer,
    records)`` runs there and then
    (in the tensor hook) and, where it returns True, the records drop their output gradients,
    so that at most a few layers' output gradients are alive at once instead of every layer's.

    A layer whose calls do not all receive a gradient (a call off the loss's path), whose
    record list grows during the pass (reentrant checkpointing reruns the forward pass inside
    the backward pass), or for which ``complete`` fails, keeps its gradients; the caller
    handles it after the pass, as in the one-pass mode (where a failure is raised)."""

    def arm(module_name: str, module: nn.Module, count: int, expected: list[LayerRecord]) -> None:
        def receive(record: LayerRecord, grad: torch.Tensor) -> None:
            record.output_grad = grad
            layer_records = records[module_name]
            if len(layer_records) != count or any(r.output_grad is None for r in expected):
                return
            try:
                with torch.no_grad():
                    done = complete(module_name, module, layer_records)
            except Exception:  # noqa: BLE001  (computed again after the pass, which raises it)
                return
            if done:
                for r in layer_records:
                    r.output_grad, r.watch = None, None

        for record in expected:
            record.watch = functools.partial(receive, record)

    for module_name, module in modules.items():
        expected = [r for r in records[module_name] if reached(r)]
        if expected:
            arm(module_name, module, len(records[module_name]), expected)


def _norms_in_hook(
    early: dict[str, dict[str, torch.Tensor]], summaries: dict[int, torch_checks.RowSummary]
) -> CompleteFn:
    """The first pass's ``complete``: the layer's squared norms (into ``early``) and its
    records' row summaries (into ``summaries``)."""

    def complete(module_name: str, module: nn.Module, layer_records: list[LayerRecord]) -> bool:
        calls = layer_calls(module_name, layer_records)
        early[module_name] = rule_for(module).squared_norms(module, calls)
        for r in layer_records:
            if r.output_grad is not None:
                summaries[id(r)] = torch_checks.summarize_rows(r.output_grad)
        return True

    return complete


def ghost(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    weights_from: WeightsFn | None,
    low_memory: bool = False,
) -> Reduction:
    """Squared norms (and, with ``weights_from``, the weighted sum) by the ghost strategy;
    ``low_memory``: the ``"ghost-lowmem"`` strategy (:func:`_second_pass`)."""
    retain = low_memory and weights_from is not None
    found = capture(spec, call, loss, layers, low_memory=low_memory, retain=retain)
    return _reduce(loss, found, weights_from, low_memory)


def _reduce(
    loss: ModuleLoss, found: Captured, weights_from: WeightsFn | None, low_memory: bool
) -> Reduction:
    """:func:`ghost`'s norms and weighted sums from a captured pass."""
    squared, params, position = found.squared, found.params, found.position
    assert squared is not None
    if weights_from is None:
        return Reduction(squared, None)
    # The clipped sum from the same inputs and output gradients, each example's scaled by its
    # weight: one weight-gradient computation, no second backward pass. A non-finite record
    # makes its example's squared norm non-finite, so when every norm is finite (one host sync)
    # no record needs cleaning before the weighted sums (see weighted_calls).
    finite = bool(torch.isfinite(sum(x.detach().float() for x in squared)).all())
    groups = weight_groups(weights_from(squared), len(found.diff))
    if low_memory:
        return Reduction(squared, _second_pass(loss, found, groups, finite))
    sums: list[Any] = [None] * len(found.diff)  # (zeros at the end where nothing reached)
    for weights, leaves in groups:
        group = {name for name, leaf in params.items() if position[id(leaf)] in leaves}
        owners = {
            m: module
            for m, module in found.modules.items()
            if _owns_any(m, module, group, found.canonical)
        }
        computed = _per_layer(
            owners,
            found.records,
            params,
            _weighted_sum_of(weights.detach(), clean=not finite),
            found.canonical,
        )
        for name, value in computed:
            if name in group:  # a tied parameter's weighted sum: the sum of its uses'
                k = position[id(params[name])]
                tied = name in found.tied and sums[k] is not None  # the sum of its uses',
                sums[k] = sums[k].add_(value) if tied else value  # into the first (its own)
    _add_formed_sums(found, groups, sums)
    return Reduction(squared, _zeros_where_unreached(sums, found.diff))


def _zeros_where_unreached(sums: list[Any], diff: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weighted sums, zeros for a parameter no layer's records reached (a model's worth of
    zeros written up front would be a noticeable part of a large model's step)."""
    return [torch.zeros_like(x) if s is None else s for s, x in zip(sums, diff)]


def _add_formed_sums(found: Captured, groups: list[Any], sums: list[Any]) -> None:
    """The weighted sums of the formed per-example gradients (generic units, position-bias
    tables), examples of weight 0 zeroed first."""
    params, position = found.params, found.position
    for weights, leaves in groups:
        for name in found.unit_grads:
            if position[id(params[name])] not in leaves:
                continue
            grads = _zero_rows(found.unit_grads[name], weights != 0)
            with in_reduction_precision(grads.device):  # not in autocast's bfloat16
                sums[position[id(params[name])]] = torch.tensordot(
                    weights.detach().to(grads.dtype), grads, dims=1
                )


def _second_pass(
    loss: ModuleLoss, found: Captured, groups: list[Any], finite: bool
) -> list[torch.Tensor]:
    """The low-memory mode's weighted sum: the first pass's backward pass again, through its
    retained graph, and, in each layer's tensor hook, the layer's weighted sum from its inputs
    and these output gradients (``_weighted_sum_of``, as the one-pass mode computes it), after
    which they are dropped.

    The second pass gives the same output gradients as the first (the same graph, the same
    kernels), so each example's contribution is built from the gradient its norm was computed
    from, and the clip bound holds exactly, under ``torch.autocast`` too (where a backward pass
    of clip-weighted losses would round each example's gradient differently). This is checked:
    each record's row summaries must match the first pass's (within float32 rounding, for
    non-deterministic kernels), else :class:`GhostUnsupported`. On a first run the pass also
    gives the batch gradient of every parameter, for the checks the one-pass mode makes there.
    """
    second = found.second
    assert second is not None
    params, position, canonical = found.params, found.position, found.canonical
    sums: list[Any] = [None] * len(found.diff)
    mismatch: list[str] = []
    seen: set[int] = set()

    def add(module_name: str, values: Iterator[tuple[str, torch.Tensor]], group: set) -> None:
        for name, value in values:
            if name in group:
                k = position[id(params[name])]
                tied = name in found.tied and sums[k] is not None  # the sum of its uses',
                sums[k] = sums[k].add_(value) if tied else value  # into the first (its own)

    def complete(module_name: str, module: nn.Module, layer_records: list[LayerRecord]) -> bool:
        for r in layer_records:
            if r.output_grad is None:
                continue
            seen.add(id(r))
            first = second.summaries.get(id(r))
            if first is None or not torch_checks.same_rows(first, r.output_grad):
                mismatch.append(module_name)
                return True  # nothing is summed from it: the pass fails below
        calls = layer_calls(module_name, layer_records)
        for weights, leaves in groups:
            group = {name for name, leaf in params.items() if position[id(leaf)] in leaves}
            if _owns_any(module_name, module, group, canonical):
                values = _weighted_sum_of(weights.detach(), clean=not finite)(module, calls)
                add(module_name, _named(module_name, values, params, canonical), group)
        for r in layer_records:  # its sums are done: the inputs are autograd's alone now
            r.inputs, r.input_versions = (), ()
        return True

    for slot in (r for rs in found.records.values() for r in rs):
        slot.watch = None
    _when_complete(found.modules, found.records, complete, lambda r: id(r) in second.summaries)
    targets = found.diff if second.pending is not None else second.light
    with torch.enable_grad():
        batch_grads = torch.autograd.grad(second.losses.sum(), targets, allow_unused=True)
    found.second = None  # the graph is freed
    for module_name, module in found.modules.items():  # layers not completed in a hook
        layer_records = found.records[module_name]
        if any(r.output_grad is not None for r in layer_records):
            with torch.no_grad():
                complete(module_name, module, layer_records)
    missing = [
        name
        for name, rs in found.records.items()
        if any(id(r) in second.summaries and id(r) not in seen for r in rs)
    ]
    if missing:  # a forward pass rerun inside the backward pass, with no hooks of pergrad's
        raise GhostUnsupported(
            f"the second backward pass did not reach layer {missing[0]!r}'s recorded output "
            f"(a forward pass rerun inside the backward pass): use strategy='ghost'"
        )
    if mismatch:
        raise GhostUnsupported(
            f"the second backward pass gave layer {mismatch[0]!r} other output gradients than "
            f"the first (non-deterministic kernels): the low-memory mode cannot build the "
            f"clipped sum from the gradients its norms came from. Call "
            f"torch.use_deterministic_algorithms(True), or use strategy='ghost'"
        )
    _add_formed_sums(found, groups, sums)
    if second.pending is not None:
        key, units, tables = second.pending
        by_name = {name: batch_grads[position[id(leaf)]] for name, leaf in params.items()}
        _check_unit_sums(units, units, tables, found.unit_grads, by_name)
        assert found.squared is not None
        squared_norms = [None if g is None else _squared_norm(g) for g in batch_grads]
        _check_consistency(params, position, found.squared, squared_norms, len(found.squared[0]))
        loss.ghost_checked.add(key)
    return _zeros_where_unreached(sums, found.diff)


def layerwise(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    reduction: str,
    args: tuple[Any, ...],
) -> list[LeafReduction]:
    """Plug-in reduction ``reduction`` (``capture/rules.register_reduction``) of each parameter
    whose layer's rule has it, from one captured pass; per-example gradients of the others
    (a layer without the plug-in: its rule's ``per_example``; a generic unit's parameters; a
    tied parameter: the sum of its uses' plug-in values where the plug-in is additive and
    every use has it, else the sum of their per-example gradients)."""
    found = capture(spec, call, loss, layers, norms=False)
    params, position = found.params, found.position
    results: list[LeafReduction | None] = [None] * len(found.diff)
    additive = {
        name
        for name, uses in found.tied.items()
        if is_additive(reduction)
        and all(
            owner in found.modules and rule_for(found.modules[owner]).reduction(reduction)
            for owner, _ in uses
        )
    }
    formed_ties = set(found.tied) - additive
    tied: dict[str, torch.Tensor] = {}
    for module_name, module in found.modules.items():
        rule = rule_for(module)
        plug_in = rule.reduction(reduction)
        uses_formed = any(
            found.canonical.get(_full_name(module_name, p)) in formed_ties
            for p, _ in layer_parameters(module)
        )
        calls = layer_calls(module_name, found.records[module_name])
        if not calls:  # never called, or its output did not reach the loss: zeros below
            continue
        own = [
            p
            for p, _ in layer_parameters(module)
            if found.canonical.get(_full_name(module_name, p)) in params
        ]
        with torch.no_grad():
            values = plug_in(module, calls, *args) if plug_in is not None else {}
            missing = uses_formed or any(p not in values for p in own)
            grads = rule.per_example(module, calls) if missing else {}
        for param_name in own:
            name = found.canonical[_full_name(module_name, param_name)]
            k = position[id(params[name])]
            if name in found.tied:  # summed over its uses: values, or formed gradients
                value = values[param_name] if name in additive else grads[param_name]
                tied[name] = tied[name] + value if name in tied else value
            elif param_name in values:
                results[k] = LeafReduction(values[param_name], True)
            else:
                results[k] = LeafReduction(grads[param_name], False)
    for name, value in tied.items():
        results[position[id(params[name])]] = LeafReduction(value, name in additive)
    for name, value in found.unit_grads.items():
        results[position[id(params[name])]] = LeafReduction(value, False)
    batch_size = call.batch_size
    return [
        result
        if result is not None
        else LeafReduction(leaf.detach().new_zeros((batch_size, *leaf.shape)), False)
        for result, leaf in zip(results, found.diff)
    ]


def _check_layout(
    spec: Spec,
    call: Call,
    run: BatchedPass,
    summaries: dict[int, torch_checks.RowSummary],
    retain: bool,
) -> None:
    """The first run of a layout: every captured output gradient (or, for those dropped
    before the check, its summary) is row-local, and examples run alone get their batched loss
    (``torch_checks.py``). ``retain``: keep the graph for a later pass."""
    batch_size, losses = call.batch_size, run.losses
    if batch_size < 2:  # one example: every row is its own
        return

    def weighted_backward(weights: torch.Tensor) -> None:
        with torch.enable_grad():
            torch.autograd.grad(
                (losses * weights).sum(), run.light, allow_unused=True, retain_graph=retain
            )

    torch_checks.check_rows(
        run.captured(),
        weighted_backward,
        torch_checks.row_weights(batch_size, losses),
        summaries,
    )
    _check_losses_alone(spec, call, run)


def _check_losses_alone(spec: Spec, call: Call, run: BatchedPass) -> None:
    """The first examples run alone must get their batched losses (unless the model drew
    random numbers in ``run``: a run alone would draw other ones)."""
    if call.backend.rng_state_changed(run.rng):
        return  # the model draws random numbers (dropout): a run alone draws other ones
    single = single_example_fn(spec, call, {})
    batched = tuple(call.leaves[i][j] for i, j in call.batched_positions)
    detached = tuple(x.detach() for x in run.diff)
    index = torch_checks.check_losses_alone(
        single, detached, batched, run.losses.detach(), torch_checks.LOSS_CHECKS
    )
    if index is not None:
        raise GhostUnsupported(
            f"example {index} gets another loss when run alone than in the batched pass: the "
            f"examples interact (batch statistics, a branch on the whole batch), or the "
            f"model's output does not hold the batch on axis 0"
        )


def _unit_parameters(
    model: nn.Module, units: dict[str, nn.Module], params: dict[str, torch.Tensor]
) -> dict[str, dict[str, str]]:
    """unit name -> {name relative to the unit: full name} of the parameters it handles."""
    assigned: dict[str, dict[str, str]] = {unit: {} for unit in units}
    for name in params:
        owner = name.rpartition(".")[0]
        if rule_for(model.get_submodule(owner)) is not None:
            continue
        unit = torch_generic.find_unit(model, owner)
        if unit in assigned:
            assigned[unit][_relative_name(unit, name)] = name
    return assigned


def _relative_name(module_name: str, full_name: str) -> str:
    return full_name[len(module_name) + 1 :] if module_name else full_name


def _unit_grads(
    units: dict[str, nn.Module],
    assigned: dict[str, dict[str, str]],
    unit_records: dict[str, list[Any]],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """full name -> ``(B, *shape)`` per-example gradients of the generic units' parameters."""
    result = {}
    for unit, module in units.items():
        names = assigned[unit]
        unit_params = {rel: params[full].detach() for rel, full in names.items()}
        constants = _unit_constants(unit, module, set(names.values()), params, canonical)
        try:
            grads = torch_generic.per_example(
                module, unit_params, unit_records[unit], batch_size, constants
            )
        except GhostUnsupported as err:
            raise GhostUnsupported(f"layer {unit!r} ({type(module).__name__}): {err}") from err
        except Exception as err:
            if is_pergrad_error(err):
                raise
            raise GhostUnsupported(
                f"layer {unit!r} ({type(module).__name__}) has no ghost rule and torch.func "
                f"could not vectorise it alone ({type(err).__name__}: {err})"
            ) from err
        result.update({names[rel]: g.detach() for rel, g in grads.items()})
    return result


def _unit_constants(
    unit: str,
    module: nn.Module,
    differentiated: set[str],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
) -> dict[str, torch.Tensor]:
    """The values in ``params`` of the unit's other parameters (its layers with a rule, its
    nested units'), named relative to the unit, so that run alone it computes what the batched
    pass did; detached, so that only the unit's own parameters are differentiated. A tied
    parameter is given once, under its first name in the unit (``functional_call`` ties the
    others)."""
    constants = {}
    for rel, _ in module.named_parameters():
        name = canonical.get(_full_name(unit, rel))
        if name in params and name not in differentiated:
            constants[rel] = params[name].detach()
    return constants


def _light_targets(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    params: dict[str, torch.Tensor],
    canonical: dict[str, str],
) -> list[torch.Tensor]:
    """What to differentiate so that the backward pass reaches every hooked layer's output
    and computes no weight gradient: a layer's vector parameter (a bias, a norm's scale) if
    it has one; otherwise (a bias-free linear layer, an embedding: Llama's every layer, an LM
    head) for each call its input, where that is the layer's own argument, unchanged, and
    smaller than the output (an LM head's: its gradient is computed on the way anyway, and the
    output's, B x T x vocabulary numbers, would be returned and held), else its output, as long
    as no in-place op has changed them since (their hooks would not fire), else its smallest
    parameter."""
    chosen: dict[int, torch.Tensor] = {}
    for module_name, module in modules.items():
        own = [
            params[name]
            for param_name, _ in layer_parameters(module)
            if (name := canonical.get(_full_name(module_name, param_name))) in params
        ]
        if not own:
            continue
        smallest = min(own, key=lambda p: p.numel())
        outputs = [r.output for r in records[module_name] if r.output is not None]
        unchanged = all(
            r.output is None or r.output._version == r.output_version for r in records[module_name]
        )
        if smallest.dim() >= 2 and outputs and unchanged:
            for r in records[module_name]:
                if r.output is None:
                    continue
                x = r.light_input
                small = (
                    x is not None
                    and x._version == r.input_versions[0]
                    and x.numel() < r.output.numel()
                )
                target = x if small else r.output
                chosen[id(target)] = target
        else:
            chosen[id(smallest)] = smallest
    return list(chosen.values())


def _full_name(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def _owns_any(
    module_name: str, module: nn.Module, names: set[str], canonical: dict[str, str]
) -> bool:
    return any(
        canonical.get(_full_name(module_name, name)) in names
        for name, _ in layer_parameters(module)
    )


def _squared_norms_of(module: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    return rule_for(module).squared_norms(module, calls)


def _weighted_sum_of(weights: torch.Tensor, clean: bool = True) -> Any:
    def weighted_sum(module: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
        rule = rule_for(module)
        if clean:
            calls = weighted_calls(calls, weights)
        if rule.weighted_sum is not None:
            return rule.weighted_sum(module, calls, weights)
        per_example = rule.per_example(module, calls)  # as small as an activation
        return {k: torch.tensordot(weights.to(g.dtype), g, dims=1) for k, g in per_example.items()}

    return weighted_sum


def weighted_calls(calls: list[LayerCall], weights: torch.Tensor) -> list[LayerCall]:
    """The calls as a rule's weighted sum may read them: in the rows of the examples of weight
    0, the output gradients zeroed and the non-finite entries of the floating inputs replaced
    by 0.

    An example of weight 0 then adds exactly nothing (finite inputs, a zero output gradient,
    and a rule's sum is linear in the output gradients), where ``0 * nan`` from a nan record
    would be nan. Inputs are touched only where axis 0 has the batch size, and only their
    non-finite entries: an example of positive weight, a mask's ``-inf`` of a real example
    and an input shared by the batch keep their values. One elementwise pass over the records.
    """
    keep = weights != 0
    return [
        LayerCall(
            tuple(_finite_in_zero_rows(x, keep) for x in call.inputs),
            _zero_rows(call.output_grad, keep),
        )
        for call in calls
    ]


def _rows(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return keep.to(like.device).reshape((-1,) + (1,) * (like.dim() - 1))


def _finite_in_zero_rows(x: Any, keep: torch.Tensor) -> Any:
    if not (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dim() > 0
        and x.shape[0] == keep.shape[0]
    ):
        return x
    return torch.where(_rows(keep, x) | torch.isfinite(x), x, 0.0)


def _zero_rows(records: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``records`` (``(B, ...)``) with the rows of the examples of weight 0 zeroed."""
    return torch.where(_rows(keep, records), records, 0.0)


def _per_layer(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    params: dict[str, torch.Tensor],
    compute: Any,
    canonical: dict[str, str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(parameter name, value)`` from ``compute(layer, calls)`` for each hooked layer, over the
    differentiated parameters it owns, named as in ``params`` (``canonical``: every name of a
    parameter in the model -> that one). A tied parameter comes once for each layer using it."""
    for module_name, module in modules.items():
        calls = layer_calls(module_name, records[module_name])
        if not calls:  # never called, or its output did not reach the loss: zero gradients
            continue
        with torch.no_grad():
            values = compute(module, calls)
        for param_name, value in values.items():
            name = canonical.get(_full_name(module_name, param_name))
            if name in params:
                yield name, value


def _tied_squared_norms(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    params: dict[str, torch.Tensor],
    tied: dict[str, list[tuple[str, str]]],
    canonical: dict[str, str],
) -> dict[str, torch.Tensor]:
    """Squared norms of the parameters of the layers that share one (``tied``: name ->
    ``(module name, attribute)`` of each use): each layer's rule gives its own parameters'
    norms, and each shared parameter's adds its uses' norms and their cross terms in float64
    (``torch_tied.py``). Where some example's uses nearly cancel, the rules run again on float64
    copies of the calls. Layers whose output did not reach the loss add nothing."""
    sharing = sorted({owner for owners in tied.values() for owner, _ in owners})
    calls = {owner: layer_calls(owner, records[owner]) for owner in sharing}
    result, exact_enough = _tied_pass(modules, calls, params, tied, canonical)
    if not exact_enough:
        wide = {owner: torch_tied.widened(owner_calls) for owner, owner_calls in calls.items()}
        result, _ = _tied_pass(modules, wide, params, tied, canonical)
    return result


def _tied_pass(
    modules: dict[str, nn.Module],
    calls: dict[str, list[LayerCall]],
    params: dict[str, torch.Tensor],
    tied: dict[str, list[tuple[str, str]]],
    canonical: dict[str, str],
) -> tuple[dict[str, torch.Tensor], bool]:
    """:func:`_tied_squared_norms` from the sharing layers' ``calls`` as they are, and whether
    every tied sum is :func:`torch_tied.well_conditioned` (always, for float64 calls)."""
    result, exact_enough = {}, True
    with torch.no_grad():
        own = {
            owner: rule_for(modules[owner]).squared_norms(modules[owner], owner_calls)
            for owner, owner_calls in calls.items()
            if owner_calls
        }
        for owner, values in own.items():
            for param_name, value in values.items():
                name = canonical.get(_full_name(owner, param_name))
                if name in params and name not in tied:
                    result[name] = value.to(params[name].dtype)
        for name, owners in tied.items():
            present = [(owner, attribute) for owner, attribute in owners if owner in own]
            if present:
                terms = [own[o][a] for o, a in present]
                total = torch_tied.tied_squared_norms(
                    [torch_tied.Use(modules[o], a, calls[o]) for o, a in present], terms
                )
                wide = all(t.dtype == torch.float64 for t in terms)
                exact_enough &= wide or torch_tied.well_conditioned(total, terms)
                result[name] = total.to(params[name].dtype)
    return result, exact_enough


def _fill_zeros(
    params: dict[str, torch.Tensor], position: dict[int, int], squared: list[Any], batch_size: int
) -> None:
    """Zero norms for the parameters no hook saw (layers whose output did not reach the loss)."""
    for leaf in params.values():
        if squared[position[id(leaf)]] is None:
            squared[position[id(leaf)]] = leaf.new_zeros(batch_size)


@dataclass
class BatchGradient:
    """A first run's batch gradient, as its checks need it: each leaf's squared norm (None
    where the loss does not reach it), and the whole gradient of the ``kept`` leaves (those
    whose per-example gradients are formed, checked entry by entry)."""

    squared_norms: list[Any]
    kept: dict[int, torch.Tensor]


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grad.detach()) ** 2


def _batch_gradient(
    total: torch.Tensor, diff: list[torch.Tensor], keep: set[int], retain: bool
) -> BatchGradient:
    """The backward pass of ``total`` into every leaf of ``diff``, each leaf's gradient
    reduced to its squared norm as soon as the pass has accumulated it and then dropped (kept
    whole for the leaves in ``keep``): a first run checks the norms against the batch gradient
    without holding a model's worth of gradients beside the records."""
    found = BatchGradient([None] * len(diff), {})

    def reduce(k: int, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        assert grad is not None
        found.squared_norms[k] = _squared_norm(grad)
        if k in keep:
            found.kept[k] = grad

    handles = [
        leaf.register_post_accumulate_grad_hook(functools.partial(reduce, k))
        for k, leaf in enumerate(diff)
    ]
    try:
        torch.autograd.backward(total, inputs=diff, retain_graph=retain)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _check_consistency(
    params: dict[str, torch.Tensor],
    position: dict[int, int],
    squared: list[Any],
    batch_squared_norms: list[Any],
    batch_size: int,
) -> None:
    """Refuse norms the batch gradient contradicts (``batch_squared_norms``: each leaf's
    ``|sum_i g_i|^2``, None where the loss does not reach it).

    For any per-example gradients, ``|sum_i g_i|^2 <= B sum_i |g_i|^2``. If the batch gradient
    breaks it, some use of the parameter escaped the layer hooks.
    """
    checked = [(k, g) for k, g in enumerate(batch_squared_norms) if g is not None]
    if not checked:
        return
    batch_sq = torch.stack([g for _, g in checked])
    bound = batch_size * torch.stack([squared[k].sum() for k, _ in checked])
    slack = _CONSISTENCY_SLACK.get(torch_checks.checked_dtype(batch_sq), _LOW_PRECISION_SLACK)
    escaped = (batch_sq > bound * (1 + slack) + 1e-30).nonzero().flatten().tolist()
    if escaped:
        names = {position[id(leaf)]: name for name, leaf in params.items()}
        raise GhostUnsupported(
            f"parameter {names[checked[escaped[0]][0]]!r} has a batch gradient larger than its "
            f"per-example norms allow: it is used outside the forward pass of the layer that "
            f"owns it"
        )
