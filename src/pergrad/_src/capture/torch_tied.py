"""Tied parameters on the ghost path: the cross terms of two layers sharing one parameter.

A parameter used by several layers (GPT-2's input embedding, reused as its output projection;
T5's one table, looked up by its encoder's and its decoder's embedding layers and reused as its
lm head) has the per-example gradient ``g = g_1 + ... + g_k``, one term per layer, so

    |g|^2 = sum_j |g_j|^2 + 2 sum_{j < l} <g_j, g_l>.

Each ``|g_j|^2`` is its layer rule's squared norm (``torch_layers.py``); a *cross rule* gives
``<g_j, g_l>`` per example from the two layers' captured calls without forming either gradient.
Cross rules are registered for a pair of layer families (``rules.LayerRule.name``) and the
parameter each side shares, one small function a pair, in either order: (embedding, linear)
and (embedding, embedding) below. A tie between families without one is not ghosted
(``torch_plan.plan`` refuses it, naming the pair).

Precision: a tied gradient may nearly cancel (``g_1 ~ -g_2``); the sum above then rounds by
about ``eps (|g_1|^2 + |g_2|^2)``, which in float32 under-estimates ``|g|^2`` by far more than its
own size allows, and an example clipped by that norm exceeds the clipping bound. So the cross
terms and the sum are computed in float64 (from the small records: an embedding's output
gradients, the projection's inputs and its output gradients gathered at the looked-up ids; never
a ``B x T x V`` copy), the uses' own norms in the model's dtype as for any layer, and
:func:`well_conditioned` tells whether that suffices: where the sum is at least
:data:`CANCELLATION_FLOOR` of the own norms, their float32 rounding is at most ``1 /
CANCELLATION_FLOOR`` times its usual relative size in the total. Otherwise the caller recomputes
the own norms on float64 copies of the calls (:func:`widened`). MPS has no float64: there the
model's dtype is kept.

    uses = [Use(model.emb, "weight", emb_calls), Use(model.head, "weight", head_calls)]
    total = tied_squared_norms(uses, [emb_norms, head_norms])   # (B,) float64
    well_conditioned(total, [emb_norms, head_norms])            # else: widened(...) and again

A DP step whose tied parameter's formed per-example gradient is no larger than its LM head's
output gradients holds that instead, the uses' terms summed in the backward pass, and takes its
norms from the sum: no cross terms (``torch_held_tied.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import torch_layers
from pergrad._src.capture.rules import rule_for
from pergrad._src.capture.torch_layers import LayerCall
from pergrad._src.errors import Unsupported

# cross(layer_a, calls_a, layer_b, calls_b) -> (B,) per-example <g_a, g_b> of the parameter the
# two layers share, from their LayerCall records of one batched pass.
CrossFn = Callable[[Any, list[LayerCall], Any, list[LayerCall]], torch.Tensor]

# The sum of a tied parameter's terms must be at least this fraction of its uses' own squared
# norms for those norms' model-dtype rounding to be kept (see the module docstring).
CANCELLATION_FLOOR = 0.25


@dataclass(frozen=True)
class CrossRule:
    """The cross term of a parameter shared by a layer of family ``families[0]`` (as its
    attribute ``parameters[0]``) and one of family ``families[1]`` (as ``parameters[1]``)."""

    families: tuple[str, str]
    parameters: tuple[str, str]
    cross: CrossFn


_CROSS: dict[tuple[str, str], CrossRule] = {}


def register_cross(
    family_a: str, family_b: str, *, parameters: tuple[str, str] = ("weight", "weight")
) -> Callable[[CrossFn], CrossFn]:
    """Decorator: register ``cross(layer_a, calls_a, layer_b, calls_b)`` for the pair of
    families; it serves the pair in either order."""

    def decorate(cross: CrossFn) -> CrossFn:
        _CROSS[(family_a, family_b)] = CrossRule((family_a, family_b), parameters, cross)
        return cross

    return decorate


def cross_rule(first: tuple[str, str], second: tuple[str, str]) -> CrossFn | None:
    """The cross rule of a parameter used as ``first = (family, attribute)`` by one layer and as
    ``second`` by another, with its arguments in that order; None if there is none."""
    rule = _CROSS.get((first[0], second[0]))
    if rule is not None and rule.parameters == (first[1], second[1]):
        return rule.cross
    swapped = _CROSS.get((second[0], first[0]))
    if swapped is not None and swapped.parameters == (second[1], first[1]):
        return lambda layer_a, calls_a, layer_b, calls_b: swapped.cross(
            layer_b, calls_b, layer_a, calls_a
        )
    return None


def missing_cross(uses: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The first pair of families among ``uses`` (``(family, attribute)`` of each layer using
    one parameter) that has no cross rule, or None when every pair has one."""
    for first, second in combinations(uses, 2):
        if cross_rule(first, second) is None:
            return first[0], second[0]
    return None


@dataclass(frozen=True)
class Use:
    """One layer's use of a shared parameter in one batched pass.

    Attributes:
      layer: the module.
      parameter: the attribute under which it holds the parameter (``"weight"``).
      calls: its calls in the pass, in the model's dtype or :func:`widened`.
    """

    layer: nn.Module
    parameter: str
    calls: list[LayerCall]


