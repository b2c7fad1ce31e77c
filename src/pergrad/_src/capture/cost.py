"""The cost model of a ghost norm, one for both frameworks: Gram matrices or the formed gradient.

A linear map applied at ``T`` positions per example has per-example gradient ``sum_t x_t (x)
d_t`` (for ``nn.Bilinear``, ``sum_t d_t (x) x1_t (x) x2_t``). Its squared norm comes either from
the Gram matrices of the factors, ``T^2 (sum of the factors' widths)`` multiply-adds per
example, or from forming it, ``T (product of the widths)``. The Gram route runs in float64 (its
sum cancels where the gradient does, see ``torch_layers.outer_product_squared_norms``), and a
float64 multiply-add costs about :data:`FLOAT64_COST` float32 ones, so it is taken where
``FLOAT64_COST T sum(widths) <= prod(widths)``.

Measured by ``benchmarks/gram_precision.py`` (2-core CPU, PyTorch): the cheaper route picked on
every shape there, from T = 16 to 1024 and widths 128 to 3072 (an earlier rule, ``T^2 (p + q)
<= 50 p q``, took the Gram route for a ViT MLP at T = 65, 128 x 512, where forming is about 1.4x
faster). The PyTorch layer rules and the JAX contraction rules both ask this module, and
``choose_strategy``'s ``norm_routes`` report its decision.
"""

from __future__ import annotations

import math

FLOAT64_COST = 2

# "auto" takes the ghost strategy (either framework) only if the per-example gradients it forms
# for parameters outside every rule (layers without a rule, bare parameters) stay under this
# many numbers (B x their size; 128 MB in float32); else the chunked strategy.
MAX_FORMED_NUMBERS = 2**25


def gram_is_cheaper_for(positions: int, widths: tuple[int, ...]) -> bool:
    """Whether the Gram route costs less for a gradient with factors of these ``widths``
    (``(p, q)`` for a dense layer, ``(out, in1, in2)`` for a bilinear one) at ``positions``."""
    return FLOAT64_COST * positions * sum(widths) <= math.prod(widths)


def gram_limit_for(widths: tuple[int, ...]) -> int:
    """The most positions per example for which :func:`gram_is_cheaper_for` takes the Gram
    route (0 or 1: never past one position)."""
    return math.prod(widths) // (FLOAT64_COST * sum(widths))


def gram_is_cheaper(positions: int, width_in: int, width_out: int) -> bool:
    """:func:`gram_is_cheaper_for` a ``width_in x width_out`` dense layer:
    ``FLOAT64_COST T (p + q) <= p q``."""
    return gram_is_cheaper_for(positions, (width_in, width_out))


def gram_limit(width_in: int, width_out: int) -> int:
    """:func:`gram_limit_for` a ``width_in x width_out`` dense layer."""
    return gram_limit_for((width_in, width_out))


def formed_or_gram_route(widths: tuple[int, ...], symbols: str = "|x|^2 |d|^2") -> str:
    """How a layer of factor ``widths`` gets its norms, in words, for ``norm_routes``: the
    closed form at one position (``symbols``), then Gram matrices up to the limit, then the
    gradient formed."""
    limit = gram_limit_for(widths)
    formed = f"the {' x '.join(map(str, widths))} per-example gradient formed"
    if limit < 2:  # one position takes the closed form whatever the widths
        return f"{formed} (one position: {symbols}; Gram matrices never cost less here)"
    return f"Gram matrices in float64 for up to {limit} positions per example, else {formed}"


def dense_route(width_in: int, width_out: int) -> str:
    """:func:`formed_or_gram_route` for a ``width_in x width_out`` dense layer."""
    return formed_or_gram_route((width_in, width_out))
