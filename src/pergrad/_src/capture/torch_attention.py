"""The ghost rule of ``nn.MultiheadAttention``: its projections as linear layers.

``nn.MultiheadAttention`` uses its weights through ``F.multi_head_attention_forward``: its
``out_proj`` is never called as a module and no hook sees the in-projection's output, so no
linear rule can read them. But each of its parameters belongs to a linear map applied at every
position: the in-projection ``[q, k, v] = [query, key, value] W_in^T + b_in`` and the
out-projection ``y = attended W_out^T + b_out``. Their per-example gradients follow from the
inputs of those maps and the gradients at their outputs, and all of these come from what a
hook on the attention itself records (its inputs and masks, the parameter values of the pass,
the gradient at its output ``dy``):

- the out-projection's output gradient is ``dy``, its input ``attended``;
- ``d attended = dy W_out``; recomputing the attention from ``q, k, v`` (projected again, as
  autograd leaves) and backpropagating ``d attended`` through it alone (not through the model)
  gives ``dq, dk, dv``: the in-projection's output gradients.

Examples do not mix inside the attention (its masks act within an example), so row ``b`` of
each of these is example ``b``'s. The per-example squared norms and weighted sums of the four
(or, with ``kdim`` / ``vdim`` set, six) parameters then come from the linear machinery of
``torch_layers.py`` (:func:`~pergrad._src.capture.torch_layers.outer_product_squared_norms`
and its cost model): the in-projection's weight is three row blocks (q, k, v) with their own
inputs, whose squared norms add; the blocks of inputs passed as one tensor (self-attention's
query, key and value) share one block, so one Gram matrix serves them.

Covered: ``batch_first`` either way, self- and cross-attention, separate projection weights
(``kdim`` / ``vdim``), with or without bias, ``key_padding_mask``, ``attn_mask`` (2-D or per
head), ``is_causal``, ``need_weights`` (the attention weights must not reach the loss: a
gradient reaching them refuses the call, and ``"auto"`` takes the chunked strategy). Not
covered (:func:`not_covered`; such a layer has no rule, and runs alone as a generic unit as
every attention did before this rule): ``add_bias_kv``, ``add_zero_attn``, and attention
dropout in training mode (its mask cannot be recomputed).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergrad._src.capture.cost import dense_route
from pergrad._src.capture.rules import Recorded, register
from pergrad._src.capture.torch_layers import (
    LayerCall,
    outer_product_squared_norms,
    side_by_side,
)
from pergrad._src.errors import Unsupported

# nn.MultiheadAttention.forward's arguments after self, by position, and their defaults
_PARAMETERS = tuple(inspect.signature(nn.MultiheadAttention.forward).parameters.values())[1:]
_NAMES = tuple(parameter.name for parameter in _PARAMETERS)
_DEFAULTS = {p.name: p.default for p in _PARAMETERS if p.default is not inspect.Parameter.empty}


@dataclass
class AttentionCall:
    """One call of the attention, batch first: what ``LayerCall.inputs`` holds, in this order
    (a tuple, so that the precision wrapper of ``rules.py`` widens its tensors)."""

    query: torch.Tensor  # (B, L, embed_dim)
    key: torch.Tensor  # (B, S, kdim)
    value: torch.Tensor  # (B, S, vdim)
    # The masks as their finite values and where they block (-inf, or True in a boolean mask),
    # so that every float input is finite: a weighted sum may zero non-finite inputs.
    padding_values: torch.Tensor | None  # (B, S)
    padding_blocked: torch.Tensor | None
    mask_values: torch.Tensor | None  # (L, S) or (B * heads, L, S)
    mask_blocked: torch.Tensor | None
    need_weights: bool
    is_causal: bool
    # the parameter values of the pass (functional_call swaps them in), detached
    in_proj_weight: torch.Tensor | None
    q_proj_weight: torch.Tensor | None
    k_proj_weight: torch.Tensor | None
    v_proj_weight: torch.Tensor | None
    in_proj_bias: torch.Tensor | None
    out_proj_weight: torch.Tensor
    out_proj_bias: torch.Tensor | None


_FIELDS = tuple(f.name for f in fields(AttentionCall))


def not_covered(layer: nn.MultiheadAttention) -> str | None:
    """Why the rule does not cover this attention, or None."""
    if layer.bias_k is not None:
        return "add_bias_kv=True (learned key and value rows) is not covered by its rule"
    if layer.add_zero_attn:
        return "add_zero_attn=True is not covered by its rule"
    if layer.training and layer.dropout > 0:
        return (
            f"attention dropout ({layer.dropout}) in training mode draws a mask its rule cannot "
            f"recompute; use eval mode or dropout=0.0 for the attention"
        )
    return None


def _record(
    layer: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict, output: Any
) -> Recorded:
    """The call's arguments, batch first, and the values of the parameters in this pass."""
    # by name, the defaults filled in, as Signature.bind and apply_defaults would give them
    # (the call ran, so they bind): written out, as a compiled model's whole-graph capture
    # traces this and dynamo does not trace bind (torch_compiled.py)
    given = {**_DEFAULTS, **dict(zip(_NAMES, args)), **kwargs}
    query, key, value = given["query"], given["key"], given["value"]
    if not all(
        isinstance(x, torch.Tensor) and x.dim() == 3 and not x.is_nested
        for x in (query, key, value)
    ):
        raise Unsupported(
            "nn.MultiheadAttention's rule takes a batched (3-D, not nested) query, key and value"
        )
    axis = 0 if layer.batch_first else 1
    moved: dict[int, torch.Tensor] = {}

    def batch_first(x: torch.Tensor) -> torch.Tensor:  # one tensor passed twice stays one
        return moved.setdefault(id(x), x.movedim(axis, 0))

    attention = AttentionCall(
        batch_first(query),
        batch_first(key),
        batch_first(value),
        *_split_mask(given["key_padding_mask"]),
        *_split_mask(given["attn_mask"]),
        bool(given["need_weights"]),
        bool(given["is_causal"]),
        _value(layer.in_proj_weight),
        _value(layer.q_proj_weight),
        _value(layer.k_proj_weight),
        _value(layer.v_proj_weight),
        _value(layer.in_proj_bias),
        _value(layer.out_proj.weight),
        _value(layer.out_proj.bias),
    )
    batch = attention.query.shape[0]
    if attention.key.shape[0] != batch or attention.value.shape[0] != batch:
        raise Unsupported("the query, key and value of the attention differ in batch size")
    attended, weights = output
    return Recorded(
        tuple(getattr(attention, name) for name in _FIELDS), attended, axis, unread=(weights,)
    )


