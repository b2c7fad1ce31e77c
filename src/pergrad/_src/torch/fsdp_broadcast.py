"""Per-example gradients of bare parameters beside FSDP2 modules, read off the forward pass:
timm's ViT keeps ``pos_embed`` ``(1, T, d)`` and ``cls_token`` ``(1, 1, d)`` on the model
itself, which holds the ``fully_shard``'ed blocks, and uses them as
``cls_token.expand(B, -1, -1)`` and ``x + pos_embed``. For the DP step of ``fsdp.py``, through
``fsdp_units.py``.

Such a parameter's generic unit (``torch_generic.find_unit``) is, or holds, an FSDP2 module: it
cannot be run alone over the examples as ``fsdp_units.py`` runs the others (FSDP's collectives
would run inside ``vmap``). But where a use of the parameter ``p`` is *row-local*, example
``b``'s row of the op's output depending on ``p`` and on row ``b`` of the op's other operand
only, example ``b``'s gradient of ``p`` through that use is row ``b`` of the gradient at ``p``
expanded to the batch. So while the norm pass's forward runs, a ``TorchFunctionMode``
(:func:`reading_uses`) looks at every op that receives ``p`` (by identity with the module's
attribute at that moment: FSDP2 swaps its gathered plain tensor in while the module runs, and
its DTensor back after) and hands each use it recognises ``e = p.expand(B, ...)`` instead: the
same numbers, so the model computes what it computed, and a tensor hook on ``e`` keeps its
gradient, whose row ``b`` is example ``b``'s share. Summed over the uses, example ``b``'s
gradient of ``p`` (:func:`read_off`): ``B x`` the parameter's size, as the units' formed
gradients, which they then join (norms, the records' sum under mixed precision).

Recognised uses, ``B`` the process's batch size:

- broadcasting elementwise arithmetic (``+ - * /``: the operators, ``torch.add`` ..., the
  in-place forms on the other operand) of ``p`` with one tensor that has the output's ``B``
  rows on axis 0, ``p`` having fewer axes or a leading 1 (``x + pos_embed``, ``x * gamma``);
- ``p.expand(B, ...)``, ``expand_as``, ``broadcast_to`` of such a ``p`` to ``B`` rows
  (``cls_token.expand(B, -1, -1)``).

Any other op whose output carries ``p``'s gradient (a matmul, an indexing, a resampling,
``p.to(dtype)``, two tracked parameters in one op) is noted as a problem, which ``fsdp.py``
raises on every process once they agree (``fsdp_checks.agree``), before the backward pass; an
op that reads only ``p``'s metadata or a detached copy passes. A use the mode does not see
(compiled code, a region with torch functions disabled) is caught at every step: ``p`` itself
is an input of the norm pass's backward pass too (one more gradient of its size: cheaper than
keeping layouts, as the units do, whose check runs them once more), and the per-example
gradients must add up to its batch gradient, or the step is refused the same way, never
reduced with a part missing.
As for the layers' records in the FSDP2 step, axis 0 of the activations is taken to be the
batch.

Why a function mode: FSDP2 owns the module's attribute (it swaps the gathered tensor in and the
shard back), and an attribute swapped for ``p.expand(B, ...)`` would silently change what any
other use computes (``F.linear`` with a batch of weights); the mode sees each use with its
operands, substitutes only where that changes no value, and refuses the rest. Cost: one Python
call per op of the norm pass's forward pass (8 to 11 us more per op than without the mode,
measured on 2 CPU cores at load 6.5), and ``B x`` the parameter's size per use.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name

from pergrad._src.capture import torch_rules  # noqa: F401  (registers every layer rule)
from pergrad._src.capture.rules import rule_for
from pergrad._src.capture.torch_checks import TOLERANCES, GradientSlot, checked_dtype
from pergrad._src.errors import Unsupported

# broadcasting elementwise arithmetic: substituting p by its rows changes no value
_ELEMENTWISE = frozenset(
    {
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        torch.Tensor.add,
        torch.Tensor.sub,
        torch.Tensor.mul,
        torch.Tensor.div,
    }
)
# the same, in place on their first operand (which must not be the parameter)
_IN_PLACE = frozenset({torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_})
_ELEMENTWISE_OPTIONS = frozenset({"alpha", "rounding_mode"})
# p's rows broadcast to the output's shape
_EXPANDS = frozenset(
    {torch.Tensor.expand, torch.Tensor.expand_as, torch.Tensor.broadcast_to, torch.broadcast_to}
)
# what the refusal says pergrad reads off (the end of a problem's message)
_RECOGNISED = (
    "pergrad reads the per-example gradients of such a parameter off the forward pass where "
    "each use is row by row: x + p, x - p, x * p, x / p with x's batch on axis 0, and "
    "p.expand(B, ...), p.expand_as(x), broadcast_to, p having a leading axis of 1 or none"
)
_MOVE = (
    "Move such parameters into a submodule of their own that is not fully_shard'ed and holds "
    "no fully_shard'ed module (run alone there), or freeze them (requires_grad_(False))"
)


@dataclass
class Use(GradientSlot):
    """One recognised use: the op's name; ``output_grad`` the ``(B, ...)`` gradient at the
    parameter expanded to the batch for it."""

    op: str = ""


@dataclass
class Tracked:
    """A parameter read off the forward pass.

    Attributes:
      owner, attribute: where the module holds it (FSDP2 swaps the tensor there).
      shape: its (whole) shape.
      where: the unit, for messages (``"the model itself (ViT)"``, ``"module 'embed' (...)"``).
      sharded: the FSDP2 modules the unit is or holds, for messages.
      path: the modules from the unit down to the owner (FSDP2 gathers the parameter when the
        one of them that manages it, or one above the unit, runs).
      shard_type: ``DTensor`` (what the attribute holds while the parameter is sharded).
      uses: its recognised uses, in the order they ran.
      batch: the gradient at each distinct tensor it was (its batch gradient, summed).
      seen: those tensors.
      handles: the hooks on those tensors (removed by :func:`release`).
    """

    owner: nn.Module
    attribute: str
    shape: torch.Size
    where: str
    sharded: list[str]
    path: list[nn.Module]
    shard_type: type
    uses: list[Use] = field(default_factory=list)
    batch: list[GradientSlot] = field(default_factory=list)
    seen: list[torch.Tensor] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)

    def current(self) -> torch.Tensor | None:
        """The parameter's tensor in its module if a plain one (FSDP2 has gathered it: the
        module is running) that requires a gradient, else None (a DTensor shard)."""
        value = getattr(self.owner, self.attribute, None)
        plain = isinstance(value, torch.Tensor) and not isinstance(value, self.shard_type)
        return value if plain and value.requires_grad else None


@dataclass
class UseCapture:
    """What :func:`reading_uses` saw: unit name -> ``{name relative to the unit: Tracked}``.
    ``targets`` and ``problems`` are the caller's lists (``fsdp_units.UnitCapture``'s): the
    tensors the backward pass must reach, and why a use cannot be taken."""

    parameters: dict[str, dict[str, Tracked]]
    targets: list[torch.Tensor]
    problems: list[str]


def holds_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is, or holds, an FSDP2 module (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


@contextmanager
def reading_uses(
    units: dict[str, nn.Module],
    batch_size: int,
    targets: list[torch.Tensor],
    problems: list[str],
) -> Iterator[UseCapture]:
    """While open, every op of the model that receives a trainable parameter of ``units``
    (those no layer with a rule owns: the unit's own, or all of a unit without such a layer,
    as ``torch_plan.ownership`` assigns them) is read (module docstring). The tensors each
    parameter was in the forward pass (seen by the ops, at its module's calls, and at the end)
    are, on a normal exit with no problem noted, hooked for its batch gradient and join
    ``targets``; the hooks go with :func:`release`, or with the capture (a step stopped before
    the gradients are read)."""
    capture = UseCapture(
        {name: _tracked(name, module) for name, module in units.items()}, targets, problems
    )
    tracked = [t for by_name in capture.parameters.values() for t in by_name.items()]
    if not tracked:
        yield capture
        return
    modules = {id(m): m for _, t in tracked for m in t.path}
    # (FSDP's own pre-forward hook is first: it has swapped the gathered tensors in)
    handles = [
        module.register_forward_pre_hook(lambda *_: _note(tracked)) for module in modules.values()
    ]
    try:
        with _UseReader(tracked, batch_size, targets, problems):
            yield capture
    finally:
        _remove(handles)
    if problems:  # (the step is refused once the processes agree)
        return
    _note(tracked)
    for _, parameter in tracked:
        for tensor in parameter.seen:
            slot = GradientSlot()
            parameter.batch.append(slot)
            parameter.handles.append(tensor.register_hook(slot.receive))
            targets.append(tensor)
    # (a step refused after this, on another process, drops the capture: its hooks go too)
    weakref.finalize(capture, _remove, [h for _, t in tracked for h in t.handles])


def _note(tracked: list[tuple[str, Tracked]]) -> None:
    """Each parameter's tensor in its module now, if a plain one (FSDP2 has gathered it)."""
    for _, parameter in tracked:
        value = parameter.current()
        if value is not None and not any(v is value for v in parameter.seen):
            parameter.seen.append(value)


def release(capture: UseCapture) -> None:
    """Remove the hooks on the parameters' tensors (once the backward pass ran)."""
    _remove(
        [h for by_name in capture.parameters.values() for t in by_name.values() for h in t.handles]
    )


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _tracked(unit: str, module: nn.Module) -> dict[str, Tracked]:
    """``{name relative to the unit: Tracked}`` of the unit's parameters that no layer with a
    rule owns (``torch_plan._unit_parameters``' assignment, from the unit alone): its own if it
    holds a layer with a rule, else all of them; trainable ones only."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    has_rule = any(rule_for(m) is not None for m in module.modules())
    where = f"module {unit!r}" if unit else "the model itself"
    where = f"{where} ({type(module).__name__})"
    sharded = [
        ".".join(part for part in (unit, sub) if part) or "<root>"
        for sub, m in module.named_modules()
        if isinstance(m, FSDPModule)
    ]
    found = {}
    for name, param in module.named_parameters(recurse=has_rule is False):
        if param.requires_grad:
            owner_name, _, attribute = name.rpartition(".")
            parts = owner_name.split(".") if owner_name else []
            path = [module.get_submodule(".".join(parts[:k])) for k in range(len(parts) + 1)]
            found[name] = Tracked(path[-1], attribute, param.shape, where, sharded, path, DTensor)
    return found


class _UseReader(TorchFunctionMode):
    """The mode of :func:`reading_uses`."""

    def __init__(
        self,
        tracked: list[tuple[str, Tracked]],
        batch_size: int,
        targets: list[torch.Tensor],
        problems: list[str],
    ) -> None:
        super().__init__()
        self.tracked = tracked
        self.batch_size = batch_size
        self.targets = targets
        self.problems = problems

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        current = [(n, t, v) for n, t in self.tracked if (v := t.current()) is not None]
        received = _tensors(args, kwargs) if current else []
        hits = [(n, t, v) for n, t, v in current if any(x is v for x in received)]
        if not hits or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        name, parameter, value = hits[0]
        if not any(v is value for v in parameter.seen):
            parameter.seen.append(value)
        if len(hits) == 1 and sum(x is value for x in received) == 1:
            expanded = _row_local(func, args, kwargs, value, self.batch_size)
            if expanded is not None:
                rows, substituted = expanded
                use = Use(op=resolve_name(func) or repr(func))
                parameter.uses.append(use)
                rows.register_hook(use.receive)
                self.targets.append(rows)
                return substituted()
        output = func(*args, **kwargs)
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(output)):
            problem = _problem(name, parameter, func, [n for n, _, _ in hits], self.batch_size)
            if problem not in self.problems:
                self.problems.append(problem)
        return output


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments (a cheap pass over flat arguments and lists of
    tensors, the common case: every op of the forward pass comes here)."""
    found = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)) and all(isinstance(y, torch.Tensor) for y in x):
            found.extend(x)
        elif isinstance(x, (list, tuple, dict)):
            found.extend(y for y in pytree.tree_leaves(x) if isinstance(y, torch.Tensor))
    return found


