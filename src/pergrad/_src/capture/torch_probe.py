"""The shapes a ghost plan's layers see, for the cost model of ``strategy="auto"``
(``cost.route_costs``), without running the model on numbers.

A layer's norm work depends on its positions per example (a convolution's output positions, a
linear layer's tokens), which only a forward pass shows. :func:`layer_works` runs the model on
its first example, without gradients (``1 / B`` of the batch's forward pass), with forward
hooks on the planned layers that record their output shapes, removed before it returns; the
model sees copies of its buffers and the random number generators are restored afterwards, so
nothing of the model or of the user's random stream changes. The answer is remembered per loss,
per example shape (the batch size does not enter it) and per structure of the model
(``torch_plan.Structure``: a module replaced is probed again), so a training loop probes once
per layout; so are the works made of it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from pergrad._src.capture import cost
from pergrad._src.capture.cost import LayerWork
from pergrad._src.capture.torch_plan import GENERIC, POSITION_BIAS
from pergrad._src.core.module_loss import ModuleLoss

# Rules whose norm work is linear in the layer's output (no positions-by-width products).
LIGHT_RULES = frozenset(
    {
        "embedding",
        "layer_norm",
        "rms_norm",
        "hf_rms_norm",
        "group_norm",
        "instance_norm",
        "batch_norm_eval",
    }
)
# Layouts remembered per loss (the oldest dropped past this many): a cache beside the losses,
# weakly held, as checked_layouts is on them.
_REMEMBERED = 16
_probed: weakref.WeakKeyDictionary[ModuleLoss, dict[Any, Any]] = weakref.WeakKeyDictionary()


def layer_works(
    loss: ModuleLoss,
    layers: dict[str, str],
    generic_size: int,
    args: tuple[Any, ...],
    holdable: frozenset[str] = frozenset(),
    structure: Any = None,
) -> list[LayerWork] | str:
    """The :class:`~pergrad._src.capture.cost.LayerWork` of every call of the planned
    ``layers`` on one example of ``args`` (``(params, *inputs, *targets)``, batched on axis
    0), or why there is no estimate (a rule the cost model does not know, a model that does
    not run on one example alone).

    ``holdable``: the layers a DP step may hold as their formed per-example gradients
    (``capture/torch_held.py``); each of them whose parameters are no more numbers than its
    calls' outputs, as there, is one ``"held"`` work instead of its calls', and the uses of a
    tied parameter held together (``torch_held_tied.py``) one for all of theirs.

    ``structure``: the model's ``torch_plan.Structure`` (its plan's), under which the shapes
    and the works are remembered; None: the shapes are remembered per layout only, and the
    works made afresh."""
    unknown = sorted({rule for rule in layers.values() if not _known(rule)})
    if unknown:
        return f"no work estimate for the rule(s) {unknown}"
    params, inputs = args[0], args[1 : 1 + loss.num_inputs]
    batch_size = _batch_size(inputs)
    leaves, spec = pytree.tree_flatten(list(inputs))
    key = (tuple(sorted(layers.items())), str(spec), tuple(map(_shape_of, leaves)), structure)
    remembered = _probed.setdefault(loss, {})
    if key not in remembered:
        if len(remembered) >= _REMEMBERED:
            remembered.pop(next(iter(remembered)))
        remembered[key] = _Probed(_probe(loss, layers, params, inputs, batch_size))
    probed = remembered[key]
    if isinstance(probed.shapes, str):
        return probed.shapes
    if structure is None:
        return _works(loss.model, layers, generic_size, holdable, probed.shapes)
    made = (holdable, generic_size, cost.settings())  # (the held works read its constants)
    if made not in probed.works:
        if len(probed.works) >= 4:  # (the oldest dropped)
            probed.works.pop(next(iter(probed.works)))
        probed.works[made] = _works(loss.model, layers, generic_size, holdable, probed.shapes)
    return list(probed.works[made])


class _Probed:
    """One layout's probe: its ``shapes`` (or why it failed), and the works made of them by
    ``(holdable, generic_size, cost.settings())`` (a few: a loop asks with one or two)."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]] | str) -> None:
        self.shapes = shapes
        self.works: dict[Any, list[LayerWork]] = {}


def _works(
    model: nn.Module,
    layers: dict[str, str],
    generic_size: int,
    holdable: frozenset[str],
    shapes: list[tuple[str, tuple[int, ...]]],
) -> list[LayerWork]:
    """:func:`layer_works` from the probe's ``shapes``."""
    works = [(name, _work(model.get_submodule(name), layers[name], out)) for name, out in shapes]
    held = _held_layers(model, works, holdable)
    kept = [work for name, work in works if not any(name in group for group in held)]
    kept += held.values()
    if generic_size:
        kept.append(LayerWork("formed", 1, (), 1, generic_size))
    return kept


