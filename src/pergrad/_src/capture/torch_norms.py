"""Certified per-example squared norms of a linear map's per-example gradient ``A_i^T D_i``.

The maths every PyTorch layer rule shares (``torch_layers.py``, ``torch_rules/``,
``torch_attention.py``): the Gram route ``<A A^T, D D^T>`` or the formed route ``|A^T D|^2``,
chosen by the cost model (``cost.py``), computed in the operands' precision with an a-priori
rounding bound (``cost.Certified``), the examples whose bound is loose recomputed in float64;
sums of squares (a bias's, a table's rows') with theirs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import torch

from pergrad._src.capture import cost
from pergrad._src.capture.cost import gram_is_cheaper


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
      is ``|a|^2 |d|^2``; where ``cost.gram_is_cheaper`` (priced in the precision the Gram
      matrices would take) they give it in ``O(T^2 (p + q))`` (Li et al. 2021, "Large
      language models can be strong differentially private learners"), ``T x T`` blocks at
      a time so that their memory stays under
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
    # One dtype for both, at least float32: under autocast a user-level quantity's records come
    # as float32 inputs and bfloat16 output gradients, whose Gram matrix would be rounded in
    # bfloat16 while the bound assumed the inputs' unit roundoff.
    common = torch.promote_types(
        torch.promote_types(activations.dtype, output_grads.dtype), torch.float32
    )
    activations, output_grads = activations.to(common), output_grads.to(common)
    if positions == 1:
        return _one_position(activations, output_grads)
    if not cost.FAST_NORMS:
        return _uncertified(
            activations, output_grads, gram_is_cheaper(positions, width_in, width_out)
        )
    input_unit = _input_unit(activations)
    unit = unit_roundoff(activations.dtype)
    widths = (width_in, width_out)
    fast = cost.fast_gram_suffices(positions, widths, unit, input_unit, split=True)
    # the certified fast Gram route is priced as such (cost.FAST_GRAM_COST) where its bound
    # leaves room for cancellation (cost.fast_gram_priced), else at float64's crossover
    priced = cost.fast_gram_priced(positions, widths, unit, input_unit, split=True)
    gram = gram_is_cheaper(positions, width_in, width_out, priced)
    if gram and not fast and _has_float64(activations):
        # the fast precision could not certify a Gram sum tightly: float64, as before
        return _in_chunks(activations, output_grads, _gram_in, 0.0, wide=True)
    replay = _REPLAY.get()
    loose_count = None
    if replay is not None and _has_float64(activations):
        # this call's fast result from the deferred pass, and how many of its examples are
        # loose where the caller has read it (replayed)
        found, loose_count = next(replay)
    else:
        route = _gram_in if gram else _formed_in
        found = _in_chunks(activations, output_grads, route, input_unit)
    return _tightened(found, activations, output_grads, gram, loose_count)


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``: half its machine epsilon."""
    return torch.finfo(dtype).eps / 2


def matmul_input_unit(device: Any) -> float:
    """How much PyTorch's matrix products of float32 tensors round their inputs on ``device``
    under the current settings: 0 (IEEE float32), ``2**-11`` (TF32:
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"``, ``allow_tf32``, or
    ``torch.set_float32_matmul_precision("high")``) or ``2**-8`` (bfloat16: ``"medium"`` on a
    CPU). pergrad's own products run with these off (``rules.full_float32``), so inside them
    this is 0 (and the routes are priced in float32); a call outside them reads the user's."""
    cuda = torch.device(device).type == "cuda"
    backends = torch.backends
    backend = backends.cuda.matmul if cuda else getattr(backends.mkldnn, "matmul", None)
    setting = getattr(backend, "fp32_precision", None)
    if setting is None:  # torch < 2.9: the old API (whose getter raises once both were used)
        legacy = torch.get_float32_matmul_precision()
        if legacy == "medium":
            return 2.0**-8
        tf32 = cuda and bool(backends.cuda.matmul.allow_tf32)
        return 2.0**-11 if tf32 or legacy == "high" else 0.0
    if setting == "none":  # unset: the global default's
        setting = getattr(backends, "fp32_precision", "none")
    return {"bf16": 2.0**-8, "tf32": 2.0**-11}.get(setting, 0.0)


