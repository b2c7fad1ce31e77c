"""Checks that establish, on a layout's first call, what the PyTorch capture assumes.

The hooks and ghost strategies run the model once on the whole batch and read each layer's input
and output gradient as if axis 0 held the examples: row ``b`` of a layer's output gradient is
taken to be example ``b``'s, and the layer's rule reduces over the other axes. Shapes alone
cannot establish that (a layer run time-first on a ``(T, B, D)`` input with ``T == B`` has the
batch size on axis 0, and its rows are time steps), so the capture's acceptance of a layer is
only a first filter; these checks decide:

- :func:`check_rows`: each captured output gradient is *row-local*: the loss of example ``b``
  reaches row ``b`` of the output and no other row. With that, a rule that treats axis 0
  independently (every layer rule does: linear maps, convolutions over their batch axis,
  lookups, norms over trailing axes) gives each example exactly its gradient, whatever the
  layer's input looks like. Tested by a second backward pass of ``sum_b w_b loss_b``: row-local
  gradients are then ``w_b`` times the first pass's row ``b``; the weights are spread
  geometrically over three decades, so any two examples' weights differ by at least
  ``1000 ** (1 / (B - 1)) - 1`` (2.7% at ``B = 256``), far above the tolerance, and a row that
  belongs to another example (a permutation) or mixes several is caught.
- :func:`check_losses_alone`: the batched pass gives each example the loss it gets when run
  alone (the definition of a per-example gradient), which catches examples that interact (batch
  statistics, a branch on a batch-wide value), a model output whose axis 0 is not the batch, and
  a capture that changed what the model computes (the broadcast of shared position ids).

Both run on the first call of each layout: :func:`layout_key` (parameter names and the shapes
and dtypes of every argument) with the shapes of every record the pass captured
(:func:`records_signature`), each dimension equal to the batch size marked as the batch. One
check then covers every batch size of the same layout (Poisson sampling draws a new one each
step), while a coincidence like ``T == B`` (a time-first layer's axis 0 taken for the batch)
changes the marks and is checked again. A training loop pays them once per layout: one more
backward pass and a few forward passes of one example. A single example's checks cover single
examples only (its rows cannot be told apart).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pergrad._src.capture.rules import full_float32
from pergrad._src.errors import Unsupported


@dataclass(frozen=True)
class Tolerance:
    """A first-call check's tolerance by the dtype whose rounding its operands carry."""

    float64: float
    float32: float
    lower: float  # bfloat16 / float16 (under autocast), or anything else

    def of(self, dtype: torch.dtype) -> float:
        if dtype == torch.float64:
            return self.float64
        return self.float32 if dtype == torch.float32 else self.lower


# Every first-call check of the PyTorch kernel and of the hooks strategy, and its tolerance
# (relative to the scale each check names), in one table.
TOLERANCES = {
    # a layer's output-gradient rows against the weighted run's (torch_checks.rows_match), and
    # the absolute part as a share of the record's largest row
    "rows": Tolerance(1e-7, 1e-3, 3e-2),
    "rows_absolute": Tolerance(1e-10, 1e-5, 1e-3),
    # an example's loss run alone against its row of the batch (torch_checks)
    "loss_alone": Tolerance(1e-7, 1e-3, 1e-2),
    # hooks: |sum_i g_i - batch gradient| at the scale sqrt(B sum_i |g_i|^2), a bound on the
    # summation's rounding (sum_i |g_i| <= sqrt(B sum_i |g_i|^2)) times a few ulps
    "gradient_sum": Tolerance(1e-9, 1e-4, 1e-2),
    # hooks: example 0's gradient run alone against its per-example gradient
    "gradient_alone": Tolerance(1e-7, 1e-3, 1e-2),
    # ghost: the slack of |sum_i g_i|^2 <= B sum_i |g_i|^2 for rounding (under autocast, the
    # norms come from the records and the batch gradient was rounded) (torch_verify)
    "norms_consistency": Tolerance(1e-3, 1e-3, 3e-2),
    # generic units: sum_i g_i against the batch gradient (torch_generic); a unit taken along
    # the wrong axis is off by O(1), bfloat16's rounding of the two by ~1e-2
    "unit_sum": Tolerance(1e-3, 1e-3, 3e-2),
}

# How many examples the first call runs alone: enough to catch a model output split along the
# wrong axis or examples that interact, at the cost of a few forward passes of one example.
LOSS_CHECKS = 8


