"""Timing calls against each other: interleaved rounds and paired ratios (no framework imported).

``time_interleaved({name: call}, rounds, warmup)`` for calls timed side by side (in the orders
of ``balanced_orders``), ``median_ms`` and ``paired_ratio`` to read its rounds, ``timed(call)``
for one call too long to repeat.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

Timings = dict[Hashable, list[float]]  # method -> seconds of each round


def time_interleaved(
    methods: dict[Hashable, Callable[[], Any]], rounds: int, warmup: int, order: str = "balanced"
) -> Timings:
    """Seconds per call of each method; every round runs each method once.

    ``order="balanced"`` (default): the rounds take the rows of :func:`balanced_orders` in
    turn, so that over every ``len(rows)`` rounds each method runs at each position, and right
    after each other method, equally often: what a call leaves behind (the caches, a parked
    thread pool, the allocator's state) can weigh on the next one. A rotated order (``order="rotated"``, each round the previous one
    shifted by one) always puts the same method before a given one: in the benchmark,
    pergrad's JAX call always came right after the Python loop of small calls, and the
    hand-written ``jit(vmap(grad))``, the same compiled program, right after pergrad's; with
    10 rounds, the results of 2026-11-23 read pergrad 14% slower on the transformer
    (``benchmarks/jax_vmap_gap.py``).

    The collector runs between rounds, never during a call; the objects that exist after the
    warm-up are frozen out of it first. A full collection walks every object of the process
    (torch and JAX make hundreds of thousands) and leaves the caches cold: the calls after it
    took twice as long on the small workloads (linreg: 1.6 ms instead of 0.6 ms).
    """
    if order not in ("balanced", "rotated"):
        raise ValueError(f"order must be 'balanced' or 'rotated'; got {order!r}")
    for call in methods.values():
        for _ in range(warmup):
            call()
    keys = list(methods)
    times: Timings = {key: [] for key in keys}
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for r in range(rounds):
            gc.collect()  # only what the timed calls left behind
            for key in _round_order(keys, r, order):
                start = time.perf_counter()
                methods[key]()
                times[key].append(time.perf_counter() - start)
    finally:
        gc.enable()
        gc.unfreeze()
    return times


def balanced_orders(n: int) -> list[list[int]]:
    """The rows of a Williams design for ``n`` methods: orders of ``range(n)`` in which each
    method stands at each position equally often and directly follows each other method
    equally often: ``n`` rows for an even ``n`` (once each), ``2 n`` for an odd one (the rows
    and their mirror images: twice each). E. J. Williams, "Experimental designs balanced for
    the estimation of residual effects of treatments", Aust. J. Sci. Res. A 2 (1949).

    ``balanced_orders(4) == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]``."""
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(k + r) % n for k in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def _round_order(keys: list[Hashable], r: int, order: str) -> list[Hashable]:
    if not keys:
        return []
    if order == "rotated":
        shift = r % len(keys)
        return keys[shift:] + keys[:shift]
    rows = balanced_orders(len(keys))
    return [keys[k] for k in rows[r % len(rows)]]


def median_ms(seconds: list[float]) -> float:
    """The median of ``seconds``, in milliseconds."""
    return 1e3 * statistics.median(seconds)


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """``(call(), the seconds it took)``: one wall-clock measurement."""
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of the per-round ratio: robust to noise that hits a whole round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))
