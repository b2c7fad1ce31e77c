"""A layer rule's records widened to float32: whole, or a chunk of examples at a time.

Every registered rule's reductions compute in at least float32 (``rules.py``): a bfloat16 or
float16 call (a bfloat16 model, FSDP2's ``MixedPrecisionPolicy``, ``torch.autocast``) is copied
to float32 first. Widened whole, an LM head's vocabulary-wide output gradients ``(B, T, V)``
become a float32 copy twice their size on top of a DP step's peak (issue 36); past
:data:`WIDENED_WHOLE_NUMBERS` numbers, :func:`call_widened` widens and reduces a chunk of
examples at a time instead, where slicing the examples is provably what slicing axis 0 does,
and combines the chunks: per-example values (squared norms, certified pairs included, and
per-example gradients) side by side, weighted sums (the weights sliced to match) added up. A
float32 or float64 call has nothing to widen: it runs whole, as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from pergrad._src.capture.cost import Certified

# A rule call whose float32 copies of its bfloat16 / float16 records would hold more numbers
# than WIDENED_WHOLE_NUMBERS (64 MiB of float32) is widened and reduced a chunk of examples at
# a time, each chunk about WIDENED_CHUNK_NUMBERS (a bfloat16 GPT-2's DP step with FSDP2 over 2
# processes, 4 x 128 tokens each, vocabulary 32768, 16.8 M numbers to widen, peaked at 146 MiB
# widened whole, 129 MiB in chunks, the non-private step at 90, for about 8% more time;
# benchmarks/results/cpu/fsdp_memory_bf16*.md). Below it chunks bought no memory where
# measured (vocabulary 8192: the float32 copy does not set the peak) and cost about 5% of the
# step's time. 2**20 numbers a chunk, 4 MiB of float32, as the blocks
# the norms form (torch_norms.FORMED_BLOCK_BYTES): small next to the records worth chunking,
# and at least half a million numbers of work a chunk, which outweighs the rule's kernels
# launched again.
WIDENED_WHOLE_NUMBERS = 2**24
WIDENED_CHUNK_NUMBERS = 2**20
# At most this many chunks (unless an example is larger than a chunk): a large batch of small
# examples would otherwise launch the rule's kernels thousands of times. The float32 copy held
# at once is then the largest of about 2**20 numbers, one example's and 1/16 of the call's.
MAX_WIDENED_CHUNKS = 16


def call_widened(
    fn: Callable[..., dict[str, Any]],
    layer: Any,
    calls: list[Any],
    args: tuple[Any, ...],
    sum_size: Callable[[], int] | None = None,
) -> dict[str, Any]:
    """``fn(layer, calls, *args)`` on the calls and ``args`` widened to float32, whole or a
    chunk of examples at a time (:func:`_examples_per_chunk`); the values in ``fn``'s dtype.

    ``sum_size``: ``fn`` gives weighted sums (``args``: the ``(B,)`` weights), added up over
    the chunks, of ``sum_size()`` numbers in all (the layer's reduced parameters; asked only
    where chunks are considered); None: it gives per-example values ``(B, ...)``, put side by
    side."""
    if not any(map(_is_narrow_float, _records_and(calls, args))):
        return fn(layer, calls, *args)  # nothing to widen (float32, float64: most calls)
    chunk = _examples_per_chunk(calls, args, sum_size)
    if chunk is None:
        return fn(layer, widened_calls(calls), *(widen(a) for a in args))
    return _chunked(fn, layer, calls, args, chunk, sum_size is not None)


def _records_and(calls: list[Any], args: tuple[Any, ...]) -> Iterator[Any]:
    for call in calls:
        yield from call.inputs
        yield call.output_grad
    yield from args


def widen(x: Any) -> Any:
    """float16 / bfloat16 -> float32; anything else (float32, float64, integers) as it is."""
    return x.float() if _is_narrow_float(x) else x


def _is_narrow_float(x: Any) -> bool:
    """A tensor of a floating dtype narrower than float32 (float16, bfloat16, float8): one
    set lookup, as this runs for every record of every rule call."""
    return getattr(x, "dtype", None) in _narrow_floats()


@functools.cache
def _narrow_floats() -> frozenset[Any]:
    import torch

    dtypes = (d for d in vars(torch).values() if isinstance(d, torch.dtype))
    return frozenset(d for d in dtypes if d.is_floating_point and d.itemsize < 4)


def widened_calls(calls: list[Any]) -> list[Any]:
    """Each call with its inputs and output gradient widened (:func:`widen`)."""
    return [type(call)(_widened_inputs(call.inputs), widen(call.output_grad)) for call in calls]


def _widened_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each input widened once: an input passed twice (self-attention's query, key and value)
    stays one tensor, which a rule may use (one Gram matrix for the three)."""
    done: dict[int, Any] = {}
    for x in inputs:
        if id(x) not in done:
            done[id(x)] = widen(x)
    return tuple(done[id(x)] for x in inputs)