@dataclass(kw_only=True)
class GradientSlot:
    """Where a record keeps the gradient at a captured output: ``receive`` is the tensor
    hook's. :func:`check_rows` sets ``watch`` for its second backward pass, which then goes to
    ``watch`` instead, and ``output_grad`` keeps the first pass's."""

    output_grad: torch.Tensor | None = None
    watch: Callable[[torch.Tensor], None] | None = None

    def receive(self, grad: torch.Tensor) -> None:
        """The output gradient of a backward pass (the tensor hook's)."""
        if self.watch is not None:
            self.watch(grad)
        else:
            self.output_grad = grad


def checked_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype whose rounding ``x`` carries, for the tolerances: under ``torch.autocast`` a
    float32 tensor may come out of bfloat16 / float16 arithmetic (the gradient of a cast)."""
    device_type = x.device.type
    autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
    return (
        torch.get_autocast_dtype(device_type) if autocast and x.dtype == torch.float32 else x.dtype
    )


def layout_key(params: Iterable[str], arguments: Iterable[Any], batch_size: int) -> tuple[Any, ...]:
    """What the checks are valid for, before the model runs: the parameter names and each
    tensor argument's shape (each dimension equal to ``batch_size`` marked, :func:`marked`)
    and dtype."""
    shapes = tuple(
        (marked(x.shape, batch_size), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        for x in arguments
    )
    return (frozenset(params), shapes)


#: a dimension equal to the batch size, in a layout's shapes
BATCH = "B"


def marked(shape: Iterable[int], batch_size: int) -> tuple[Any, ...]:
    """``shape`` with each dimension equal to ``batch_size`` replaced by :data:`BATCH`."""
    return tuple(BATCH if d == batch_size else d for d in shape)


# record fields that do not describe the layout: gradients, and version counters (a parameter
# recorded as an input is bumped by every optimizer step)
_UNSHAPED = frozenset({"output_grad", "watch", "input_versions", "output_version"})


def records_signature(records: dict[str, list[Any]], batch_size: int) -> tuple[Any, ...]:
    """The shapes (batch size marked), dtypes and flags of everything a pass recorded, layer by
    layer and call by call: two passes with the same signature hooked the same layers the
    same number of times on inputs laid out the same way, whatever their batch sizes. A
    single example's signature is its own (its rows are not checked: every row is its own, so
    its checks cover no other batch size)."""
    return (batch_size == 1,) + tuple(
        (name, tuple(_signature(r, batch_size) for r in calls))
        for name, calls in sorted(records.items())
    )


def _signature(x: Any, batch_size: int) -> Any:
    kind = type(x)
    if kind is torch.Tensor or isinstance(x, torch.Tensor):
        return (marked(x.shape, batch_size), x.dtype, x.requires_grad)
    if x is None or kind in _PLAIN:
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_signature(v, batch_size) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v, batch_size)) for k, v in x.items())
    names = _shaped_fields(kind)
    if names is not None:
        return (kind.__name__, tuple(_signature(getattr(x, name), batch_size) for name in names))
    return x if isinstance(x, (bool, int, float, str)) else kind.__name__


# Python's plain values, which describe themselves (their subclasses are asked with isinstance)
_PLAIN = frozenset({bool, int, float, str})


@functools.cache
def _shaped_fields(kind: type) -> tuple[str, ...] | None:
    """A dataclass's fields that describe the layout (not in ``_UNSHAPED``), or None for any
    other class. Records are a few dataclasses, signed a few dozen times a call: asked once
    per class (``dataclasses.fields`` costs a microsecond a record)."""
    if not dataclasses.is_dataclass(kind):
        return None
    return tuple(f.name for f in dataclasses.fields(kind) if f.name not in _UNSHAPED)


def is_checked(loss: Any, schedule: str, key: tuple[Any, ...], signature: tuple[Any, ...]) -> bool:
    """Whether ``schedule`` (``"ghost"``, ``"hooks"``) has checked layout ``key`` with records
    of ``signature`` (:func:`records_signature`) of ``loss`` (a :func:`pergrad.module_loss`):
    the one place where checked layouts are remembered, on the loss, so every wrapper of the
    same model shares them."""
    return (schedule, key, signature) in loss.checked_layouts


def has_checked(loss: Any, schedule: str, key: tuple[Any, ...]) -> bool:
    """Whether ``schedule`` has checked layout ``key`` with any records (the hooks strategy
    then runs light and confirms the records' signature after the forward pass)."""
    return any(entry[:2] == (schedule, key) for entry in loss.checked_layouts)


def mark_checked(
    loss: Any, schedule: str, key: tuple[Any, ...], signature: tuple[Any, ...]
) -> None:
    """Remember that ``schedule``'s first-call checks of layout ``key`` with records of
    ``signature`` passed."""
    loss.checked_layouts.add((schedule, key, signature))


def row_weights(batch_size: int, like: torch.Tensor) -> torch.Tensor:
    """``(B,)`` weights from 1 down to 1/1000 (1/16 below float32), geometrically spaced. At
    most 1, so the weighted pass cannot overflow where the plain one did not (float16 records
    of a loss scaled by a ``GradScaler`` sit close to 65504)."""
    spread = 1000.0 if like.dtype in (torch.float32, torch.float64) else 16.0
    steps = -torch.arange(batch_size, dtype=torch.float64) / max(batch_size - 1, 1)
    return (spread**steps).to(device=like.device, dtype=like.dtype)


@dataclass(frozen=True)
class RowSummary:
    """What :func:`check_rows` keeps of an output gradient that was released after the first
    pass (the low-memory ghost strategy): three numbers per row, each linear in the row
    (its norm is, for the positive weights the check uses), see :func:`summarize_rows`.

    Attributes:
      values: ``(B, 3)``.
      dtype: the gradient's dtype, whose rounding the tolerance allows for.
    """

    values: torch.Tensor
    dtype: torch.dtype


@full_float32()  # TF32 would round the summaries past the checks' float32 tolerances
def summarize_rows(grad: torch.Tensor) -> RowSummary:
    """Each row's norm, sum, and inner product with a fixed ramp (``-1 .. 1`` over the row),
    ``(B, 3)``, read :data:`ROW_BLOCK_NUMBERS` numbers at a time.

    A row-local weighted gradient scales all three by the row's weight; a row that belongs to
    another example, or mixes several, keeps them in that ratio only by coincidence. The ramp
    is deterministic: the check draws no random numbers from the user's generators."""
    rows = grad.detach().flatten(1)
    wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
    ramp = torch.linspace(-1.0, 1.0, rows.shape[1], dtype=wide, device=rows.device)
    blocks = []
    for block in rows.split(_rows_per_block(rows)):
        block = block.to(wide)
        blocks.append(
            torch.stack([torch.linalg.vector_norm(block, dim=1), block.sum(1), block @ ramp], 1)
        )
    values = torch.cat(blocks) if blocks else rows.new_zeros((0, 3), dtype=wide)
    return RowSummary(values, checked_dtype(grad))


# Within this relative error of each row's norm, a second backward pass through the same graph
# reproduces the first's output gradient (float32 rounding: for non-deterministic kernels).
_SAME_ROWS_TOLERANCE = 1e-6


def same_rows(first: RowSummary, grad: torch.Tensor) -> bool:
    """Whether ``grad`` is the gradient ``first`` summarises, row by row, to within float32
    rounding of the row's norm: equal wherever the backward pass is deterministic. (The
    low-memory ghost strategy's second pass must give the first's gradients: its sums must
    come from the gradients its norms did.)"""
    second = summarize_rows(grad).values
    if second.shape != first.values.shape:
        return False
    finite = torch.isfinite(first.values)
    if not torch.equal(finite, torch.isfinite(second)):
        return False
    error = torch.where(finite, second - first.values, 0.0).abs().amax(1)
    size = torch.where(finite, first.values, 0.0)[:, 0].abs()
    return bool((error <= _SAME_ROWS_TOLERANCE * size + 1e-30).all())


def check_rows(
    records: dict[str, list[Any]],
    weighted_backward: Callable[[torch.Tensor], None],
    weights: torch.Tensor,
    summaries: dict[int, RowSummary] | None = None,
) -> None:
    """Raise :class:`Unsupported` unless every record's output gradient is row-local.

    Args:
      records: layer name -> its call records, each with an ``output_grad`` ``(B, ...)`` (or
        None) from the backward pass of ``sum_b loss_b`` and a ``watch`` slot that its tensor
        hook hands later gradients to (``torch_engine.LayerRecord.receive``). Left as they were.
      weighted_backward: runs the backward pass of ``sum_b weights[b] * loss_b`` through the
        same graph, so that the records' tensor hooks fire again (or, where reentrant
        checkpointing reruns the forward pass inside the backward pass, so that new records
        are appended, in the same order; they are removed again).
      weights: ``(B,)``, as :func:`row_weights` gives.
      summaries: ``id(record) -> RowSummary`` for records whose first-pass gradient was
        released (``output_grad`` None): compared through their summaries.

    Each weighted gradient is compared as its hook receives it and then dropped, so the pass
    holds one layer's second gradient at a time, not a second copy of every record's.
    """
    summaries = summaries or {}
    plain = {
        name: [(r, summaries.get(id(r), r.output_grad)) for r in rs] for name, rs in records.items()
    }
    seen: set[int] = set()
    problems: list[str] = []

    def watcher(name: str, record: Any, first: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def watch(second: torch.Tensor) -> None:
            seen.add(id(record))
            if not problems and not _row_local(first, second, weights):
                problems.append(name)

        return watch

    for name, before in plain.items():
        for record, first in before:
            if first is not None:
                record.watch = watcher(name, record, first)
    try:
        weighted_backward(weights)
        if problems:
            raise Unsupported(_row_problem(problems[0]))
        for name, before in plain.items():
            reached = [(r, first) for r, first in before if first is not None]
            # Reentrant checkpointing reruns the forward pass inside the backward pass: its
            # new records, in order, pair with the first ones (whose hooks did not fire).
            rerun = [r.output_grad for r in records[name][len(before) :]]
            rerun = [g for g in rerun if g is not None]
            if rerun:
                if len(rerun) != len(reached):
                    raise Unsupported(_row_problem(name))
                for (_, first), second in zip(reached, rerun):
                    if not _row_local(first, second, weights):
                        raise Unsupported(_row_problem(name))
            elif any(id(r) not in seen for r, _ in reached):
                raise Unsupported(_row_problem(name))
    finally:
        for name, before in plain.items():
            del records[name][len(before) :]
            for record, first in before:
                record.watch = None
                record.output_grad = None if isinstance(first, RowSummary) else first


def weighted_summaries(
    records: dict[str, list[Any]],
    weighted_backward: Callable[[torch.Tensor], None],
    weights: torch.Tensor,
) -> dict[str, list[RowSummary | None]]:
    """The first half of a row check run before the plain pass: each record's summary of its
    output gradient of ``sum_b weights[b] * loss_b`` (None where none reached it), by name, in
    the order of the calls, each gradient summarised as its hook hands it over and dropped.
    :func:`check_rows_against` compares the plain pass's records with them."""
    found: dict[str, list[RowSummary | None]] = {n: [None] * len(rs) for n, rs in records.items()}

    def watcher(summaries: list[RowSummary | None], k: int) -> Callable[[torch.Tensor], None]:
        def watch(grad: torch.Tensor) -> None:
            summaries[k] = summarize_rows(grad)

        return watch

    for name, rs in records.items():
        for k, record in enumerate(rs):
            record.watch = watcher(found[name], k)
    try:
        weighted_backward(weights)
    finally:
        for rs in records.values():
            for record in rs:
                record.watch = None
    return found


def check_rows_against(
    records: dict[str, list[Any]],
    weighted: dict[str, list[RowSummary | None]],
    weights: torch.Tensor,
    summaries: dict[int, RowSummary] | None = None,
) -> None:
    """Raise :class:`Unsupported` unless every record's output gradient (of
    ``sum_b loss_b``, a later run of the same batch) is row-local: row ``b`` times
    ``weights[b]`` must be what :func:`weighted_summaries` summarised of the weighted run's
    gradient at the same call. ``summaries``: ``id(record) -> RowSummary`` for records whose
    gradient was released (``output_grad`` None). The same test as :func:`check_rows`, the
    two backward passes in two runs, so that neither keeps its graph for the other."""
    summaries = summaries or {}
    for name, rs in records.items():
        if len(rs) != len(weighted.get(name, ())):
            raise Unsupported(
                f"run a second time on the same batch, the model called layer {name!r} "
                f"another number of times: the ghost strategy cannot check where the batch is"
            )
        for record, second in zip(rs, weighted[name]):
            first = summaries.get(id(record))
            if first is None and record.output_grad is not None:
                first = summarize_rows(record.output_grad)
            if first is None:  # no gradient reached this call: nothing to place
                continue
            if second is None or not rows_match(
                second.values, first.values, divide_by=weights, dtype=first.dtype
            ):
                raise Unsupported(_row_problem(name))


def records_finite(
    records: dict[str, list[Any]], summaries: dict[int, RowSummary] | None = None
) -> bool:
    """Whether every captured output gradient (or, for a released one, its summary: a row
    norm is finite only where the row is) is finite: an overflowing pass (float16 under too
    large a loss scale) says nothing about where the batch is, so it is not checked."""
    return all(
        all_finite(r.output_grad)
        for rs in records.values()
        for r in rs
        if r.output_grad is not None
    ) and all(bool(torch.isfinite(s.values).all()) for s in (summaries or {}).values())


def all_finite(x: torch.Tensor) -> bool:
    """``torch.isfinite(x).all()`` for ``(B, ...)``, a block of rows at a time."""
    return all(bool(torch.isfinite(block).all()) for block in x.split(_rows_per_block(x)))


def _row_problem(name: str) -> str:
    return (
        f"the loss of one example depends on rows of layer {name!r}'s output that belong to "
        f"other examples: axis 0 has the batch size but does not hold the batch (a time-first "
        f"or permuted layout, an input shared by the batch), or the examples interact"
    )


def _row_local(
    first: torch.Tensor | RowSummary, weighted: torch.Tensor, weights: torch.Tensor
) -> bool:
    """Whether ``weighted`` (a layer's output gradient of ``sum_b weights[b] loss_b``) is row
    ``b`` of ``first`` (of ``sum_b loss_b``, or its summary) times ``weights[b]``, for every
    ``b``."""
    if isinstance(first, RowSummary):
        got = summarize_rows(weighted).values
        return rows_match(got, first.values, divide_by=weights, dtype=first.dtype)
    return rows_match(weighted.detach().flatten(1), first.detach().flatten(1), divide_by=weights)


# rows_match reads its rows this many numbers at a time: an LM head's output gradient (B x T x
# V) compared whole would take several copies of it in float64 on a layout's first call.
ROW_BLOCK_NUMBERS = 2**22


def _rows_per_block(x: torch.Tensor) -> int:
    """How many rows of ``(B, ...)`` make a block of at most :data:`ROW_BLOCK_NUMBERS` numbers
    (at least one row)."""
    return max(1, ROW_BLOCK_NUMBERS // max(1, x[0].numel()))


@full_float32()
def rows_match(
    got: torch.Tensor,
    want: torch.Tensor,
    divide_by: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether ``(B, n)`` rows agree, each within the dtype's tolerance of its norm (plus a
    share of the largest row's, for rows that cancel to rounding noise), row ``b`` of ``got``
    divided by ``divide_by[b]`` first if given; the tolerance is ``dtype``'s (default: the one
    whose rounding ``want`` carries). Entries that are not finite (an example with a nan
    input, which a clipped sum zeroes) must be so in both: they are compared by where they
    are, the others by value. Read :data:`ROW_BLOCK_NUMBERS` numbers at a time."""
    checked = dtype or checked_dtype(want)
    relative = TOLERANCES["rows"].of(checked)
    absolute = TOLERANCES["rows_absolute"].of(checked)
    rows = _rows_per_block(want)
    errors, sizes = [], []
    for start in range(0, want.shape[0], rows):
        got_rows, want_rows = got[start : start + rows], want[start : start + rows]
        if divide_by is not None:
            scale = divide_by[start : start + rows].to(want_rows.dtype).unsqueeze(1)
            got_rows = got_rows / scale
        finite = torch.isfinite(want_rows)
        if not torch.equal(finite, torch.isfinite(got_rows)):
            return False
        if not bool(finite.all()):
            got_rows = torch.where(finite, got_rows, 0.0)
            want_rows = torch.where(finite, want_rows, 0.0)
        errors.append(torch.linalg.vector_norm((got_rows - want_rows).double(), dim=1))
        sizes.append(torch.linalg.vector_norm(want_rows.double(), dim=1))
    error, size = torch.cat(errors), torch.cat(sizes)
    return bool((error <= relative * size + absolute * size.max()).all())


def check_losses_alone(
    single: Callable[[tuple[Any, ...], tuple[Any, ...]], Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    losses: torch.Tensor,
    count: int,
) -> int | None:
    """The first example among the first ``count`` whose loss alone differs from its batched
    loss, or None. ``single(diff_values, example)`` is the loss of one example."""
    # A loss that cancels to rounding noise (cross-entropy of a confident, right prediction)
    # is judged at the scale of the batch's largest loss.
    floor = 64 * torch.finfo(checked_dtype(losses)).eps * float(losses.detach().abs().max())
    with torch.no_grad():
        for index in range(min(count, losses.shape[0])):
            alone = single(diff_values, tuple(v[index] for v in batched_values))
            if not close(losses[index], alone, "loss_alone", floor):
                return index
    return None


def close(got: torch.Tensor, want: torch.Tensor, check: str, floor: float = 0.0) -> bool:
    """``|got - want| <= TOLERANCES[check] * |want| + floor`` (norms)."""
    scale = torch.linalg.vector_norm(want) + torch.finfo(want.dtype).tiny
    error = torch.linalg.vector_norm(got - want)
    return bool(error <= TOLERANCES[check].of(checked_dtype(want)) * scale + floor)
