"""``nn.Bilinear``: ``y = x1^T W x2 + b``, ``W`` of shape ``(out, in1, in2)``.

At ``T`` positions per example (any leading dimensions) the per-example gradient of ``W`` is
``sum_t d_t (x) x1_t (x) x2_t`` and of ``b`` is ``sum_t d_t``. Its squared norm comes without
forming it, from the three Gram matrices (``sum_{t,s} (d_t . d_s)(x1_t . x1_s)(x2_t . x2_s)``,
``T^2 (out + in1 + in2)`` multiply-adds per example, in float64 as for a dense layer, since the
sum cancels where the gradient does); where forming the ``out x in1 x in2`` gradient is cheaper
(``T out in1 in2``), it is formed. One position: the closed form ``|d|^2 |x1|^2 |x2|^2``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pergrad._src.capture.cost import formed_or_gram_route, gram_is_cheaper_for
from pergrad._src.capture.rules import register
from pergrad._src.capture.torch_layers import LayerCall, side_by_side, squared_norms_of, tokens


def _positions(layer: nn.Bilinear, calls: list[LayerCall]) -> tuple[Any, Any, Any]:
    """``x1 (B, T, in1)``, ``x2 (B, T, in2)``, ``d (B, T, out)``: every call's positions side by
    side (a layer called twice sees more positions)."""
    x1, d = tokens(calls, layer.in1_features, layer.out_features)
    batch = d.shape[0]
    x2 = side_by_side([c.inputs[1].reshape(batch, -1, layer.in2_features) for c in calls], 1)
    return x1, x2, d


def _widths(layer: nn.Bilinear) -> tuple[int, int, int]:
    return (layer.out_features, layer.in1_features, layer.in2_features)


def bilinear_per_example(layer: nn.Bilinear, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    x1, x2, d = _positions(layer, calls)
    result = {"weight": torch.einsum("bto,bti,btj->boij", d, x1, x2)}
    if layer.bias is not None:
        result["bias"] = d.sum(1)
    return result


def bilinear_weighted_sum(
    layer: nn.Bilinear, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    x1, x2, d = _positions(layer, calls)
    scaled = d * weights.to(d.dtype)[:, None, None]
    result = {"weight": torch.einsum("bto,bti,btj->oij", scaled, x1, x2)}
    if layer.bias is not None:
        result["bias"] = scaled.sum((0, 1))
    return result


@register(
    nn.Bilinear,
    name="bilinear",
    per_example=bilinear_per_example,
    weighted_sum=bilinear_weighted_sum,
    route=lambda layer: formed_or_gram_route(_widths(layer), "|d|^2 |x1|^2 |x2|^2", float64=True),
)
def bilinear_squared_norms(layer: nn.Bilinear, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    x1, x2, d = _positions(layer, calls)
    positions = d.shape[1]
    if positions == 1:
        weight = (d**2).sum((1, 2)) * (x1**2).sum((1, 2)) * (x2**2).sum((1, 2))
    elif (
        gram_is_cheaper_for(positions, _widths(layer)) and d.device.type != "mps"
    ):  # MPS: no float64
        wide = [t.double() for t in (d, x1, x2)]
        grams = [t @ t.transpose(1, 2) for t in wide]
        weight = (grams[0] * grams[1] * grams[2]).sum((1, 2)).to(d.dtype)
    else:
        weight = squared_norms_of(bilinear_per_example(layer, calls)["weight"])
    result = {"weight": weight}
    if layer.bias is not None:
        result["bias"] = (d.sum(1) ** 2).sum(1)
    return result
