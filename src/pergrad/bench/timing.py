"""Timing calls against each other: interleaved rounds and paired ratios (no framework imported).

``time_interleaved({name: call}, rounds, warmup)`` for calls timed side by side, ``median_ms``
and ``paired_ratio`` to read its rounds, ``timed(call)`` for one call too long to repeat.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

Timings = dict[Hashable, list[float]]  # method -> seconds of each round


def time_interleaved(
    methods: dict[Hashable, Callable[[], Any]], rounds: int, warmup: int
) -> Timings:
    """Seconds per call of each method; every round runs each method once, in a rotated order.

    The collector runs between rounds, never during a call; the objects that exist after the
    warm-up are frozen out of it first. A full collection walks every object of the process
    (torch and JAX make hundreds of thousands) and leaves the caches cold: the calls after it
    took twice as long on the small workloads (linreg: 1.6 ms instead of 0.6 ms).
    """
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
            shift = r % len(keys)
            for key in keys[shift:] + keys[:shift]:
                start = time.perf_counter()
                methods[key]()
                times[key].append(time.perf_counter() - start)
    finally:
        gc.enable()
        gc.unfreeze()
    return times


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
