"""Noise mechanisms: what every DP path adds to the clipped sum, and what the accountant reads.

A mechanism describes the noise of one training run. It is a pure object in the manner of
optax's transformations: its state (buffers of past draws, a step counter) lives outside it,
made by :meth:`NoiseMechanism.init` and threaded through :meth:`NoiseMechanism.add` by the
caller (``DPOptimizer`` holds it; ``optax_aggregate`` keeps it in its optax state). Its privacy
is its DP event, :meth:`NoiseMechanism.dp_event`, which :func:`pergrad.dp.epsilon`,
:func:`pergrad.dp.noise_multiplier_for` and :class:`pergrad.dp.Accountant` hand to
``dp_accounting``. Every DP path takes a mechanism through ``noise=``; the default is
:func:`gaussian`, independent Gaussian noise at every step (DP-SGD).

A new mechanism is one subclass in one module::

    class MyNoise(NoiseMechanism):
        def init(self, template):             # state for a run; template: like the sums
            return ...
        def add(self, summed, std, rng, state, *, owned=False):
            return noisy, new_state           # summed + this step's noise of scale std
        def dp_event(self, dpa, noise_multiplier, steps, sampled):
            return ...                        # a dp_accounting.DpEvent for the whole run

A mechanism made for one run (correlated noise, :mod:`pergrad._src.dp.correlated`) also says
its :attr:`NoiseMechanism.steps` and :attr:`NoiseMechanism.sample_rate`, which the accounting
then takes from it.

The noise is drawn through the backend protocol (``standard_normal``, ``split_key``,
``add_scaled``), so one mechanism serves JAX and PyTorch, a ``torch.Generator``, a JAX key and
:class:`pergrad.dp.SecureRandom` alike.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

from pergrad._src.backends import backend_of
from pergrad._src.errors import PergradTypeError, PergradValueError


class NoiseMechanism(abc.ABC):
    """The noise of one DP training run (see the module docstring).

    ``std`` in :meth:`add` is the standard deviation of one step's noise per coordinate,
    ``noise_multiplier * sensitivity`` of the clipped sum (``max_norm`` for flat clipping);
    a mechanism that correlates its draws across steps scales them by it.
    """

    @property
    def steps(self) -> int | None:
        """The number of steps of the run this mechanism is made for, or None for a mechanism
        that serves a run of any length (:func:`gaussian`). The accounting takes ``steps`` from
        a mechanism that fixes them, and :meth:`add` may refuse a step past them."""
        return None

    @property
    def sample_rate(self) -> float | None:
        """Read only where :attr:`steps` is not None: the Poisson sample rate that the
        mechanism's DP event assumes, None where it assumes no sampling (the accounting then
        takes no ``sample_rate``). A mechanism that fixes no run leaves the sampling to the
        caller of the accounting."""
        return None

    def init(self, template: Any) -> Any:
        """The state of a fresh run; ``template`` is a pytree shaped like the clipped sums
        (for buffers). Stateless mechanisms keep the default, ``()``."""
        del template
        return ()

    @abc.abstractmethod
    def add(
        self, summed: Any, std: float, rng: Any, state: Any, *, owned: bool = False
    ) -> tuple[Any, Any]:
        """``(summed + this step's noise, the next state)``.

        Args:
          summed: a pytree of arrays, the clipped sum of one step.
          std: the noise scale, ``noise_multiplier * sensitivity``.
          rng: a JAX key, a ``torch.Generator`` (None: torch's global one) or a
            :class:`pergrad.dp.SecureRandom`.
          state: what :meth:`init` (or the last call) returned.
          owned: True when the caller owns ``summed``'s arrays and lets the noise be written
            into them (PyTorch; JAX arrays are never written).
        """

    @abc.abstractmethod
    def dp_event(
        self, dpa: Any, noise_multiplier: float, steps: int, sampled: Callable[[Any], Any]
    ) -> Any:
        """The ``dp_accounting`` event of ``steps`` steps of this noise at ``noise_multiplier``.

        Args:
          dpa: the ``dp_accounting`` module.
          noise_multiplier: the noise scale divided by the sensitivity.
          steps: the number of steps.
          sampled: wraps the event of one step's release in the run's batch sampling
            (Poisson, or fixed-size batches without replacement).
        """


class GaussianNoise(NoiseMechanism):
    """Independent Gaussian noise at every step: ``N(0, std^2)`` per coordinate (DP-SGD).

    Stateless; its run is ``steps`` self-composed sampled Gaussian mechanisms.
    """

    def add(
        self, summed: Any, std: float, rng: Any, state: Any, *, owned: bool = False
    ) -> tuple[Any, Any]:
        return add_independent_gaussian(summed, std, rng, owned=owned), state

    def dp_event(
        self, dpa: Any, noise_multiplier: float, steps: int, sampled: Callable[[Any], Any]
    ) -> Any:
        return dpa.SelfComposedDpEvent(sampled(dpa.GaussianDpEvent(noise_multiplier)), steps)

    def __repr__(self) -> str:
        return "GaussianNoise()"

    def __eq__(self, other: object) -> bool:
        return type(other) is GaussianNoise

    def __hash__(self) -> int:
        return hash(GaussianNoise)


def gaussian() -> GaussianNoise:
    """Independent Gaussian noise at every step, the noise of DP-SGD (every ``noise=``'s
    default)."""
    return GaussianNoise()


def add_independent_gaussian(summed: Any, std: float, rng: Any, *, owned: bool = False) -> Any:
    """``summed`` plus ``std * z``, ``z`` iid standard normal per entry, one draw per leaf in
    flat order (PyTorch on a CPU: a leaf of more than ``2**20`` numbers drawn in chunks, each
    from a generator seeded from ``rng``, side by side: ``torch_backend.NOISE_CHUNK_NUMBERS``). With ``owned``, each draw is written into its leaf (the same numbers: ``std *
    z`` rounded, then added); a leaf that appears twice in ``summed`` gets two draws, and the
    second is added to a copy."""
    if isinstance(std, bool) or not isinstance(std, (int, float)) or std < 0:
        raise PergradValueError(f"add_noise: std must be a number >= 0; got {std!r}.")
    bk = backend_of(summed, "add_noise", "summed")
    _, leaves, treedef = bk.flatten(summed)
    keys = bk.split_key(rng, len(leaves))
    seen: set[int] = set()
    in_place = []
    for leaf in leaves:
        in_place.append(owned and id(leaf) not in seen)
        seen.add(id(leaf))
    noisy = []
    for group in _groups([math.prod(bk.shape(leaf)) for leaf in leaves]):
        # each leaf's draw in flat order, as one leaf at a time would: the same numbers
        draws = [bk.standard_normal(keys[k], leaves[k]) for k in group]
        noisy += bk.add_scaled([leaves[k] for k in group], draws, std, [in_place[k] for k in group])
    return bk.unflatten(treedef, noisy)


# The noise is drawn and added a group of leaves at a time, the draws of a group held together
# (for one foreach op a group, ``add_scaled``): at most this many numbers, or one leaf.
GROUP_NUMBERS = 2**24


def _groups(sizes: list[int]) -> list[list[int]]:
    """Consecutive positions of ``sizes`` (numbers of entries), each group at most
    :data:`GROUP_NUMBERS` in all or a single larger one."""
    groups: list[list[int]] = []
    total = 0
    for k, size in enumerate(sizes):
        if not groups or total + size > GROUP_NUMBERS:
            groups.append([])
            total = 0
        groups[-1].append(k)
        total += size
    return groups


def check_mechanism(func_name: str, noise: Any) -> NoiseMechanism:
    """``noise`` as a mechanism: None is :func:`gaussian`."""
    if noise is None:
        return GaussianNoise()
    if not isinstance(noise, NoiseMechanism):
        raise PergradTypeError(
            f"{func_name}: noise must be a noise mechanism (pergrad.dp.gaussian(), or a "
            f"subclass of pergrad.dp.NoiseMechanism) or None; got {type(noise).__name__}."
        )
    return noise
