"""The PyTorch capture engine: one batched pass with each parameterised layer's calls recorded.

For a :func:`pergrad.module_loss` model, :func:`capturing` puts a forward hook on each layer
owning a differentiated parameter: it keeps the layer's positional inputs (or what its rule's
``record`` asks for: keyword arguments, the parameter values) and puts a tensor hook on its
output, which records the output's gradient in the backward pass (a tensor hook, not
``autograd.grad`` with respect to the output, because it sees the gradient of the value the
layer produced even when a later in-place op rewrites it). :func:`per_example_losses`
gives each example's loss from the batched output, as ``module_loss`` defines it, and
:func:`layer_calls` turns a layer's records into the ``LayerCall`` s its rule reduces.

The engine takes a layer whose input and output have the batch size on axis 0 (or on another
axis its rule allows: a time-first linear layer's input ``(T, B, D)``, moved to the front);
that is a filter, not a proof (``T == B``): ``torch_checks.py`` establishes the batch axis on the first
call of each layout. Module hooks are removed on the way out; tensor hooks live on the call's
own tensors.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from pergrad._src.capture import torch_rules  # noqa: F401  (registers every layer rule)
from pergrad._src.capture.rules import LayerRule, Recorded, rule_for
from pergrad._src.capture.torch_checks import GradientSlot
from pergrad._src.capture.torch_layers import LayerCall
from pergrad._src.core.call import Call, Spec
from pergrad._src.core.module_loss import ModuleLoss, as_scalar
from pergrad._src.errors import PergradValueError, Unsupported, is_pergrad_error


def model_and_loss_arguments(
    call: Call, args: list[Any], num_inputs: int, batch_size: int
) -> tuple[tuple[Any, ...], list[Any], list[Any]]:
    """The model's batched inputs, the loss function's arguments and their ``vmap`` dims.

    ``module_loss`` gives every per-example argument a batch axis of one; a shared (unbatched)
    model input therefore becomes ``B`` copies, and a shared target keeps ``in_dims=None``.
    """
    batched = set(call.batched_positions)
    inputs, targets, target_dims = [], [], []
    for i, arg in enumerate(args[1:], start=1):
        _, leaves, treedef = call.backend.flatten(arg)
        dims = [0 if (i, j) in batched else None for j in range(len(leaves))]
        if i <= num_inputs:
            leaves = [
                x.unsqueeze(0).expand(batch_size, *x.shape)
                if d is None and isinstance(x, torch.Tensor)
                else x
                for x, d in zip(leaves, dims)
            ]
            inputs.append(call.backend.unflatten(treedef, leaves))
        else:
            targets.append(arg)
            target_dims.append(call.backend.unflatten(treedef, dims))
    return tuple(inputs), targets, target_dims


@dataclass
class LayerRecord(GradientSlot):
    """One call of a hooked layer: what its rule reads (``Recorded.inputs``), their versions
    when it read them, its output gradient (batch first: the ``GradientSlot``), and the largest
    magnitude of the gradients that reached an output the rule does not read (None: none did)."""

    inputs: tuple[Any, ...]
    input_versions: tuple[int, ...]
    unread_grad: torch.Tensor | None = None
    # The recorded output and its version then: differentiating it (while no in-place op has
    # changed it) reaches the output gradient without any weight gradient (capture/torch_passes.capture).
    output: torch.Tensor | None = None
    output_version: int = -1
    # Whether the output's gradient is awaited (by a tensor hook, or from the caller: see
    # ``capturing``'s ``output_hooks``), and the output's batch axis.
    hooked: bool = False
    output_axis: int = 0
    # The layer's own first argument, where it is the recorded input (batch on axis 0) and
    # requires grad: differentiating it also reaches the output gradient, and its gradient is
    # smaller than the output's for an LM head (capture/torch_session.py).
    light_input: torch.Tensor | None = None


@contextmanager
def capturing(
    modules: dict[str, nn.Module], batch_size: int, output_hooks: bool = True
) -> Iterator[dict[str, list[LayerRecord]]]:
    """Forward hooks that record each call of ``modules`` (by name); removed on the way out.

    A layer is recorded as its rule's ``record`` says (``rules.Recorded``), or, by default, as
    its positional inputs and its output, the batch on the first of the rule's ``batch_axes``
    that has the batch size in both (moved to the front). With ``output_hooks=False``, no
    tensor hook is put on the outputs (10 us a layer): the caller differentiates the recorded
    outputs itself, where none was changed in place, and hands each record its output's
    gradient (``record.receive(grad.movedim(record.output_axis, 0))``)."""
    records: dict[str, list[LayerRecord]] = {name: [] for name in modules}

    def hook(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict, output: Any) -> Any:
        rule = rule_for(module)
        recorded, expanded, plain = recorded_call(
            name, module, rule, args, kwargs, output, batch_size
        )
        inputs = recorded.inputs
        record = LayerRecord(inputs, tuple(getattr(x, "_version", 0) for x in inputs))
        records[name].append(record)
        # The tensor hooks hold their record weakly: the output (which the record keeps, as
        # the light pass's target) holds its graph, which holds the hook; held strongly, the
        # record would close a cycle through autograd's objects that Python's collector cannot
        # see, and the pass (records, graph) would never be freed. ``records`` holds them.
        weak = weakref.ref(record)
        if recorded.output.requires_grad:
            axis = recorded.batch_axis
            if output_hooks:
                recorded.output.register_hook(functools.partial(_receive, weak, axis))
            record.output, record.output_version = recorded.output, recorded.output._version
            record.hooked, record.output_axis = True, axis
            first = inputs[0] if inputs else None
            if (
                plain
                and axis == 0
                and expanded is None
                and isinstance(first, torch.Tensor)
                and first.requires_grad
            ):
                record.light_input = first
        for other in recorded.unread:
            if isinstance(other, torch.Tensor) and other.requires_grad:
                other.register_hook(functools.partial(note_unread, weak))
        return expanded

    # Under torch.compile, dynamo cannot put a tensor hook that stores into a record in its
    # graph (an unsafe side effect): it breaks the graph at each hooked layer either way. Not
    # tracing the hook makes that break cheap (no failed attempt, no recompilation of the hook
    # for each layer's name) and leaves the hook to run as it does eagerly.
    untraced = torch.compiler.disable(hook)
    handles = [
        module.register_forward_hook(functools.partial(untraced, name), with_kwargs=True)
        for name, module in modules.items()
    ]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def recorded_call(
    name: str,
    module: nn.Module,
    rule: LayerRule | None,
    args: tuple[Any, ...],
    kwargs: dict,
    output: Any,
    batch_size: int,
    check: bool = True,
) -> tuple[Recorded, Any, bool]:
    """How one call of a hooked layer is recorded: its rule's ``check`` (unless ``check`` is
    False), then its rule's ``record``, or the plain call (:func:`plain_call`); the output to
    replace the layer's with (None: keep it); and whether it was recorded plainly. Raises
    :class:`Unsupported` where the call is refused, or where a rule's record does not hold the
    batch on the axes it says."""
    if check and rule is not None and rule.check is not None:
        rule.check(module, args, kwargs, output)
    recorded = (
        None if rule is None or rule.record is None else rule.record(module, args, kwargs, output)
    )
    if recorded is None:
        axes = (0,) if rule is None else rule.batch_axes
        plain, expanded = plain_call(name, module, args, output, batch_size, axes)
        return plain, expanded, True
    if not (
        recorded.inputs
        and _holds_batch(recorded.inputs[0], 0, batch_size)
        and _holds_batch(recorded.output, recorded.batch_axis, batch_size)
    ):
        raise Unsupported(
            f"layer {name!r} ({type(module).__name__}) did not get the batch of "
            f"{batch_size} on the axes its rule expects"
        )
    return recorded, None, False


def _receive(weak: weakref.ref, axis: int, grad: torch.Tensor) -> None:
    """A recorded output's tensor hook: its gradient, batch first, into the record (if alive)."""
    record = weak()
    if record is not None:
        record.receive(grad.movedim(axis, 0))


