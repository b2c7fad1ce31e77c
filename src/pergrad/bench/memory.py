"""Peak memory of one call of one method, measured in a fresh process.

``measure(workload, method, batch_size, device)`` runs ``python -m pergrad.bench.memory ...``;
``measure_sizes(workload, method, sizes, device)`` does the same for several batch sizes in one
child (the sweep), one after the other. For each batch size the child builds the
workload and the method, calls it once (JAX compiles then), then, on Linux, resets the
process's peak resident set size (``/proc/self/clear_refs``) and calls it again: the figure is
the peak RSS during that second call minus the RSS just before it, so it counts the call's
working memory and its result, not the imports, the model, the data or JIT compilation. glibc's mmap threshold is pinned (``MALLOC_MMAP_THRESHOLD_``) so
that large buffers freed after the first call go back to the OS instead of being reused
unseen. Where the peak cannot be reset, the figure is ``ru_maxrss`` after the first call minus
the RSS before it (so it includes compilation, and in a sweep only what a batch size adds to the
peak of the smaller ones); the JSON says which.

On CUDA, torch methods report ``torch.cuda.max_memory_allocated`` over the second call instead;
JAX methods on a GPU are not measured (JAX has no peak of device memory that can be reset).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys


def measure(
    workload: str, method: str, batch_size: int, device: str = "cpu", timeout: float = 300
) -> dict:
    return measure_sizes(workload, method, (batch_size,), device, timeout)[batch_size]


def measure_sizes(
    workload: str, method: str, sizes: tuple[int, ...], device: str = "cpu", timeout: float = 600
) -> dict[int, dict]:
    """``{batch size: {"peak_mib": ..., "how": ...}}``, measured in one fresh process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    command = [sys.executable, "-m", "pergrad.bench.memory", workload, method, str(device)]
    command += [str(size) for size in sizes]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        failed = {"peak_mib": None, "how": f"failed: {done.stderr.strip().splitlines()[-1:]}"}
        return dict.fromkeys(sizes, failed)
    by_size = json.loads(done.stdout.strip().splitlines()[-1])
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


def reset_peak() -> None:
    """Reset this process's peak resident memory (``VmHWM``) to its current one (Linux >= 4.0,
    ``/proc/self/clear_refs``); raises ``OSError`` where that cannot be done."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _reset_peak() -> bool:
    try:
        reset_peak()
        return True
    except OSError:
        return False


def _child(workload_name: str, method_name: str, device: str, sizes: list[int]) -> dict[int, dict]:
    import warnings

    warnings.simplefilter("ignore")
    by_size = {}
    for size in sizes:
        try:
            by_size[size] = _measure_one(workload_name, method_name, device, size)
        except Exception as e:  # unsupported at this size: the others still count
            by_size[size] = {"peak_mib": None, "how": f"failed: {type(e).__name__}: {e}"[:200]}
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
    import resource  # Unix only

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    call()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"peak_mib": peak / 1024, "how": "ru_maxrss delta over the 1st call"}


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2], sys.argv[3], [int(b) for b in sys.argv[4:]])))
