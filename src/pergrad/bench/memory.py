"""Peak memory of one call of one method, measured in a fresh process.

``measure(workload, method, batch_size, device)`` measures it in a child process
(``pergrad.bench.child.run_in_child``); ``measure_sizes(workload, method, sizes, device)`` does
the same for several batch sizes in one child (the sweep), one after the other. For each batch
size the child builds the workload and the method, calls it once (JAX compiles then), then, on
Linux, resets the process's peak resident set size (``/proc/self/clear_refs``) and calls it
again: the figure is the peak RSS during that second call minus the RSS just before it, so it
counts the call's working memory and its result, not the imports, the model, the data or JIT
compilation. glibc's mmap threshold is pinned (``MALLOC_MMAP_THRESHOLD_``) so that large buffers
freed after the first call go back to the OS instead of being reused unseen. Where the peak
cannot be reset, the figure is ``ru_maxrss`` after the first call minus the RSS before it (so
it includes compilation, and in a sweep only what a batch size adds to the peak of the smaller
ones); the JSON says which.

On CUDA, torch methods report ``torch.cuda.max_memory_allocated`` over the second call instead;
JAX methods on a GPU are not measured (JAX has no peak of device memory that can be reset).

The probes, for a benchmark that measures its own calls: ``status_mib("VmRSS")`` (resident
now), ``peak_rss_over(call)`` (the peak during a call; ``reset_peak()`` and
``status_mib("VmHWM")`` for a peak over more), ``max_rss_mib()`` (the peak since the process
started); ``free_buffers_to_the_os()`` in a process that did not start with
``FREED_BUFFERS_TO_THE_OS`` in its environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable
from typing import Any

from pergrad.bench.child import ChildFailed, run_in_child
from pergrad.bench.report import error_summary

# glibc maps (and unmaps, when freed) every buffer from 64 KiB up on its own: a freed buffer
# leaves the resident set, so the next call's peak is its own.
FREED_BUFFERS_TO_THE_OS = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def measure(
    workload: str, method: str, batch_size: int, device: str = "cpu", timeout: float = 300
) -> dict:
    return measure_sizes(workload, method, (batch_size,), device, timeout)[batch_size]


def measure_sizes(
    workload: str, method: str, sizes: tuple[int, ...], device: str = "cpu", timeout: float = 600
) -> dict[int, dict]:
    """``{batch size: {"peak_mib": ..., "how": ...}}``, measured in one fresh process."""
    try:
        by_size = run_in_child(
            _peaks_by_size,
            workload,
            method,
            str(device),
            list(sizes),
            env=FREED_BUFFERS_TO_THE_OS,
            timeout=timeout,
        )
    except ChildFailed as error:
        return dict.fromkeys(sizes, {"peak_mib": None, "how": f"failed: {error.reason}"})
    return {int(size): result for size, result in by_size.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def status_mib(field: str) -> float:
    """A memory field of ``/proc/self/status`` (Linux: ``"VmRSS"``, ``"VmHWM"``) in MiB."""
    return _status_kib(field) / 1024


def max_rss_mib() -> float:
    """This process's peak resident memory since it started (``ru_maxrss``), in MiB (Unix)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak() -> None:
    """Reset this process's peak resident memory (``VmHWM``) to its current one (Linux >= 4.0,
    ``/proc/self/clear_refs``); raises ``OSError`` where that cannot be done."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_over(call: Callable[[], Any]) -> float:
    """The peak resident memory (``VmHWM``, MiB) during ``call()``: the peak is reset first
    (Linux; raises ``OSError`` where it cannot be)."""
    reset_peak()
    call()
    return status_mib("VmHWM")


def free_buffers_to_the_os() -> None:
    """``FREED_BUFFERS_TO_THE_OS`` for this process, already running (glibc's ``mallopt``;
    nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD


def _reset_peak() -> bool:
    try:
        reset_peak()
        return True
    except OSError:
        return False


def _peaks_by_size(
    workload_name: str, method_name: str, device: str, sizes: list[int]
) -> dict[int, dict]:
    import warnings

    warnings.simplefilter("ignore")
    by_size = {}
    for size in sizes:
        try:
            by_size[size] = _measure_one(workload_name, method_name, device, size)
        except Exception as e:  # unsupported at this size: the others still count
            by_size[size] = {"peak_mib": None, "how": f"failed: {error_summary(e)}"}
        gc.collect()
    return by_size


def _measure_one(workload_name: str, method_name: str, device_name: str, batch_size: int) -> dict:
    import torch

    from pergrad.bench.methods import METHODS_BY_NAME
    from pergrad.bench.workloads import WORKLOADS, build

    method = METHODS_BY_NAME[method_name]
    workload = WORKLOADS[workload_name]
    device = torch.device(device_name)
    if device.type == "cuda" and method.framework == "jax":
        return {"peak_mib": None, "how": "not measured: JAX on a GPU"}
    call = method.build(workload, *build(workload, batch_size, device))
    if device.type == "cuda":
        call()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = call()
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return {"peak_mib": peak / 2**20, "how": "cuda max_memory_allocated, 2nd call"}
    if os.path.exists("/proc/self/clear_refs"):
        call()  # the result is dropped at once
        gc.collect()
        if _reset_peak():
            before = _status_kib("VmRSS")
            result = call()
            peak = _status_kib("VmHWM") - before
            del result
            return {"peak_mib": peak / 1024, "how": "VmHWM - VmRSS over the 2nd call"}
    before = max_rss_mib()
    call()
    return {"peak_mib": max_rss_mib() - before, "how": "ru_maxrss delta over the 1st call"}