def note_unread(weak: weakref.ref, grad: torch.Tensor | None) -> None:
    """An unread output's tensor hook: a gradient reached it; its largest magnitude is kept
    (a 0-d tensor: not read here, so no host sync in the backward pass). A gradient of zeros
    everywhere changes no parameter's gradient, so it does not refuse the call: a compiled
    graph's backward pass gives every output of its graph a gradient, zeros for those the loss
    does not use (attention weights returned but not used)."""
    record = weak()
    if record is not None and grad is not None:  # (None: a compiled graph's unused output)
        largest = grad.detach().abs().amax() if grad.numel() else grad.new_zeros(())
        known = record.unread_grad
        record.unread_grad = largest if known is None else torch.maximum(known, largest)


def plain_call(
    name: str,
    module: nn.Module,
    args: tuple[Any, ...],
    output: Any,
    batch_size: int,
    batch_axes: tuple[int, ...],
) -> tuple[Recorded, Any]:
    """A layer's positional inputs and output, the batch moved to axis 0 of the first input;
    and the output to replace the layer's with (None: keep it)."""
    first = args[0] if args else None
    expanded = None
    if _broadcast_lookup(module, first, output, batch_size):
        # Position embeddings: one (1, T) row of indices shared by the batch, its output
        # broadcast against the (B, T, D) token embeddings. Expanding it to B rows changes
        # no value and gives each example its own output gradient.
        first = first.expand(batch_size, *first.shape[1:])
        args = (first, *args[1:])
        output = expanded = output.expand(batch_size, *output.shape[1:])
    axis = next(
        (
            axis
            for axis in batch_axes
            if _holds_batch(first, axis, batch_size) and _holds_batch(output, axis, batch_size)
        ),
        None,
    )
    if axis is None:
        where = " or ".join(str(axis) for axis in batch_axes)
        raise Unsupported(
            f"layer {name!r} ({type(module).__name__}) did not get the batch of "
            f"{batch_size} on axis {where} of a positional input and of its output"
        )
    if axis:  # time-first: (T, B, ...) -> (B, T, ...)
        args = (first.movedim(axis, 0), *args[1:])
    return Recorded(args, output, axis), expanded


