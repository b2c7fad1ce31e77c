"""Ghost-norm rules for PyTorch's dense layers, and what other rule files share with them.

Each rule sees the layer's calls in one forward pass over the whole batch (the inputs it got and
the gradient of the summed per-example losses with respect to its output, batch first) and
returns ``{param_name: (B,)}`` squared norms without forming the ``(B, *param_shape)``
per-example gradients. Each family also has a ``per_example`` function that forms those
gradients from the same calls, for the ``"hooks"`` strategy of
:func:`pergrad.per_example_grads`. A layer called several times in one pass (a shared block) is
handled by treating every call's positions as more tokens of one sequence: the per-example
gradient is the sum over calls.

Families here: ``nn.Linear`` (any number of leading token dimensions), ``nn.Conv1d`` /
``nn.Conv2d`` / ``nn.Conv3d`` and the transposed ``nn.ConvTranspose1d/2d/3d`` (stride, padding
incl. ``"same"`` and non-zero padding modes, output padding, dilation, groups),
``nn.Embedding`` and Hugging Face's ``Conv1D`` (GPT-2's linear layers). Normalisation layers:
``torch_rules/norms.py``; ``nn.Bilinear``: ``torch_rules/bilinear.py``;
``nn.MultiheadAttention``: ``torch_attention.py``. Shared: :class:`LayerCall`,
:func:`outer_product_squared_norms`, :func:`tokens`, :func:`squared_norms_of`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergrad._src.capture import cost
from pergrad._src.capture.cost import dense_route
from pergrad._src.capture.quantities import Lookups, Tokens
from pergrad._src.capture.rules import register
from pergrad._src.capture.torch_norms import (
    certified_sum_of_squares,
    magnitudes,
    outer_product_squared_norms,
    squared_norms_of,
    summed_squared_norms,
    unit_roundoff,
)


@dataclass
class LayerCall:
    """One call of a layer in the batched forward pass.

    Attributes:
      inputs: the positional inputs it received, batch first (``inputs[0]``: ``(B, ...)``).
      output_grad: d(sum of per-example losses) / d(output), ``(B, *output_shape)``.
    """

    inputs: tuple[Any, ...]
    output_grad: torch.Tensor


def side_by_side(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat``, without the copy for the usual single call."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def tokens(calls: list[LayerCall], width_in: int, width_out: int) -> tuple[Any, Any]:
    """Every call's inputs ``(B, N, width_in)`` and output gradients ``(B, N, width_out)``, the
    positions of all calls side by side (a layer called twice is one layer seeing more tokens)."""
    batch = calls[0].output_grad.shape[0]
    activations = side_by_side([c.inputs[0].reshape(batch, -1, width_in) for c in calls], 1)
    output_grads = side_by_side([c.output_grad.reshape(batch, -1, width_out) for c in calls], 1)
    return activations, output_grads


def _summed_outer_products(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``sum_n left[b, n]^T right[b, n]`` per example, ``(B, L, R)``, for ``left (B, N, L)``
    and ``right (B, N, R)``. Several tokens: one batched matrix product straight into the
    result (``einsum`` plans its own path around it: 30 us a layer on the bench transformer);
    one token: the outer product as a broadcast multiply (6% faster than a product of inner
    size 1 at B=1024, 128 x 256; the same numbers, a single term each)."""
    if left.shape[1] == 1:
        return left.transpose(1, 2) * right
    return torch.bmm(left.transpose(1, 2), right)


