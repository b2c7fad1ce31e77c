"""Gaussian noise from the operating system's cryptographic random source.

A PRNG such as a ``torch.Generator`` or a JAX key is predictable from its seed and state; an
attacker who learns them can subtract the noise. :class:`SecureRandom` draws every number from
``os.urandom`` (the kernel's CSPRNG), as Opacus's ``secure_mode`` does, without the unmaintained
``torchcsprng``: 53 random bits per uniform, Box-Muller to Gaussians in float64, on the host.

Floating-point attacks (Mironov 2012): a Gaussian computed in floating point has gaps and a
distorted tail that can leak the value it was added to. Following Holohan & Braghin (2021) and
Opacus, each noise value is the sum of ``terms`` independent draws scaled by ``1/sqrt(terms)``
(default 2), which smooths those artefacts; it mitigates the attack, it does not prove its
absence.

Cost: ``16 * terms`` random bytes per noise value from the kernel, plus the host-to-device copy.
``benchmarks/secure_noise.py`` measures it against the framework's own generator.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from pergrad._src.errors import PergradValueError


class SecureRandom:
    """A noise source for ``rng=`` / ``generator=`` of pergrad's DP functions, drawing from the
    operating system's cryptographic source; nothing to seed, nothing to store.

        noisy = pergrad.dp.private_mean(grads, 1.0, 1.1, rng=pergrad.dp.SecureRandom(),
                                        expected_batch_size=256)

    Works with PyTorch (the draw is copied to the gradients' device and dtype) and JAX (also
    inside ``jax.jit``, through an ordered ``io_callback``: every call draws anew).

    Args:
      terms: each noise value is the sum of this many independent Gaussians, scaled to unit
        variance (>= 1; default 2, as Opacus's secure mode).
    """

    def __init__(self, terms: int = 2) -> None:
        if not (isinstance(terms, int) and not isinstance(terms, bool) and terms >= 1):
            raise PergradValueError(f"SecureRandom: terms must be an int >= 1; got {terms!r}.")
        self.terms = terms

    def normal(self, shape: tuple[int, ...]) -> np.ndarray:
        """Standard Gaussian values of ``shape``, float64, from ``os.urandom``."""
        count = math.prod(shape)
        total = np.zeros(count)
        for _ in range(self.terms):
            total += _gaussians(count)
        return (total / math.sqrt(self.terms)).reshape(shape)

    def __repr__(self) -> str:
        return f"SecureRandom(terms={self.terms})"


def _gaussians(count: int) -> np.ndarray:
    pairs = (count + 1) // 2
    bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64)
    scale = 2.0**-53
    first = ((bits[0::2] >> np.uint64(11)).astype(np.float64) + 1.0) * scale  # (0, 1]
    second = (bits[1::2] >> np.uint64(11)).astype(np.float64) * scale  # [0, 1)
    radius = np.sqrt(-2.0 * np.log(first))
    angle = 2.0 * np.pi * second
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]


def is_secure(rng: Any) -> bool:
    return isinstance(rng, SecureRandom)