def _holds_batch(x: Any, axis: int, batch_size: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > axis and x.shape[axis] == batch_size


def _broadcast_lookup(module: nn.Module, first: Any, output: Any, batch_size: int) -> bool:
    return (
        isinstance(module, nn.Embedding)
        and batch_size > 1
        and isinstance(first, torch.Tensor)
        and isinstance(output, torch.Tensor)
        and first.dim() > 1
        and first.shape[0] == 1
        and output.shape[0] == 1
    )


def per_example_losses(
    spec: Spec,
    loss: ModuleLoss,
    output: Any,
    targets: list[Any],
    target_dims: list[Any],
    batch_size: int,
) -> torch.Tensor:
    """``loss_fn`` on each example's output row, as ``module_loss`` calls it: ``(B,)``."""
    try:
        losses = _known_row_losses(loss.loss_fn, output, targets, target_dims, batch_size)
    except Exception:  # (a target out of range) the general path raises it as it does
        losses = None
    if losses is not None:
        return losses

    # Output leaves with the batch on axis 0 are split by example; anything else (a Hugging Face
    # key-value cache object, a shared tensor) is passed to every row as it is.
    leaves, treedef = pytree.tree_flatten(output)
    split = [
        isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size for x in leaves
    ]
    batched_leaves = [x for x, b in zip(leaves, split) if b]

    def loss_of_row(leaf_rows: list[Any], *target_rows: Any) -> Any:
        rows = iter(leaf_rows)
        output_row = pytree.tree_unflatten(
            [next(rows) if b else x for x, b in zip(leaves, split)], treedef
        )
        batch_of_one = [pytree.tree_map(_add_batch_axis, x) for x in (output_row, *target_rows)]
        return as_scalar(loss.loss_fn(*batch_of_one))

    try:
        losses = torch.func.vmap(loss_of_row, in_dims=(0, *target_dims))(batched_leaves, *targets)
    except Exception as err:
        if is_pergrad_error(err):
            raise
        # loss_fn cannot be vmapped: a loop over the rows (cheap next to the model); if one
        # row fails too, that error, from the user's loss_fn, is the clearest.
        losses = torch.stack(
            [
                loss_of_row(*_row(index, (batched_leaves, *targets), (0, *target_dims)))
                for index in range(batch_size)
            ]
        )
    if not (
        isinstance(losses, torch.Tensor)
        and losses.shape == (batch_size,)
        and losses.is_floating_point()
    ):
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise PergradValueError(
            f"{spec.func_name}: fn must return a real scalar loss for one example; loss_fn on "
            f"one example's output gave {got} per example. (has_aux losses are not supported "
            f"here: return only the loss.)"
        )
    return losses


def _known_row_losses(
    loss_fn: Any, output: Any, targets: list[Any], target_dims: list[Any], batch_size: int
) -> torch.Tensor | None:
    """``F.cross_entropy`` or ``F.mse_loss`` with their defaults, on one batched output and one
    batched target of plain tensors: each example's loss from one call with
    ``reduction="none"``, the mean over the example's positions as a batch of one takes it
    (a class index of -100 is ignored; an example with only ignored positions gets NaN, 0/0,
    as alone). ``vmap`` over the loss costs 0.4 ms on the bench transformer (8% of its batch
    gradient); this, 0.03 ms. None for anything else (the general path)."""
    if loss_fn is not F.cross_entropy and loss_fn is not F.mse_loss:
        return None
    if not (len(targets) == 1 and target_dims[0] == 0):
        return None
    target = targets[0]
    if not (
        type(output) is torch.Tensor
        and type(target) is torch.Tensor
        and output.dim() > 0
        and output.shape[0] == batch_size
        and target.dim() > 0
        and target.shape[0] == batch_size
        and output.is_floating_point()
    ):
        return None
    if loss_fn is F.mse_loss:
        if target.shape != output.shape or target.dtype != output.dtype:
            return None  # broadcast or promoted: as the function decides, through vmap
        terms = F.mse_loss(output, target, reduction="none")
        return terms.reshape(batch_size, -1).mean(1)
    if target.is_floating_point():  # class probabilities, one per output entry
        if target.shape != output.shape or target.dtype != output.dtype:
            return None
        terms = F.cross_entropy(output, target, reduction="none")
        return terms.reshape(batch_size, -1).mean(1)
    if target.dtype != torch.long or target.shape != output.shape[:1] + output.shape[2:]:
        return None
    terms = F.cross_entropy(output, target, reduction="none")  # 0 where ignored
    counted = (target != -100).reshape(batch_size, -1).sum(1)
    return terms.reshape(batch_size, -1).sum(1) / counted.to(terms.dtype)


def _row(index: int, trees: tuple[Any, ...], dims: tuple[Any, ...]) -> list[Any]:
    """Example ``index`` of each tree: leaves batched on axis 0 (dims 0) indexed, others kept."""
    rows = []
    for tree, tree_dims in zip(trees, dims):
        leaves, spec = pytree.tree_flatten(tree)
        leaf_dims = pytree.tree_flatten(tree_dims)[0]  # None is a leaf in torch's pytrees
        if len(leaf_dims) != len(leaves):  # one 0 / None for the whole tree
            leaf_dims = leaf_dims * len(leaves)
        rows.append(
            pytree.tree_unflatten(
                [x if d is None else x[index] for x, d in zip(leaves, leaf_dims)], spec
            )
        )
    return rows


def _add_batch_axis(x: Any) -> Any:
    return x.unsqueeze(0) if isinstance(x, torch.Tensor) else x


def layer_calls(module_name: str, records: list[LayerRecord]) -> list[LayerCall]:
    """The calls of a layer whose output reached the loss, for its rule. Raises
    :class:`Unsupported` where the records cannot be trusted."""
    for record in records:
        # (a NaN gradient is not 0: refused)
        if record.unread_grad is not None and not bool(record.unread_grad == 0):
            raise Unsupported(
                f"the loss depends on an output of layer {module_name!r} that its rule does not "
                f"read (attention weights)"
            )
        versions = tuple(getattr(x, "_version", 0) for x in record.inputs)
        if versions != record.input_versions:
            raise Unsupported(
                f"the input of layer {module_name!r} was modified in place after the layer read it"
            )
    return [
        LayerCall(record.inputs, record.output_grad)
        for record in records
        if record.output_grad is not None
    ]
