"""A pytree of parameters seen as one flat vector of its floating-point leaves.

Second-order methods (Hessian-vector products, linear solves) and gradient scores are
arithmetic on vectors of length ``P``, the number of parameters. :class:`FlatParams` keeps the
user's structure beside that vector: :meth:`FlatParams.unravel` rebuilds the parameters from a
vector (so the loss of one example can be called on it), and :meth:`FlatParams.rows_to_tree`
turns ``(k, P)`` rows back into a pytree whose leaves have a leading axis ``k``.

Non-float leaves (integer arrays, an equinox module's activation functions, Python numbers) are
carried along as constants: they are not part of the vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pergrad._src.backends import Backend
from pergrad._src.errors import PergradTypeError


@dataclass(frozen=True)
class FlatParams:
    """The float leaves of ``params`` concatenated into ``vector`` (shape ``(P,)``).

    Attributes:
      backend: the framework of the parameters.
      vector: ``(P,)`` the float leaves, flattened and concatenated, cut from autodiff graphs.
      treedef: the structure of the parameters.
      leaves: every leaf of the parameters (constants included), in flattening order.
      paths: the path of each leaf, ``"['w']"`` style.
      positions: which leaves are in ``vector``, in order.
      shapes: the shape of each of those leaves.
    """

    backend: Backend
    vector: Any
    treedef: Any
    leaves: tuple[Any, ...]
    paths: tuple[str, ...]
    positions: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def create(cls, func_name: str, arg_name: str, bk: Backend, params: Any) -> FlatParams:
        paths, leaves, treedef = bk.flatten(params)
        positions = tuple(i for i, x in enumerate(leaves) if bk.is_array(x) and bk.is_inexact(x))
        if not positions:
            found = ", ".join(f"{p or 'root'}: {type(x).__name__}" for p, x in zip(paths, leaves))
            raise PergradTypeError(
                f"{func_name}: {arg_name} must hold floating-point arrays to differentiate; "
                f"got no float array (leaves: {found or 'none'})."
            )
        shapes = tuple(bk.shape(leaves[i]) for i in positions)
        pieces = [
            bk.stop_gradient(leaves[i]).reshape(math.prod(bk.shape(leaves[i]))) for i in positions
        ]
        vector = bk.concatenate(pieces, axis=0)
        return cls(bk, vector, treedef, tuple(leaves), tuple(paths), positions, shapes)

    @property
    def size(self) -> int:
        """P, the number of parameters in the vector."""
        return sum(math.prod(shape) for shape in self.shapes)

    def _bounds(self) -> list[tuple[int, int]]:
        bounds, start = [], 0
        for shape in self.shapes:
            bounds.append((start, start + math.prod(shape)))
            start += math.prod(shape)
        return bounds

    def unravel(self, vector: Any) -> Any:
        """The parameters' pytree with its float leaves read from ``vector`` ``(P,)``."""
        leaves = list(self.leaves)
        for i, shape, (start, stop) in zip(self.positions, self.shapes, self._bounds()):
            leaves[i] = vector[start:stop].reshape(shape)
        return self.backend.unflatten(self.treedef, leaves)

    def rows_to_tree(self, rows: Any) -> Any:
        """``(k, P)`` rows as a pytree like the parameters, each leaf ``(k, *leaf_shape)``.

        Constant (non-float) leaves come back as None, as gradients of them would.
        """
        count = self.backend.shape(rows)[0]
        leaves: list[Any] = [None] * len(self.leaves)
        for i, shape, (start, stop) in zip(self.positions, self.shapes, self._bounds()):
            leaves[i] = rows[:, start:stop].reshape(count, *shape)
        return self.backend.unflatten(self.treedef, leaves)
