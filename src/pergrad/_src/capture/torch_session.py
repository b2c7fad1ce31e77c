"""One captured pass of a :func:`pergrad.module_loss`, and its state until it has been reduced.

:func:`forward` runs the model ONCE on the whole batch (``functional_call`` with fresh leaf
tensors for the parameters, so the model's own tensors, ``.grad`` fields and flags are never
touched; on a checked layout's later runs, where ``params`` are views of the model's own
parameters, the model itself, differentiated with ``torch.autograd.grad`` only:
:func:`own_leaves`) under the hooks of ``torch_engine.py`` (layers with a rule),
``torch_generic.py`` (generic units) and ``torch_position_bias.py`` (position-bias tables), and
gives each example's loss (``torch.func.vmap`` over the output's rows, the ``unsqueeze(0)`` that
``module_loss`` does). The backward passes that follow (``torch_passes.py``) fill each record's
output gradient; the reductions (``torch_quantities.py``) and the first call's checks
(``torch_verify.py``) read them from the :class:`CapturedPass`.

What the backward passes differentiate (:attr:`CapturedPass.light`) reaches every hooked
output without computing a weight gradient by a matrix product: a layer's bias, or its
recorded input or output, or a small lookup table's weight (:func:`_light_targets`). A
recorded output that cannot be a light target is let go as soon as its call returns
(:func:`_outputs_let_go`). :func:`when_complete` arms the records so that a layer's output
gradients are reduced, and dropped, in the tensor hook of its last call (the low-memory mode).
A ``torch.compile(model)`` whose layout is checked is run in whole graphs instead
(``torch_compiled.py``): the same records, and its light targets are the probes at the layers'
outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import (
    torch_checks,
    torch_compiled,
    torch_generic,
    torch_own,
    torch_position_bias,
)
from pergrad._src.capture.rules import layer_parameters, rule_for
from pergrad._src.capture.torch_engine import (
    LayerRecord,
    capturing,
    model_and_loss_arguments,
    per_example_losses,
)
from pergrad._src.capture.torch_plan import Ownership, ownership
from pergrad._src.core.call import Call, Spec
from pergrad._src.core.module_loss import ModuleLoss, refuse_batch_mixing_layers
from pergrad._src.errors import Unsupported

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


@dataclass(kw_only=True)
class CapturedPass:
    """The batched forward pass of one call under the hooks, and what its backward passes and
    reductions add to it.

    Attributes:
      diff: the differentiated leaves (fresh tensors), in the core's flat order.
      params: the parameter dict the model ran with (its values are ``diff``).
      owners: which layer, unit or table reduces each parameter (``torch_plan.Ownership``).
      batch_size: ``B``.
      records: the hooked layers' calls (``torch_engine.LayerRecord``), by layer name.
      unit_records, bias_records: the generic units' and position-bias tables' calls, until
        their per-example gradients are formed (then emptied, :meth:`release`).
      losses: ``(B,)`` per-example losses and their graph; None once no backward pass follows.
      loss_values: the same losses, detached: kept after the graph is freed (a DP step reports
        their mean).
      light: what a backward pass differentiates to reach every hooked output without any
        weight gradient (empty once no backward pass follows).
      rng: the backend's random-number state before the forward pass.
      unit_grads: name in ``params`` -> ``(B, *shape)`` per-example gradients of the generic
        units' parameters and the position-bias tables.
      held: name in ``params`` -> ``(B, *shape)`` per-example gradients of the layers reduced to
        them in the backward pass, their records dropped there (``torch_held.py``).
      squared: per leaf ``(B,)`` squared norms, or None when not asked for.
      summaries: ``id(record) -> torch_checks.RowSummary`` of the output gradients dropped
        after their layer was reduced (the low-memory mode): the row check and the second
        pass compare these.
      pending_key: the layout whose first-call checks the low-memory mode's second pass still
        owes (None: none).
      signature: the records' ``torch_checks.records_signature``, where :func:`forward` has
        read it (a pass on the model's own parameters; None: not read).
    """

    diff: list[torch.Tensor]
    params: dict[str, torch.Tensor]
    owners: Ownership
    batch_size: int
    records: dict[str, list[LayerRecord]]
    unit_records: dict[str, list[Any]]
    bias_records: dict[str, list[Any]]
    losses: torch.Tensor | None
    light: list[torch.Tensor]
    rng: Any
    unit_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    held: dict[str, torch.Tensor] = field(default_factory=dict)
    squared: list[Any] | None = None
    summaries: dict[int, torch_checks.RowSummary] = field(default_factory=dict)
    pending_key: Any = None
    loss_values: torch.Tensor | None = None
    signature: Any = None

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """``id(leaf) -> index`` in ``diff``."""
        return {id(leaf): k for k, leaf in enumerate(self.diff)}

    def index_of(self, name: str) -> int:
        """The position in ``diff`` of parameter ``name`` (as in ``params``)."""
        return self.position[id(self.params[name])]

    def captured(self) -> dict[str, list[Any]]:
        """Every record with a gradient slot: layers, units, tables."""
        return {**self.records, **self.unit_records, **self.bias_records}

    def summarize_and_drop_gradients(self) -> None:
        """Keep only a row summary of each output gradient received (in ``summaries``), and
        drop the later gradients of the units and tables, whose sums come from their formed
        per-example gradients."""
        slots = [r for rs in self.captured().values() for r in rs]
        for slot in slots:
            if slot.output_grad is not None:
                self.summaries[id(slot)] = torch_checks.summarize_rows(slot.output_grad)
        for slot in slots:
            slot.output_grad = None
        for rs in (*self.unit_records.values(), *self.bias_records.values()):
            for r in rs:
                r.watch = _drop

    def release(self, keep_graph: bool) -> None:
        """Drop what only the capture needed: the units' and tables' records, and, unless
        ``keep_graph`` (a second backward pass follows), the losses and their graph."""
        self.unit_records, self.bias_records = {}, {}
        if not keep_graph:
            self.release_graph()

    def release_graph(self) -> None:
        """Drop the losses and the light targets: the graph is freed."""
        self.losses, self.light = None, []


def _drop(grad: torch.Tensor) -> None:
    """A gradient slot's watch that drops what it is given."""


def forward(
    spec: Spec, call: Call, loss: ModuleLoss, layers: dict[str, str], compiled: bool = False
) -> CapturedPass:
    """The batched forward pass with every layer of ``layers`` (module name -> rule, as
    ``torch_plan.plan`` gives) hooked, and the per-example losses. ``compiled``: a
    ``torch.compile`` d model may be captured in whole graphs (``torch_compiled.capture``;
    its records give only the output gradients and inputs: no weight gradient follows).

    A later run of a checked layout runs the model on its own parameters where ``params`` are
    views of them (:func:`own_leaves`), without ``functional_call``; its records must then
    have a checked signature too, else the pass is run again with fresh leaves (a first run's
    backward pass writes its leaves' ``.grad``, ``torch_verify.batch_gradient``)."""
    refuse_batch_mixing_layers(loss.model, spec.func_name)
    own = own_leaves(call, loss)
    if own is not None:
        leaves, key = own
        session = _forward(spec, call, loss, layers, compiled, leaves)
        signature = torch_checks.records_signature(session.captured(), call.batch_size)
        if torch_checks.is_checked(loss, "ghost", key, signature):
            session.signature = signature
            return session
        call.backend.set_rng_state(session.rng)  # (the same random draws)
        del session
    return _forward(spec, call, loss, layers, compiled, None)


#: Whether later runs of a checked layout may run the model on its own parameters
#: (:func:`own_leaves`); a switch for the benchmarks that compare the two.
OWN_PARAMETERS = True


def own_leaves(call: Call, loss: ModuleLoss) -> tuple[list[torch.Tensor], Any] | None:
    """The model's own parameters, in the order of ``call.diff_positions``, where the forward
    pass may run on them, and the call's ``torch_checks.layout_key`` (else None: fresh
    leaves): the parameters are one dict of names, each a view of the model's own parameter
    that ``torch_own.own_parameters_to_differentiate`` accepts; the ghost strategy has checked
    the call's layout (a first run's checks write its leaves' ``.grad``); the model is not a
    ``torch.compile`` d one (whose graphs run on ``functional_call`` s parameters,
    ``torch_compiled.py``); no ``torch.autocast`` is on (``torch_own.autocast_on``)."""
    if not OWN_PARAMETERS or torch_compiled.is_compiled(loss.model):
        return None
    leaves, treedef = call.leaves[0], call.treedefs[0]
    if torch_own.autocast_on(leaves):
        return None
    if len(call.diff_positions) != len(leaves) or any(i != 0 for i, _ in call.diff_positions):
        return None
    if getattr(treedef, "type", None) is dict and len(treedef.context) == treedef.num_leaves:
        params = dict(zip(treedef.context, leaves))  # (a flat dict, as the plan requires)
    else:
        params = call.backend.unflatten(treedef, leaves)
    if not (isinstance(params, dict) and all(isinstance(name, str) for name in params)):
        return None
    arguments = [x for xs in call.leaves[1:] for x in xs]
    key = torch_checks.layout_key(params, arguments, call.batch_size)
    if not torch_checks.has_checked(loss, "ghost", key):
        return None
    mine = torch_own.own_parameters_to_differentiate(loss.model, params)
    names = {id(value): name for name, value in params.items()}
    if mine is None or len(names) < len(params):  # (one tensor under two names)
        return None
    return [mine[names[id(leaves[j])]] for _, j in call.diff_positions], key


def _forward(
    spec: Spec,
    call: Call,
    loss: ModuleLoss,
    layers: dict[str, str],
    compiled: bool,
    own: list[torch.Tensor] | None,
) -> CapturedPass:
    """:func:`forward`'s pass, on the model's own parameters ``own`` (None: fresh leaves and
    ``functional_call``)."""
    model = loss.model
    batch_size = call.batch_size
    if own is None:
        diff = [call.leaves[i][j].detach().requires_grad_(True) for i, j in call.diff_positions]
    else:
        diff = own
    batched = [call.leaves[i][j] for i, j in call.batched_positions]
    args = call.rebuild(diff, batched)
    params = args[0]
    inputs, targets, target_dims = model_and_loss_arguments(call, args, loss.num_inputs, batch_size)
    owners = _remembered_ownership(loss, params, layers)
    # Each generic unit's smallest parameter (and below, each layer's bias or output):
    # differentiating these reaches every output gradient at almost no cost of its own.
    unit_light = [
        min((params[full] for full in names.values()), key=lambda p: p.numel())
        for names in owners.unit_parameters.values()
    ] + [params[weight] for weight in owners.tables.values()]  # a table: buckets x heads numbers
    smallest = {
        name: _smallest_parameter(owners, name, module, params)
        for name, module in owners.modules.items()
    }
    rng = call.backend.rng_state()
    with torch.enable_grad():
        # a torch.compile'd model, its layout checked: the records from whole graphs
        in_graphs = torch_compiled.capture(loss, owners, call, params, inputs) if compiled else None
        if in_graphs is not None:
            output, records = in_graphs.output, in_graphs.records
            unit_records, bias_records = in_graphs.unit_records, {}
        else:
            with (
                capturing(owners.modules, batch_size) as records,
                _outputs_let_go(owners, smallest, records),
                torch_generic.capturing_units(owners.units, batch_size) as unit_records,
                torch_position_bias.capturing(
                    model, list(owners.tables), batch_size
                ) as bias_records,
            ):
                output = loss.forward(params if own is None else None, inputs)
            # chosen before the loss, the outputs let go (see _light_targets); checked after it
            watched = _reachable_by_the_loss(records, output)
            chosen = _light_targets(owners, records, smallest)
        losses = per_example_losses(spec, loss, output, targets, target_dims, batch_size)
    if in_graphs is not None:  # the probes' gradients are the output gradients
        light = in_graphs.probes
        _let_go_of_outputs(records)
    else:
        light = _light_after_the_loss(chosen, watched, smallest) + unit_light
        del chosen, watched
    return CapturedPass(
        diff=diff,
        params=params,
        owners=owners,
        batch_size=batch_size,
        records=records,
        unit_records=unit_records,
        bias_records=bias_records,
        losses=losses,
        light=light,
        rng=rng,
        loss_values=losses.detach(),
    )


# Each loss's last ownerships of its parameters, under the model's structure they were worked
# out from (see _remembered_ownership).
_OWNERSHIP: weakref.WeakKeyDictionary[ModuleLoss, dict[Any, Ownership]] = (
    weakref.WeakKeyDictionary()
)


def _remembered_ownership(
    loss: ModuleLoss, params: dict[str, torch.Tensor], layers: dict[str, str]
) -> Ownership:
    """``torch_plan.ownership`` of this call, kept on the loss under what it depends on, read
    afresh at each call: the parameter names, the plan's layers, every module (name, object,
    class, rule) and every parameter (name, object). Working it out walks the model (0.2 ms a
    call on the bench transformer, 4% of its batch gradient); reading the structure, a tenth
    of that. (A module or parameter replaced under the same name is another object: the
    ownership kept holds the modules it names, so their ids are not reused meanwhile.)"""
    model = loss.model
    key = (
        tuple(params),
        tuple(layers.items()),
        tuple(
            (name, id(m), type(m), id(rule_for(m)))
            for name, m in model.named_modules(remove_duplicate=False)
        ),
        tuple((name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)),
    )
    kept = _OWNERSHIP.setdefault(loss, {})
    found = kept.get(key)
    if found is None:
        if len(kept) >= 8:  # (the oldest dropped)
            kept.pop(next(iter(kept)))
        found = kept[key] = ownership(model, params, layers)
    return found


def _light_targets(
    owners: Ownership,
    records: dict[str, list[LayerRecord]],
    smallest_parameters: dict[str, torch.Tensor | None],
) -> list[torch.Tensor]:
    """What to differentiate so that the backward pass reaches every hooked layer's output
    and computes no weight gradient: a layer's vector parameter (a bias, a norm's scale) if
    it has one; otherwise (a bias-free linear layer, an embedding: Llama's every layer, an LM
    head) for each call its input, where that is the layer's own argument, unchanged, and no
    larger than the output (an LM head's: its gradient is computed on the way anyway, and the
    output's, B x T x vocabulary numbers, would be returned and held; a square projection's:
    autograd keeps the input for the weight gradient anyway, where it may not keep the output,
    and one input serves every layer reading it, as Llama's and T5's query, key and value
    projections do: 32 MiB less of Llama's working memory at T=128, B=16, 1.11x to 1.02x the
    non-private step's), else its output, as long
    as no in-place op has changed them since (their hooks would not fire), else its smallest
    parameter; a lookup table of fewer numbers than its outputs, its weight
    (:func:`_table_is_lighter`). ``smallest_parameters``: each layer's
    (:func:`_smallest_parameter`).

    By layer, each target with its version as chosen. Read at the end of the model's forward
    pass, before the loss; the records' outputs and inputs are let go here (each output the
    graph's now, or a target): the outputs that autograd does not keep (a square projection's
    whose input is its target, the pre-activations of a bias-free MLP) are then freed before
    the loss's own buffers come, where the step's peak was (T5 at T=128, B=16: 104 MiB of
    them, its DP step's live tensors 629 MiB against the non-private step's 513)."""
    chosen: dict[str, list[tuple[torch.Tensor, int]]] = {}
    for module_name, module in owners.modules.items():
        smallest = smallest_parameters[module_name]
        if smallest is None:
            continue
        layer_records = records[module_name]
        unchanged = all(
            r.output is None or r.output._version == r.output_version for r in layer_records
        )
        outputs = [r.output for r in layer_records if r.output is not None]
        table = _table_is_lighter(owners, module_name, module, smallest, outputs)
        layer_targets = []
        if smallest.dim() >= 2 and outputs and unchanged and not table:
            for r in layer_records:
                if r.output is not None:
                    x = _light_input(r)
                    target = r.output if x is None else x
                    layer_targets.append((target, target._version))
        else:
            layer_targets.append((smallest, smallest._version))
        chosen[module_name] = layer_targets
    _let_go_of_outputs(records)
    return chosen


def _let_go_of_outputs(records: dict[str, list[LayerRecord]]) -> None:
    """The records keep their inputs only: each output is the graph's now, or a light target
    (an LM head's logits are freed early)."""
    for layer_records in records.values():
        for record in layer_records:
            record.output = record.light_input = None


def _reachable_by_the_loss(
    records: dict[str, list[LayerRecord]], output: Any
) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """By layer, its recorded outputs (with their versions) that share storage with a tensor of
    the model's ``output``: the loss function, which receives it, may change those in place
    (a layer output returned as it is, or a view of it: the logits, the hidden states, the
    key-value cache), which :func:`_light_after_the_loss` then sees. Read with the records'
    outputs still in place (before :func:`_light_targets` lets them go)."""
    returned = {x.untyped_storage().data_ptr() for x in _tensors_in(output)}
    watched: dict[str, list[tuple[torch.Tensor, int]]] = {}
    for module_name, layer_records in records.items():
        for r in layer_records:
            if r.output is not None and r.output.untyped_storage().data_ptr() in returned:
                watched.setdefault(module_name, []).append((r.output, r.output_version))
    return watched


def _tensors_in(output: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors of a model's output: in tuples, lists, dicts (Hugging Face's
    ``ModelOutput``) and dataclasses, nested."""
    if isinstance(output, torch.Tensor):
        yield output
    elif depth > 8:  # (a structure this deep holds no layer's output)
        return
    elif isinstance(output, (tuple, list)):
        for x in output:
            yield from _tensors_in(x, depth + 1)
    elif isinstance(output, dict):
        for x in output.values():
            yield from _tensors_in(x, depth + 1)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for f in dataclasses.fields(output):
            yield from _tensors_in(getattr(output, f.name, None), depth + 1)


def _light_after_the_loss(
    chosen: dict[str, list[tuple[torch.Tensor, int]]],
    watched: dict[str, list[tuple[torch.Tensor, int]]],
    smallest_parameters: dict[str, torch.Tensor | None],
) -> list[torch.Tensor]:
    """The light targets of :func:`_light_targets`, each once, where the loss changed none of a
    layer's targets nor of its outputs it could reach (:func:`_reachable_by_the_loss`) in
    place; such a layer's smallest parameter instead (the hooks on its outputs would not fire,
    or the target would no longer lead to them)."""
    light: dict[int, torch.Tensor] = {}
    for module_name, layer_targets in chosen.items():
        kept = layer_targets + watched.get(module_name, [])
        if any(x._version != version for x, version in kept):
            smallest = smallest_parameters[module_name]
            assert smallest is not None
            layer_targets = [(smallest, smallest._version)]
        for target, _ in layer_targets:
            light[id(target)] = target
    return list(light.values())


def _table_is_lighter(
    owners: Ownership,
    module_name: str,
    module: nn.Module,
    weight: torch.Tensor,
    outputs: list[torch.Tensor],
) -> bool:
    """Whether to differentiate a lookup table's weight rather than its outputs: a layer whose
    rule reads it by rows (``rules.LayerRule.lookups``: its weight gradient is a scatter of
    the output gradients, no matrix product), used by no other layer (a tied table's gradient
    would compute its other uses', an LM head's product), with fewer numbers than its
    outputs. The outputs, which autograd does not keep (an embedding's output is only added
    to), are then freed with the forward pass instead of held through the backward pass, and
    the pass returns a table-sized gradient instead of theirs: BERT's position and token-type
    tables, 4 MiB each way at T=128, B=16."""
    rule = rule_for(module)
    return (
        rule is not None
        and rule.lookups is not None
        and module_name not in owners.sharing
        and weight.numel() < sum(output.numel() for output in outputs)
    )


def _smallest_parameter(
    owners: Ownership, module_name: str, module: nn.Module, params: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """The smallest of the parameters in ``params`` that layer ``module_name`` reduces (None:
    none)."""
    own = [
        params[name]
        for param_name, _ in layer_parameters(module)
        if (name := owners.name_in_params(module_name, param_name)) is not None
    ]
    return min(own, key=lambda p: p.numel()) if own else None


@contextmanager
def _outputs_let_go(
    owners: Ownership,
    smallest_parameters: dict[str, torch.Tensor | None],
    records: dict[str, list[LayerRecord]],
) -> Iterator[None]:
    """Forward hooks, run after the capture's, that let go of each call's recorded output (and
    the input kept beside it) as soon as the call returns, for the layers whose light target
    is a vector parameter (:func:`_light_targets` reads those only for layers without one).
    Held to the end of the forward pass, they would add to its peak every such output that
    autograd does not keep itself (an attention block's output projection, a residual
    branch's last linear layer): BERT's (4 layers, width 256, T=128, B=16) forward pass
    peaked 14 MiB higher (134 against 120 MiB above the step's baseline).
    ``smallest_parameters``: each layer's (:func:`_smallest_parameter`)."""
    records_of = {
        id(module): records[module_name]
        for module_name, module in owners.modules.items()
        if (smallest := smallest_parameters[module_name]) is not None and smallest.dim() < 2
    }
    if not records_of:
        yield
        return
    # one untraced hook for all (as the capture's own: see torch_engine.capturing; wrapping
    # costs about 10 us, a tenth of a small layer's call)
    let_go = torch.compiler.disable(functools.partial(_let_go, records_of))
    handles = [
        module.register_forward_hook(let_go)
        for module in owners.modules.values()
        if id(module) in records_of
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _let_go(
    records_of: dict[int, list[LayerRecord]], module: nn.Module, args: Any, output: Any
) -> None:
    """The hook of :func:`_outputs_let_go`: the call just recorded keeps its inputs only."""
    layer_records = records_of[id(module)]
    if layer_records:
        layer_records[-1].output = layer_records[-1].light_input = None


def _light_input(record: LayerRecord) -> torch.Tensor | None:
    """The call's own input, where differentiating it instead of the output holds no more and
    still reaches the output gradient (unchanged since the layer read it, no larger)."""
    x = record.light_input
    assert record.output is not None
    if (
        x is not None
        and x._version == record.input_versions[0]
        and x.numel() <= record.output.numel()
    ):
        return x
    return None


@contextmanager
def reentrant_refused() -> Iterator[None]:
    """Turn the error of a backward pass through reentrant activation checkpointing into
    :class:`Unsupported` (:data:`REENTRANT`); other errors pass through."""
    try:
        yield
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        raise Unsupported(REENTRANT) from err


# complete(layer name, layer, its records) -> whether its output gradients may be dropped
CompleteFn = Callable[[str, nn.Module, list[LayerRecord]], bool]


def when_complete(
    modules: dict[str, nn.Module],
    records: dict[str, list[LayerRecord]],
    complete: CompleteFn,
    reached: Callable[[LayerRecord], bool] = lambda r: r.hooked,
) -> None:
    """Arm the low-memory mode for the backward pass that follows: when every recorded call of
    a layer that the pass reaches (``reached``: an output that requires grad; in a second
    pass, a call the first reached) has its output gradient, ``complete(name, layer,
    records)`` runs there and then (in the tensor hook) and, where it returns True, the
    records drop their output gradients, so that at most a few layers' output gradients are
    alive at once instead of every layer's.

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
