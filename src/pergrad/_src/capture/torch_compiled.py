"""The ghost capture of a ``torch.compile`` d model in whole graphs (issue 36).

The eager capture (``torch_engine.capturing``) records each layer's output gradient with a
tensor hook that stores it: a side effect dynamo cannot put in a graph, so a compiled model's
forward pass breaks into one graph per hooked layer. A compiled graph also hides its
intermediate tensors from tensor hooks and from ``torch.autograd.grad``. Here, instead, each
hooked layer call's output gets a zero *probe* added (``output + probe``), a leaf tensor that
is an INPUT of the compiled function: the gradient of the loss with respect to the probe is the
output gradient (a tensor hook on a leaf input fires, compiled or not), and the layer's inputs
leave the graph as its outputs (a forward hook that appends to a list is a side effect dynamo
replays after the graph). The function pergrad compiles (:func:`capture`) runs the model under
the user's ``OptimizedModule`` (``model._orig_mod``) with the parameters detached, by the user's
own compile settings (``model.dynamo_ctx``: backend and options): its backward pass computes
the probes' gradients only, no weight gradient.

When it applies: the model is ``torch.compile(model)`` (an ``OptimizedModule``), no layer under
it is compiled in place (``layer.compile()``: its calls would be separate graphs, with the
hooks outside them), every parameter belongs to a layer with a rule or to a generic unit
(``torch_generic.py``: its arguments and first output recorded in the graph, a probe on that
output), with no position-bias table, in a one-pass capture (not the
low-memory mode's, whose second backward pass needs the first's graph), and the layout has
passed the ghost strategy's first-call checks (``torch_checks.has_checked``). Otherwise
:func:`capture` returns None and the caller takes the eager capture. The first run of a layout
(its checks) runs with dynamo off (:func:`eager_until_checked`): nothing is compiled for it.
Not thread-safe: the hooks find the run's probes and lists through one global (``_ACTIVE``).

A call is recorded as the eager capture records it (``torch_engine.recorded_call``), traced
into the graph: plainly, or by its rule's ``record`` (``nn.MultiheadAttention``: its inputs,
masks and the parameter values of the pass), the probe then added to the output the record
names, in the layer's returned structure. A rule's ``check`` (Hugging Face's RMS norms) runs on
the eager run of each layout and batch size (:func:`_layer_calls`), outside the graph. An
output a rule's record does not read (attention weights, ``need_weights=True``) gets a probe
of its own: a compiled backward pass gives every output of its graph a gradient, zeros where
the loss does not use it, and a gradient there that is not all zeros refuses the call
(``torch_engine.note_unread``), as the eager capture's tensor hook does.

Completeness: a probe needs each layer call's output shape, and the records must cover every
call. The first compiled capture of a layout runs the model once eagerly (no gradient) with
hooks that note each call's output shape and dtype (:func:`_layer_calls`); every compiled run
must then record exactly those calls, with those shapes, or it is dropped and the eager capture
runs instead (dynamo does not guard on module hooks, ``skip_nnmodule_hook_guards``: a graph
traced without pergrad's hooks could be reused silently, and its records would be missing);
their signature (``torch_checks.records_signature``) must also be one the first-call checks
passed. A layout whose compiled run failed so is not tried again.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.func import functional_call

from pergrad._src.capture import torch_checks
from pergrad._src.capture.rules import LayerRule, rule_for
from pergrad._src.capture.torch_engine import LayerRecord, note_unread, recorded_call
from pergrad._src.capture.torch_generic import UnitCall, first_tensor
from pergrad._src.capture.torch_plan import POSITION_BIAS, Ownership
from pergrad._src.core.call import Call
from pergrad._src.core.module_loss import ModuleLoss, running_statistics_left_alone

# The prefix torch.compile(model) gives the names of the model's parameters and buffers.
PREFIX = "_orig_mod."


@dataclass(frozen=True)
class LayerCallShape:
    """One call of a hooked layer, from the eager run: the shape and dtype of the tensor the
    probe is added to (its output, the output broadcast to the batch, or the output its rule's
    ``record`` names), the batch axis of the recorded output, and the shapes and dtypes of the
    outputs its rule does not read (``Recorded.unread``: attention weights), each of which
    gets a probe of its own, whose gradient says whether the loss reaches it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_axis: int
    unread: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()


