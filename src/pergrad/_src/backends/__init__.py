"""The backend protocol and the choice of backend from the arrays a call receives.

Everything framework-specific that the core needs sits behind :class:`Backend`; one module per
framework implements it (``jax_backend.py``, ``torch_backend.py``). Adding a framework means
adding one module and one entry in :data:`_BACKEND_MODULES`.

Frameworks are imported lazily: a backend module is imported only when a call needs it, and the
detection below only looks for frameworks that the user's process has already imported (an array
of a framework cannot exist before that framework is imported).
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pergrad._src.errors import PergradTypeError

_BACKEND_MODULES = {
    "jax": "pergrad._src.backends.jax_backend",
    "torch": "pergrad._src.backends.torch_backend",
}

# The module a framework's arrays come from, used to detect the backend without importing it.
_FRAMEWORK_IMPORT_NAMES = {"jax": "jax", "torch": "torch"}


_vectorised_depth = threading.local()


def runs_vectorised(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, marked as running under a backend's ``vmap`` while it runs (each backend's
    :meth:`Backend.vmap` wraps the function it maps): a failure there may be the framework's
    vmap's own, which a loop over the examples would not meet, so ``core/call.py`` leaves it to
    the strategies' fallback instead of explaining it as a failure of one example."""

    def marked(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_vectorised_depth, "value", 0)
        _vectorised_depth.value = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _vectorised_depth.value = depth

    return marked


def is_running_vectorised() -> bool:
    """Whether the calling code runs inside a function a backend's ``vmap`` maps."""
    return getattr(_vectorised_depth, "value", 0) > 0


