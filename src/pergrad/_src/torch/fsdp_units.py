"""Per-example gradients of an FSDP2 model's parameters that no layer rule owns (a ViT's class
token and position embeddings, a LayerScale's ``gamma``, a weight used through ``F.linear``),
for the DP step of ``fsdp.py``. Split from it.

As in the single-process ghost strategy (``capture/torch_generic.py``), each such parameter's
*generic unit* (``torch_generic.find_unit``) has its calls recorded in the norm pass (its
arguments, the gradient at its output) and is then run ALONE over this process's examples
(``torch.func.vmap``), its rule-less parameters differentiated: their ``(B, *shape)``
per-example gradients, complete on each process for its own examples, without communication.

What FSDP2 changes: a unit's parameters are whole only while the FSDP module above it runs (its
forward pass gathers them, and frees them after). So the unit's forward hook clones them at its
first call of the pass (:func:`capturing_units`: the unit's parameters, held until the
gradients are formed), and the unit runs alone on those clones. A unit that is, or holds, an
FSDP2 module cannot run alone (it would run FSDP's collectives inside ``vmap``): its parameters'
per-example gradients are read off the forward pass instead, where each of their uses is row by
row (``x + pos_embed``, ``cls_token.expand(B, -1, -1)``: ``fsdp_broadcast.py``), and the step is
refused otherwise.

Low-precision passes (FSDP's ``param_dtype``, ``torch.autocast``): the unit runs alone in
float32 (autocast off), on float32 copies of its clones, arguments and output gradients, and
its per-example gradients come out in the shards' dtype; both their norms and their share of
the clipped sum are formed from them, so each example stays within ``max_norm`` to float32
rounding. (Run alone in bfloat16, their sum would be another rounding of the batch gradient
than the batched pass's, past the check's tolerance.)

Checks (as the single-process route's, ``torch_generic.py``): each example's slice run alone
must reproduce its row of the unit's batched output, and, on the first step of each layout of
the unit's calls (``torch_checks.records_signature``: their shapes with the batch size marked),
the per-example gradients must add up to the unit's batch gradient (the unit run once more on
the whole batch); else the step is refused on every process (``fsdp_checks.agree``), never
reduced along the wrong axis.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from pergrad._src.capture import torch_checks
from pergrad._src.capture.torch_generic import (
    UnitCall,
    check_sums,
    per_example,
    running_alone,
)
from pergrad._src.capture.torch_plan import Ownership
from pergrad._src.torch import fsdp_broadcast

# unit module -> the signatures (torch_checks.records_signature) of the calls whose per-example
# gradients passed the sum check; weakly held, as the checked layouts are on the losses
_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[Any]] = weakref.WeakKeyDictionary()


@dataclass
class UnitCapture:
    """What the norm pass's forward hooks kept of the generic units.

    Attributes:
      calls: unit name -> each call (``torch_generic.UnitCall``: its arguments, its output,
        and the gradient there once the backward pass ran).
      values: unit name -> ``{name relative to the unit: clone}`` of every parameter of the
        unit, whole, as its first call used it.
      targets: each call's output (with its graph), for the backward pass to reach; emptied
        after it.
      problems: why a call cannot be taken (its output not batched on axis 0, a parameter
        still sharded at its call); raised once the processes agree.
      rounding: unit name -> the autocast dtype its first call ran under (None: no autocast):
        the precision its outputs carry, for the rows check.
      uses: the uses read off the forward pass of the parameters of the units that are, or
        hold, an FSDP2 module (``fsdp_broadcast.py``; those units have no ``calls``).
    """

    calls: dict[str, list[UnitCall]]
    values: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    targets: list[torch.Tensor] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    rounding: dict[str, torch.dtype | None] = field(default_factory=dict)
    uses: fsdp_broadcast.UseCapture | None = None


@contextmanager
def capturing_units(units: dict[str, nn.Module], batch_size: int) -> Iterator[UnitCapture]:
    """Forward hooks on ``units`` that keep each call's arguments, its output and its output's
    gradient, and clone the unit's parameters at its first call; the uses of the parameters of
    the units that are, or hold, an FSDP2 module read instead (``fsdp_broadcast.reading_uses``).
    A call or a use that cannot be taken is noted in ``problems``, never raised: the other
    processes are in FSDP's forward pass."""
    sharded = {name: m for name, m in units.items() if fsdp_broadcast.holds_sharded(m)}
    alone = {name: m for name, m in units.items() if name not in sharded}
    capture = UnitCapture({name: [] for name in alone})
    handles = [
        module.register_forward_hook(
            functools.partial(_hook, capture, batch_size, name), with_kwargs=True
        )
        for name, module in alone.items()
    ]
    try:
        with fsdp_broadcast.reading_uses(
            sharded, batch_size, capture.targets, capture.problems
        ) as uses:
            capture.uses = uses
            yield capture
    finally:
        for handle in handles:
            handle.remove()


