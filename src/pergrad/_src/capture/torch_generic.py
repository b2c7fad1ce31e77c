"""Parameters no layer rule owns, inside a model whose other layers have one.

Rather than giving up the ghost strategy for the whole model (an ``nn.MultiheadAttention`` in a
transformer, a custom block owning a parameter, a ViT embedding's class token and position
embeddings beside its patch convolution), such a parameter gets its per-example gradient from a
*generic unit*: a module whose forward hook keeps its inputs (keyword arguments too) and the
gradient at its output, and which is then run ALONE over the examples with ``torch.func.vmap``
(``grad`` of ``<unit(x_i), dz_i>``) with only the parameters it is given differentiated. Only
those are materialised (``B x`` their size); the layers with a rule stay ghost.

The unit of a parameter owned by module ``M`` (:func:`find_unit`):

- ``M`` holds no layer with a rule: the outermost ancestor of ``M``, below the model, whose
  subtree holds none either (so that a parent reading the parameter is run too);
- ``M`` holds a layer with a rule (the embedding above; a learnable scale of the model itself,
  ``M`` being the root): ``M`` itself, with only its rule-less parameters differentiated. Its
  layers with a rule run inside it as constants: their own norms come from their hooks, which
  record the one batched pass only (the units run after the hooks are removed). A model with
  no layer with a rule at all has no unit of its own: that is the chunked strategy.

An input or keyword argument is taken as batched when it is a tensor whose first axis has the
batch size. That is a guess, so it is checked: on every run, each example's slice run alone
must reproduce its row of the unit's batched output, and on the first run of each layout the
units' per-example gradients must add up to the batch gradient and their output gradients be
row-local (``torch_checks.py``); a shared input of that size, or a time-first unit with
``T == B``, is refused, never reduced along the wrong axis. A unit's output must have the batch
on axis 0 (the first element of a tuple output), or the run is refused the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from pergrad._src.capture.rules import rule_for
from pergrad._src.capture.torch_checks import (
    TOLERANCES,
    GradientSlot,
    checked_dtype,
    rows_match,
)
from pergrad._src.errors import Unsupported, is_pergrad_error


def find_unit(model: nn.Module, owner: str) -> str | None:
    """The generic unit (a module name, ``""`` for the model) of a parameter owned by module
    ``owner``, which has no layer rule: ``owner`` when its subtree holds a layer with a rule,
    else its outermost ancestor below the model whose subtree holds none. None for a parameter
    of the model itself when no layer of the model has a rule: the whole model run alone is the
    chunked strategy, with nothing left for the ghost strategy to save."""
    if owner == "":
        return owner if _has_rule(model) else None
    if _has_rule(model.get_submodule(owner)):
        return owner
    unit = owner
    while "." in unit:
        parent = unit.rpartition(".")[0]
        if _has_rule(model.get_submodule(parent)):
            break
        unit = parent
    return unit


def _has_rule(module: nn.Module) -> bool:
    return any(rule_for(m) is not None for m in module.modules())


@dataclass
class UnitCall(GradientSlot):
    """One call of a unit: its arguments, its output, and the gradient there."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: torch.Tensor


@contextmanager
def capturing_units(
    units: dict[str, nn.Module], batch_size: int
) -> Iterator[dict[str, list[UnitCall]]]:
    """Forward hooks that keep each unit call's arguments and its output's gradient."""
    records: dict[str, list[UnitCall]] = {name: [] for name in units}

    def hook(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        first = first_tensor(output)
        if first is None or first.dim() == 0 or first.shape[0] != batch_size:
            raise Unsupported(
                f"layer {name!r} ({type(module).__name__}) did not return the batch of "
                f"{batch_size} on axis 0"
            )
        record = UnitCall(args, dict(kwargs), first.detach())
        records[name].append(record)
        if first.requires_grad:
            first.register_hook(record.receive)

    handles = [
        module.register_forward_hook(functools.partial(hook, name), with_kwargs=True)
        for name, module in units.items()
    ]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def running_alone(unit: str, module: nn.Module) -> Iterator[None]:
    """Around a unit's run alone: its refusal (:class:`Unsupported`) named after the unit, and
    any other error of the framework's (torch.func cannot vectorise it) as a refusal too."""
    try:
        yield
    except Unsupported as err:
        raise Unsupported(f"layer {unit!r} ({type(module).__name__}): {err}") from err
    except Exception as err:
        if is_pergrad_error(err):
            raise
        raise Unsupported(
            f"layer {unit!r} ({type(module).__name__}) has no ghost rule and torch.func "
            f"could not vectorise it alone ({type(err).__name__}: {err})"
        ) from err


def first_tensor(output: Any) -> torch.Tensor | None:
    """The layer's output, or the first element of a tuple output (``nn.MultiheadAttention``
    returns ``(output, weights)``)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def per_example(
    unit: nn.Module,
    params: dict[str, torch.Tensor],
    calls: list[UnitCall],
    batch_size: int,
    constants: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``{relative name: (B, *shape)}``: per-example gradients of ``params`` (named relative to
    ``unit``), summed over the unit's calls. ``constants``: the unit's other parameters as the
    batched pass used them (not differentiated); the unit's own are used for any not given."""
    values = dict(constants or {})
    total: dict[str, torch.Tensor] = {}
    for call in calls:
        if call.output_grad is None:
            continue
        leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
        dims = tuple(0 if _batched(x, batch_size) else None for x in leaves)

        def inner(
            p: dict, output_grad: torch.Tensor, *rows: Any, spec: Any = spec, dims: tuple = dims
        ) -> Any:
            rows = [x.unsqueeze(0) if d == 0 else x for x, d in zip(rows, dims)]
            args, kwargs = pytree.tree_unflatten(rows, spec)
            out = first_tensor(torch.func.functional_call(unit, {**values, **p}, args, kwargs))
            return (out * output_grad.unsqueeze(0)).sum(), out.detach()[0]

        grads, outputs = torch.func.vmap(
            torch.func.grad(inner, has_aux=True), in_dims=(None, 0, *dims)
        )(params, call.output_grad, *leaves)
        # Each example's slice, run alone, must give its row of the batched output: otherwise
        # axis 0 of an input was taken for the batch by its size alone.
        if outputs.shape != call.output.shape or not rows_match(
            outputs.flatten(1), call.output.flatten(1)
        ):
            raise Unsupported(
                "run alone on each example's slice of its inputs (axis 0), it does not "
                "reproduce its output in the batch: axis 0 of an input is not the batch"
            )
        for name, g in grads.items():
            total[name] = total[name] + g if name in total else g
    return total


def _batched(x: Any, batch_size: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size


def check_sums(
    unit_name: str, per_example_grads: dict[str, torch.Tensor], batch_grads: dict[str, Any]
) -> None:
    """Raise :class:`Unsupported` unless the per-example gradients add up to the batch
    gradient (first run only): a shared input taken for a batched one would break it."""
    for name, grads in per_example_grads.items():
        expected = batch_grads.get(name)
        if expected is None:
            continue
        error = torch.linalg.vector_norm(grads.sum(0) - expected)
        # (under autocast both come from bfloat16 / float16 arithmetic, whatever their dtype)
        tolerance = TOLERANCES["unit_sum"].of(checked_dtype(expected))
        if error > tolerance * torch.linalg.vector_norm(expected) + 1e-12:
            raise Unsupported(
                f"the per-example gradients of layer {unit_name!r} (run alone, without a ghost "
                f"rule) do not add up to the batch gradient of {name!r}"
            )