def _examples_per_chunk(
    calls: list[Any], args: tuple[Any, ...], sum_size: Callable[[], int] | None
) -> int | None:
    """How many examples of ``calls`` to widen at a time; None: all at once (as many numbers
    as :data:`WIDENED_WHOLE_NUMBERS` or fewer to widen, a layout not known to be batch first,
    or a weighted sum whose chunks would not save memory).

    Chunked only where slicing axis 0 of every tensor is provably slicing the examples: each
    call has a single input, batch first (a plain layer's, or a rule's ``Recorded.inputs[0]``:
    the engine checks both) and its output gradient (batch first), and every further argument
    (a weighted sum's ``(B,)`` weights) has the batch on axis 0. A rule's other inputs (masks,
    the parameter values an attention's ``record`` keeps, a bilinear layer's second input)
    may be shared by the batch: such calls are widened whole.

    A weighted sum on chunks holds two sums of ``sum_size()`` numbers at a time (the chunks' so
    far and the next chunk's): chunked only where the float32 copy it saves is larger (an LM
    head's ``(V, D)`` sum is as large as ``D`` of its ``V``-wide output gradients)."""
    first = calls[0].output_grad
    batch = first.shape[0] if first.dim() else 0
    tensors = [t for call in calls for t in (*call.inputs, call.output_grad)]
    if batch < 2 or any(len(call.inputs) != 1 for call in calls):
        return None
    if not all(_batch_first(t, batch) for t in (*tensors, *args)):
        return None
    widened = sum(t.numel() for t in tensors if _is_narrow_float(t))
    if widened <= max(WIDENED_WHOLE_NUMBERS, WIDENED_CHUNK_NUMBERS):
        return None
    per_example = -(-widened // batch)
    fewest = -(-batch // MAX_WIDENED_CHUNKS)
    chunk = max(1, WIDENED_CHUNK_NUMBERS // per_example, fewest)
    if chunk >= batch:
        return None
    if sum_size is not None and widened - chunk * per_example <= sum_size():
        return None
    return chunk


def _batch_first(x: Any, batch: int) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch


def _chunked(
    fn: Callable[..., dict[str, Any]],
    layer: Any,
    calls: list[Any],
    args: tuple[Any, ...],
    chunk: int,
    summed: bool,
) -> dict[str, Any]:
    """``fn`` on ``chunk`` examples of the calls at a time, each chunk widened alone, the
    results combined as they come: added up in place where ``summed`` (weighted sums), else
    written side by side into one ``(B, ...)`` result (squared norms, certified pairs
    included, and per-example gradients), so that no two chunks' results are held apart."""
    batch = calls[0].output_grad.shape[0]
    combined: dict[str, Any] = {}
    for start in range(0, batch, chunk):
        size = min(chunk, batch - start)
        rows = [
            type(call)(
                tuple(x.narrow(0, start, size) for x in call.inputs),
                call.output_grad.narrow(0, start, size),
            )
            for call in calls
        ]
        sliced = (widen(a.narrow(0, start, size)) for a in args)
        values = fn(layer, widened_calls(rows), *sliced)
        del rows
        if combined and values.keys() != combined.keys():
            raise RuntimeError(
                f"the rule of {type(layer).__name__} gave other parameters for another chunk "
                f"of examples: {sorted(values)} against {sorted(combined)}"
            )
        for key, value in values.items():
            if summed and start == 0:  # (not a view of a record: it is added to in place)
                combined[key] = value if value._base is None else value.clone()
            elif summed:
                combined[key].add_(value)
            else:
                if start == 0:
                    combined[key] = _batch_of(value, batch)
                _write_rows(combined[key], value, start)
        del values, value  # not held through the next chunk
    return combined


def _batch_of(value: Any, batch: int) -> Any:
    """An empty ``(batch, ...)`` result shaped and typed as a chunk's ``value`` (a tensor or a
    certified norm's pair)."""
    if isinstance(value, Certified):
        return Certified(_batch_of(value.estimate, batch), _batch_of(value.bound, batch))
    return value.new_empty((batch, *value.shape[1:]))


def _write_rows(out: Any, value: Any, start: int) -> None:
    """A chunk's per-example ``value`` into rows ``start:`` of ``out``: a tensor, or a certified
    norm's estimates and bounds each (every example keeps its own bound)."""
    if isinstance(out, Certified):
        _write_rows(out.estimate, value.estimate, start)
        _write_rows(out.bound, value.bound, start)
        return
    out.narrow(0, start, value.shape[0]).copy_(value)
