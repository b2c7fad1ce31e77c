"""``module_loss``: the loss of one example from an ``nn.Module`` and a batch loss function.

It writes once the pattern every torch.func tutorial repeats: ``functional_call`` with the
parameters as an argument and the buffers as they are, the example given a batch axis of one
(``unsqueeze(0)``), and a batch loss (``F.cross_entropy``) that then averages over one example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from pergrad._src.errors import PergradTypeError, PergradValueError


class ModuleLoss:
    """The loss of one example through ``model``: ``loss(params, *inputs, *targets) -> scalar``.

    Made by :func:`module_loss`; pass it to :func:`pergrad.per_example_grads` with
    ``loss.params()``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any], num_inputs: int) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        # (schedule, layout, records' signature) whose first-call checks passed
        # (capture/torch_checks.py: is_checked / mark_checked; the ghost and hooks schedules):
        # later runs skip them, at any batch size.
        self.checked_layouts: set[tuple[str, Any, Any]] = set()

    def params(self) -> dict[str, torch.Tensor]:
        """The trainable parameters (``requires_grad``), detached: they share storage with the
        model, so they follow optimizer steps, and no graph leads back into the model."""
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def __call__(self, params: dict[str, torch.Tensor], *example: Any) -> torch.Tensor:
        if len(example) < self.num_inputs:
            raise PergradValueError(
                f"module_loss: the loss takes params, then {self.num_inputs} model input(s), "
                f"then the loss function's arguments; got {len(example)} argument(s) after "
                f"params."
            )
        refuse_batch_mixing_layers(self.model, "module_loss")
        for position, x in enumerate(example[: self.num_inputs]):
            if isinstance(x, Mapping) and _is_one_leaf(x):
                raise PergradTypeError(
                    f"module_loss: model input {position} is a {type(x).__name__}, a mapping "
                    f"torch's pytrees cannot split by example (a Hugging Face BatchEncoding?), "
                    f"so every example would get the whole batch. Pass dict(batch) instead."
                )
        batched = [pytree.tree_map(_add_batch_axis, x) for x in example]
        inputs, targets = batched[: self.num_inputs], batched[self.num_inputs :]
        out = self.loss_fn(self.forward(params, inputs), *targets)
        if isinstance(out, tuple) and len(out) == 2:  # (loss, aux), for has_aux=True
            return as_scalar(out[0]), out[1]
        return as_scalar(out)

    def forward(self, params: dict[str, torch.Tensor] | None, inputs: Sequence[Any]) -> Any:
        """The model's output on batched ``inputs``: with ``params`` in place of its own
        parameters (``functional_call``), or, for ``params=None``, with its own. A dict input
        is passed as keyword arguments, as ``model(**batch)``."""
        args = [x for x in inputs if not isinstance(x, Mapping)]
        kwargs: dict[str, Any] = {}
        for x in inputs:
            if isinstance(x, Mapping):
                kwargs.update(x)
        unwritten = running_statistics_left_alone(self.model)
        if params is None:
            if not unwritten:
                return self.model(*args, **kwargs)
            return functional_call(self.model, unwritten, tuple(args), kwargs)
        buffers = {**dict(self.model.named_buffers()), **unwritten}
        return functional_call(self.model, (params, buffers), tuple(args), kwargs)


def running_statistics_left_alone(model: nn.Module) -> dict[str, None]:
    """Buffer name -> None for each running statistic that a layer in training mode would
    write but does not read: an instance norm with ``track_running_stats=True`` normalises
    each example by its own statistics in training mode and then folds the batch's into its
    running ones. Run with these buffers absent, it computes the same output and writes
    nothing (the promise of :func:`module_loss`), and ``vmap`` batches it."""
    absent: dict[str, None] = {}
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.modules.instancenorm._InstanceNorm)
            and module.training
            and module.track_running_stats
        ):
            prefix = f"{name}." if name else ""
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer is not None:
                    absent[prefix + buffer_name] = None
    return absent


def _is_one_leaf(x: Any) -> bool:
    leaves = pytree.tree_leaves(x)
    return len(leaves) == 1 and leaves[0] is x


def as_scalar(loss: Any) -> Any:
    if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() == 1:
        return loss.reshape(())  # a reduction="none" loss of the one example
    return loss


def _add_batch_axis(x: Any) -> Any:
    return x.unsqueeze(0) if isinstance(x, torch.Tensor) else x


def module_loss(model: nn.Module, loss_fn: Callable[..., Any], num_inputs: int = 1) -> ModuleLoss:
    """The loss of one example through ``model``, ready for :func:`pergrad.per_example_grads`.

    Args:
      model: any ``nn.Module``. Its buffers (BatchNorm statistics in eval mode) are used as they
        are and never written; BatchNorm in training mode is refused, since it mixes examples.
        An instance norm with ``track_running_stats=True`` in training mode normalises each
        example by its own statistics, as it does in training, and its running statistics are
        left as they are (they are an average over the batch, which per-example quantities
        do not compute, and under DP a release of the data that no accountant counts): update
        them outside pergrad if your evaluation reads them.
      loss_fn: a batch loss, ``loss_fn(output, *targets) -> scalar``, e.g.
        ``torch.nn.functional.cross_entropy``. It is called on a batch of one example.
      num_inputs: how many of the per-example arguments go to the model (the rest go to
        ``loss_fn``). Default 1: ``loss(params, x, y)`` runs ``loss_fn(model(x), y)``. A model
        input that is a dict is passed as keyword arguments: with Hugging Face models,
        ``loss(params, {"input_ids": ids, "attention_mask": mask}, labels)`` runs
        ``loss_fn(model(input_ids=..., attention_mask=...), labels)``.

    Example::

        loss = pergrad.module_loss(model, F.cross_entropy)
        grads = pergrad.per_example_grads(loss)(loss.params(), X, Y)
        # {'fc.weight': (B, 10, 128), 'fc.bias': (B, 10), ...}

    Parameters with ``requires_grad=False`` are not in ``loss.params()`` and stay fixed.
    """
    if not isinstance(model, nn.Module):
        raise PergradTypeError(
            f"module_loss: model must be a torch.nn.Module; got {type(model).__name__}."
        )
    if not callable(loss_fn):
        raise PergradTypeError(
            f"module_loss: loss_fn must be a callable loss_fn(output, *targets) -> scalar; got "
            f"{type(loss_fn).__name__}."
        )
    if isinstance(num_inputs, bool) or not isinstance(num_inputs, int) or num_inputs < 1:
        raise PergradValueError(
            f"module_loss: num_inputs must be a positive int; got {num_inputs!r}."
        )
    refuse_batch_mixing_layers(model, "module_loss")
    return ModuleLoss(model, loss_fn, num_inputs)


def refuse_batch_mixing_layers(model: nn.Module, func_name: str) -> None:
    """Raise if ``model`` has a layer whose output for one example depends on the others."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise PergradValueError(
                f"{func_name}: layer {name!r} ({type(module).__name__}) is in training "
                f"mode, where it normalises with the statistics of the whole batch, so an "
                f"example's gradient depends on the other examples and per-example gradients "
                f"are not defined. Call model.eval() (running statistics), or replace it with "
                f"GroupNorm / LayerNorm."
            )