@dataclass
class CompiledCapture:
    """A compiled run's output, its records (as ``torch_engine.capturing`` gives them, their
    output gradients filled by the backward pass through the probes' hooks), and the probes:
    what that backward pass differentiates."""

    output: Any
    records: dict[str, list[LayerRecord]]
    probes: list[torch.Tensor]
    unit_records: dict[str, list[UnitCall]]


@dataclass
class _Compiled:
    """A layout's expected layer calls and the compiled function that runs them."""

    calls: dict[str, list[LayerCallShape]]
    function: Any


class _Active:
    """What the hooks of the compiled run read: the probes, and where the inputs go. Set inside
    the compiled function from its arguments (a global object, so that a graph reused on a
    later step replays its appends into that step's lists, not into the lists it was traced
    with)."""

    probes: dict[str, list[torch.Tensor]] | None = None
    unread: dict[str, list[tuple[torch.Tensor, ...]]] | None = None
    sink: dict[str, list[tuple[Any, ...]]] | None = None


_ACTIVE = _Active()
_CaptureFn = TypeVar("_CaptureFn", bound=Callable[..., Any])
# ModuleLoss -> layout key -> _Compiled, or None where the compiled capture failed
_COMPILED: weakref.WeakKeyDictionary[ModuleLoss, dict[Any, _Compiled | None]] = (
    weakref.WeakKeyDictionary()
)


def eager_until_checked(capture_fn: _CaptureFn) -> _CaptureFn:
    """``torch_passes.capture``, run with dynamo off (``torch.compiler.set_stance("force_eager")``)
    on a compiled model's first run of a layout: its checks (the weighted pass, the examples run
    alone) would otherwise compile the model cut at every hooked layer, and once per batch of
    one, for a single step; the compiled capture takes over from the next run (the checks
    establish the layout, which the compiled model computes as the eager one does)."""

    @functools.wraps(capture_fn)
    def capture(spec: Any, call: Call, loss: ModuleLoss, *args: Any, **kwargs: Any) -> Any:
        set_stance = getattr(torch.compiler, "set_stance", None)  # (torch >= 2.6)
        if set_stance is None or not _first_run_of_compiled(loss, call):
            return capture_fn(spec, call, loss, *args, **kwargs)
        with set_stance("force_eager"):
            return capture_fn(spec, call, loss, *args, **kwargs)

    return capture


def _first_run_of_compiled(loss: ModuleLoss, call: Call) -> bool:
    model = loss.model
    if not is_compiled(model) or _compiled_inside(model):
        return False
    params = call.backend.unflatten(call.treedefs[0], call.leaves[0])
    arguments = [x for xs in call.leaves[1:] for x in xs]
    key = torch_checks.layout_key(params, arguments, call.batch_size)
    return not torch_checks.has_checked(loss, "ghost", key)


def is_compiled(model: Any) -> bool:
    """Whether ``model`` is a ``torch.compile(model)`` (an ``OptimizedModule``). Without
    importing dynamo: where it was never imported, nothing was compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def _compiled_inside(model: nn.Module) -> bool:
    """Whether a module under ``torch.compile(model)`` is compiled on its own."""
    return any(
        is_compiled(m) or getattr(m, "_compiled_call_impl", None) is not None
        for m in model._orig_mod.modules()
    )


def why_not(model: nn.Module, owners: Ownership) -> str | None:
    """Why the compiled capture cannot run ``model``'s layers (None: it can, once a layout has
    passed its first-call checks)."""
    if not is_compiled(model):
        return "the model is not a torch.compile(model) (an OptimizedModule)"
    modules = {**owners.modules, **owners.units}
    return _why_not_layers(model, modules, bool(owners.tables))


def _why_not_layers(model: nn.Module, modules: dict[str, nn.Module], tables: bool) -> str | None:
    if _compiled_inside(model):
        return "a module under the compiled model is compiled on its own (layer.compile())"
    if tables:
        return "position-bias tables are expanded to the batch outside the compiled graph"
    if not all(name.startswith(PREFIX) or name == PREFIX[:-1] for name in modules):
        return "a hooked layer is not under the compiled model"
    return None


def describe(model: nn.Module, layers: dict[str, str]) -> str | None:
    """What a ghost ``StrategyChoice`` reason says of a ``torch.compile(model)`` (None for any
    other model): whether its norm pass runs in whole graphs, and if not, why. ``layers``: each
    hooked layer's, unit's and table's family by module name (``torch_plan.plan``)."""
    if not is_compiled(model):
        return None
    named = dict(model.named_modules())
    modules = {name: named[name] for name in layers if name in named}
    why = _why_not_layers(model, modules, POSITION_BIAS in layers.values())
    if why is None:
        return (
            "torch.compile: from the second call of each layout, the norm pass runs in whole "
            "graphs (a probe at each layer's output)"
        )
    return f"torch.compile: the norm pass cut at each hooked layer ({why})"