def _hook(
    capture: UnitCapture,
    batch_size: int,
    name: str,
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    output: Any,
) -> None:
    first = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] != batch_size:
        capture.problems.append(
            f"layer {name!r} ({type(module).__name__}), which has no ghost rule, did not return "
            f"the batch of {batch_size} on axis 0"
        )
        return
    if name not in capture.values:
        from torch.distributed.tensor import DTensor

        sharded = [rel for rel, p in module.named_parameters() if isinstance(p, DTensor)]
        if sharded:
            capture.problems.append(
                f"layer {name!r} ({type(module).__name__})'s parameters {sharded} are still "
                f"shards (DTensors) at its call"
            )
            return
        # (FSDP frees the gathered parameters after the pass: the unit runs alone on these)
        capture.values[name] = {rel: p.detach().clone() for rel, p in module.named_parameters()}
        device_type = first.device.type
        autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
        capture.rounding[name] = torch.get_autocast_dtype(device_type) if autocast else None
    record = UnitCall(args, dict(kwargs), first.detach())
    capture.calls[name].append(record)
    if first.requires_grad:
        first.register_hook(record.receive)
        capture.targets.append(first)


def formed_gradients(
    owners: Ownership, capture: UnitCapture, batch_size: int, dtypes: dict[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """Name in ``params`` -> ``(B, *shape)`` per-example gradients of the units' parameters (in
    ``dtypes[name]``, the shards' dtype), for this process's examples; none for a unit whose
    output did not reach the loss (its parameters' gradients are zero). Raises
    :class:`Unsupported` where a unit cannot be run alone or fails the checks (module
    docstring), or where the gradients read off the forward pass do not add up
    (``fsdp_broadcast.read_off``). The hooks of the reading go first, the backward pass done."""
    if capture.uses is not None:
        fsdp_broadcast.release(capture.uses)  # (the backward pass ran)
    result = {}
    for unit, module in owners.units.items():
        if capture.uses is not None and unit in capture.uses.parameters:
            if batch_size:
                names = owners.unit_parameters[unit]
                for rel, grad in fsdp_broadcast.read_off(capture.uses, unit, batch_size).items():
                    result[names[rel]] = grad.to(dtypes[names[rel]])
            continue
        rounding = capture.rounding.get(unit)
        calls = [
            _widened_call(c, rounding) for c in capture.calls[unit] if c.output_grad is not None
        ]
        if not calls or not batch_size:
            continue
        names = owners.unit_parameters[unit]
        values = {rel: _widened(v) for rel, v in capture.values[unit].items()}
        params = {rel: values[rel] for rel in names}
        constants = {rel: v for rel, v in values.items() if rel not in names}
        # the sum check once per layout of the unit's calls (as in one process): the batch
        # size marked, so Poisson batches do not run the unit on the batch once more each step
        signature = torch_checks.records_signature({unit: calls}, batch_size)
        checked = _CHECKED.setdefault(module, set())
        with (
            running_alone(unit, module),
            torch.autocast(calls[0].output.device.type, enabled=False),
        ):
            grads = per_example(module, params, calls, batch_size, constants)
            if signature not in checked:
                check_sums(unit, grads, _batch_gradients(module, params, constants, calls))
                checked.add(signature)
        for rel, grad in grads.items():
            result[names[rel]] = grad.detach().to(dtypes[names[rel]])
    return result


def _batch_gradients(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
    calls: list[UnitCall],
) -> dict[str, torch.Tensor]:
    """The unit's batch gradient of ``params`` over ``calls`` (run once on the whole batch):
    what the per-example gradients must add up to."""
    leaves = {rel: p.detach().requires_grad_() for rel, p in params.items()}
    total: dict[str, torch.Tensor] = {}
    with torch.enable_grad():
        for call in calls:
            output = torch.func.functional_call(
                module, {**constants, **leaves}, call.args, call.kwargs
            )
            first = output[0] if isinstance(output, (tuple, list)) else output
            assert call.output_grad is not None
            grads = torch.autograd.grad(
                first, list(leaves.values()), call.output_grad.to(first.dtype), allow_unused=True
            )
            for rel, grad in zip(leaves, grads):
                if grad is not None:
                    total[rel] = total[rel] + grad if rel in total else grad
    return total


def _widened(x: Any) -> Any:
    """A floating tensor below float32 as a float32 copy; every tensor detached."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach()
    return x.float() if x.is_floating_point() and x.element_size() < 4 else x


def _widened_call(call: UnitCall, rounding: torch.dtype | None) -> UnitCall:
    """The call with its arguments and output gradient :func:`_widened`; its output as the
    rows check reads it: at its own precision, or at the autocast dtype ``rounding`` whose
    rounding a float32 output of an autocast pass carries (the check's tolerance is its
    dtype's)."""
    args, kwargs = pytree.tree_map(_widened, (call.args, call.kwargs))
    output = call.output
    if rounding is not None and output.is_floating_point():
        output = output.to(rounding)
    widened = UnitCall(args, kwargs, output)
    widened.output_grad = _widened(call.output_grad)
    return widened
