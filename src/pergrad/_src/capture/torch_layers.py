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

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergrad._src.capture import cost
from pergrad._src.capture.cost import dense_route, gram_is_cheaper
from pergrad._src.capture.quantities import Lookups, Tokens
from pergrad._src.capture.rules import register


@dataclass
class LayerCall:
    """One call of a layer in the batched forward pass.

    Attributes:
      inputs: the positional inputs it received, batch first (``inputs[0]``: ``(B, ...)``).
      output_grad: d(sum of per-example losses) / d(output), ``(B, *output_shape)``.
    """

    inputs: tuple[Any, ...]
    output_grad: torch.Tensor


def outer_product_squared_norms(activations: torch.Tensor, output_grads: torch.Tensor) -> Any:
    """``sum_g |sum_t a[b, g, t] (x) d[b, g, t]|^2`` for each example ``b``, certified.

    The per-example gradient of a linear map applied at ``T`` positions (tokens, or conv patches)
    is ``sum_t a_t d_t^T``; ``G`` independent blocks (conv groups) add their squared norms.

    Args:
      activations: ``(B, G, T, p)`` the layer's inputs.
      output_grads: ``(B, G, T, q)`` the gradients at its outputs.

    Returns:
      ``cost.Certified``: ``(B,)`` squared norms in the operands' precision and a bound on their
      rounding (a plain ``(B,)`` tensor where ``cost.FAST_NORMS`` is off). For one position it
      is ``|a|^2 |d|^2``; where ``cost.gram_is_cheaper`` the Gram matrices give it in ``O(T^2
      (p + q))`` (Li et al. 2021, "Large language models can be strong differentially private
      learners"), ``T x T`` blocks at a time so that their memory stays under
      :data:`GRAM_BLOCK_BYTES`; otherwise forming ``a^T d`` (``p x q`` per example and group,
      this layer only) is cheaper.

    The Gram sum ``sum_{t,s} (a_t . a_s)(d_t . d_s)`` cancels wherever the per-position
    gradients ``a_t d_t^T`` nearly cancel: in float32 (or TF32 on a GPU) a gradient a thousand
    times smaller than ``sum_t |a_t| |d_t|`` came out 30% too small or negative. The bound
    (:func:`_gram_in`, :func:`_formed_in`) says so; an example whose bound exceeds
    ``cost.ROUNDING_TOLERANCE`` of its norm is computed again in float64
    (:func:`_tightened`).
    """
    positions, width_in = activations.shape[-2:]
    width_out = output_grads.shape[-1]
    if positions == 1:
        return _one_position(activations, output_grads)
    gram = gram_is_cheaper(positions, width_in, width_out)
    if not cost.FAST_NORMS:
        return _uncertified(activations, output_grads, gram)
    input_unit = _input_unit(activations)
    unit = _unit(activations.dtype)
    fast = cost.fast_gram_suffices(positions, (width_in, width_out), unit, input_unit)
    if gram and not fast and _has_float64(activations):
        # the fast precision could not certify a Gram sum tightly: float64, as before
        return _in_chunks(activations, output_grads, _gram_in, 0.0, wide=True)
    route = _gram_in if gram else _formed_in
    found = _in_chunks(activations, output_grads, route, input_unit)
    return _tightened(found, activations, output_grads, gram)


