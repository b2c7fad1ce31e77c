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
costs about :data:`FLOAT64_COST` float32 multiply-adds per multiply-add, the certified float32
Gram route :data:`FAST_GRAM_COST` (its products, magnitudes and bound sums): a PyTorch layer
whose fast Gram route suffices takes it up to that crossover (:func:`gram_is_cheaper`,
``fast=True``); JAX keeps the float64 crossover (XLA's CPU products of these shapes did not
show one clear crossover for the float32 route).

Measured by ``benchmarks/gram_precision.py`` (2-core CPU, PyTorch, float64 Gram matrices): the
cheaper route picked on every shape there, from T = 16 to 1024 and widths 128 to 3072. The
PyTorch layer rules and the JAX contraction rules both ask this module, and
``choose_strategy``'s ``norm_routes`` report its decision.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

FLOAT64_COST = 2
# The certified float32 Gram route (PyTorch) against forming the gradient, per multiply-add of
# its T x T products: measured on a 2-core CPU, both routes certified, each with its bound
# (benchmarks/results/cpu/gram_precision.md): Gram 0.17-0.96x the formed route's time where
# T (p + q) <= 0.75 p q, 1.38-1.70x from T (p + q) = p q on; the crossover near 0.8.
FAST_GRAM_COST = 1.25
# True: a layer whose certified float32 Gram route suffices is priced at FAST_GRAM_COST; False:
# at FLOAT64_COST, as before (a benchmark's baseline: dp_transformers.py --float64-crossover).
FAST_GRAM_PRICED = True
# ... and only where its bound for positions that do not cancel stays under this share of
# ROUNDING_TOLERANCE (FAST_MARGIN / 8): real gradients' positions cancel partly, and the Gram
# route's bound grows with the square of the cancellation, so a layer near FAST_MARGIN would
# have its examples computed again in float64. A GPT-2's LM head (256 x 8192 at 128 tokens,
# its widest factor's dot products alone near FAST_MARGIN) came out loose on every example, and
# the step 5% slower than with that layer formed; its q, k, v and MLP layers, under this
# margin, never.
FAST_GRAM_PRICE_MARGIN = 1 / 64
# True: PyTorch's Gram route sums a wide factor's Gram matrix over chunks of its width
# (gram_chunks), which bounds each entry's rounding by chunk + count additions, not width: a
# GPT-2 LM head (768 x 50257) is then certified in float32 where it took float64, and its MLP
# layers' examples (3072 wide) are not loose; False: one product over the whole width, as
# before (a benchmark's baseline, read at each call).
SPLIT_GRAM = True
# ... for factors wider than this, in chunks of GRAM_CHUNK (chunks of 128 cost 1.2-1.3x the
# whole product on 768-1024-wide factors at 128 tokens, 2-core CPU: small products run below
# the matrix units' speed; 512 wide, a GPT-2 small MLP factor's chunks cost less than the
# float64 recomputation of its loose examples they avoid).
GRAM_SPLIT_WIDTH = 1024
GRAM_CHUNK = 512
# True: the Gram route forms only the T x T blocks on and above the diagonal, those above
# counted twice (both Gram matrices are symmetric); False: every block, as before (a
# benchmark's baseline, read at each call).
SYMMETRIC_GRAM = True
# The unit roundoff the cost model prices the fast route at (float32).
FLOAT32_UNIT = 2.0**-24

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
# True: a ghost step's host reads (which layers' certified norms to tighten, whether a tied
# parameter's uses cancel, whether every norm is finite) are made at once, after every layer's
# norms (torch_quantities.squared_norms); False: each where it arises, as before, for a
# benchmark's baseline (benchmarks/dp_step_profile.py --legacy-syncs; read at each call).
DEFERRED_READS = True
# True: the one-pass ghost DP step reduces each layer whose per-example gradients are no more
# numbers than its output gradients to them in the backward pass, its records dropped there
# (capture/torch_held.py); False: every layer's records held to the end, as before, for a
# benchmark's baseline (benchmarks/dp_transformers.py --records-held; PyTorch reads it at each
# call, JAX when the step is traced: strategies/ghost_jax._held).
HOLD_FORMED = True
# True: a tied parameter (GPT-2's token table and LM head) is held likewise where that is
# smaller, its uses' terms summed as they complete (capture/torch_held_tied.py); False: its
# uses keep their records and their cross terms, as before, for a benchmark's baseline (read
# at each call; HOLD_FORMED off turns it off too).
HOLD_TIED = True