def _input_unit(x: torch.Tensor) -> float:
    """:func:`matmul_input_unit` for float32 operands; other dtypes are used as they are."""
    return matmul_input_unit(x.device) if x.dtype == torch.float32 else 0.0


def _has_float64(x: torch.Tensor) -> bool:
    return x.device.type != "mps"  # MPS has no float64: there the fast bound stands


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
    found: Any,
    activations: torch.Tensor,
    output_grads: torch.Tensor,
    gram: bool,
    loose_count: int | None = None,
) -> Any:
    """``found`` with the examples whose bound exceeds ``cost.ROUNDING_TOLERANCE`` of their
    estimate (positions that cancel) computed again from float64 copies of their records: by
    the Gram matrices where ``gram``, else formed. Nothing in float64 on MPS, which has none.

    Which examples those are is known on the device only. On a CPU, reading it costs nothing
    (every kernel has finished when it returns): only the loose examples are computed again,
    none in the usual case. On an accelerator, reading it would stall the host until the
    device catches up, once per layer: where every example again in float64 costs less than
    such a stall (``cost.tighten_without_sync``: small layers, whose kernels are too short to
    hide it) every example is computed again and the loose ones' values taken by a mask,
    without the host ever waiting; a larger layer's work hides the stall, and it is read.
    Within :func:`deferred_tightening` (a ghost step's norms) nothing is read here: the caller
    checks every layer's at once and runs a loose layer's rule again under :func:`replayed`,
    which gives ``loose_count``, the number of loose examples it read: their rows are then
    found on the device (:func:`first_rows`), without a read."""
    if not _has_float64(activations):
        return found
    deferred = _DEFERRED.get()
    if deferred is not None:  # checked later, with every other layer's (deferred_tightening)
        deferred.append(found)
        return found
    loose = _loose(found)
    route = _gram_in if gram else _formed_in
    if _without_sync(activations, output_grads):
        exact = _in_chunks(activations, output_grads, route, 0.0, wide=True)
        return cost.Certified(
            torch.where(loose, exact.estimate, found.estimate),
            torch.where(loose, exact.bound, found.bound),
        )
    if loose_count is None:
        if not bool(loose.any()):
            return found
        rows = loose.nonzero().squeeze(1)
    elif loose_count == 0:
        return found
    else:
        rows = first_rows(loose, loose_count)
    exact = _in_chunks(activations[rows], output_grads[rows], route, 0.0, wide=True)
    return cost.Certified(
        found.estimate.index_copy(0, rows, exact.estimate),
        found.bound.index_copy(0, rows, exact.bound),
    )


@contextlib.contextmanager
def deferred_tightening() -> Iterator[list[Any]]:
    """Within it, :func:`outer_product_squared_norms` tightens nothing: it returns each
    certified norm (a ``cost.Certified`` pair) as the fast precision gave it (``estimate +
    bound`` is already an upper bound of the exact squared norm, only a looser one) and appends
    it to the list this yields, so that the caller checks every layer's at once
    (:func:`loose_counts`, one host read a step: ``torch_quantities.squared_norms``) and tightens
    only the layers where some example's bound is loose (:func:`replayed`)."""
    found: list[Any] = []
    token = _DEFERRED.set(found)
    try:
        yield found
    finally:
        _DEFERRED.reset(token)


# The certified norms of the enclosing deferred_tightening, None outside one.
_DEFERRED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "pergrad_deferred_tightening", default=None
)