def _value(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.detach()


def _split_mask(mask: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An attention mask as (its finite values, where it blocks): ``(None, mask)`` for a
    boolean one (True: not attended); for a float one, -inf marks where it blocks."""
    if mask is None:
        return None, None
    if not mask.is_floating_point():
        return None, mask.bool()
    with torch.no_grad():
        blocked = torch.isneginf(mask)
        return mask.detach().masked_fill(blocked, 0.0), blocked


def _additive(
    values: torch.Tensor | None, blocked: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """The additive mask (``-inf`` where blocked) in ``dtype``, as the attention adds it."""
    if values is None and blocked is None:
        return None
    if values is None:
        values = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device)
    return values.to(dtype).masked_fill(blocked, float("-inf"))


@dataclass
class _Gradients:
    """One call's recomputed linear maps: the inputs and output gradients of the in- and
    out-projections, all ``(B, positions, width)``."""

    call: AttentionCall
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    attended: torch.Tensor
    output_grad: torch.Tensor


def _gradients(layer: nn.MultiheadAttention, call: LayerCall) -> _Gradients:
    """``dq, dk, dv`` by backpropagating ``dy W_out`` through the attention alone."""
    attention = AttentionCall(*call.inputs)
    if attention.in_proj_weight is not None:
        w_q, w_k, w_v = attention.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = attention.q_proj_weight, attention.k_proj_weight, attention.v_proj_weight
    biases = (None,) * 3 if attention.in_proj_bias is None else attention.in_proj_bias.chunk(3)
    with torch.no_grad():
        q, k, v = (
            F.linear(x, w, b).requires_grad_()
            for x, w, b in zip(
                (attention.query, attention.key, attention.value), (w_q, w_k, w_v), biases
            )
        )
        d_attended = call.output_grad @ attention.out_proj_weight
    with torch.enable_grad():
        attended = _attend(layer, attention, q, k, v)
        dq, dk, dv = torch.autograd.grad(attended, (q, k, v), d_attended)
    return _Gradients(attention, dq, dk, dv, attended.detach(), call.output_grad)


def _attend(
    layer: nn.MultiheadAttention,
    attention: AttentionCall,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """The attention of projected ``q (B, L, E)``, ``k, v (B, S, E)`` before the out-projection:
    ``(B, L, E)``, with the masks combined as ``F.multi_head_attention_forward`` does."""
    batch, length, width = q.shape
    source = k.shape[1]
    heads = layer.num_heads

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, x.shape[1], heads, width // heads).transpose(1, 2)

    mask, causal = _mask(attention, q.dtype, batch, heads, length, source)
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), mask, is_causal=causal)
    return out.transpose(1, 2).reshape(batch, length, width)


def _mask(
    attention: AttentionCall, dtype: torch.dtype, batch: int, heads: int, length: int, source: int
) -> tuple[torch.Tensor | None, bool]:
    """The additive mask ``(B or 1, heads or 1, L, S)`` and the causal flag that
    ``F.multi_head_attention_forward`` hands to the attention: ``is_causal`` replaces the mask
    only without a padding mask and without weights asked for (the mask is a hint otherwise)."""
    padding = _additive(attention.padding_values, attention.padding_blocked, dtype)
    if attention.is_causal and padding is None and not attention.need_weights:
        return None, True
    mask = _additive(attention.mask_values, attention.mask_blocked, dtype)
    if mask is not None:
        mask = mask.reshape(1, 1, length, source) if mask.dim() == 2 else mask
        mask = mask.reshape(-1, heads if mask.shape[0] > 1 else 1, length, source)
    if padding is not None:
        padding = padding.reshape(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return mask, False


def _blocks(gradients: list[_Gradients]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(parameter, inputs (B, N, p), output gradients (B, N, q))`` of each weight's row
    blocks, in row order, every call's positions side by side. In-projection blocks whose
    inputs are one tensor in every call share a block (self-attention: one for all three)."""
    first = gradients[0].call
    if first.in_proj_weight is None:
        names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        groups = [(0,), (1,), (2,)]
    elif all(g.call.query is g.call.key is g.call.value for g in gradients):
        names, groups = ("in_proj_weight",), [(0, 1, 2)]
    elif all(g.call.key is g.call.value for g in gradients):
        names, groups = ("in_proj_weight",) * 2, [(0,), (1, 2)]
    else:
        names, groups = ("in_proj_weight",) * 3, [(0,), (1,), (2,)]
    blocks = []
    for name, group in zip(names, groups):
        inputs = side_by_side(
            [(g.call.query, g.call.key, g.call.value)[group[0]] for g in gradients], 1
        )
        grads = side_by_side(
            [torch.cat([(g.dq, g.dk, g.dv)[i] for i in group], -1) for g in gradients], 1
        )
        blocks.append((name, inputs, grads))
    attended = side_by_side([g.attended for g in gradients], 1)
    blocks.append(
        ("out_proj.weight", attended, side_by_side([g.output_grad for g in gradients], 1))
    )
    return blocks


def _bias_grads(
    layer: nn.MultiheadAttention, gradients: list[_Gradients]
) -> dict[str, torch.Tensor]:
    """``(B, *bias_shape)`` per-example gradients of the biases (summed over positions)."""
    if layer.in_proj_bias is None and layer.out_proj.bias is None:
        return {}
    in_proj = sum(torch.cat([g.dq.sum(1), g.dk.sum(1), g.dv.sum(1)], -1) for g in gradients)
    out_proj = sum(g.output_grad.sum(1) for g in gradients)
    result = {}
    if layer.in_proj_bias is not None:
        result["in_proj_bias"] = in_proj
    if layer.out_proj.bias is not None:
        result["out_proj.bias"] = out_proj
    return result


def attention_per_example(
    layer: nn.MultiheadAttention, calls: list[LayerCall]
) -> dict[str, torch.Tensor]:
    gradients = [_gradients(layer, call) for call in calls]
    parts: dict[str, list[torch.Tensor]] = {}
    for name, inputs, grads in _blocks(gradients):
        parts.setdefault(name, []).append(torch.einsum("bnq,bnp->bqp", grads, inputs))
    result = {name: torch.cat(blocks, 1) for name, blocks in parts.items()}
    return {**result, **_bias_grads(layer, gradients)}


def attention_weighted_sum(
    layer: nn.MultiheadAttention, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    gradients = [_gradients(layer, call) for call in calls]
    parts: dict[str, list[torch.Tensor]] = {}
    for name, inputs, grads in _blocks(gradients):
        scaled = grads * weights.to(grads.dtype)[:, None, None]
        rows = scaled.reshape(-1, scaled.shape[-1]).T @ inputs.reshape(-1, inputs.shape[-1])
        parts.setdefault(name, []).append(rows)
    result = {name: torch.cat(blocks, 0) for name, blocks in parts.items()}
    for name, grads in _bias_grads(layer, gradients).items():
        result[name] = weights.to(grads.dtype) @ grads
    return result


def is_covered(layer: Any) -> bool:
    """An ``nn.MultiheadAttention`` (exactly: a subclass may compute something else) whose
    configuration the rule covers. Any other has no rule: as before the rule existed, its
    parameters are run alone as a generic unit (``torch_generic.py``), which handles them all
    (it fails only for dropout in training mode, where ``"auto"`` takes the chunked strategy)."""
    return type(layer) is nn.MultiheadAttention and not_covered(layer) is None


@register(
    name="multihead_attention",
    per_example=attention_per_example,
    weighted_sum=attention_weighted_sum,
    matches=is_covered,
    record=_record,
    nested=("out_proj.weight", "out_proj.bias"),
    route=lambda layer: (
        "each projection as a dense layer: " + dense_route(layer.embed_dim, layer.embed_dim)
    ),
)
def attention_squared_norms(
    layer: nn.MultiheadAttention, calls: list[LayerCall]
) -> dict[str, torch.Tensor]:
    gradients = [_gradients(layer, call) for call in calls]
    result: dict[str, torch.Tensor] = {}
    for name, inputs, grads in _blocks(gradients):
        squared = outer_product_squared_norms(inputs[:, None], grads[:, None])
        result[name] = result[name] + squared if name in result else squared
    for name, grads in _bias_grads(layer, gradients).items():
        result[name] = (grads**2).sum(-1)
    return result