def capture(
    loss: ModuleLoss,
    owners: Ownership,
    call: Call,
    params: dict[str, torch.Tensor],
    inputs: tuple[Any, ...],
) -> CompiledCapture | None:
    """The batched forward pass of a compiled model with every layer of ``owners`` recorded,
    in whole graphs; None where the compiled capture does not apply (:func:`why_not`, a layout
    not yet checked) or failed (the caller then runs the eager capture)."""
    if why_not(loss.model, owners) is not None:
        return None
    batch_size = call.batch_size
    key = torch_checks.layout_key(params, [x for xs in call.leaves[1:] for x in xs], batch_size)
    if not torch_checks.has_checked(loss, "ghost", key):
        return None
    layouts = _COMPILED.setdefault(loss, {})
    exact = (key, batch_size)  # (the probes' shapes are this batch size's)
    if exact not in layouts:
        calls = _layer_calls(loss, owners, params, inputs, batch_size)
        layouts[exact] = None if calls is None else _Compiled(calls, _compile(loss.model))
    compiled = layouts[exact]
    found = None if compiled is None else _run(loss, owners, params, inputs, batch_size, compiled)
    # records of a layout the first-call checks did not pass (as the eager capture's would
    # be: torch_passes.capture decides on that signature): the eager capture runs and checks
    signature = (
        None
        if found is None
        else torch_checks.records_signature({**found.records, **found.unit_records}, batch_size)
    )
    if signature is None or not torch_checks.is_checked(loss, "ghost", key, signature):
        layouts[exact] = None
        return None
    return found


def _run(
    loss: ModuleLoss,
    owners: Ownership,
    params: dict[str, torch.Tensor],
    inputs: tuple[Any, ...],
    batch_size: int,
    compiled: _Compiled,
) -> CompiledCapture | None:
    """One compiled run: the probes made from the expected calls, the records checked
    against them (every call, no other)."""
    device = next(iter(params.values())).device
    probes = {
        name: [_probe(c.shape, c.dtype, device) for c in layer_calls]
        for name, layer_calls in compiled.calls.items()
    }
    unread = {
        name: [tuple(_probe(*u, device) for u in c.unread) for c in layer_calls]
        for name, layer_calls in compiled.calls.items()
    }
    sink: dict[str, list[tuple[Any, ...]]] = {name: [] for name in compiled.calls}
    detached = {name[len(PREFIX) :]: p.detach() for name, p in params.items()}
    args, kwargs = _arguments(inputs)
    hook = functools.partial(_probe_hook, batch_size, _rules(owners))
    try:
        with _hooked(owners, hook, hook):
            output = compiled.function(
                detached, _buffers(loss.model), probes, unread, sink, args, kwargs
            )
    except Exception:  # noqa: BLE001  (the eager capture runs it again, and raises what it raises)
        return None
    finally:
        _ACTIVE.probes = _ACTIVE.unread = _ACTIVE.sink = None
    if {n: len(s) for n, s in sink.items()} != {n: len(c) for n, c in compiled.calls.items()}:
        return None  # a call not recorded (a graph reused without the hooks), or one too many
    unit_records: dict[str, list[UnitCall]] = {name: [] for name in owners.units}
    for name in owners.units:
        for (args_, kwargs_, first), probe in zip(sink[name], probes[name]):
            unit_call = UnitCall(args_, kwargs_, first.detach())
            probe.register_hook(unit_call.receive)
            unit_records[name].append(unit_call)
    records: dict[str, list[LayerRecord]] = {name: [] for name in owners.modules}
    for name, layer_calls in compiled.calls.items():
        if name in owners.units:
            continue
        for recorded, probe, others, expected in zip(
            sink[name], probes[name], unread[name], layer_calls
        ):
            record = LayerRecord(recorded, tuple(getattr(x, "_version", 0) for x in recorded))
            record.hooked = True
            axis = expected.batch_axis
            probe.register_hook(functools.partial(_receive, record, axis))
            for other in others:  # a gradient there, not all zero, refuses the call
                other.register_hook(functools.partial(note_unread, weakref.ref(record)))
            records[name].append(record)
    flat = [p for layer_probes in probes.values() for p in layer_probes]
    flat += [p for layer_others in unread.values() for others in layer_others for p in others]
    return CompiledCapture(output, records, flat, unit_records)