def wide(x: Any) -> Any:
    """A floating-point tensor in float64 (on MPS, which has no float64, as it is); anything else
    as it is."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type != "mps":
        return x.double()
    return x


def widened(calls: list[LayerCall]) -> list[LayerCall]:
    """``calls`` with their floating-point inputs and output gradients in float64 (on MPS, which
    has no float64, as they are)."""
    return [LayerCall(tuple(wide(x) for x in c.inputs), wide(c.output_grad)) for c in calls]


def well_conditioned(total: torch.Tensor, squared_norms: list[torch.Tensor]) -> torch.Tensor:
    """0-d boolean tensor, on the device (the caller reads it, with others, on the host):
    whether every example's tied squared norm ``total`` is at least :data:`CANCELLATION_FLOOR`
    of the sum of its uses' own ``squared_norms``; then the own norms' rounding in the model's
    dtype stays small in the total."""
    own = sum(wide(norms) for norms in squared_norms)
    return (total >= CANCELLATION_FLOOR * own).all()


def tied_squared_norms(uses: list[Use], squared_norms: list[torch.Tensor]) -> torch.Tensor:
    """``(B,)`` squared norms of a parameter shared by ``uses`` (at least one), given each use's
    own ``(B,)`` squared norms: their sum plus twice every pair's cross term, in float64 (on MPS
    in the model's dtype).

    The exact value is ``|g|^2 >= 0``; the sum of the terms can round below zero where the uses
    cancel, so it is clamped at zero (:func:`well_conditioned` says when to widen the calls).
    """
    total = wide(squared_norms[0])
    for own in squared_norms[1:]:
        total = total + wide(own)
    for first, second in combinations(uses, 2):
        cross = cross_rule(_family(first), _family(second))
        if cross is None:  # the plan refuses such ties before running
            raise Unsupported(f"no cross rule for {_family(first)} and {_family(second)}")
        total = total + 2 * wide(cross(first.layer, first.calls, second.layer, second.calls))
    return total.clamp_min(0)


def _family(use: Use) -> tuple[str, str]:
    rule = rule_for(use.layer)
    if rule is None:
        raise Unsupported(f"no ghost rule for {type(use.layer).__name__}")
    return rule.name, use.parameter


@register_cross("embedding", "linear")
def embedding_linear_cross(
    embedding: nn.Embedding,
    embedding_calls: list[LayerCall],
    linear: nn.Linear,
    linear_calls: list[LayerCall],
) -> torch.Tensor:
    """An embedding table ``(V, D)`` tied to a bias-free projection ``nn.Linear(D, V)``.

    The embedding's gradient has row ``id_s`` += ``e_s`` for each looked-up position ``s``
    (output gradient ``e_s``); the linear's is ``sum_t d_t a_t^T`` (input ``a_t``, output gradient
    ``d_t``). So ``<g_emb, g_lin> = sum_s sum_t d_t[id_s] (a_t . e_s)``: the output gradients
    gathered at the looked-up ids ``(B, T, S)`` times the inner products ``A E^T``
    ``(B, T, S)``, summed. Positions of all calls side by side; the padding row gets no
    gradient, as in the embedding rule.
    """
    ids, rows, _ = torch_layers.lookups(embedding, embedding_calls)
    ids = ids.long()
    inputs, grads = torch_layers.tokens(
        linear_calls, embedding.embedding_dim, embedding.num_embeddings
    )
    at_ids = wide(torch.gather(grads, 2, ids.unsqueeze(1).expand(-1, grads.shape[1], -1)))
    products = wide(inputs) @ wide(rows).transpose(1, 2)  # (B, T, S), each a sum over D
    return (at_ids.to(products.dtype) * products).sum((1, 2))


@register_cross("embedding", "embedding")
def embedding_embedding_cross(
    first: nn.Embedding,
    first_calls: list[LayerCall],
    second: nn.Embedding,
    second_calls: list[LayerCall],
) -> torch.Tensor:
    """One table ``(V, D)`` looked up by two embedding layers (T5's encoder and decoder
    embeddings, both the shared one).

    Each layer's gradient has row ``r`` equal to the sum of the output gradients of its
    positions that look up ``r``; so ``<g_1, g_2> = sum_r s_1[r] . s_2[r]`` over the rows both
    look up, per example. Both layers' ``(example, row)`` keys are numbered together, each
    layer's output gradients summed per key, and the products of the two sums added up per
    example: ``O(N D)`` for ``N`` looked-up positions, never ``V x D`` per example. The padding
    row of each layer gets no gradient, as in the embedding rule.
    """
    _, first_grads, first_keys = torch_layers.lookups(first, first_calls)
    _, second_grads, second_keys = torch_layers.lookups(second, second_calls)
    first_grads, second_grads = wide(first_grads), wide(second_grads)
    batch, width = first_grads.shape[0], first.embedding_dim
    unique_keys, row_of_position = torch.unique(
        torch.cat([first_keys, second_keys]), return_inverse=True
    )
    split = first_keys.shape[0]
    sums = []
    for grads, rows in (
        (first_grads, row_of_position[:split]),
        (second_grads, row_of_position[split:]),
    ):
        total = grads.new_zeros(unique_keys.shape[0], width)
        total.index_add_(0, rows, grads.reshape(-1, width))
        sums.append(total)
    cross = first_grads.new_zeros(batch)
    cross.index_add_(0, unique_keys // first.num_embeddings, (sums[0] * sums[1]).sum(1))
    return cross
