"""Whether a call's parameters are the model's own, so that a pass may run the model on them
instead of ``torch.func.functional_call`` with fresh leaves.

``functional_call`` swaps each parameter in and out of its module and walks the module tree on
every call (0.2 ms a call on the bench transformer, a tenth of its forward pass). Where the
``params`` given are views of the model's own parameters (as ``loss.params()`` and
``DPOptimizer`` give), the model can run as it is, and ``torch.autograd.grad`` with respect to
those parameters gives what it gives with respect to fresh leaves, without writing ``.grad``.
The hooks strategy's light passes (``strategies/hooks_torch.py``) and the ghost capture's later
runs of a checked layout (``torch_session.forward``) do so.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def views_of(
    params: dict[str, torch.Tensor], own: dict[str, torch.Tensor], requiring_grad: bool = False
) -> bool:
    """Whether each of ``params`` is a view of the parameter of the same name in ``own``, the
    whole of it (same storage, offset, shape, strides and dtype; with ``requiring_grad``: of
    one that requires grad). Plain tensors only: a tensor subclass (FSDP's ``DTensor``) may
    have no storage of its own to compare."""
    for name, value in params.items():
        mine = own.get(name)
        if (
            mine is None
            or type(value) is not torch.Tensor
            or type(mine) not in (torch.Tensor, nn.Parameter)
            or not value.is_set_to(mine)
            or value.dtype != mine.dtype
            or (requiring_grad and not mine.requires_grad)
        ):
            return False
    return True


def own_parameters_to_differentiate(
    model: nn.Module, params: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """The model's own parameters, by the names of ``params``, where ``torch.autograd.grad``
    with respect to them gives what it gives with respect to fresh leaves holding ``params``
    (else None): each of ``params`` is a view of its own parameter (:func:`views_of`), which
    requires grad (a frozen one would leave its layer's outputs undifferentiable), is a leaf
    with no tensor hook of the user's (``register_hook``: differentiating it would call them),
    and is named once in ``params`` (a tied parameter asked for under two names needs a leaf
    for each)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    if not views_of(params, own, requiring_grad=True):
        return None
    mine = {name: own[name] for name in params}
    if len({id(p) for p in mine.values()}) < len(mine) or any(
        not p.is_leaf or p._backward_hooks for p in mine.values()
    ):
        return None
    return mine


def autocast_on(tensors: Iterable[Any]) -> bool:
    """Whether ``torch.autocast`` is on for the CPU or for a device of ``tensors``. Autocast
    keeps the low-precision copy of each parameter it casts until its region ends, so a
    training step taken inside the region would leave the next pass on the model's own
    parameters the old weights' copies (fresh leaves are new tensors, cast anew): a pass runs
    on them only where it is off."""
    devices = {"cpu"} | {x.device.type for x in tensors if isinstance(x, torch.Tensor)}
    return any(torch.is_autocast_enabled(device) for device in devices)