# Reading on the host which examples' certified norms need float64 stalls it until an
# accelerator has caught up: about this many float32 multiply-adds of a matrix product
# (measured on an NVIDIA H100: a read 0.035 ms, 2.4e13 multiply-adds/s in IEEE float32, so
# 8.6e8; benchmarks/results/nvidia-h100-80gb-hbm3/device_costs.md). Where computing every
# example again costs less (FLOAT64_ACCELERATOR_COST per multiply-add), the tightening does so
# instead, without reading anything (torch_norms._tightened). Where the ghost step can, it
# reads every layer's flags at once instead (DEFERRED_READS), and this choice is left to the
# layers that are reduced alone (the low-memory mode's hooks, user-level norms, a loose layer
# computed again). A CPU has nothing to wait for.
SYNC_COST = 10**9
# On the H100 a float64 multiply-add cost 0.86 float32 ones (2.8e13 against 2.4e13 per second),
# but float64 runs at 1/32 to 1/64 of float32's rate on most other GPUs: 16 keeps those from
# computing whole layers again in float64, at the cost of a read on the ones with fast float64.
FLOAT64_ACCELERATOR_COST = 16


def tighten_without_sync(device_type: str, work: float) -> bool:
    """Whether a layer's certified norms are tightened without a host read on a
    ``device_type`` device: every example again in float64 (``work`` float32 multiply-adds in
    the fast precision) costs less than the stall of reading which examples need it."""
    return device_type != "cpu" and FLOAT64_ACCELERATOR_COST * work <= SYNC_COST


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