class Backend(Protocol):
    """What the core asks of a framework.

    Trees are flattened to ``(paths, leaves, treedef)``; the core works on flat leaves and
    rebuilds the user's structures with :meth:`unflatten`, so a backend needs only flat ``vmap``
    and ``value_and_grad`` over a tuple argument.
    """

    name: str
    supports_randomness: bool  # whether ``randomness=`` means something (torch.func's vmap)

    def is_array(self, x: Any) -> bool:
        """True for an array this backend computes with (numpy arrays count for JAX)."""

    def owns(self, x: Any) -> bool:
        """True for an array that only this framework produces (used to detect the backend)."""

    def flatten(self, tree: Any) -> tuple[list[str], list[Any], Any]:
        """Leaves of ``tree`` with their paths (``"['w']"`` style) and the structure."""

    def leaves(self, tree: Any) -> list[Any]:
        """Leaves of ``tree`` only: cheaper than :meth:`flatten` (no paths)."""

    def flatten_leaves(self, tree: Any) -> tuple[list[Any], Any]:
        """Leaves and structure of ``tree`` without the paths: :meth:`flatten`'s leaves and
        treedef, cheaper."""

    def unflatten(self, treedef: Any, leaves: Sequence[Any]) -> Any: ...

    def broadcast_prefix(self, prefix: Any, tree: Any) -> list[Any] | None:
        """``prefix`` broadcast to one entry per leaf of ``tree``; None if not a prefix."""

    def shape(self, x: Any) -> tuple[int, ...]: ...

    def dtype_name(self, x: Any) -> str: ...

    def is_inexact(self, x: Any) -> bool:
        """True for floating or complex arrays (the ones that can be differentiated)."""

    def as_differentiable(self, x: Any) -> Any:
        """A Python float turned into a 0-d array of the default float dtype."""

    def constant_leaves(self, tree: Any) -> frozenset[int]:
        """Indices of the leaves of a differentiated ``tree`` that the framework's own
        convention keeps constant although they are Python floats (elsewhere a float is
        differentiated, as ``jax.grad`` does)."""

    def moveaxis_to_front(self, x: Any, axis: int) -> Any: ...

    def value_and_grad(self, fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        """``fn(diff_leaves, *rest)`` -> value and gradient w.r.t. the tuple ``diff_leaves``."""

    def loop_value_and_grad(self, fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        """Like :meth:`value_and_grad`, for one example at a time outside any vmap; may use
        the framework's plain autodiff, which handles more than its function transforms."""

    def match_varying(self, diff: tuple[Any, ...], batched: tuple[Any, ...]) -> tuple[Any, ...]:
        """The differentiated leaves, made to vary over the devices the batched leaves vary
        over (JAX ``shard_map``); unchanged elsewhere."""

    def rng_state(self) -> Any:
        """The framework's global random state (None where randomness is explicit, as in JAX)."""

    def set_rng_state(self, state: Any) -> None: ...

    def rng_state_changed(self, state: Any) -> bool:
        """Whether random numbers were drawn since ``state`` was read."""

    def vmap(
        self,
        fn: Callable[..., Any],
        in_axes: tuple[Any, ...],
        chunk_size: int | None,
        randomness: str | None,
    ) -> Callable[..., Any]: ...

    def take(self, x: Any, index: int) -> Any:
        """Example ``index`` of an array batched on axis 0."""

    def stack(self, xs: Sequence[Any]) -> Any: ...

    def zeros_example(self, x: Any) -> Any:
        """Zeros shaped like ``x`` with a leading axis of size 1 instead of its own."""

    def slice_empty(self, x: Any) -> Any:
        """``x[:0]``: the empty batch of arrays shaped like ``x``."""

    def explain_failure(self, err: Exception) -> Exception | None:
        """A clear error for a vmap failure that a loop would not fix, else None."""

    def to_numpy(self, x: Any) -> Any:
        """A numpy copy of ``x`` (used for small results: ``(B,)`` statistics, indices)."""

    def from_numpy(self, x: Any, like: Any) -> Any:
        """``x`` as an array of this framework, on the device of ``like``."""

    def add_scaled(
        self, xs: Sequence[Any], noises: Sequence[Any], scale: float, in_place: Sequence[bool]
    ) -> list[Any]:
        """``x + scale * noise`` for each ``x`` of ``xs`` and ``noise`` of ``noises``, rounded
        as written (``scale * noise``, then the sum); where ``in_place``, into ``x`` (and into
        ``noise`` always: the draws are the caller's; PyTorch, JAX arrays are not written). The
        pairs written in place are added before the others, so an ``x`` listed twice gets
        both. PyTorch: a few ``torch._foreach_*`` ops for all the pairs (on an accelerator a
        handful of kernels, not two a pair)."""

    def standard_normal(self, rng: Any, like: Any) -> Any:
        """Standard normal noise shaped like ``like``: ``rng`` is a JAX key or a
        ``torch.Generator`` (None: torch's global generator)."""

    def split_key(self, rng: Any, num: int) -> Any:
        """``num`` independent randomness sources from ``rng`` (JAX keys; torch returns it)."""

    def scalar_loss_problem(self, loss: Any) -> str | None:
        """None if ``loss`` is a real scalar array, else a description of what it is."""

    # Second-order pieces and linear algebra, used by ``pergrad.influence``.

    def hvp(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Hessian-vector products of a scalar ``fn(x, *args)`` with ``x`` a 1-D array.

        Returns ``hvp(x, tangents, *args)``: for ``tangents`` of shape ``(k, P)`` the ``(k, P)``
        rows ``H @ tangents[j]``, with ``H`` the Hessian of ``fn`` at ``x``. Made once and
        called many times (by iterative solvers), so a backend may compile it.
        """

    def eye(self, n: int, like: Any) -> Any:
        """The ``(n, n)`` identity with the dtype and device of ``like``."""

    def eigh(self, matrix: Any) -> tuple[Any, Any]:
        """Eigenvalues (ascending) and eigenvectors (columns) of a symmetric matrix."""

    def cholesky(self, matrix: Any) -> Any | None:
        """The lower Cholesky factor of a symmetric matrix, or None where it is not positive
        definite (to the precision of its dtype)."""

    def cholesky_solve(self, factor: Any, rows: Any) -> Any:
        """``(k, n)`` rows ``x_j = A^-1 rows[j]`` for ``A = factor @ factor.T``."""

    def concatenate(self, xs: Sequence[Any], axis: int) -> Any: ...

    def stop_gradient(self, x: Any) -> Any:
        """``x`` cut from any autodiff graph it belongs to (torch: ``detach``)."""

    def isfinite(self, x: Any) -> Any:
        """Booleans shaped like ``x``: True where an entry is neither inf nor nan."""

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        """``x`` where ``condition`` holds, else ``y`` (an array or a Python number), broadcast
        together; unlike ``condition * x``, a nan or inf of ``x`` outside ``condition`` does not
        reach the result."""

    def known_all(self, condition: Any) -> bool | None:
        """Whether every entry of ``condition`` holds, where it can be read now (a host sync on
        an accelerator); None where it cannot (under ``jax.jit``, a torch.func transform or
        ``torch.compile``). Lets a step skip work that only a rare case needs."""


def available_backend_names() -> tuple[str, ...]:
    return tuple(_BACKEND_MODULES)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; a clear error when its framework is not installed."""
    if name not in _BACKEND_MODULES:
        raise ValueError(
            f"backend must be one of {sorted(_BACKEND_MODULES)} or None; got {name!r}."
        )
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
    except ImportError as err:
        raise ImportError(
            f"backend={name!r} needs {name} installed: pip install 'pergrad[{name}]' ({err})"
        ) from err
    return module.BACKEND


def backend_of(tree: Any, func_name: str, arg_name: str) -> Backend:
    """The backend of the arrays in ``tree``; a clear error if there are none or two kinds."""
    found = frameworks_in(tree)
    kinds = sorted({framework for framework, _, _ in found})
    if len(kinds) == 1:
        return get_backend(kinds[0])
    if not kinds:
        raise PergradTypeError(
            f"{func_name}: {arg_name} must hold JAX arrays or torch tensors; got "
            f"{type(tree).__name__} with no framework array in it."
        )
    raise PergradTypeError(
        f"{func_name}: {arg_name} mixes arrays of {' and '.join(kinds)}; pass one framework's."
    )


def framework_names_in(tree: Any) -> set[str]:
    """The frameworks whose arrays ``tree`` holds; like :func:`frameworks_in` without the paths,
    for the common case where there is nothing to report."""
    found = set()
    for name, import_name in _FRAMEWORK_IMPORT_NAMES.items():
        if import_name in sys.modules:
            backend = get_backend(name)
            if any(backend.owns(leaf) for leaf in backend.leaves(tree)):
                found.add(name)
    return found


def frameworks_in(tree: Any) -> list[tuple[str, str, type]]:
    """``(framework, path, type)`` for each framework array found in ``tree``.

    Only frameworks already imported by the process are looked for, so this never imports one.
    """
    found = []
    for name, import_name in _FRAMEWORK_IMPORT_NAMES.items():
        if import_name not in sys.modules:
            continue
        backend = get_backend(name)
        paths, leaves, _ = backend.flatten(tree)
        for path, leaf in zip(paths, leaves):
            if backend.owns(leaf):
                found.append((name, path, type(leaf)))
    return found