def _unit(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``: half its machine epsilon."""
    return torch.finfo(dtype).eps / 2


def matmul_input_unit(device: Any) -> float:
    """How much PyTorch's matrix products of float32 tensors round their inputs on ``device``
    under the current settings: 0 (IEEE float32), ``2**-11`` (TF32:
    ``torch.backends.cuda.matmul.allow_tf32``, or ``torch.set_float32_matmul_precision("high")``)
    or ``2**-8`` (``"medium"``: bfloat16)."""
    setting = torch.get_float32_matmul_precision()
    if setting == "medium":
        return 2.0**-8
    tf32 = torch.device(device).type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)
    return 2.0**-11 if tf32 or setting == "high" else 0.0


def _input_unit(x: torch.Tensor) -> float:
    """:func:`matmul_input_unit` for float32 operands; other dtypes are used as they are."""
    return matmul_input_unit(x.device) if x.dtype == torch.float32 else 0.0


def dense_route_of(layer: Any, width_in: int, width_out: int) -> str:
    """``cost.dense_route`` in the precision ``layer``'s float32 products take now."""
    return dense_route(width_in, width_out, input_unit=matmul_input_unit(_device_of(layer)))


def _device_of(layer: Any) -> Any:
    param = next(layer.parameters(), None)
    return "cpu" if param is None else param.device


def _has_float64(x: torch.Tensor) -> bool:
    return x.device.type != "mps"  # MPS has no float64: there the fast bound stands


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def _one_position(activations: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """``|a|^2 |d|^2`` summed over groups. Sums of squares: nothing cancels, so the result is
    within a relative ``gamma_(p + q + G + 1)``, as a materialised gradient's own norm is (the
    rounding every clip path accepts); no bound is added."""
    return ((activations**2).sum(-1) * (output_grads**2).sum(-1)).sum((1, 2))


def _uncertified(activations: torch.Tensor, output_grads: torch.Tensor, gram: bool) -> Any:
    """The route before certified norms (``cost.FAST_NORMS`` off: a benchmark's baseline): the
    Gram matrices in float64, the formed gradient in the operands' precision, no bound."""
    if gram and _has_float64(activations):
        # a few examples at a time in float64 (at most FORMED_BLOCK_BYTES of copies), into one
        # pair of buffers: an LM head's output gradients copied whole would double their memory
        per_example = activations[0].numel() + output_grads[0].numel()
        chunk = min(len(activations), max(1, FORMED_BLOCK_BYTES // (8 * per_example)))
        wide_a = activations.new_empty((chunk, *activations.shape[1:]), dtype=torch.float64)
        wide_d = output_grads.new_empty((chunk, *output_grads.shape[1:]), dtype=torch.float64)
        pieces = []
        for a, d in zip(activations.split(chunk), output_grads.split(chunk)):
            rows = len(a)
            wide_a[:rows].copy_(a)
            wide_d[:rows].copy_(d)
            pieces.append(_blocked_gram(wide_a[:rows], wide_d[:rows]).to(activations.dtype))
        return torch.cat(pieces)
    return _in_chunks(activations, output_grads, _formed_in, 0.0).estimate


def _blocked_gram(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``sum_{t,s} (a_t . a_s)(d_t . d_s)`` per example for ``a (B, G, T, p)``, ``d (B, G, T,
    q)``, over ``T x T`` blocks of at most :data:`GRAM_BLOCK_BYTES`, without a bound (the
    uncertified baseline, in float64)."""
    batch, groups, positions = a.shape[:3]
    per_entry = 2 * batch * groups * a.element_size()
    block = max(1, min(positions, int((GRAM_BLOCK_BYTES / per_entry) ** 0.5)))
    total = a.new_zeros(batch)
    for start in range(0, positions, block):
        rows_a, rows_d = a[:, :, start : start + block], d[:, :, start : start + block]
        for other in range(0, positions, block):
            cols_a, cols_d = a[:, :, other : other + block], d[:, :, other : other + block]
            gram_a = rows_a @ cols_a.transpose(-1, -2)
            gram_d = rows_d @ cols_d.transpose(-1, -2)
            total = total + (gram_a * gram_d).sum((1, 2, 3))
    return total


def _tightened(
    found: Any, activations: torch.Tensor, output_grads: torch.Tensor, gram: bool
) -> Any:
    """``found`` with the examples whose bound exceeds ``cost.ROUNDING_TOLERANCE`` of their
    estimate (positions that cancel) computed again from float64 copies of their records: by
    the Gram matrices where ``gram``, else formed. One host sync; nothing recomputed (and no
    float64 on MPS, which has none) where every bound is tight."""
    loose = found.bound > cost.ROUNDING_TOLERANCE * found.estimate
    if not _has_float64(activations) or not bool(loose.any()):
        return found
    rows = loose.nonzero().squeeze(1)
    route = _gram_in if gram else _formed_in
    exact = _in_chunks(activations[rows], output_grads[rows], route, 0.0, wide=True)
    return cost.Certified(
        found.estimate.index_copy(0, rows, exact.estimate),
        found.bound.index_copy(0, rows, exact.bound),
    )


def _in_chunks(
    activations: torch.Tensor,
    output_grads: torch.Tensor,
    route: Any,
    input_unit: float,
    wide: bool = False,
) -> Any:
    """``route(a, d, input_unit)`` a few examples at a time (at most :data:`FORMED_BLOCK_BYTES`
    of the gradients it forms, or of float64 copies where ``wide``: an LM head's output
    gradients copied whole would double their memory), the results side by side in the
    operands' dtype."""
    groups, width_in = activations.shape[1], activations.shape[-1]
    width_out = output_grads.shape[-1]
    size = 8 if wide else activations.element_size()
    if route is _formed_in:
        per_example = width_in * width_out * groups * size
    else:
        per_example = (activations[0].numel() + output_grads[0].numel()) * size
    chunk = min(len(activations), max(1, FORMED_BLOCK_BYTES // per_example))
    if route is _formed_in:  # one buffer for every chunk: fresh ones cost page faults
        dtype = (
            torch.float64 if wide else torch.promote_types(activations.dtype, output_grads.dtype)
        )
        buffer = activations.new_empty((chunk, groups, width_in, width_out), dtype=dtype)
        route = functools.partial(_formed_in, buffer=buffer)
    pieces = []
    for a, d in zip(activations.split(chunk), output_grads.split(chunk)):
        found = route(_wide(a), _wide(d), 0.0) if wide else route(a, d, input_unit)
        pieces.append(found.to(activations.dtype))
    if len(pieces) == 1:
        return pieces[0]
    return cost.Certified(
        torch.cat([p.estimate for p in pieces]), torch.cat([p.bound for p in pieces])
    )


# Per-example gradients formed for their norm (where the Gram route is dearer) are formed a few
# examples at a time, at most this many bytes.
FORMED_BLOCK_BYTES = 2**25
# Gram matrices of a long sequence are formed in T x T blocks of at most this many bytes (the
# two matrices and the three of their bound, the whole chunk): T = 2048, B = 16 in one piece
# would be 1 GiB in float64.
GRAM_BLOCK_BYTES = 2**27


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``(B, G, T)`` each position's Euclidean norm ``|x_t|``."""
    return torch.linalg.vector_norm(x, dim=-1)


def _gram_in(a: torch.Tensor, d: torch.Tensor, input_unit: float) -> Any:
    """``sum_{t,s} (a_t . a_s)(d_t . d_s)`` per example for ``a (B, G, T, p)``, ``d (B, G, T,
    q)``, in their dtype over ``T x T`` blocks of at most :data:`GRAM_BLOCK_BYTES`, with its
    rounding bound.

    With ``A_ts = a_t . a_s`` computed within ``alpha |a_t| |a_s|`` (``alpha =
    cost.product_error(p)``), ``D_ts`` within ``beta |d_t| |d_s|``, each product ``A D``
    rounded once and the products summed over ``s``, then ``t`` (and groups, and blocks), so
    that each passes through at most ``m`` additions:

    ``|sum - exact| <= gamma_(m+1) sum |A D| + alpha sum |a_t||a_s| |D_ts| + beta sum |A_ts|
    |d_t||d_s| + alpha beta (sum_t |a_t||d_t|)^2``,

    from the computed ``A``, ``D`` (their own rounding is in the last term). The bound's sums
    are of non-negative terms, each within ``gamma_k`` relatively: it is raised by ``2
    gamma_k`` for them. No underflow is assumed (its errors are absolute, below ``2**-126`` per
    operation in float32, far under any clipping bound)."""
    batch, groups, positions = a.shape[:3]
    width_in, width_out = a.shape[-1], d.shape[-1]
    unit = _unit(a.dtype)
    per_entry = 5 * batch * groups * a.element_size()
    block = max(1, min(positions, int((GRAM_BLOCK_BYTES / per_entry) ** 0.5)))
    blocks = -(-positions // block)
    norms_a, norms_d = _magnitudes(a), _magnitudes(d)
    total = a.new_zeros(batch)
    magnitude = a.new_zeros(batch)  # sum |A D|
    from_a = a.new_zeros(batch)  # sum |a_t||a_s| |D_ts|
    from_d = a.new_zeros(batch)  # sum |A_ts| |d_t||d_s|
    for start in range(0, positions, block):
        rows = slice(start, start + block)
        for other in range(0, positions, block):
            cols = slice(other, other + block)
            gram_a = a[:, :, rows] @ a[:, :, cols].transpose(-1, -2)
            gram_d = d[:, :, rows] @ d[:, :, cols].transpose(-1, -2)
            product = gram_a * gram_d
            total = total + _nested_sum(product)
            magnitude = magnitude + _nested_sum(product.abs_())
            outer_a = norms_a[:, :, rows, None] * norms_a[:, :, None, cols]
            from_a = from_a + _nested_sum(outer_a.mul_(gram_d.abs_()))
            outer_d = norms_d[:, :, rows, None] * norms_d[:, :, None, cols]
            from_d = from_d + _nested_sum(outer_d.mul_(gram_a.abs_()))
    alpha = cost.product_error(width_in, unit, input_unit)
    beta = cost.product_error(width_out, unit, input_unit)
    depth = 2 * block + groups + blocks * blocks
    terms = (norms_a * norms_d).sum(-1)  # (B, G): sum_t |a_t| |d_t|
    bound = (
        cost.gamma(depth + 1, unit) * magnitude
        + alpha * from_a
        + beta * from_d
        + alpha * beta * (terms * terms).sum(-1)
    )
    own = cost.gamma(depth + 2 * (width_in + width_out + positions) + 16, unit)
    return cost.Certified(total.clamp_min(0), bound * (1 + 2 * own))


def _nested_sum(x: torch.Tensor) -> torch.Tensor:
    """``(B, G, R, C) -> (B,)``, over columns, then rows, then groups: every term passes through
    at most ``C + R + G`` additions, whatever order each reduction takes."""
    return x.sum(-1).sum(-1).sum(-1)


def _formed_in(
    a: torch.Tensor, d: torch.Tensor, input_unit: float, buffer: torch.Tensor | None = None
) -> Any:
    """``|a^T d|_F^2`` per example from the formed ``p x q`` gradients (``a (B, G, T, p)``, ``d
    (B, G, T, q)``, a few examples at a time, into ``buffer`` where given, squared in place), with its
    rounding bound.

    Each entry of the formed ``G' = a^T d`` is within ``theta sum_t |a_ti| |d_tj|`` of the exact
    one (``theta = cost.product_error(T)``), so ``|G| <= |G'| + theta sqrt(sum_g (sum_t |a_t|
    |d_t|)^2)``; ``|G'|^2`` is summed over columns, rows and groups (within ``gamma_(p + q + G
    + 1)``). The bound is ``(sqrt(|G'|^2 (1 + gamma)) + theta S)^2 - |G'|^2``, raised for its
    own rounding: relative to the norm it is ``theta S / |G|``, not the Gram route's
    square."""
    groups, positions, width_in = a.shape[1:]
    width_out = d.shape[-1]
    unit = _unit(a.dtype)
    dtype = torch.promote_types(a.dtype, d.dtype) if buffer is None else buffer.dtype
    out = None if buffer is None else buffer[: len(a)]
    formed = torch.matmul(a.transpose(-1, -2).to(dtype), d.to(dtype), out=out)
    squared = _nested_sum(formed.square_())
    theta = cost.product_error(positions, unit, input_unit)
    terms = (_magnitudes(a) * _magnitudes(d)).sum(-1)  # (B, G)
    error = theta * (terms * terms).sum(-1).sqrt()
    return _certified_sum_of_squares(squared, error, width_in + width_out + groups + positions)


def _certified_sum_of_squares(squared: torch.Tensor, error: torch.Tensor, depth: int) -> Any:
    """The certified squared norm of a computed vector ``v'`` whose squares were summed into
    ``squared`` (each term through at most ``depth`` additions) and which is within ``error``
    (Euclidean) of the exact one: ``(sqrt(squared (1 + 2 gamma)) + error)^2 - squared``,
    raised by ``2 gamma`` for its own rounding."""
    unit = _unit(squared.dtype)
    relative = cost.gamma(depth + 1, unit)
    upper = (squared * (1 + 2 * relative)).sqrt() + error
    own = cost.gamma(2 * depth + 16, unit)
    bound = (upper * upper - squared).clamp_min(0) * (1 + 2 * own) + 4 * unit * squared
    return cost.Certified(squared, bound)


def summed_squared_norms(terms: torch.Tensor) -> Any:
    """``|sum_t terms[b, t]|^2`` per example for ``terms (B, T, q)`` (a bias's gradient: the
    output gradients summed over positions), certified: the sum of ``T`` terms is within
    ``gamma_T sum_t |terms_t|`` of the exact one, which cancelling positions make large next to
    the norm. A plain tensor where ``cost.FAST_NORMS`` is off."""
    squared = squared_norms_of(terms.sum(1))
    if not cost.FAST_NORMS:
        return squared
    positions, width = terms.shape[1], terms.shape[-1]
    error = cost.gamma(positions, _unit(terms.dtype)) * _magnitudes(terms).sum(-1)
    return _certified_sum_of_squares(squared, error, width + positions)


def squared_norms_of(per_example: torch.Tensor) -> torch.Tensor:
    """``(B, ...)`` per-example gradients of one parameter -> ``(B,)`` squared norms."""
    return (per_example**2).reshape(per_example.shape[0], -1).sum(1)


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


def linear_per_example(layer: nn.Linear, calls: list[LayerCall]) -> dict[str, torch.Tensor]:
    activations, output_grads = tokens(calls, layer.in_features, layer.out_features)
    result = {"weight": torch.einsum("bnq,bnp->bqp", output_grads, activations)}
    if layer.bias is not None:
        result["bias"] = output_grads.sum(1)
    return result


def _weighted_tokens(
    calls: list[LayerCall], width_in: int, width_out: int, weights: torch.Tensor
) -> tuple[Any, Any]:
    """All positions of all examples as rows: inputs ``(B N, width_in)`` and output gradients
    scaled by their example's weight ``(B N, width_out)``."""
    activations, output_grads = tokens(calls, width_in, width_out)
    scaled = output_grads * weights.to(output_grads.dtype)[:, None, None]
    return activations.reshape(-1, width_in), scaled.reshape(-1, width_out)


def linear_weighted_sum(
    layer: nn.Linear, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    activations, scaled = _weighted_tokens(calls, layer.in_features, layer.out_features, weights)
    result = {"weight": scaled.T @ activations}
    if layer.bias is not None:
        result["bias"] = scaled.sum(0)
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
    route=lambda layer: dense_route_of(layer, layer.in_features, layer.out_features),
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
    result = {"weight": torch.einsum("bnp,bnq->bpq", activations, output_grads)}
    if layer.bias is not None:
        result["bias"] = output_grads.sum(1)
    return result


def hf_conv1d_weighted_sum(
    layer: nn.Module, calls: list[LayerCall], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    width_in, width_out = layer.weight.shape
    activations, scaled = _weighted_tokens(calls, width_in, width_out, weights)
    result = {"weight": activations.T @ scaled}
    if layer.bias is not None:
        result["bias"] = scaled.sum(0)
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
    route=lambda layer: dense_route_of(layer, *layer.weight.shape),
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
        f"as a dense layer: " + dense_route_of(layer, width_in, width_out)
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
    indices = torch.cat([c.inputs[0].reshape(batch, -1) for c in calls], dim=1)
    output_grads = torch.cat([c.output_grad.reshape(batch, -1, width) for c in calls], dim=1)
    if layer.padding_idx is not None:
        output_grads = output_grads * (indices != layer.padding_idx).unsqueeze(-1)
    example = torch.arange(batch, device=indices.device).unsqueeze(1)
    keys = (example * layer.num_embeddings + indices).reshape(-1)
    return indices, output_grads, keys


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
    unique_keys, row_of_position = torch.unique(keys, return_inverse=True)
    row_sums = output_grads.new_zeros(unique_keys.shape[0], width)
    row_sums.index_add_(0, row_of_position, output_grads.reshape(-1, width))
    squared = output_grads.new_zeros(batch)
    squared.index_add_(0, unique_keys // layer.num_embeddings, (row_sums**2).sum(1))
    if not cost.FAST_NORMS:
        return {"weight": squared}
    # each row's sum of at most T output gradients is within gamma_T of the sum of their sizes
    positions = output_grads.shape[1]
    error = cost.gamma(positions, _unit(squared.dtype)) * _magnitudes(output_grads).sum(-1)
    return {"weight": _certified_sum_of_squares(squared, error, width + positions)}
