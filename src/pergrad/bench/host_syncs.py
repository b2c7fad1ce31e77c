"""Count the host synchronisations of a piece of PyTorch code, on any device, the CPU included.

On an accelerator, an op whose result the host must read (``.item()``, ``bool(tensor)``,
``float(tensor)``, ``.tolist()``, ``torch.equal``, ``nonzero``, boolean indexing and the other
ops whose output shape depends on values, a copy to the CPU) stalls Python until the device has
finished everything queued before it. On a CPU nothing waits, so such reads are invisible in a
timing: :class:`HostSyncs` finds them by the op instead, with a short Python stack for each.
Not seen on a CPU: a copy from the host to an accelerator (``torch.tensor(x, device=...)``),
which waits for the device too (PyTorch synchronises its stream after a blocking copy).

    >>> with HostSyncs() as syncs:
    ...     step()
    >>> syncs.count, syncs.top_sites(5)
"""

from __future__ import annotations

import collections
import os
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read a value on the host (the scalar reads: ``item``, ``bool``, ``float``,
# ``is_nonzero`` all end in ``_local_scalar_dense``), or whose output shape depends on the
# values (the device must finish before the host knows it). ``equal`` reads on CUDA.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "nonzero",
        "nonzero_static",
        "equal",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "allclose",
        "repeat_interleave",
    }
)


def is_sync(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the aten op ``func`` with these arguments makes the host wait for the device:
    one of :data:`SYNC_OPS`, an index by a boolean mask (a ``nonzero`` inside), or a copy of
    a tensor of another device to the CPU."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return not (name == "repeat_interleave" and kwargs.get("output_size") is not None)
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else ()
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    if name in ("_to_copy", "copy_"):
        source = args[1] if name == "copy_" else args[0]
        target = kwargs.get("device") if name == "_to_copy" else args[0].device
        if isinstance(source, torch.Tensor) and target is not None:
            return source.device.type != "cpu" and torch.device(target).type == "cpu"
    return False


# Tensor methods that hand a value to Python: on an accelerator, each waits for the device
# (on a CPU, ``tolist`` and ``numpy`` read memory without an aten op, so only their names
# show them)
READ_METHODS = frozenset(
    {"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy"}
)


class HostSyncs:
    """A context that counts the host synchronisations of the code run inside it: the Python
    reads of a tensor's value (:data:`READ_METHODS`, through a ``TorchFunctionMode``) and the
    aten ops that wait for values (:func:`is_sync`, through a ``TorchDispatchMode``; a scalar
    read inside a Python read is not counted again), with the innermost ``frames`` Python
    frames of each (those in files whose path holds ``within``, when given: ``"pergrad"``).

    Attributes:
      count: the number of syncs.
      ops: the number of aten ops below autograd, views and ``detach`` left out (a proxy for
        the kernels an accelerator would launch).
      sites: ``Counter`` of ``(op, stack)``, the stack ``"file:line function <- ..."``.
    """

    def __init__(self, frames: int = 3, within: str | None = None) -> None:
        self.frames, self.within = frames, within
        self.count, self.ops = 0, 0
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reading = 0  # inside a Python read: its own aten ops are not counted again
        self._modes = (_Reads(self), _Ops(self))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def record(self, name: str) -> None:
        self.count += 1
        self.sites[(name, self._stack())] += 1

    def _stack(self) -> str:
        frames = [f for f in traceback.extract_stack() if not f.filename.endswith(_HERE)]
        frames = [f for f in frames if not f.filename.startswith(_TORCH)]
        if self.within is not None:
            frames = [f for f in frames if self.within in f.filename]
        shown = [
            f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-self.frames :])
        ]
        return " <- ".join(shown) or "(outside)"

    def top_sites(self, count: int = 10) -> list[tuple[str, str, int]]:
        """The ``count`` most frequent ``(op, stack, times)``."""
        return [(op, stack, times) for (op, stack), times in self.sites.most_common(count)]


class _Reads(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = getattr(func, "__name__", "")
        if name not in READ_METHODS:
            return func(*args, **(kwargs or {}))
        self.syncs.record(name)
        self.syncs._reading += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.syncs._reading -= 1


class _Ops(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not (func.is_view or func.overloadpacket.__name__ in _NOT_KERNELS):
            self.syncs.ops += 1
        if not self.syncs._reading and is_sync(func, args, kwargs):
            self.syncs.record(func.overloadpacket.__name__)
        return func(*args, **kwargs)


# no kernel: views, and allocations (the caching allocator hands out memory without one)
_NOT_KERNELS = frozenset(
    {
        "detach",
        "alias",
        "_unsafe_view",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
    }
)
_HERE = "host_syncs.py"
_TORCH = os.path.dirname(torch.__file__)


def _short(filename: str) -> str:
    """A file name from its package directory on (``pergrad/_src/...``)."""
    for marker in ("/pergrad/", "/site-packages/", "/benchmarks/"):
        if marker in filename:
            return marker.strip("/") + "/" + filename.split(marker, 1)[1]
    return filename