def _receive(record: LayerRecord, axis: int, grad: torch.Tensor) -> None:
    record.receive(grad.movedim(axis, 0))


def _probe(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero of the call's output shape, a leaf that requires grad: one number broadcast
    (stride 0), so that the probes take no memory of their own (an LM head's is as large as
    its logits); their gradients are full."""
    zero = torch.zeros((), dtype=dtype, device=device)
    return zero.expand(shape).detach().requires_grad_(True)


def _compile(model: nn.Module) -> Any:
    """The function the compiled capture runs, compiled as the user compiled ``model``
    (``OptimizedModule.dynamo_ctx``: the same backend, mode and options)."""
    inner = model._orig_mod

    def run_layers(
        params: dict[str, torch.Tensor],
        buffers: dict[str, Any],
        probes: dict[str, list[torch.Tensor]],
        unread: dict[str, list[tuple[torch.Tensor, ...]]],
        sink: dict[str, list[tuple[Any, ...]]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        _ACTIVE.probes, _ACTIVE.unread, _ACTIVE.sink = probes, unread, sink
        output = functional_call(inner, (params, buffers), args, kwargs)
        _ACTIVE.probes = _ACTIVE.unread = _ACTIVE.sink = None
        return output

    return model.dynamo_ctx(run_layers)


def _probe_hook(
    batch_size: int,
    rules: dict[str, LayerRule | None],
    name: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
) -> Any:
    """The forward hook traced into the compiled graph: the call's recorded inputs to the sink,
    and its output with the call's probe added to the tensor whose gradient its rule reads, and
    a probe of its own to each output its rule does not read. (Its rule's ``check`` ran on the
    eager run: :func:`_layer_calls`.) A generic unit (``name`` not in ``rules``):
    :func:`_unit_probe`."""
    probes, unread, sink = _ACTIVE.probes, _ACTIVE.unread, _ACTIVE.sink
    assert probes is not None and unread is not None and sink is not None
    if name not in rules:
        return _unit_probe(name, args, kwargs, output, probes, sink)
    recorded, _, plain = recorded_call(
        name, module, rules[name], args, kwargs, output, batch_size, check=False
    )
    index = len(sink[name])
    sink[name].append(recorded.inputs)
    probe = probes[name][index]
    target = recorded.output  # (the layer's output, or that output broadcast to the batch)
    if target.shape != probe.shape:  # (a static shape: checked while tracing)
        raise RuntimeError(f"layer {name!r}: output {target.shape}, expected {probe.shape}")
    if plain:
        return target + probe
    pairs = [(target, target + probe)]
    others = [x for x in recorded.unread if isinstance(x, torch.Tensor)]
    pairs += [(other, other + extra) for other, extra in zip(others, unread[name][index])]
    for old, new in pairs:
        if not _holds(output, old):  # (the eager run checked it: _layer_calls)
            raise RuntimeError(f"layer {name!r}: its rule records a tensor it does not return")
        output = _replaced(output, old, new)
    return output


def _unit_probe(
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    probes: dict[str, list[torch.Tensor]],
    sink: dict[str, list[tuple[Any, ...]]],
) -> Any:
    """A generic unit's call (``torch_generic.py``) in the compiled graph: its arguments and
    first output to the sink (what ``capturing_units`` records), and its output with the
    call's probe added to that first output."""
    first = first_tensor(output)
    probe = probes[name][len(sink[name])]
    if first is None or first.shape != probe.shape:  # (static shapes: checked while tracing)
        raise RuntimeError(f"unit {name!r}: its first output is not the one its eager run gave")
    sink[name].append((args, dict(kwargs), first))
    return _replaced(output, first, first + probe)


def _holds(output: Any, x: torch.Tensor) -> bool:
    """Whether ``output`` (a tensor, or tuples, lists and dicts of them) holds the tensor ``x``."""
    if isinstance(output, torch.Tensor):
        return output is x
    if isinstance(output, (tuple, list)):
        return any(_holds(y, x) for y in output)
    if isinstance(output, dict):
        return any(_holds(y, x) for y in output.values())
    return False


def _replaced(output: Any, old: torch.Tensor, new: Any) -> Any:
    """``output`` (a tensor, or tuples, lists and dicts of them) with the tensor ``old``
    replaced by ``new``."""
    if isinstance(output, torch.Tensor):
        return new if output is old else output
    if isinstance(output, (tuple, list)):
        return type(output)(_replaced(x, old, new) for x in output)
    if isinstance(output, dict):
        return {key: _replaced(x, old, new) for key, x in output.items()}
    return output


class _NotInGraphs(Exception):
    """A layer call the whole-graph capture cannot serve (:func:`_layer_calls`)."""


def _layer_calls(
    loss: ModuleLoss,
    owners: Ownership,
    params: dict[str, torch.Tensor],
    inputs: tuple[Any, ...],
    batch_size: int,
) -> dict[str, list[LayerCallShape]] | None:
    """Each hooked layer's calls in one eager run of the model under the compiled one (no
    gradient), each checked by its rule's ``check`` (which the compiled runs of the layout
    then do without); None where that run fails or a check refuses a call (the eager capture
    then runs, and says why)."""
    calls: dict[str, list[LayerCallShape]] = {name: [] for name in (*owners.modules, *owners.units)}
    rules = _rules(owners)

    def note(
        name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        # (a call its rule's check refuses: the eager capture runs, and says why)
        recorded, _, plain = recorded_call(
            name, module, rules[name], args, kwargs, output, batch_size
        )
        target = recorded.output
        others = [x for x in recorded.unread if isinstance(x, torch.Tensor)]
        if not plain and not all(_holds(output, x) for x in [target, *others]):
            raise _NotInGraphs  # a recorded tensor that is not one the layer returns
        unread = tuple((tuple(x.shape), x.dtype) for x in others)
        calls[name].append(
            LayerCallShape(tuple(target.shape), target.dtype, recorded.batch_axis, unread)
        )

    def note_unit(
        name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        first = first_tensor(output)
        if first is None or first.dim() == 0 or first.shape[0] != batch_size:
            raise _NotInGraphs  # (the eager capture refuses it, and says why)
        calls[name].append(LayerCallShape(tuple(first.shape), first.dtype, 0))

    detached = {name[len(PREFIX) :]: p.detach() for name, p in params.items()}
    args, kwargs = _arguments(inputs)
    try:
        with torch.no_grad(), _hooked(owners, note, note_unit):
            functional_call(loss.model._orig_mod, (detached, _buffers(loss.model)), args, kwargs)
    except Exception:  # noqa: BLE001  (the eager capture runs it again, and raises what it raises)
        return None
    return calls


def _rules(owners: Ownership) -> dict[str, LayerRule | None]:
    """Each layer's rule (looked up outside the traced hook)."""
    return {name: rule_for(module) for name, module in owners.modules.items()}


@contextmanager
def _hooked(owners: Ownership, hook: Any, unit_hook: Any) -> Iterator[None]:
    """``hook(name, module, args, kwargs, output)`` on every layer of ``owners``, and
    ``unit_hook`` (the same arguments) on every generic unit; removed on the way out."""
    hooked = [(hook, owners.modules), (unit_hook, owners.units)]
    handles = [
        module.register_forward_hook(functools.partial(on_call, name), with_kwargs=True)
        for on_call, modules in hooked
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _arguments(inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's positional and keyword arguments, as ``ModuleLoss.forward`` passes them."""
    args = tuple(x for x in inputs if not isinstance(x, Mapping))
    kwargs: dict[str, Any] = {}
    for x in inputs:
        if isinstance(x, Mapping):
            kwargs.update(x)
    return args, kwargs


def _buffers(model: nn.Module) -> dict[str, Any]:
    """The buffers of the model under the compiled one, as ``ModuleLoss.forward`` passes them
    (running statistics a layer would write but does not read: absent)."""
    inner = model._orig_mod
    return {**dict(inner.named_buffers()), **running_statistics_left_alone(inner)}