def _held_layers(
    model: nn.Module, works: list[tuple[str, LayerWork]], holdable: frozenset[str]
) -> dict[frozenset[str], LayerWork]:
    """The layers held together (one, or the uses of one tied parameter) -> their ``"held"``
    work (``numbers`` their parameters', ``norm_work`` all their calls',
    ``cost.held_norm_work``), for each group of ``holdable`` layers whose per-example
    gradients are no more numbers than the output gradients of the group's first layer to
    complete in the backward pass, the one whose first call comes last (``torch_held``'s and
    ``torch_held_tied``'s test, per example)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    calls: dict[str, list[LayerWork]] = {}
    first_call: dict[str, int] = {}
    for k, (name, work) in enumerate(works):
        if name not in holdable:
            continue
        if name not in calls:
            params = model.get_submodule(name).parameters(recurse=False)
            groups.setdefault(tuple(sorted(map(id, params))), []).append(name)
        calls.setdefault(name, []).append(work)
        first_call.setdefault(name, k)  # (a layer completes at its first call's gradient)
    held = {}
    for names in groups.values():
        first = max(names, key=first_call.__getitem__)
        group_calls = [work for name in names for work in calls[name]]
        if group_calls[0].numbers <= sum(map(cost.layer_output_numbers, calls[first])):
            held[frozenset(names)] = LayerWork(
                "held", 1, (), 1, group_calls[0].numbers, cost.held_norm_work(group_calls)
            )
    return held


def _known(rule: str) -> bool:
    return rule in LIGHT_RULES or rule in ("linear", "hf_conv1d", "conv", GENERIC, POSITION_BIAS)


def _batch_size(inputs: tuple[Any, ...]) -> int | None:
    for x in pytree.tree_leaves(list(inputs)):
        if isinstance(x, torch.Tensor) and x.ndim:
            return x.shape[0]
    return None


def _shape_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape[1:]) if x.ndim else (), x.dtype)
    return type(x).__name__


def _probe(
    loss: ModuleLoss, layers: dict[str, str], params: Any, inputs: tuple[Any, ...], batch: Any
) -> list[tuple[str, tuple[int, ...]]] | str:
    """``[(layer, output shape of one example)]`` for each call of each hooked layer, in call
    order, from the model run on its first example without gradients; or why it could not run.
    The buffers it sees are copies and the random number generators are restored after it, so
    the model and the user's random stream are as they were."""
    model = loss.model
    calls: list[tuple[str, tuple[int, ...]]] = []

    def record(name: str) -> Any:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            leaves = pytree.tree_leaves(output)
            first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
            if first is not None:
                calls.append((name, tuple(first.shape)))

        return hook

    def one_example(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch:
            return x[:1]
        return x

    example = pytree.tree_map(one_example, list(inputs))
    args = [x for x in example if not isinstance(x, Mapping)]
    kwargs = {k: v for x in example if isinstance(x, Mapping) for k, v in x.items()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    devices = sorted({p.device.index for p in params.values() if p.device.type == "cuda"})
    hooked = [n for n, rule in layers.items() if rule not in (GENERIC, POSITION_BIAS)]
    handles = [model.get_submodule(n).register_forward_hook(record(n)) for n in hooked]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            functional_call(model, (params, buffers), tuple(args), kwargs)
    except Exception as err:  # any failure: no estimate, and the ghost norms are kept
        return f"the model did not run on one example alone ({type(err).__name__}: {err})"
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _work(module: nn.Module, rule: str, out: tuple[int, ...]) -> LayerWork:
    """One call's :class:`LayerWork` from the rule and the output shape ``(1, ...)``."""
    numbers = sum(p.numel() for p in module.parameters(recurse=False))
    outputs = math.prod(out[1:])
    if rule in LIGHT_RULES:
        return LayerWork("light", 1, (outputs,), 1, numbers)
    weight = module.weight
    if rule == "conv":
        groups = module.groups
        width_in, width_out = weight[0].numel(), module.out_channels // groups
        positions = max(1, outputs // module.out_channels)
        if type(module) not in (nn.Conv1d, nn.Conv2d) or positions**2 >= width_in * width_out:
            return LayerWork("formed", positions, (width_in, width_out), groups, numbers)
        return LayerWork("dense", positions, (width_in, width_out), groups, numbers)
    width_in, width_out = weight.shape if rule == "hf_conv1d" else weight.shape[::-1]
    return LayerWork("dense", max(1, outputs // width_out), (width_in, width_out), 1, numbers)