def first_rows(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the ``count`` true entries of the ``(B,)`` boolean ``mask``, ascending
    (``mask.nonzero().squeeze(1)``, where ``count`` is known on the host), found without a
    host read: a stable sort puts the true entries first, in their order."""
    return torch.sort(mask.logical_not().to(torch.uint8), stable=True).indices[:count]


@contextlib.contextmanager
def replayed(found: list[Any], loose_counts: list[int] | None = None) -> Iterator[None]:
    """Within it, :func:`outer_product_squared_norms` takes its fast-precision result from
    ``found`` (what :func:`deferred_tightening` collected from the same rule on the same
    records, in the order of its calls) instead of computing it again, and tightens it: a loose
    layer's second run costs only its float64 examples. ``loose_counts``: for each of
    ``found``, the number of its loose examples as the caller read them (:func:`loose_counts`),
    so that the tightening reads nothing; None: each reads its own, as outside."""
    counts = [None] * len(found) if loose_counts is None else loose_counts
    if len(counts) != len(found):
        raise ValueError(
            f"replayed: loose_counts must have one count per certified norm in found "
            f"({len(found)}); got {len(counts)}."
        )
    token = _REPLAY.set(zip(found, counts))
    try:
        yield
    finally:
        _REPLAY.reset(token)


_REPLAY: contextvars.ContextVar[Iterator[Any] | None] = contextvars.ContextVar(
    "pergrad_replayed_norms", default=None
)


def loose_counts(found: list[Any]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """How many examples of each certified norm in ``found`` (``cost.Certified`` pairs of
    ``(B,)`` tensors, or of one chunk's examples where a rule ran on chunks of the batch,
    ``widening.WIDENED_CHUNK_NUMBERS``; at least one) have a bound over
    ``cost.ROUNDING_TOLERANCE`` of their estimate, the test :func:`_tightened` makes: an
    ``int64`` tensor on the device, one count per pair, and the pairs' positions in ``found``
    in its order; with it, a 0-d boolean
    tensor: whether tightening those examples keeps every estimate finite (each one's upper
    bound ``estimate + bound``, above its exact norm, is under a quarter of its dtype's
    largest number, so the float64 value rounded back cannot overflow; a loose estimate is
    itself finite, since ``nan`` and ``inf`` compare false). The pairs of one dtype, device and
    length are checked together: a few kernels, whatever their number."""
    groups: dict[tuple[Any, Any, Any], list[int]] = {}
    for k, pair in enumerate(found):
        estimate = pair.estimate
        groups.setdefault((estimate.dtype, estimate.device, estimate.shape), []).append(k)
    counts, finite = [], []
    for (dtype, _, _), positions in groups.items():
        estimates = torch.stack([found[k].estimate for k in positions])
        bounds = torch.stack([found[k].bound for k in positions])
        loose = _loose(cost.Certified(estimates, bounds))
        counts.append(loose.sum(1))
        overflow = loose & ~(estimates + bounds < torch.finfo(dtype).max / 4)
        finite.append(overflow.any().logical_not())
    order = [k for positions in groups.values() for k in positions]
    device = counts[0].device
    if len(counts) == 1:
        return counts[0], finite[0], order
    return (
        torch.cat([c.to(device) for c in counts]),
        torch.stack([f.to(device) for f in finite]).all(),
        order,
    )


def _loose(found: Any) -> torch.Tensor:
    """``(B,)`` whether each example's bound exceeds ``cost.ROUNDING_TOLERANCE`` of its
    estimate: it is computed again in float64."""
    return found.bound > cost.ROUNDING_TOLERANCE * found.estimate


def _without_sync(activations: torch.Tensor, output_grads: torch.Tensor) -> bool:
    """``cost.tighten_without_sync`` for this layer's records (never on a CPU)."""
    if activations.device.type == "cpu":
        return False
    batch, groups, positions, width_in = activations.shape
    shape = cost.LayerWork("dense", positions, (width_in, output_grads.shape[-1]), groups, 0)
    return cost.tighten_without_sync(activations.device.type, batch * cost.layer_norm_work(shape))


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
    if wide:  # so are the float64 copies: GPT-2 small's LM head, 52 MB an example, took 0.58 s
        # a step copied into fresh ones (their page faults), 0.17 s into these
        wide_a = activations.new_empty((chunk, *activations.shape[1:]), dtype=torch.float64)
        wide_d = output_grads.new_empty((chunk, *output_grads.shape[1:]), dtype=torch.float64)
    pieces = []
    for a, d in zip(activations.split(chunk), output_grads.split(chunk)):
        if wide:
            rows = len(a)
            found = route(wide_a[:rows].copy_(a), wide_d[:rows].copy_(d), 0.0)
        else:
            found = route(a, d, input_unit)
        pieces.append(found.to(activations.dtype))
    if len(pieces) == 1:
        return pieces[0]
    return cost.Certified(
        torch.cat([p.estimate for p in pieces]), torch.cat([p.bound for p in pieces])
    )


# Per-example gradients formed for their norm (where the Gram route is dearer) are formed a few
# examples at a time, at most this many bytes. The low-memory mode computes a layer's norms in
# its backward hook while the whole graph is alive, so this buffer adds to its peak: 2**25
# formed all of BERT's 16 examples' 256 x 1024 gradients at once (16 MiB; ViT's 32 x 128 x
# 512: 8 MiB). benchmarks/dp_transformers.py, the low-memory mode's memory against the
# non-private step's: BERT T=128 B=16 1.20x -> 1.15x, ViT 1.21x -> 1.17x.
FORMED_BLOCK_BYTES = 2**22
# Gram matrices of a long sequence are formed in T x T blocks of at most this many bytes (the
# two matrices and the three of their bound, the whole chunk): T = 2048, B = 16 in one piece
# would be 1 GiB in float64.
GRAM_BLOCK_BYTES = 2**27


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``(B, G, T)`` each position's Euclidean norm ``|x_t|``."""
    return torch.linalg.vector_norm(x, dim=-1)


def _gram_in(a: torch.Tensor, d: torch.Tensor, input_unit: float) -> Any:
    """``sum_{t,s} (a_t . a_s)(d_t . d_s)`` per example for ``a (B, G, T, p)``, ``d (B, G, T,
    q)``, in their dtype over ``T x T`` blocks of at most :data:`GRAM_BLOCK_BYTES`, with its
    rounding bound.

    With ``A_ts = a_t . a_s`` computed within ``alpha |a_t| |a_s|`` (``alpha =
    cost.product_error(cost.gram_entry_length(p))``: a factor wider than
    ``cost.GRAM_SPLIT_WIDTH`` summed over slices of its width, :func:`_in_width_chunks`),
    ``D_ts`` within ``beta |d_t| |d_s|``, each product ``A D``
    rounded once and the products summed over ``s``, then ``t`` (and groups, and blocks), so
    that each passes through at most ``m`` additions:

    ``|sum - exact| <= gamma_(m+1) sum |A D| + alpha sum |a_t||a_s| |D_ts| + beta sum |A_ts|
    |d_t||d_s| + alpha beta (sum_t |a_t||d_t|)^2``,

    from the computed ``A``, ``D`` (their own rounding is in the last term). The bound's sums
    are of non-negative terms, each within ``gamma_k`` relatively: it is raised by ``2
    gamma_k`` for them. Where ``cost.coarse_gram_bound_suffices`` (short sequences, narrow
    layers: kernel-bound), the three sums take their Cauchy-Schwarz bounds instead, each at
    most ``(1 + alpha)(1 + beta) sum_g (sum_t |a_t||d_t|)^2``: no ``T x T`` matrix of the bound
    is formed, and the bound of an example whose positions do not cancel stays under
    ``cost.FAST_MARGIN`` of the tolerance (one that cancels is computed again). No underflow
    is assumed (its errors are absolute, below ``2**-126`` per operation in float32, far under
    any clipping bound).

    Both Gram matrices are symmetric, and so is their product: with ``cost.SYMMETRIC_GRAM``
    only the blocks on and above the diagonal are formed (:func:`symmetric_block`), each one
    above counted twice, its share of the bound's sums with it (doubling is exact, and each
    block's error is its own; the exact sum is the same whichever half is formed)."""
    batch, groups, positions = a.shape[:3]
    width_in, width_out = a.shape[-1], d.shape[-1]
    unit = unit_roundoff(a.dtype)
    alpha = cost.product_error(cost.gram_entry_length(width_in), unit, input_unit)
    beta = cost.product_error(cost.gram_entry_length(width_out), unit, input_unit)
    coarse = cost.coarse_gram_bound_suffices(
        positions, (width_in, width_out), unit, input_unit, split=True
    )
    # a wide factor's Gram matrices as sums over chunks of its width (cost.gram_chunks)
    chunked = [_in_width_chunks(x) for x in (d, a)]
    slices = max((pieces.shape[2] for pieces in chunked if pieces is not None), default=0)
    # (4 or 1, B): the sum, then sum |A D|, sum |a_t||a_s| |D_ts| and sum |A_ts| |d_t||d_s|
    # (not needed for a coarse bound), each block's matrices written side by side and reduced
    # by one nested sum: a third of the kernels of reducing each alone (small layers are
    # kernel-bound)
    count = 1 if coarse else 4
    # the two Gram matrices, the bound's, and a chunked one's terms before they are summed
    per_entry = (2 + count + slices) * batch * groups * a.element_size()
    block = max(1, min(positions, int((GRAM_BLOCK_BYTES / per_entry) ** 0.5)))
    symmetric = cost.SYMMETRIC_GRAM
    if symmetric:
        block = min(block, symmetric_block(positions))
    blocks = -(-positions // block)
    # (2, B, G, T): |a_t| and |d_t| side by side, and each block's Gram matrices D then A, so
    # that the bound's two outer products and their two products are one kernel each
    norms = a.new_empty((2, batch, groups, positions))
    torch.linalg.vector_norm(a, dim=-1, out=norms[0])
    torch.linalg.vector_norm(d, dim=-1, out=norms[1])
    sums = None
    for start in range(0, positions, block):
        rows = slice(start, start + block)
        # both Gram matrices are symmetric, so is their product: a block below the diagonal
        # equals the transpose of its mirror's (exactly, not as computed), and the blocks above
        # it count twice (the bound's sums with them: each block's error is its own)
        for other in range(start if symmetric else 0, positions, block):
            cols = slice(other, other + block)
            size = (min(block, positions - start), min(block, positions - other))
            grams = a.new_empty((2, batch, groups, *size))
            for k, (x, pieces) in enumerate(zip((d, a), chunked)):
                if pieces is None:
                    torch.matmul(x[:, :, rows], x[:, :, cols].transpose(-1, -2), out=grams[k])
                else:  # (B, G, n, r, c) terms, summed over the n chunks in any order
                    terms = torch.matmul(pieces[:, :, :, rows], pieces[:, :, :, cols].mT)
                    torch.sum(terms, dim=2, out=grams[k])
            parts = grams.new_empty((count, *grams.shape[1:]))
            torch.mul(grams[1], grams[0], out=parts[0])
            if not coarse:
                torch.abs(parts[0], out=parts[1])
                # |a_t||a_s| |D_ts| and |d_t||d_s| |A_ts|
                torch.mul(norms[:, :, :, rows, None], norms[:, :, :, None, cols], out=parts[2:])
                parts[2:].mul_(grams.abs_())
            found = _nested_sum(parts)
            if other != start and symmetric:
                found.mul_(2)  # exact in binary floating point
            sums = found if sums is None else sums.add_(found)
    assert sums is not None
    depth = 2 * block + groups + blocks * blocks
    terms = torch.linalg.vecdot(norms[0], norms[1])  # (B, G): sum_t |a_t| |d_t|
    raised = 1 + 2 * cost.gamma(depth + 2 * (width_in + width_out + positions) + 16, unit)
    summed = cost.gamma(depth + 1, unit)
    if coarse:  # |A_ts| <= (1 + alpha) |a_t||a_s|, |D_ts| <= (1 + beta) |d_t||d_s|
        share = summed * (1 + alpha) * (1 + beta) + alpha * (1 + beta) + beta * (1 + alpha)
        bound = torch.linalg.vecdot(terms, terms).mul_((share + alpha * beta) * raised)
        return cost.Certified(sums[0].clamp_min(0), bound)
    bound = torch.linalg.vecdot(terms, terms).mul_(alpha * beta * raised)
    bound.add_(sums[1], alpha=summed * raised)
    bound.add_(sums[2], alpha=alpha * raised).add_(sums[3], alpha=beta * raised)
    return cost.Certified(sums[0].clamp_min(0), bound)


def _in_width_chunks(x: torch.Tensor) -> torch.Tensor | None:
    """``x (B, G, T, w)`` as ``(B, G, n, T, c)``: its width in ``n`` chunks of ``c``
    (``cost.gram_chunks``; the last padded with zeros, which add nothing to a dot product), or
    None where the width stays whole. One copy of ``x``; each ``T x T`` block of its Gram
    matrix is then ``n`` products of ``c``-wide slices, summed."""
    batch, groups, positions, width = x.shape
    chunk, count = cost.gram_chunks(width)
    if count == 1:
        return None
    full = width // chunk
    make = x.new_empty if full == count else x.new_zeros
    pieces = make((batch, groups, count, positions, chunk))
    pieces[:, :, :full].copy_(x[..., : full * chunk].unflatten(-1, (full, chunk)).transpose(2, 3))
    if full < count:
        pieces[:, :, full, :, : width - full * chunk].copy_(x[..., full * chunk :])
    return pieces


def symmetric_block(positions: int) -> int:
    """The side of the ``T x T`` blocks of the symmetric Gram route (``cost.SYMMETRIC_GRAM``):
    ``T`` in ``k = max(2, round(T / SYMMETRIC_BLOCK))`` nearly equal blocks, of which the
    ``k (k + 1) / 2`` on and above the diagonal are formed (``(k + 1) / 2k`` of the products:
    3/4 at ``k = 2``); under 2 * ``SYMMETRIC_MIN_BLOCK`` positions, one block (small products
    lose more to their overhead than they save)."""
    if positions < 2 * SYMMETRIC_MIN_BLOCK:
        return positions
    k = max(2, round(positions / SYMMETRIC_BLOCK))
    return -(-positions // k)


# The symmetric Gram route's block side, about (symmetric_block)...
SYMMETRIC_BLOCK = 128
# ... and its least: shorter blocks' products run too far below the matrix units' speed
# (2-core CPU: split in blocks of 32 or 33, sequences of 64 and 65 saved nothing measurable,
# 0.98-1.13x; benchmarks/results/cpu/gram_precision.md: two blocks of 64, 0.73-0.95x one of 128;
# 2 of 128, 0.85x; 4, 0.79x one of 512; 8, 0.65-0.66x one of 1024).
# The cost model still prices the route at every block's work (cost.gram_is_cheaper): a
# Gram route it takes runs faster than priced, never slower.
SYMMETRIC_MIN_BLOCK = 64


def _nested_sum(x: torch.Tensor) -> torch.Tensor:
    """``(..., B, G, R, C) -> (..., B)``, over columns, then rows, then groups: every term passes
    through at most ``C + R + G`` additions, whatever order each reduction takes."""
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
    unit = unit_roundoff(a.dtype)
    dtype = torch.promote_types(a.dtype, d.dtype) if buffer is None else buffer.dtype
    out = None if buffer is None else buffer[: len(a)]
    formed = torch.matmul(a.transpose(-1, -2).to(dtype), d.to(dtype), out=out)
    squared = _nested_sum(formed.square_())
    theta = cost.product_error(positions, unit, input_unit)
    terms = torch.linalg.vecdot(magnitudes(a), magnitudes(d))  # (B, G)
    error = torch.linalg.vector_norm(terms, dim=-1).mul_(theta)
    return certified_sum_of_squares(squared, error, width_in + width_out + groups + positions)


def certified_sum_of_squares(squared: torch.Tensor, error: torch.Tensor, depth: int) -> Any:
    """The certified squared norm of a computed vector ``v'`` whose squares were summed into
    ``squared`` (each term through at most ``depth`` additions) and which is within ``error``
    (Euclidean) of the exact one: ``(sqrt(squared (1 + 2 gamma)) + error)^2 - squared``,
    raised by ``2 gamma`` for its own rounding."""
    unit = unit_roundoff(squared.dtype)
    relative = cost.gamma(depth + 1, unit)
    raised = 1 + 2 * cost.gamma(2 * depth + 16, unit)
    # (r + e)^2 - s with r = sqrt(s (1 + 2 gamma)), expanded: e (2 r + e) + 2 gamma s, a sum of
    # non-negative terms (no cancellation, so no clamp), in five kernels
    twice_root = squared.mul(4 * (1 + 2 * relative)).sqrt_().add_(error)
    scaled = squared.mul(2 * relative * raised + 4 * unit)
    return cost.Certified(squared, torch.addcmul(scaled, error, twice_root, value=raised))


def formed_squared_norms(grads: torch.Tensor) -> Any:
    """``|g_b|^2`` of formed ``(B, *shape)`` per-example gradients, certified as the squared
    norms of exactly these numbers (what a clipped sum of them adds, ``capture/torch_held.py``):
    in float32 at least, each axis split in two where its length factors
    (``cost.split_axes``), summed over the last axis (a dot product), then over the one before,
    and so on, so that each square passes through at most the sum of the split axes' lengths of
    additions (one sum over all ``p q`` numbers could take ``p q``: a bound of 1% at a
    million; ``(256, 8192)`` goes through 224)."""
    axes = cost.split_axes(tuple(grads.shape[1:]))
    x = grads.to(torch.promote_types(grads.dtype, torch.float32)).reshape(grads.shape[0], *axes)
    if x.dim() == 1:
        squared, depth = x * x, 1
    else:
        squared, depth = torch.linalg.vecdot(x, x), sum(axes)
        while squared.dim() > 1:
            squared = squared.sum(-1)
    return certified_sum_of_squares(squared, squared.new_zeros(()), depth)


def summed_squared_norms(terms: torch.Tensor) -> Any:
    """``|sum_t terms[b, t]|^2`` per example for ``terms (B, T, q)`` (a bias's gradient: the
    output gradients summed over positions), certified: the sum of ``T`` terms is within
    ``gamma_T sum_t |terms_t|`` of the exact one, which cancelling positions make large next to
    the norm. A plain tensor where ``cost.FAST_NORMS`` is off."""
    squared = squared_norms_of(terms.sum(1))
    if not cost.FAST_NORMS:
        return squared
    positions, width = terms.shape[1], terms.shape[-1]
    error = cost.gamma(positions, unit_roundoff(terms.dtype)) * magnitudes(terms).sum(-1)
    return certified_sum_of_squares(squared, error, width + positions)


def squared_norms_of(per_example: torch.Tensor) -> torch.Tensor:
    """``(B, ...)`` per-example gradients of one parameter -> ``(B,)`` squared norms."""
    return (per_example**2).reshape(per_example.shape[0], -1).sum(1)
