"""Position-bias tables: T5's relative attention bias, and the models built like it.

An attention module that owns a ``relative_attention_bias`` embedding and a ``compute_bias``
method (Hugging Face T5, mT5, UMT5, LongT5, Switch Transformers) looks the table up with ONE
``(q, k)`` grid of bucket ids for the whole batch, turns the ``(q, k, heads)`` lookup into a
``(1, heads, q, k)`` bias, and adds it to every example's attention scores, in every block of
the stack that reuses it. The lookup has no batch axis, so no hook on the table can read one
example's share of its output gradient: autograd has summed the broadcast before any hook sees
it. A model with such a table used to leave the ghost strategy for the chunked one (whose
``vmap`` fails on the stack's data-dependent mask code) and so for a loop.

While the ghost pass runs, ``compute_bias`` returns its bias expanded to the batch,
``(B, heads, q, k)``: the same numbers, added the same way, so the model computes what it
computed, and one tensor hook on the expanded bias reads each example's row of its gradient,
summed over every block that used it. Example ``b``'s gradient of the table is that row,
laid back as ``(q, k, heads)`` and added into the buckets the grid looked up: ``B x`` the
table's size (buckets x heads, a few hundred numbers) formed per example, nothing else.

What this rests on is checked, never assumed: the bias must be exactly the lookup permuted to
``(1, heads, q, k)`` (compared on every call; another layout is refused), and on a layout's
first call the rows of the expanded bias's gradient must be row-local and the per-example
gradients must add up to the batch gradient (``torch_checks.py``, ``torch_verify.py``). A refusal
sends the call to the chunked strategy, with a ``FallbackWarning``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pergrad._src.capture.torch_checks import GradientSlot
from pergrad._src.errors import Unsupported

# The layer kind reported by choose_strategy for such a table.
POSITION_BIAS = "position-bias"


def is_position_bias(model: nn.Module, module_name: str) -> bool:
    """Whether layer ``module_name`` is the ``relative_attention_bias`` table of an attention
    module with a ``compute_bias`` method (the module docstring's pattern)."""
    if not module_name or not isinstance(model.get_submodule(module_name), nn.Embedding):
        return False
    parent_name, _, attribute = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    return attribute == "relative_attention_bias" and callable(
        getattr(parent, "compute_bias", None)
    )


@dataclass
class BiasCall(GradientSlot):
    """One call of ``compute_bias``: the bucket ids it looked up, and the gradient of its
    expanded ``(B, heads, q, k)`` bias."""

    ids: torch.Tensor


@contextmanager
def capturing(
    model: nn.Module, tables: list[str], batch_size: int
) -> Iterator[dict[str, list[BiasCall]]]:
    """While open, each table's ``compute_bias`` returns its bias expanded to the batch, and
    each call is recorded (table name -> its calls)."""
    records: dict[str, list[BiasCall]] = {name: [] for name in tables}
    restore: list[Callable[[], None]] = []
    try:
        for name in tables:
            parent = model.get_submodule(name.rpartition(".")[0])
            table = model.get_submodule(name)
            restore.append(_patch(parent, table, name, records[name], batch_size))
        yield records
    finally:
        for undo in reversed(restore):
            undo()


def _patch(
    parent: nn.Module, table: nn.Module, name: str, calls: list[BiasCall], batch_size: int
) -> Callable[[], None]:
    """Shadow ``parent.compute_bias`` with the expanding one; returns what undoes it."""
    original = parent.compute_bias
    lookups: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        lookups.append((args[0], output))

    def compute_bias(*args: Any, **kwargs: Any) -> torch.Tensor:
        lookups.clear()
        bias = original(*args, **kwargs)
        if len(lookups) != 1:
            raise Unsupported(
                f"layer {name!r}: compute_bias looked its table up {len(lookups)} times, "
                f"where one lookup was expected"
            )
        ids, values = lookups.pop()
        if (
            ids.dim() != 2
            or values.dim() != 3
            or bias.shape != (1, values.shape[2], *ids.shape)
            or not torch.equal(bias.detach(), values.detach().permute(2, 0, 1).unsqueeze(0))
        ):
            raise Unsupported(
                f"layer {name!r}: compute_bias does not return its (q, k) lookup as a "
                f"(1, heads, q, k) bias"
            )
        expanded = bias.expand(batch_size, *bias.shape[1:])
        call = BiasCall(ids)
        calls.append(call)
        if expanded.requires_grad:
            expanded.register_hook(call.receive)
        return expanded

    handle = table.register_forward_hook(keep)
    shadowed = "compute_bias" in vars(parent)
    previous = vars(parent).get("compute_bias")
    parent.compute_bias = compute_bias

    def undo() -> None:
        handle.remove()
        if shadowed:
            parent.compute_bias = previous
        else:
            del parent.compute_bias

    return undo


def per_example(table: nn.Embedding, calls: list[BiasCall], batch_size: int) -> torch.Tensor:
    """``(B, buckets, heads)``: each example's gradient of the table, summed over its calls
    (accumulated in float32 at least, returned in the table's dtype)."""
    weight = table.weight
    accumulate = torch.promote_types(weight.dtype, torch.float32)
    total = torch.zeros((batch_size, *weight.shape), dtype=accumulate, device=weight.device)
    for call in calls:
        if call.output_grad is None:  # the bias did not reach the loss
            continue
        rows = call.output_grad.permute(0, 2, 3, 1).reshape(batch_size, -1, weight.shape[1])
        total.index_add_(1, call.ids.reshape(-1), rows.to(accumulate))
    if table.padding_idx is not None:
        total[:, table.padding_idx] = 0
    return total.to(weight.dtype)
