"""The cost model of a ghost norm, one for both frameworks: Gram matrices or the formed gradient,
in a fast precision with a certified rounding bound, or in float64.

A linear map applied at ``T`` positions per example has per-example gradient ``sum_t x_t (x)
d_t`` (for ``nn.Bilinear``, ``sum_t d_t (x) x1_t (x) x2_t``). Its squared norm comes either from
the Gram matrices of the factors, ``T^2 (sum of the factors' widths)`` multiply-adds per
example, or from forming it, ``T (product of the widths)``.

Certified norms (issue 36). The dense routes compute in the operands' own precision (float32;
TF32 or bfloat16 inputs where the backend's matrix products use them) and return each
example's squared norm as a :class:`Certified` pair: the computed value (the best estimate,
which ``per_example_norms_of`` reports) and an a-priori bound on its rounding error, from the
standard bound for a floating-point dot product of length ``n``, ``|fl(x . y) - x . y| <=
gamma_n sum_i |x_i| |y_i|`` with ``gamma_n = n u / (1 - n u)`` (Higham, *Accuracy and Stability
of Numerical Algorithms*, 3.1), and the magnitudes the route already has (``|a_t|``, ``|d_t|``).
Clip factors are formed from ``estimate + bound``, an upper bound of the exact norm, so that a
clipped example stays within the bound however its per-position gradients cancel. Where the
bound exceeds :data:`ROUNDING_TOLERANCE` of an example's estimate (cancelling positions) that
example is computed again in float64 (JAX without ``jax_enable_x64``: formed), and a layer
whose fast precision could never meet the tolerance (bfloat16 matrix products, long
sequences) runs in float64 from the start (:func:`fast_gram_suffices`). The float64 route
costs about :data:`FLOAT64_COST` float32 multiply-adds per multiply-add; the crossover between
the Gram and the formed route is still the one measured with float64 Gram matrices.

Measured by ``benchmarks/gram_precision.py`` (2-core CPU, PyTorch, float64 Gram matrices): the
cheaper route picked on every shape there, from T = 16 to 1024 and widths 128 to 3072. The
PyTorch layer rules and the JAX contraction rules both ask this module, and
``choose_strategy``'s ``norm_routes`` report its decision.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

FLOAT64_COST = 2

# A certified norm whose rounding bound exceeds this share of its squared norm (a norm at most
# 0.5% too large) is computed again in float64: its clip factor would otherwise shrink the
# example noticeably, and the estimate that per_example_norms_of reports be that far off.
ROUNDING_TOLERANCE = 1e-2
# The fast precision is tried for a layer only where its bound, for positions that do not
# cancel at all, is under this share of ROUNDING_TOLERANCE: else most examples would be
# computed twice.
FAST_MARGIN = 1 / 8
# True: the dense routes run in the operands' precision with a certified bound (issue 36);
# False: the Gram route in float64 as before, for a benchmark's baseline (read at each call).
FAST_NORMS = True

# "auto" takes the ghost strategy (either framework) only if the per-example gradients it forms
# for parameters outside every rule (layers without a rule, bare parameters) stay under this
# many numbers (B x their size; 128 MB in float32); else the chunked strategy.
MAX_FORMED_NUMBERS = 2**25


class Certified(NamedTuple):
    """Per-example squared norms computed in a fast precision, with a bound on their rounding.

    Attributes:
      estimate: ``(B,)`` the computed squared norms, at least 0: the best estimate.
      bound: ``(B,)`` at least ``|exact - estimate|``: ``estimate + bound`` is an upper bound of
        the exact squared norm of the gradient the records give.

    ``dtype`` and ``to`` let a PyTorch rule's result pass through ``rules.py``'s precision
    wrapper as a tensor does; ``to`` widens the bound by the rounding of the conversion.
    """

    estimate: Any
    bound: Any

    @property
    def dtype(self) -> Any:
        return self.estimate.dtype

    def to(self, dtype: Any) -> Certified:
        """Both in ``dtype`` (PyTorch), the bound raised to cover the conversion's rounding."""
        import torch

        if dtype == self.estimate.dtype:
            return self
        unit = torch.finfo(dtype).eps / 2
        bound = (self.bound + unit * (self.estimate + self.bound)) * (1 + 2 * unit)
        return Certified(self.estimate.to(dtype), bound.to(dtype))

    def __add__(self, other: Any) -> Certified:  # type: ignore[override]
        """The sum of two squared norms (of parameter blocks, or of a tied parameter's uses):
        the estimates and the bounds add. A plain array adds with bound 0."""
        if isinstance(other, Certified):
            return Certified(self.estimate + other.estimate, self.bound + other.bound)
        return Certified(self.estimate + other, self.bound)

    __radd__ = __add__

    def upper(self) -> Any:
        """``estimate + bound``: what clip factors are formed from."""
        return self.estimate + self.bound


