"""Run one function in a child process: its memory is its own, and a crash is a result.

``run_in_child(function, *args)`` calls ``function(*args)`` in a fresh Python interpreter
(``python -m pergrad.bench.child``) and returns what it returned::

    result = run_in_child(time_and_peak, "mlp", 64, env={"OMP_NUM_THREADS": "1"}, timeout=600)

The child finds ``function`` by its module: one it can import by name, or the script this
process runs (``__main__``), loaded from its file under another name so that its ``main()``
does not run. Arguments and result travel as JSON: plain data only, tuples come back as lists
and dict keys as strings. ``env``: variables set in the child on top of this process's
environment, for what must be set before an interpreter starts (``XLA_FLAGS`` before JAX is
imported, ``MALLOC_MMAP_THRESHOLD_``, ``OMP_NUM_THREADS``).

``fork=True`` forks this process instead: the child shares the modules this one imported (so
that a first step's memory is the step's, not an import's), and ``function`` may be any
callable with a picklable result.

A child that raises, dies or has no result after ``timeout`` seconds raises ``ChildFailed``:
``reason`` says which in one line, ``stderr`` holds the child's error output (a fresh child's).
Peak memory is measured inside the function, with ``pergrad.bench.memory``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_SCRIPT = "_pergrad_bench_script"  # the name a child gives the script it loads from its file


class ChildFailed(RuntimeError):
    """A child process gave no result: ``reason`` in one line, its ``stderr`` (when captured)."""

    def __init__(self, reason: str, stderr: str = "") -> None:
        super().__init__(f"{reason}\n{stderr[-3000:]}" if stderr else reason)
        self.reason = reason
        self.stderr = stderr


def run_in_child(
    function: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    fork: bool = False,
) -> Any:
    """``function(*args)``, computed in a child process (see the module's docstring)."""
    if fork:
        if env:
            raise ValueError(
                "run_in_child: env= is read when an interpreter starts, and a forked child does "
                "not start one; pass fork=False for a fresh interpreter with these variables"
            )
        return _forked(function, args, timeout)
    where = json.dumps(_locate(function))
    command = [sys.executable, "-m", "pergrad.bench.child", where, json.dumps(list(args))]
    environment = os.environ | env if env else None
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=environment
        )
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr or ""
        stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        raise ChildFailed(f"no result in {timeout} s", stderr) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        raise ChildFailed(f"the process exited with {done.returncode}: {last}", done.stderr)
    printed = done.stdout.strip().splitlines()
    if not printed:
        raise ChildFailed("the process exited with 0 and printed no result", done.stderr)
    return json.loads(printed[-1])


def _locate(function: Callable[..., Any]) -> dict[str, str]:
    """Where a fresh interpreter finds ``function``: its module's name, or its script's file."""
    module = function.__module__
    if module in ("__main__", _SCRIPT):
        path = os.path.abspath(sys.modules[module].__file__ or "")
        return {"file": path, "name": function.__qualname__}
    return {"module": module, "name": function.__qualname__}


def _load(where: dict[str, str]) -> Callable[..., Any]:
    if "module" in where:
        found: Any = importlib.import_module(where["module"])
    else:
        spec = importlib.util.spec_from_file_location(_SCRIPT, where["file"])
        assert spec is not None and spec.loader is not None, where
        found = importlib.util.module_from_spec(spec)
        sys.modules[_SCRIPT] = found  # dataclasses look their module up while it loads
        spec.loader.exec_module(found)
    for name in where["name"].split("."):
        found = getattr(found, name)
    return found


def _forked(function: Callable[..., Any], args: tuple[Any, ...], timeout: float | None) -> Any:
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=lambda: send.send(function(*args)))
    child.start()
    send.close()
    if not receive.poll(timeout):
        child.kill()
        child.join()
        raise ChildFailed(f"no result in {timeout} s")
    try:
        result = receive.recv()
    except EOFError:  # it raised or died before sending
        child.join()
        raise ChildFailed(f"the process died (exit code {child.exitcode})") from None
    child.join()
    return result


def _main(where: str, args: str) -> None:
    result = _load(json.loads(where))(*json.loads(args))
    print(json.dumps(result))  # the last line of the output
    sys.stdout.flush()
    sys.stderr.flush()
    # The work is done: skip the interpreter's teardown, whose C++ static destructors abort a
    # process that used gloo about one exit in five (torch 2.13, "terminate called without an
    # active exception") and take seconds for torch and JAX.
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
