"""The result type of clipped sums, shared by the clipping functions and their sharded and
distributed forms (a module of its own, so that those can import it without importing each
other)."""

from __future__ import annotations

from typing import Any, NamedTuple


class ClippedSum(NamedTuple):
    """The sum over examples of clipped per-example gradients, and what clipping did.

    A named tuple, so it passes through ``jax.jit`` and the frameworks' pytree utilities.

    Attributes:
      sum: pytree like one example's gradient (no batch axis).
      norms: ``(B,)`` each example's gradient norm before clipping (flat clipping), or a list of
        ``(B,)`` norms, one per group (per-layer clipping).
      clip_fraction: share of (real, unmasked) examples whose gradient was scaled down, a 0-d
        array (per group: the share clipped in any group).
      sensitivity: how far one example can move ``sum``: the bound, or sqrt(Σ bounds²).
      count: number of real examples summed (a 0-d array; B without a mask), the non-finite
        ones included.
      nonfinite: number of real examples whose gradient was not finite (an inf or nan entry,
        so an inf or nan norm), a 0-d array. Each got weight 0 and contributes exactly nothing
        to ``sum``; it is not counted as clipped in ``clip_fraction``.
    """

    sum: Any
    norms: Any
    clip_fraction: Any
    sensitivity: float
    count: Any
    nonfinite: Any