def gram_chunks(width: int) -> tuple[int, int]:
    """``(chunk, count)``: PyTorch's Gram route (``SPLIT_GRAM``) forms the Gram matrix of a
    factor wider than ``GRAM_SPLIT_WIDTH`` as the sum of ``count`` Gram matrices of
    ``GRAM_CHUNK``-wide slices of its width (the last padded with zeros), so that each entry
    passes through ``chunk + count - 1`` additions (:func:`gram_entry_length`), not
    ``width``. ``(width, 1)`` otherwise."""
    if not SPLIT_GRAM or width <= GRAM_SPLIT_WIDTH:
        return width, 1
    return GRAM_CHUNK, -(-width // GRAM_CHUNK)


def gram_entry_length(width: int, split: bool = True) -> int:
    """How many terms each entry of a factor's Gram matrix sums, as its rounding sees them: a
    dot product of ``width`` terms, or with ``split`` (PyTorch's route, :func:`gram_chunks`)
    one of ``chunk`` terms and a sum of ``count`` of those: ``chunk + count - 1``."""
    if not split:
        return width
    chunk, count = gram_chunks(width)
    return chunk + count - 1


def fast_gram_suffices(
    positions: int,
    widths: tuple[int, ...],
    unit: float,
    input_unit: float = 0.0,
    margin: float | None = None,
    split: bool = False,
) -> bool:
    """Whether the Gram route in a fast precision (``unit``, inputs rounded to ``input_unit``)
    is worth trying: its bound for ``T`` positions that add up without cancelling stays under
    ``margin * ROUNDING_TOLERANCE`` of the norm (None: ``FAST_MARGIN``). Each Gram entry is a
    dot product over a factor's width (``split``: PyTorch's, over chunks of it,
    :func:`gram_entry_length`), and their products are summed over two ``T``-long axes."""
    if not FAST_NORMS:
        return False
    widest = product_error(max(gram_entry_length(w, split) for w in widths), unit, input_unit)
    summed = gamma(2 * positions + 2, unit)
    share = FAST_MARGIN if margin is None else margin
    return len(widths) * widest + summed <= share * ROUNDING_TOLERANCE


def fast_gram_priced(
    positions: int,
    widths: tuple[int, ...],
    unit: float = FLOAT32_UNIT,
    input_unit: float = 0.0,
    split: bool = False,
) -> bool:
    """Whether a layer's Gram route is priced as the certified fast one (``FAST_GRAM_COST``)
    rather than float64's: ``FAST_GRAM_PRICED`` and its bound within
    ``FAST_GRAM_PRICE_MARGIN`` (see there); ``split`` as for :func:`fast_gram_suffices`."""
    return FAST_GRAM_PRICED and fast_gram_suffices(
        positions, widths, unit, input_unit, FAST_GRAM_PRICE_MARGIN, split
    )


def coarse_gram_bound_suffices(
    positions: int,
    widths: tuple[int, int],
    unit: float,
    input_unit: float = 0.0,
    split: bool = False,
) -> bool:
    """Whether the Gram route's bound may bound its sums ``sum |A_ts D_ts|``, ``sum |a_t||a_s|
    |D_ts|``, ``sum |A_ts| |d_t||d_s|`` by Cauchy-Schwarz, ``|A_ts| <= |a_t||a_s|``: each by
    ``S^2 = (sum_t |a_t||d_t|)^2``, which costs no ``T x T`` matrix. For ``T`` positions that
    do not cancel the squared norm is about ``S^2 / T`` (orthogonal positions) or more, so the
    coarse bound stays under ``FAST_MARGIN * ROUNDING_TOLERANCE`` of it when ``T (gamma_(2T+2)
    + alpha + beta)`` does: short sequences of narrow layers, where the bound's kernels, not
    its arithmetic, cost the time."""
    if not FAST_NORMS:
        return False
    alpha = product_error(gram_entry_length(widths[0], split), unit, input_unit)
    beta = product_error(gram_entry_length(widths[1], split), unit, input_unit)
    share = gamma(2 * positions + 2, unit) + alpha + beta + alpha * beta
    return positions * share * (1 + alpha) * (1 + beta) <= FAST_MARGIN * ROUNDING_TOLERANCE


def gram_cost(fast: bool) -> float:
    """What one multiply-add of the Gram route costs in the formed route's: ``FAST_GRAM_COST``
    for the certified float32 route (``fast``), ``FLOAT64_COST`` for float64."""
    return FAST_GRAM_COST if fast else FLOAT64_COST


def gram_is_cheaper_for(positions: int, widths: tuple[int, ...], fast: bool = False) -> bool:
    """Whether the Gram route costs less for a gradient with factors of these ``widths``
    (``(p, q)`` for a dense layer, ``(out, in1, in2)`` for a bilinear one) at ``positions``:
    ``gram_cost(fast) T sum(widths) <= prod(widths)``; ``fast``: the Gram matrices in the
    certified fast precision (PyTorch, where :func:`fast_gram_priced`), else in float64."""
    return gram_cost(fast) * positions * sum(widths) <= math.prod(widths)


def gram_limit_for(widths: tuple[int, ...], fast: bool = False) -> int:
    """The most positions per example for which :func:`gram_is_cheaper_for` takes the Gram
    route (0 or 1: never past one position)."""
    return int(math.prod(widths) // (gram_cost(fast) * sum(widths)))


def gram_is_cheaper(positions: int, width_in: int, width_out: int, fast: bool = False) -> bool:
    """:func:`gram_is_cheaper_for` a ``width_in x width_out`` dense layer:
    ``gram_cost(fast) T (p + q) <= p q``."""
    return gram_is_cheaper_for(positions, (width_in, width_out), fast)


def gram_limit(width_in: int, width_out: int, fast: bool = False) -> int:
    """:func:`gram_limit_for` a ``width_in x width_out`` dense layer."""
    return gram_limit_for((width_in, width_out), fast)


def split_axes(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with each axis of length ``n`` split as ``(n / d, d)``, ``d`` the largest
    divisor of ``n`` at most ``sqrt(n)`` (an axis of prime length stays whole): summed one
    axis at a time, each number passes through ``sum(split_axes(shape))`` additions at most
    (a ``(256, 8192)`` gradient's squares through 224, not 8448: a bound 40x tighter). A
    reshape, nothing copied."""
    axes: list[int] = []
    for n in shape:
        d = max(k for k in range(1, math.isqrt(n) + 1) if n % k == 0) if n > 3 else 1
        axes += [n // d, d] if d > 1 else [n]
    return tuple(axes)


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
        fast_limit = gram_limit_for(widths, fast=True)
        if fast_gram_priced(fast_limit, widths, input_unit=input_unit, split=True):
            limit = fast_limit
        gram = (
            f"Gram matrices in {fast}, certified, for up to {limit} positions per example where "
            f"the bound allows (else in float64 for up to {gram_limit_for(widths)})"
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


# --- "auto" between the ghost norms and materialised per-example gradients -----------------
#
# Both are exact (each clips by an upper bound of each example's norm); they differ in time
# and memory. In multiply-adds: materialising costs MATERIALIZED_NUMBER_COST for each of the
# B x P per-example gradient numbers (written by vmap, read by the norms and again by the
# weighted sum); the ghost strategy costs each layer's norm work per example
# (layer_norm_work) and GHOST_LAYER_COST per layer call and step (its hooks, records and the
# bound's small kernels), whatever the batch; its weighted sum is one weight gradient, as the
# per-example gradients' own computation is for materialising (the two cancel). A DP step's
# held layers (capture/torch_held.py) hold their per-example gradients instead of their
# records, and a dense one costs materialising's work on its numbers (held_norm_work). Fitted
# to Opacus's MNIST SampleConvNet on a 2-core CPU (benchmarks/auto_choice.py --sweep, 1
# thread, load about 2: benchmarks/results/cpu/auto_choice_sweep.md): past the batch gradient,
# materialising took about 0.16 ms per example and 1.1 ms per step, the ghost step about
# 0.10 ms per example and 4.5 ms per step, so its fixed cost is about 3.4 ms more: 4 layers x
# GHOST_LAYER_COST at materialising's 0.16 ms for its 832 k multiply-adds per example. The
# model puts the crossover at about 47 examples, the sweep at 40-64 (materialising 0.75x the
# ghost step's time at 16 examples, a tie at 40, 1.04x at 64, 1.07-1.2x at 96-128; 6% lost at
# 48, where the two disagree). The same constants send a small transformer over 256 tokens (B =
# 8, formed norms) to materialising by time (measured 0.8-0.9x) and MLPs (closed-form norms)
# to the ghost norms (materialising 10-40x slower): benchmarks/results/cpu/auto_choice.md.
MATERIALIZED_NUMBER_COST = 32
GHOST_LAYER_COST = 2**22
# The certified bound's own work per position and unit of width (the magnitudes |a_t|, |d_t|
# and the bound's sums), next to the T p q of forming a gradient.
BOUND_WORK = 4
# Below this many per-example numbers (B x P, 1 MB in float32) "auto" keeps the ghost norms
# (which also give each example's loss) without estimating: either route takes a few
# milliseconds there, and the fixed costs that decide between them are the least certain part
# of the model.
MIN_CHOICE_NUMBERS = 2**18


class LayerWork(NamedTuple):
    """One layer call's shape, as the cost model of the route choice sees it.

    Attributes:
      kind: ``"dense"`` (a linear map applied at ``positions``: linear layers, convolutions'
        patches), ``"formed"`` (its per-example gradient formed as materialising would:
        a convolution with many positions, a generic unit), ``"light"`` (elementwise rules:
        norm layers, embeddings; work linear in the output), or ``"held"`` (a DP step's layer
        held as its formed per-example gradients, ``capture/torch_held.py``: its norms and
        its share of the clipped sum are materialising's work on its ``numbers``, the weight
        gradient its sum would otherwise take saved; one for all the layer's calls, or for all
        the calls of the layers using one tied parameter, ``capture/torch_held_tied.py``).
      positions: ``T``, positions per example (conv output positions, tokens).
      widths: ``(p, q)`` per group for ``"dense"``; ``(output numbers per example,)`` for
        ``"light"``.
      groups: independent blocks (conv groups).
      numbers: the parameter numbers this layer owns (its part of ``P``).
    """

    kind: str
    positions: int
    widths: tuple[int, ...]
    groups: int
    numbers: int
    norm_work: float = 0.0  # a "held" layer's (held_norm_work)


def layer_norm_work(layer: LayerWork, fast_gram: bool = True) -> float:
    """Multiply-adds per example of one layer call's ghost norms (see :func:`route_costs`);
    ``fast_gram``: a dense layer takes the certified float32 Gram route where it suffices
    (PyTorch's rules), else the float64 crossover (JAX's)."""
    if layer.kind == "light":
        return float(math.prod(layer.widths))
    if layer.kind == "held":
        return layer.norm_work
    if layer.kind == "formed":
        dense = layer.positions * layer.numbers
        return dense + MATERIALIZED_NUMBER_COST * layer.numbers
    positions, (width_in, width_out) = layer.positions, layer.widths
    if positions <= 1:
        return float(layer.groups * (width_in + width_out))
    fast = fast_gram and fast_gram_priced(positions, (width_in, width_out), split=True)
    if gram_is_cheaper(positions, width_in, width_out, fast):
        work = gram_cost(fast) * positions * positions * (width_in + width_out)
    else:
        work = positions * width_in * width_out
    return layer.groups * (work + BOUND_WORK * positions * (width_in + width_out))


# Memory in the route choice: materialising is taken for its speed only where what it holds,
# MATERIALIZED_MEMORY x B x P numbers (the per-example gradients and a reduction's temporary
# of their size: measured, BERT at 512 tokens, batch 4, 2 x 21.8 M numbers over the
# non-private step), is little in absolute terms (at most FREE_FORMED_NUMBERS: 16 MB in float32,
# what a non-private step of a small model spends on its activations anyway) or no more than
# the ghost pass holds (every layer's output gradients, until all norms are known: an upper
# bound of its extra memory). Past both, the time saved would cost a multiple of the
# non-private step's memory (that BERT: 2.15x; a ViT at batch 32: 2.72x, against 1.42x / 1.34x
# for the ghost norms' one-pass mode, 1.14x / 1.18x for its low-memory mode).
FREE_FORMED_NUMBERS = 2**22
MATERIALIZED_MEMORY = 2
# JAX: "auto" materialises where the work model finds it faster and XLA's compiled temporary
# memory of materialising is at most (1 + XLA_MEMORY_MARGIN) times the ghost norms' (XLA sums
# a dense layer's per-example gradients without keeping them, but keeps a row lookup's:
# benchmarks/results/cpu/dp_transformers_jax.md, tied and untied tables). At 512 tokens the
# untied flax model's clipped sum took 1.034x the ghost norms' memory materialising, and its
# whole step 1.11x the non-private step's against the ghost step's 1.05x: 1/16 would have
# taken it past the memory goal (dp_transformers_jax_512.md).
XLA_MEMORY_MARGIN = 1 / 32


def held_norm_work(calls: list[LayerWork]) -> float:
    """The norm work per example of a layer a DP step holds as its formed per-example
    gradients (``capture/torch_held.py``; or of the layers using one tied parameter, held as
    one, ``capture/torch_held_tied.py``: an LM head and its token table, whose lookups add
    their output gradients' numbers), from its ``calls``' works: a dense layer's calls
    cost materialising's work on its numbers (forming them is a weight gradient's products,
    and its share of the clipped sum, ``B P`` multiply-adds, saves the weight gradient the sum
    would take); a convolution formed over its positions or a light layer, what its calls cost
    as they were (unfolding a convolution's patches costs more than the convolution's own
    weight gradient it saves: Opacus's MNIST SampleConvNet's held ``conv1`` left its DP step's
    time per example where it was, benchmarks/results/cpu/auto_choice_sweep.md)."""
    dense = any(call.kind == "dense" for call in calls)
    rest = sum(layer_norm_work(call) for call in calls if call.kind != "dense")
    return rest + (MATERIALIZED_NUMBER_COST * calls[0].numbers if dense else 0.0)


def layer_output_numbers(layer: LayerWork) -> int:
    """Numbers per example of one layer call's output (and output gradient); a ``"held"``
    layer's parameter numbers, which the ghost pass holds instead."""
    if layer.kind == "light":
        return layer.widths[0]
    if len(layer.widths) == 2:
        return layer.groups * layer.positions * layer.widths[1]
    return layer.numbers


def layer_held_numbers(layer: LayerWork) -> float:
    """Numbers per example the ghost pass holds for one layer call: its output gradient; a
    ``"held"`` layer's formed per-example gradient (``capture/torch_held.py``), and a generic
    unit's, which is always formed."""
    return float(layer_output_numbers(layer))


class RouteCosts(NamedTuple):
    """What :func:`route_costs` estimates for one call, in multiply-adds (work) and numbers
    (memory)."""

    ghost: float
    materialize: float
    numbers: int  # B x P, the per-example gradient numbers materialising forms
    held: float = 0.0  # the numbers the ghost pass holds (layer_held_numbers, times B)
    held_layers: int = 0  # layers a DP step holds as their formed per-example gradients

    def materialize_is_cheaper(self) -> bool:
        return (
            MIN_CHOICE_NUMBERS <= self.numbers <= MAX_FORMED_NUMBERS
            and self.materialize < self.ghost
            and not self.materialize_holds_more()
        )

    def materialize_holds_more(self) -> bool:
        """Whether materialising would hold more than the ghost norms and more than
        ``FREE_FORMED_NUMBERS`` (see there)."""
        return MATERIALIZED_MEMORY * self.numbers > max(FREE_FORMED_NUMBERS, self.held)

    def describe(self) -> str:
        """The comparison in words, for ``StrategyChoice.reason``."""
        memory = (
            f"; materialising, estimated faster, would hold about "
            f"{MATERIALIZED_MEMORY * self.numbers:,} numbers, "
            f"{MATERIALIZED_MEMORY * self.numbers / max(self.held, 1):.1f}x what the "
            f"ghost norms hold ({self.held:,.0f}) and past {FREE_FORMED_NUMBERS:,}: ghost by "
            f"memory (strategy='materialize' takes it anyway)"
            if self.materialize < self.ghost and self.materialize_holds_more()
            else ""
        )
        held = (
            f" ({self.held_layers} layer(s) held as their formed per-example gradients)"
            if self.held_layers
            else ""
        )
        return (
            f"estimated extra work over a batch gradient: ghost norms {self.ghost:.3g} "
            f"multiply-adds{held}, materialised per-example gradients {self.materialize:.3g} "
            f"({self.numbers:,} numbers, at most {MAX_FORMED_NUMBERS:,} allowed){memory}"
        )


def route_costs(
    batch_size: int,
    num_params: int,
    layers: list[LayerWork],
    layer_cost: float | None = None,
    fast_gram: bool = True,
) -> RouteCosts:
    """The extra work of each exact route over a batch gradient, for ``B = batch_size``
    examples and ``P = num_params`` differentiated numbers: the ghost strategy's per-layer
    norms (:func:`layer_norm_work`, every call of every layer) and its ``layer_cost`` per layer
    call (None: ``GHOST_LAYER_COST``, PyTorch's, as it is now; 0 under ``jax.jit``) against
    materialising's ``MATERIALIZED_NUMBER_COST B P``; ``fast_gram``: as for
    :func:`layer_norm_work`."""
    if layer_cost is None:
        layer_cost = GHOST_LAYER_COST
    per_example = sum(layer_norm_work(layer, fast_gram) for layer in layers)
    ghost = batch_size * per_example + layer_cost * len(layers)
    numbers = batch_size * num_params
    held = batch_size * sum(layer_held_numbers(layer) for layer in layers)
    held_layers = sum(layer.kind == "held" for layer in layers)
    return RouteCosts(ghost, float(MATERIALIZED_NUMBER_COST * numbers), numbers, held, held_layers)


def settings() -> tuple[Any, ...]:
    """This module's switches and constants (its upper-case names) as they are now: tests and
    benchmarks change them, so a cache of what is worked out from them (the norm routes, the
    layer works of ``torch_probe``) is kept under them."""
    module = globals()
    return tuple(module[name] for name in _SETTINGS)


_SETTINGS = tuple(name for name in globals() if name.isupper())