def linear_per_example(layer: nn.Linear, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    activations, output_grads = tokens(calls, layer.in_features, layer.out_features)
    result = {"weight": _summed_outer_products(output_grads, activations)}
    if layer.bias is not None:
        result["bias"] = output_grads.sum(1)
    return result


def _weighted_tokens(
    calls: list[LayerCall], width_in: int, width_out: int, weights: torch.Tensor, bias: bool
) -> tuple[Any, Any, Any]:
    """All positions of all examples as rows, inputs ``(B N, width_in)`` and output gradients
    ``(B N, width_out)``, the narrower of the two scaled by each row's example weight (their
    product is the weighted sum; an LM head's vocabulary-wide output gradients are not copied
    whole), and with ``bias`` the bias's weighted sum ``(width_out,)`` (else None)."""
    activations, output_grads = tokens(calls, width_in, width_out)
    if width_in < width_out:
        activations = activations * weights.to(activations.dtype)[:, None, None]
        summed = (
            torch.tensordot(weights.to(output_grads.dtype), output_grads.sum(1), dims=1)
            if bias
            else None
        )
    else:
        output_grads = output_grads * weights.to(output_grads.dtype)[:, None, None]
        summed = output_grads.sum((0, 1)) if bias else None
    return activations.reshape(-1, width_in), output_grads.reshape(-1, width_out), summed


def linear_weighted_sum(
    layer: nn.Linear, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    activations, output_grads, bias = _weighted_tokens(
        calls, layer.in_features, layer.out_features, weights, layer.bias is not None
    )
    result = {"weight": output_grads.T @ activations}
    if bias is not None:
        result["bias"] = bias
    return result


# Families that treat every leading axis alike take a time-first call, (T, B, ...), as well.
TOKENWISE = (0, 1)


def linear_records(layer: nn.Linear, calls: list[LayerCall]) -> Tokens:
    """``nn.Linear``'s calls as :class:`Tokens` of its ``(out, in)`` weight."""
    a, d = tokens(calls, layer.in_features, layer.out_features)
    return Tokens(a, d, id(layer.weight), "out_in", tuple(layer.weight.shape))


@register(
    nn.Linear,
    name="linear",
    per_example=linear_per_example,
    weighted_sum=linear_weighted_sum,
    batch_axes=TOKENWISE,
    route=lambda layer: dense_route(layer.in_features, layer.out_features),
    tokens=linear_records,
)
def linear_squared_norms(layer: nn.Linear, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    activations, output_grads = tokens(calls, layer.in_features, layer.out_features)
    result = {"weight": outer_product_squared_norms(activations[:, None], output_grads[:, None])}
    if layer.bias is not None:
        result["bias"] = summed_squared_norms(output_grads)
    return result


def hf_conv1d_per_example(layer: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    """Hugging Face's ``Conv1D`` is a linear layer with the weight stored ``(in, out)``."""
    width_in, width_out = layer.weight.shape
    activations, output_grads = tokens(calls, width_in, width_out)
    result = {"weight": _summed_outer_products(activations, output_grads)}
    if layer.bias is not None:
        result["bias"] = output_grads.sum(1)
    return result


def hf_conv1d_weighted_sum(
    layer: nn.Module, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    width_in, width_out = layer.weight.shape
    activations, output_grads, bias = _weighted_tokens(
        calls, width_in, width_out, weights, layer.bias is not None
    )
    result = {"weight": activations.T @ output_grads}
    if bias is not None:
        result["bias"] = bias
    return result


def hf_conv1d_records(layer: nn.Module, calls: list[LayerCall]) -> Tokens:
    """Hugging Face ``Conv1D``'s calls as :class:`Tokens` of its ``(in, out)`` weight."""
    width_in, width_out = layer.weight.shape
    a, d = tokens(calls, width_in, width_out)
    return Tokens(a, d, id(layer.weight), "in_out", tuple(layer.weight.shape))


@register(
    "transformers.pytorch_utils.Conv1D",
    name="hf_conv1d",
    per_example=hf_conv1d_per_example,
    weighted_sum=hf_conv1d_weighted_sum,
    batch_axes=TOKENWISE,
    route=lambda layer: dense_route(*layer.weight.shape),
    tokens=hf_conv1d_records,
)
def hf_conv1d_squared_norms(layer: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    width_in, width_out = layer.weight.shape
    activations, output_grads = tokens(calls, width_in, width_out)
    result = {"weight": outer_product_squared_norms(activations[:, None], output_grads[:, None])}
    if layer.bias is not None:
        result["bias"] = summed_squared_norms(output_grads)
    return result


_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _conv_problem(layer: nn.Module) -> str | None:
    if isinstance(layer.padding, str) and layer.padding not in ("same", "valid"):
        return f"padding={layer.padding!r} is not understood"
    if isinstance(layer, _TRANSPOSED) and layer.padding_mode != "zeros":
        return f"padding_mode={layer.padding_mode!r} is not understood for a transposed conv"
    return None


def _padded(layer: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The input and the padding left to the convolution, as the layer's own forward has them:
    non-zero padding modes and string padding are applied explicitly first."""
    padding: Any = layer.padding
    if layer.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        x = F.pad(x, layer._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * len(layer.kernel_size)
    return x, padding


def _conv_patches(layer: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The input patches each output position sees: ``(B, G, L, C_in / G * prod(kernel))``.

    ``F.unfold`` orders a patch channel-major then kernel position, as the weight
    ``(C_out, C_in / G, *kernel)`` is laid out, so group ``g`` owns a contiguous slice.
    """
    x, padding = _padded(layer, x)
    kernel, stride, dilation = layer.kernel_size, layer.stride, layer.dilation
    if isinstance(layer, nn.Conv1d):  # F.unfold is 2-D only: a 1-D signal is a 1 x L image
        x = x.unsqueeze(-2)
        kernel, stride, dilation = (1, *kernel), (1, *stride), (1, *dilation)
        padding = (0, *padding)
    patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    batch, width, positions = patches.shape
    groups = layer.groups
    return patches.reshape(batch, groups, width // groups, positions).transpose(-1, -2)


def conv_tokens(layer: nn.Conv1d | nn.Conv2d, calls: list[LayerCall]) -> tuple[Any, Any]:
    """Patches ``(B, G, L, C_in / G * prod(kernel))`` and output gradients ``(B, G, L, C_out / G)``
    of every call, positions side by side."""
    batch = calls[0].output_grad.shape[0]
    groups, channels_out = layer.groups, layer.out_channels
    patches = side_by_side([_conv_patches(layer, c.inputs[0]) for c in calls], 2)
    output_grads = side_by_side(
        [
            c.output_grad.reshape(batch, groups, channels_out // groups, -1).transpose(-1, -2)
            for c in calls
        ],
        2,
    )
    return patches, output_grads


_WEIGHT_GRADS = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}


def _conv_weight_grad(layer: Any, x: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
    """The layer's weight gradient for input ``x`` and output gradient ``output_grad`` (batch
    first). A transposed convolution is the adjoint of a convolution from its output to its
    input with the same weight, so its weight gradient swaps the two."""
    weight_grad = _WEIGHT_GRADS[len(layer.kernel_size)]
    if isinstance(layer, _TRANSPOSED):
        x, output_grad, padding = output_grad, x, layer.padding
    else:
        x, padding = _padded(layer, x)
    return weight_grad(
        x, layer.weight.shape, output_grad, layer.stride, padding, layer.dilation, layer.groups
    )


def _conv_weight_per_example(layer: Any, calls: list[LayerCall]) -> torch.Tensor:
    """``(B, *weight.shape)``: the convolution's own weight gradient for each example (vmapped,
    which torch runs as one convolution with the examples as groups; faster than unfolding)."""

    def one(x_row: torch.Tensor, grad_row: torch.Tensor) -> torch.Tensor:
        return _conv_weight_grad(layer, x_row[None], grad_row[None])

    return sum(torch.func.vmap(one)(c.inputs[0], c.output_grad) for c in calls)


def _conv_bias_per_example(calls: list[LayerCall]) -> torch.Tensor:
    return sum(c.output_grad.reshape(*c.output_grad.shape[:2], -1).sum(-1) for c in calls)


def conv_per_example(layer: Any, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    result = {"weight": _conv_weight_per_example(layer, calls)}
    if layer.bias is not None:
        result["bias"] = _conv_bias_per_example(calls)
    return result


def conv_weighted_sum(
    layer: Any, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The convolution's own weight gradient, with each example's output gradient scaled."""
    # in the calls' dtype (float32 for a float16 / bfloat16 model, see rules.py), not the
    # weight's: each call's share would otherwise be rounded as it is added
    dtype = calls[0].output_grad.dtype
    weight = layer.weight.new_zeros(layer.weight.shape, dtype=dtype)
    bias = None if layer.bias is None else layer.bias.new_zeros(layer.bias.shape, dtype=dtype)
    for call in calls:
        scale = weights.to(call.output_grad.dtype).reshape(-1, *[1] * (call.output_grad.dim() - 1))
        scaled = call.output_grad * scale
        weight += _conv_weight_grad(layer, call.inputs[0], scaled)
        if bias is not None:
            bias += scaled.sum([d for d in range(scaled.dim()) if d != 1])
    return {"weight": weight} if bias is None else {"weight": weight, "bias": bias}


def _uses_gram(layer: Any, calls: list[LayerCall]) -> bool:
    """Gram matrices of unfolded patches (Conv1d / Conv2d only) when the output has few
    positions, ``T^2 < p q``; else the per-example weight gradients (``B x weight``). (Not
    ``cost.gram_is_cheaper``, whose constant was measured for linear layers.)"""
    if not isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        return False
    positions = sum(c.output_grad[0, 0].numel() for c in calls)
    width_in = layer.weight[0].numel()
    width_out = layer.out_channels // layer.groups
    return positions * positions < width_in * width_out


def _conv_route(layer: Any) -> str:
    width_in, width_out = layer.weight[0].numel(), layer.out_channels // layer.groups
    return (
        f"the {width_in} x {width_out} per-example kernel gradient formed; with fewer "
        f"than {math.isqrt(width_in * width_out - 1) + 1} output positions, the patches "
        f"as a dense layer: " + dense_route(width_in, width_out)
    )


def conv_records(layer: Any, calls: list[LayerCall]) -> Tokens | None:
    """An ungrouped ``Conv1d`` / ``Conv2d``'s calls as :class:`Tokens`: its patches and output
    gradients, the weight ``(out, in, *kernel)`` seen as ``(out, in * prod(kernel))``. None for
    other convolutions (grouped, 3-D, transposed)."""
    if type(layer) not in (nn.Conv1d, nn.Conv2d) or layer.groups != 1:
        return None
    patches, output_grads = conv_tokens(layer, calls)
    return Tokens(
        patches[:, 0], output_grads[:, 0], id(layer.weight), "out_in", tuple(layer.weight.shape)
    )


@register(
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    *_TRANSPOSED,
    name="conv",
    per_example=conv_per_example,
    problem=_conv_problem,
    weighted_sum=conv_weighted_sum,
    route=lambda layer: _conv_route(layer),
    tokens=conv_records,
)
def conv_squared_norms(layer: Any, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    if _uses_gram(layer, calls):
        patches, output_grads = conv_tokens(layer, calls)
        result = {"weight": outer_product_squared_norms(patches, output_grads)}
    else:
        result = {"weight": squared_norms_of(_conv_weight_per_example(layer, calls))}
    if layer.bias is not None:
        result["bias"] = squared_norms_of(_conv_bias_per_example(calls))
    return result


def _embedding_problem(layer: nn.Embedding) -> str | None:
    if layer.max_norm is not None:
        return "max_norm renormalises rows in place during the forward pass"
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq scales by word counts of the whole batch, not one example"
    if layer.sparse:
        return "sparse=True gives sparse gradients"
    return None


def lookups(layer: nn.Embedding, calls: list[LayerCall]) -> tuple[Any, Any, Any]:
    """The rows looked up ``(B, N)``, their output gradients ``(B, N, D)`` (zero for the padding
    row, which gets no gradient) and one key per (example, row): ``example * V + row``."""
    batch = calls[0].output_grad.shape[0]
    width = layer.embedding_dim
    indices = side_by_side([c.inputs[0].reshape(batch, -1) for c in calls], 1)
    output_grads = side_by_side([c.output_grad.reshape(batch, -1, width) for c in calls], 1)
    if layer.padding_idx is not None:
        output_grads = output_grads * (indices != layer.padding_idx).unsqueeze(-1)
    example = torch.arange(batch, device=indices.device).unsqueeze(1)
    keys = (example * layer.num_embeddings + indices).reshape(-1)
    return indices, output_grads, keys


def distinct_slots(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(keys, return_inverse=True)`` padded to ``len(keys)`` slots, without the
    host read of the number of distinct keys (on an accelerator, a stall until it has caught
    up): ``(slot_keys, slot_of_position)``, the distinct keys in increasing order in the first
    slots, 0 in the slots past them, and each position's slot. A sum per slot then adds the
    same terms in the same order as per distinct key, and the empty slots add zeros."""
    sorted_keys, order = torch.sort(keys)
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    torch.ne(sorted_keys[1:], sorted_keys[:-1], out=starts[1:])
    slot_sorted = starts.cumsum(0).sub_(1)
    slot_of_position = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    slot_keys = torch.zeros_like(keys).scatter_(0, slot_sorted, sorted_keys)
    return slot_keys, slot_of_position


def embedding_per_example(layer: nn.Embedding, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    _, output_grads, keys = lookups(layer, calls)
    batch, width = output_grads.shape[0], layer.embedding_dim
    grads = output_grads.new_zeros(batch * layer.num_embeddings, width)
    grads.index_add_(0, keys, output_grads.reshape(-1, width))
    return {"weight": grads.reshape(batch, layer.num_embeddings, width)}


def embedding_weighted_sum(
    layer: nn.Embedding, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    indices, output_grads, _ = lookups(layer, calls)
    width = layer.embedding_dim
    scaled = output_grads * weights.to(output_grads.dtype)[:, None, None]
    grad = output_grads.new_zeros(layer.num_embeddings, width)
    grad.index_add_(0, indices.reshape(-1), scaled.reshape(-1, width))
    return {"weight": grad}


def embedding_records(layer: nn.Embedding, calls: list[LayerCall]) -> Lookups:
    """``nn.Embedding``'s calls as :class:`Lookups` (the padding row's gradients zero)."""
    rows, output_grads, _ = lookups(layer, calls)
    return Lookups(rows, output_grads, id(layer.weight), tuple(layer.weight.shape))


@register(
    nn.Embedding,
    name="embedding",
    per_example=embedding_per_example,
    problem=_embedding_problem,
    weighted_sum=embedding_weighted_sum,
    batch_axes=TOKENWISE,
    route=lambda layer: (
        "each example's output gradients summed per row it looks up (nothing formed)"
    ),
    lookups=embedding_records,
)
def embedding_squared_norms(layer: nn.Embedding, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    """Per example, the output gradients of the positions that look up the same row add up;
    the squared norm is the sum over the distinct rows of the squared norm of that sum."""
    indices, output_grads, keys = lookups(layer, calls)
    batch, width = output_grads.shape[0], layer.embedding_dim
    slot_keys, slot_of_position = distinct_slots(keys)
    row_sums = output_grads.new_zeros(keys.shape[0], width)
    row_sums.index_add_(0, slot_of_position, output_grads.reshape(-1, width))
    squared = output_grads.new_zeros(batch)
    squared.index_add_(0, slot_keys // layer.num_embeddings, (row_sums**2).sum(1))
    if not cost.FAST_NORMS:
        return {"weight": squared}
    # each row's sum of at most T output gradients is within gamma_T of the sum of their sizes
    positions = output_grads.shape[1]
    error = cost.gamma(positions, unit_roundoff(squared.dtype)) * magnitudes(output_grads).sum(-1)
    return {"weight": certified_sum_of_squares(squared, error, width + positions)}