def _row_local(
    func: Callable, args: tuple, kwargs: dict, value: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, Callable[[], Any]] | None:
    """For a recognised use of ``value`` (module docstring): ``value`` expanded to the batch,
    and the op run with it in ``value``'s place; else None."""
    if func in _EXPANDS and args and args[0] is value:
        output = func(*args, **kwargs)  # (a view)
        if output.dim() and output.shape[0] == batch_size and _leading_one(value, output.dim()):
            rows = _expanded(value, output.dim(), batch_size)
            return rows, lambda: rows.expand(output.shape)
        return None
    if func not in _ELEMENTWISE and func not in _IN_PLACE:
        return None
    if len(args) != 2 or set(kwargs) - _ELEMENTWISE_OPTIONS:
        return None
    if func in _IN_PLACE and args[0] is value:
        return None
    other = args[1] if args[0] is value else args[0]
    if not isinstance(other, torch.Tensor):
        return None
    try:
        shape = torch.broadcast_shapes(other.shape, value.shape)
    except RuntimeError:
        return None
    if not (
        shape
        and other.dim() == len(shape)
        and shape[0] == other.shape[0] == batch_size
        and _leading_one(value, len(shape))
    ):
        return None
    rows = _expanded(value, len(shape), batch_size)
    swapped = tuple(rows if x is value else x for x in args)
    return rows, lambda: func(*swapped, **kwargs)


