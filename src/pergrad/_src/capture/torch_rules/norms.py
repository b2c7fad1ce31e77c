"""Normalisation layers: the per-example gradients of their scale and shift, formed (a few
widths per example, as small as an activation), and their squared norms from those.

Families: ``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face's RMS norms (``LlamaRMSNorm``,
``T5LayerNorm``, ``GemmaRMSNorm``..., one class per model, matched by their attributes and
checked against their output on each call), ``nn.GroupNorm``, ``nn.InstanceNorm*d`` and
``nn.BatchNorm*d`` in eval mode. Each is ``y = scale * x_hat + shift`` with ``x_hat`` the
normalised input, recomputed from the recorded input (:func:`_register_affine`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergrad._src.capture.rules import in_reduction_precision, register
from pergrad._src.capture.torch_checks import rows_match
from pergrad._src.capture.torch_layers import TOKENWISE, LayerCall, squared_norms_of
from pergrad._src.errors import Unsupported


def _sum_over(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    # Not x.sum(()): torch reads an empty dim list as "all dimensions".
    return x.sum(dims) if dims else x


def _affine_per_example(
    layer: nn.Module, calls: list[LayerCall], normalize: Any, reduce_dims: Any
) -> dict[str, torch.Tensor]:
    """Per-example gradients of an elementwise affine ``y = x_hat * weight + bias``.

    They are as small as one activation (``(B, *weight_shape)``), so the ghost rules form them
    too: ``sum (x_hat * d)`` and ``sum d`` over the dimensions the parameters are broadcast along.
    """
    weight_parts, bias_parts = [], []
    for call in calls:
        x, output_grad = call.inputs[0], call.output_grad
        dims = reduce_dims(x)
        if getattr(layer, "weight", None) is not None:
            weight_parts.append(_sum_over(normalize(x) * output_grad, dims))
        if getattr(layer, "bias", None) is not None:
            bias_parts.append(_sum_over(output_grad, dims))
    result = {}
    if weight_parts:
        result["weight"] = _added(weight_parts)
    if bias_parts:
        result["bias"] = _added(bias_parts)
    return result


def _added(parts: list[torch.Tensor]) -> torch.Tensor:
    """The calls' shares added, the first one as it is (no ``0 +`` copy for a single call)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _register_affine(
    *layer_types: type,
    name: str,
    normalizer: Any,
    reduce_dims: Any,
    **options: Any,
) -> None:
    """Register a normalisation layer family: ``normalizer(layer)`` gives ``x -> x_hat`` and
    ``reduce_dims(layer)`` gives ``x -> the dimensions the affine parameters broadcast along``;
    ``options``: :func:`~pergrad._src.capture.rules.register`'s (``problem``, ``matches``...)."""

    def per_example(layer: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
        return _affine_per_example(layer, calls, normalizer(layer), reduce_dims(layer))

    def squared_norms(layer: nn.Module, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
        return {k: squared_norms_of(g) for k, g in per_example(layer, calls).items()}

    register(
        *layer_types,
        name=name,
        per_example=per_example,
        route=lambda layer: (
            "the per-example scale and shift gradients formed (a few widths per example)"
        ),
        **options,
    )(squared_norms)


def _trailing_norm_dims(layer: nn.Module) -> Any:
    """The batch-and-token dimensions a LayerNorm / RMSNorm parameter is broadcast along."""
    return lambda x: tuple(range(1, x.dim() - len(layer.normalized_shape)))


def _channel_dims(layer: nn.Module) -> Any:
    """Every dimension of ``(B, C, *spatial)`` but the batch and the channels."""
    return lambda x: tuple(range(2, x.dim()))


def _layer_normalize(layer: nn.Module) -> Any:
    """``x -> x_hat``. With a weight of ones: torch's kernel without a weight is the slower one
    (83 against 47 us at (32, 32, 64) on a CPU core), and a weight of ones changes no bit."""

    def normalize(x: torch.Tensor) -> torch.Tensor:
        ones = x.new_ones(layer.normalized_shape)
        return F.layer_norm(x, layer.normalized_shape, ones, None, layer.eps)

    return normalize


_register_affine(
    nn.LayerNorm,
    name="layer_norm",
    normalizer=_layer_normalize,
    reduce_dims=_trailing_norm_dims,
    batch_axes=TOKENWISE,
)

if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    _register_affine(
        nn.RMSNorm,
        name="rms_norm",
        normalizer=lambda layer: lambda x: F.rms_norm(x, layer.normalized_shape, None, layer.eps),
        reduce_dims=_trailing_norm_dims,
        batch_axes=TOKENWISE,
    )


def _hf_rms_epsilon(layer: nn.Module) -> Any:
    """The epsilon of a Hugging Face RMS norm (``variance_epsilon``; ``eps`` in a class named
    ``...RMSNorm``, Gemma's), or None."""
    eps = getattr(layer, "variance_epsilon", None)
    if eps is None and "RMSNorm" in type(layer).__name__:
        eps = getattr(layer, "eps", None)
    return eps if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _is_hf_rms_norm(layer: nn.Module) -> bool:
    """Hugging Face's RMS norms, one class per model (``LlamaRMSNorm``, ``T5LayerNorm``,
    ``GemmaRMSNorm``...): a float epsilon and one parameter, a ``weight`` vector."""
    if _hf_rms_epsilon(layer) is None:
        return False
    params = list(layer.named_parameters())
    return len(params) == 1 and params[0][0] == "weight" and params[0][1].dim() == 1


def _hf_rms_normalize(layer: nn.Module) -> Any:
    """``x -> x / sqrt(mean(x^2) + eps)`` over the last axis, computed in float32 at least
    (every such class upcasts a float16 / bfloat16 input for it)."""
    eps = _hf_rms_epsilon(layer)

    def normalize(x: torch.Tensor) -> torch.Tensor:
        x = x.float() if x.element_size() < 4 else x
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    return normalize


def _hf_rms_check(layer: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Check that the layer computes ``weight * x_hat`` (or Gemma's ``(1 + weight) * x_hat``:
    the weight's gradient is ``x_hat`` times the output gradient either way) on this call;
    it is recorded as a plain layer. The classes are matched by their attributes, so a class
    computing something else is refused here, not reduced wrongly (a ``torch.compile`` d
    model's whole-graph capture checks the eager run of each layout: ``rules.LayerRule``)."""
    x = args[0] if args else None
    weight = layer.weight  # the value of this pass (functional_call swaps it in)
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(output, torch.Tensor)
        and x.dim() > 1
        and output.shape == x.shape
        and x.shape[-1] == weight.numel()
    ):
        raise Unsupported(
            f"{type(layer).__name__} did not map one (..., {weight.numel()}) input to an "
            f"output of its shape"
        )
    with torch.no_grad(), in_reduction_precision(x.device):
        x_hat = _hf_rms_normalize(layer)(x)
        got = output.reshape(output.shape[0], -1)
        scale = weight.to(x_hat.dtype)
        for offset in (0.0, 1.0):
            if rows_match(got, ((scale + offset) * x_hat).reshape(got.shape).to(got.dtype)):
                return
    raise Unsupported(
        f"{type(layer).__name__} has the attributes of an RMS norm (weight, epsilon) but does "
        f"not compute weight * x / sqrt(mean(x^2) + eps)"
    )


_register_affine(
    name="hf_rms_norm",
    normalizer=_hf_rms_normalize,
    reduce_dims=lambda layer: lambda x: tuple(range(1, x.dim() - 1)),
    matches=_is_hf_rms_norm,
    check=_hf_rms_check,
    batch_axes=TOKENWISE,
)

_register_affine(
    nn.GroupNorm,
    name="group_norm",
    normalizer=lambda layer: lambda x: F.group_norm(x, layer.num_groups, None, None, layer.eps),
    reduce_dims=_channel_dims,
)


def _running_stats(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running mean and variance in ``x``'s dtype: a bfloat16 model's inputs reach the
    rules widened to float32 (rules.py), and torch refuses mixed dtypes here."""
    return layer.running_mean.to(x.dtype), layer.running_var.to(x.dtype)


def _instance_normalizer(layer: nn.Module) -> Any:
    def normalize(x: torch.Tensor) -> torch.Tensor:
        if layer.training or not layer.track_running_stats:  # each example's own statistics
            return F.instance_norm(x, eps=layer.eps)
        mean, var = _running_stats(layer, x)
        return F.instance_norm(x, mean, var, use_input_stats=False, eps=layer.eps)

    return normalize


_register_affine(
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    name="instance_norm",
    normalizer=_instance_normalizer,
    reduce_dims=_channel_dims,
)


def _batch_norm_problem(layer: nn.Module) -> str | None:
    if layer.training or layer.running_mean is None:
        return "it normalises with the statistics of the whole batch"
    return None


_register_affine(
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    name="batch_norm_eval",
    normalizer=lambda layer: (
        lambda x: F.batch_norm(x, *_running_stats(layer, x), None, None, False, 0.0, layer.eps)
    ),
    reduce_dims=_channel_dims,
    problem=_batch_norm_problem,
)