def split(value: Any) -> tuple[Any, Any]:
    """``(estimate, bound)`` of a rule's squared norms: a :class:`Certified` pair, or a plain
    ``(B,)`` array (computed exactly enough: bound None)."""
    if isinstance(value, Certified):
        return value.estimate, value.bound
    return value, None


def gamma(count: int, unit: float) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` rounded operations in
    unit roundoff ``u`` (infinite where ``n u >= 1``)."""
    product = count * unit
    return math.inf if product >= 1 else product / (1 - product)


def product_error(length: int, unit: float, input_unit: float = 0.0) -> float:
    """The relative error bound of a dot product of ``length`` terms, each term against the sum
    of the terms' magnitudes: its inputs rounded to ``input_unit`` first (TF32: ``2**-11``,
    bfloat16: ``2**-8``; 0 where they are used as they are), then products and sums in
    ``unit``: ``(1 + input_unit)^2 (1 + gamma_length) - 1``."""
    return (1 + input_unit) ** 2 * (1 + gamma(length, unit)) - 1


def fast_gram_suffices(
    positions: int, widths: tuple[int, ...], unit: float, input_unit: float = 0.0
) -> bool:
    """Whether the Gram route in a fast precision (``unit``, inputs rounded to ``input_unit``)
    is worth trying: its bound for ``T`` positions that add up without cancelling stays under
    ``FAST_MARGIN * ROUNDING_TOLERANCE`` of the norm. Each Gram entry is a dot product over a
    factor's width, and their products are summed over two ``T``-long axes."""
    if not FAST_NORMS:
        return False
    widest = product_error(max(widths), unit, input_unit)
    summed = gamma(2 * positions + 2, unit)
    return len(widths) * widest + summed <= FAST_MARGIN * ROUNDING_TOLERANCE


def gram_is_cheaper_for(positions: int, widths: tuple[int, ...]) -> bool:
    """Whether the Gram route costs less for a gradient with factors of these ``widths``
    (``(p, q)`` for a dense layer, ``(out, in1, in2)`` for a bilinear one) at ``positions``:
    ``FLOAT64_COST T sum(widths) <= prod(widths)``, the crossover measured with the Gram
    matrices in float64 (kept for the certified float32 ones, whose crossover is not measured
    yet: the Gram route only gets cheaper)."""
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


def precision_name(input_unit: float) -> str:
    """The fast precision in words, from the rounding of the matrix products' inputs."""
    return {0.0: "float32", 2**-11: "TF32", 2**-8: "bfloat16"}.get(input_unit, "low precision")


def formed_or_gram_route(
    widths: tuple[int, ...],
    symbols: str = "|x|^2 |d|^2",
    input_unit: float = 0.0,
    float64: bool = False,
) -> str:
    """How a layer of factor ``widths`` gets its norms, in words, for ``norm_routes``: the
    closed form at one position (``symbols``), then Gram matrices up to the limit, then the
    gradient formed; in which precision, and whether the norms are certified (``float64``: a
    rule whose Gram route is always in float64, and whose norms carry no bound)."""
    limit = gram_limit_for(widths)
    formed = f"the {' x '.join(map(str, widths))} per-example gradient formed"
    if FAST_NORMS and not float64:
        fast = precision_name(input_unit)
        certified = (
            f"in {fast}, certified (each squared norm with its rounding bound, added before "
            f"clipping; an example whose bound exceeds {ROUNDING_TOLERANCE:g} of it computed "
            f"again in float64)"
        )
        gram = (
            f"Gram matrices in {fast} where the bound allows (else float64), certified, for up "
            f"to {limit} positions per example"
        )
    else:
        certified = "in float32 (not certified)"
        gram = f"Gram matrices in float64 for up to {limit} positions per example"
    if limit < 2:  # one position takes the closed form whatever the widths
        return f"{formed} {certified} (one position: {symbols}; Gram matrices never cost less)"
    return f"{gram}, else {formed} {certified}"


def dense_route(width_in: int, width_out: int, input_unit: float = 0.0) -> str:
    """:func:`formed_or_gram_route` for a ``width_in x width_out`` dense layer."""
    return formed_or_gram_route((width_in, width_out), input_unit=input_unit)