def _leading_one(value: torch.Tensor, ndim: int) -> bool:
    """Whether ``value``, broadcast to ``ndim`` axes, has one row (0-d tensors excluded)."""
    return 0 < value.dim() < ndim or (value.dim() == ndim and value.shape[0] == 1)


def _expanded(value: torch.Tensor, ndim: int, batch_size: int) -> torch.Tensor:
    """``value`` with leading axes of 1 up to ``ndim`` axes, the first expanded to the batch:
    ``(B, ...)``, each row ``value``'s numbers (no copy)."""
    padded = value.reshape((1,) * (ndim - value.dim()) + tuple(value.shape))
    return padded.expand(batch_size, *padded.shape[1:])


def _problem(
    name: str, parameter: Tracked, func: Callable, names: list[str], batch_size: int
) -> str:
    op = resolve_name(func) or repr(func)
    together = f" together with {names[1:]}" if len(names) > 1 else ""
    return (
        f"the trainable parameter {name!r} of {parameter.where} belongs to no layer with a "
        f"ghost rule, and that module holds the FSDP2 module(s) {parameter.sharded[:3]} "
        f"(fully_shard), whose collectives cannot run per example; {_RECOGNISED} (B = "
        f"{batch_size} here), but the model used it in {op}{together}, which pergrad does not "
        f"recognise as row by row. {_MOVE}"
    )


@torch.no_grad()
def read_off(capture: UseCapture, unit: str, batch_size: int) -> dict[str, torch.Tensor]:
    """``{name relative to the unit: (B, *shape)}`` per-example gradients of the unit's
    tracked parameters, summed over their uses, in float32 at least; none for a parameter
    whose gradient did not reach the loss. Raises :class:`Unsupported` where they do not add
    up to the parameter's batch gradient (a use the mode did not see)."""
    result = {}
    for name, parameter in capture.parameters[unit].items():
        shape = parameter.shape
        parts = [
            _widened(use.output_grad).reshape(batch_size, *shape)
            for use in parameter.uses
            if use.output_grad is not None
        ]
        batch = [slot.output_grad for slot in parameter.batch if slot.output_grad is not None]
        if not parts and not batch:
            continue
        rows = sum(parts[1:], parts[0]) if parts else _zeros(batch[0], batch_size, shape)
        _check_sum(name, parameter, parts, batch)
        result[name] = rows
    return result


def _check_sum(
    name: str, parameter: Tracked, parts: list[torch.Tensor], batch: list[torch.Tensor]
) -> None:
    """Raise :class:`Unsupported` unless the uses' rows add up to the batch gradient, to the
    rounding of the dtype they were computed in (``unit_sum`` of ``TOLERANCES``), at the scale
    of the uses' and the batch gradient's norms (a sum of uses that cancel rounds at theirs)."""
    expected = sum((_widened(g) for g in batch[1:]), _widened(batch[0])) if batch else None
    sums = [part.sum(0) for part in parts]
    got = sum(sums[1:], sums[0]) if sums else torch.zeros_like(expected)
    if expected is None:
        expected = torch.zeros_like(got)
    scale = torch.linalg.vector_norm(expected) + sum(torch.linalg.vector_norm(s) for s in sums)
    dtypes = [checked_dtype(g) for g in batch] or [torch.float32]
    tolerance = max(TOLERANCES["unit_sum"].of(dtype) for dtype in dtypes)
    if torch.linalg.vector_norm(got - expected) > tolerance * scale + 1e-12:
        ops = ", ".join(sorted({use.op for use in parameter.uses})) or "none seen"
        raise Unsupported(
            f"the per-example gradients of the trainable parameter {name!r} of "
            f"{parameter.where}, read off its uses in the forward pass ({ops}), do not add up "
            f"to its batch gradient: the model also uses it where pergrad cannot see (compiled "
            f"code, a custom autograd.Function, a region with torch functions disabled); "
            f"{_RECOGNISED}. {_MOVE}"
        )


def _widened(x: torch.Tensor) -> torch.Tensor:
    """A floating tensor below float32 as a float32 copy."""
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def _zeros(like: torch.Tensor, batch_size: int, shape: torch.Size) -> torch.Tensor:
    return _widened(like).new_zeros((batch_size, *shape))
