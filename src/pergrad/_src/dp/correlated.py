"""Correlated noise: matrix-factorisation DP-FTRL, in the conventions of jax-privacy 2.0.0.

A run of ``steps`` steps releases the noisy clipped sums ``x + sigma * M z``: ``x`` the clipped
sums of the steps stacked as rows, ``z`` iid standard normal per step and coordinate, ``M =
C^-1`` the *noising matrix*, ``C`` the lower-triangular Toeplitz *strategy matrix*, and
``sigma = noise_multiplier * max_norm * sensitivity``. Since ``x + sigma M z = M (C x + sigma
z)``, the run is a post-processing of ONE Gaussian release of ``C x``, whose L2 sensitivity
over the allowed participation patterns of one example is ``max_norm * sensitivity``: its DP
event is one ``GaussianDpEvent(noise_multiplier)``, whatever the number of steps (a banded
strategy under cyclic Poisson sampling is accounted with amplification instead:
:mod:`pergrad._src.dp.cyclic`). Step ``t`` adds row ``t`` of ``sigma * M z``, generated as the
steps come (:meth:`CorrelatedNoise.add`):

- :func:`toeplitz`: ``C`` Toeplitz with the given first column, banded when it is shorter than
  the run (``bands = len(strategy_coefs)``). The noise solves ``C x = z`` row by row, keeping
  the ``bands - 1`` last rows of ``x``, each shaped like the model (jax-privacy's
  ``toeplitz.inverse_as_streaming_matrix``; Algorithm 9 of arXiv:2306.08153).
- :func:`blt`: a buffered linear Toeplitz ``C``, first column ``1, t_1, t_2, ...`` with ``t_i =
  sum_j output_scales[j] * buffer_decays[j] ** (i - 1)``; the noise keeps one model-sized
  buffer per decay (jax-privacy's ``BufferedToeplitz.inverse_as_streaming_matrix``; Algorithm 3
  of arXiv:2408.08868).
- :func:`pergrad.dp.optimal_blt` (:mod:`pergrad._src.dp.strategy_optimization`): the BLT
  that minimises ``sensitivity ** 2 * max_error`` for a run.

Participation: an example takes part in at most ``participations`` steps, any two of them at
least ``min_separation`` steps apart (jax-privacy's ``min_sep``: 1 allows consecutive steps;
None is 1, the weakest assumption). :meth:`CorrelatedNoise.sensitivity` is the largest
``||C u||`` over the indicator vectors ``u`` of such patterns, computed at the earliest pattern
(steps ``0, b, 2b, ...``). That is the maximum when the first column of ``C`` is non-negative
and non-increasing (Theorem 2 of arXiv:2405.13763, as jax-privacy's
``toeplitz.minsep_sensitivity_squared`` uses it); the constructors check that property when
``participations > 1`` and refuse other strategies. With one participation the sensitivity is
the norm of the first column (the longest column of a lower-triangular Toeplitz matrix) for any
coefficients.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pergrad._src.backends import backend_of
from pergrad._src.dp.accounting import check_count
from pergrad._src.dp.cyclic import amplified_event, check_amplified_run
from pergrad._src.dp.noise import NoiseMechanism
from pergrad._src.dp.toeplitz_algebra import (
    blt_rational,
    blt_strategy_coefs,
    earliest_pattern_sensitivity_squared,
    lower_triangular_toeplitz,
    prefix_sum_max_error,
    rational_coefs,
)
from pergrad._src.errors import PergradTypeError, PergradValueError

# Coefficients are "non-increasing" up to rounding of this relative size (BLT coefficients are
# sums of powers computed in floating point).
_MONOTONE_TOLERANCE = 1e-12


class CorrelatedNoiseState(NamedTuple):
    """The state of a correlated-noise run: the number of steps taken (an int32 array) and,
    per leaf of the clipped sums in flat order, the mechanism's buffers, each shaped like the
    leaf. A pytree of arrays, so it goes through ``jax.jit``."""

    step: Any
    buffers: tuple[tuple[Any, ...], ...]


class CorrelatedNoise(NoiseMechanism):
    """Noise ``M z`` with ``M = C^-1``, ``C`` a lower-triangular Toeplitz strategy matrix, for
    a run of :attr:`steps` steps (see the module docstring). Made by :func:`toeplitz`,
    :func:`blt` and :func:`pergrad.dp.optimal_blt`.

    Step ``t`` adds ``std * sensitivity() * (M z)[t]`` to the clipped sum, where ``std`` is
    the ``noise_multiplier * max_norm`` that every DP path passes; its DP event is one Gaussian
    release at ``noise_multiplier`` for the whole run.
    """

    def __init__(
        self,
        func_name: str,
        strategy_coefs: np.ndarray,
        coefs_arg: str,
        steps: int,
        participations: int,
        min_separation: int | None,
    ) -> None:
        self._steps = steps
        self._participations = participations
        self._min_separation = min_separation
        self._strategy_coefs = strategy_coefs
        self._strategy_coefs.setflags(write=False)
        self._noising_coefs: np.ndarray | None = None
        self._sensitivity: float | None = None
        # (with a sample_rate, set by the subclass before this, each release is one column)
        if participations > 1 and self.sample_rate is None:
            _check_earliest_pattern_is_worst(func_name, coefs_arg, strategy_coefs, participations)

    # --- the run --------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """The number of steps of the run; :meth:`add` refuses a step past them."""
        return self._steps

    @property
    def sample_rate(self) -> float | None:
        """None: the accounting assumes no amplification by sampling (one Gaussian release).
        A banded :func:`toeplitz` made with ``sample_rate`` returns it (cyclic Poisson
        sampling, amplified accounting)."""
        return None

    @property
    def participations(self) -> int:
        """The largest number of steps one example takes part in."""
        return self._participations

    @property
    def min_separation(self) -> int | None:
        """The smallest gap between two steps of one example (None: 1, any steps)."""
        return self._min_separation

    # --- the matrices ---------------------------------------------------------------------

    def strategy_coefs(self) -> np.ndarray:
        """The first column of ``C``, ``(steps,)`` float64 (zeros past the bands)."""
        return self._strategy_coefs

    def noising_coefs(self) -> np.ndarray:
        """The first column of ``M = C^-1``, ``(steps,)`` float64 (``M`` is Toeplitz too)."""
        if self._noising_coefs is None:
            self._noising_coefs = self._compute_noising_coefs()
            self._noising_coefs.setflags(write=False)
        return self._noising_coefs

    def strategy_matrix(self) -> np.ndarray:
        """``C``, numpy ``(steps, steps)``, lower triangular."""
        return lower_triangular_toeplitz(self.strategy_coefs())

    def noising_matrix(self) -> np.ndarray:
        """``M = C^-1``, numpy ``(steps, steps)``, lower triangular: step ``t``'s noise is
        ``noise_multiplier * max_norm * sensitivity() * (M z)[t]``."""
        return lower_triangular_toeplitz(self.noising_coefs())

    def sensitivity(self) -> float:
        """The largest ``||C u||`` over the indicator vectors ``u`` of the allowed
        participation patterns (at most :attr:`participations` steps, at least
        :attr:`min_separation` apart); sqrt(participations) for DP-SGD (``toeplitz([1.0])``).
        With :attr:`sample_rate` (cyclic Poisson sampling), the norm of one participation's
        column, ``||strategy_coefs||``: the accounting composes the participations.
        """
        if self._sensitivity is None:
            released = 1 if self.sample_rate is not None else self._participations
            squared = earliest_pattern_sensitivity_squared(
                self._strategy_coefs, released, self._min_separation or 1
            )
            self._sensitivity = math.sqrt(squared)
        return self._sensitivity

    def max_error(self) -> float:
        """The largest, over the steps ``t``, expected squared error of the ``t``-th prefix sum
        per unit noise and coordinate: the largest squared row norm of ``A M``, ``A`` the
        lower-triangular matrix of ones; ``steps`` for DP-SGD. The loss that
        :func:`pergrad.dp.optimal_blt` minimises is ``sensitivity() ** 2 * max_error()``."""
        return prefix_sum_max_error(self.noising_coefs())

    # --- the protocol ---------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def num_buffers(self) -> int:
        """The number of arrays shaped like each leaf that the state keeps."""

    @abc.abstractmethod
    def _compute_noising_coefs(self) -> np.ndarray: ...

    @abc.abstractmethod
    def _next_draw(self, z: Any, buffers: tuple[Any, ...], in_place: bool) -> tuple[Any, Any]:
        """``((M z)[t], the next buffers)`` for one leaf, from this step's draw ``z`` (which
        may be overwritten) and the buffers; with ``in_place``, the buffers may be written."""

    def init(self, template: Any) -> CorrelatedNoiseState:
        """Zeroed buffers, :attr:`num_buffers` per leaf of ``template`` (shaped like the
        clipped sums: the parameters will do), and a step count of 0."""
        bk = backend_of(template, f"{type(self).__name__}.init", "template")
        leaves = bk.leaves(template)
        buffers = tuple(
            tuple(_zeros_like(bk, leaf) for _ in range(self.num_buffers)) for leaf in leaves
        )
        # like=None: the count lives on the host for torch, so reading it costs no device sync.
        step = bk.from_numpy(np.zeros((), np.int32), None)
        return CorrelatedNoiseState(step, buffers)

    def add(
        self, summed: Any, std: float, rng: Any, state: Any, *, owned: bool = False
    ) -> tuple[Any, CorrelatedNoiseState]:
        """``summed`` plus this step's row of ``std * sensitivity() * M z``, and the next state.

        A step past :attr:`steps` is refused: a ``ValueError`` where the step count can be read
        (PyTorch; JAX outside ``jax.jit``); under ``jax.jit``, where nothing can be raised, the
        noisy sums of such a step are NaN, so the first update past the run poisons the
        parameters visibly instead of adding noise the accounting does not cover. With
        ``owned``, the sums and the state's buffers are written in place (PyTorch); the caller
        must then keep only the state returned.
        """
        bk = backend_of(summed, f"{type(self).__name__}.add", "summed")
        keys = bk.split_key(rng, len(bk.leaves(summed)))
        return self.add_draws(
            summed,
            lambda index, leaf: bk.standard_normal(keys[index], leaf),
            std,
            state,
            owned=owned,
        )

    def add_draws(
        self,
        summed: Any,
        draw: Callable[[int, Any], Any],
        std: float,
        state: Any,
        *,
        owned: bool = False,
    ) -> tuple[Any, CorrelatedNoiseState]:
        """:meth:`add` with this step's standard-normal draws taken from ``draw(index, leaf)``
        (``index``: the leaf's position in flat order; returns an array shaped like ``leaf``),
        called once per leaf in flat order, after the step count is checked.

        For a caller that draws elsewhere: on an FSDP2 model (``torch/fsdp.py``) rank 0 draws
        each parameter's whole ``z`` and scatters every process its shard, and each process
        keeps the state of its own shards only. The recursion acts on each coordinate alone,
        so a shard's noise is the single-process noise's rows of that shard.
        """
        func_name = f"{type(self).__name__}.add"
        bk = backend_of(summed, func_name, "summed")
        _, leaves, treedef = bk.flatten(summed)
        step, buffers = _check_state(func_name, state, len(leaves), self.num_buffers)
        within = bk.known_all(step < self._steps)
        if within is False:
            raise PergradValueError(
                f"{func_name}: this mechanism is made for a run of steps={self._steps}, and "
                f"step {self._steps + 1} was asked for. Correlated noise is defined for the "
                "run it was made for only; make a mechanism for a longer run."
            )
        scale = std * self.sensitivity()
        seen: set[int] = set()
        noisy, next_buffers = [], []
        for index, (leaf, leaf_buffers) in enumerate(zip(leaves, buffers)):
            in_place = owned and id(leaf) not in seen
            seen.add(id(leaf))
            leaf_noise, leaf_buffers = self._next_draw(draw(index, leaf), leaf_buffers, owned)
            noisy_leaf = _add_into(leaf, scale * leaf_noise, in_place)
            if within is None:  # traced: the step count is known only when the step runs
                noisy_leaf = bk.where(step < self._steps, noisy_leaf, math.nan)
            noisy.append(noisy_leaf)
            next_buffers.append(leaf_buffers)
        return bk.unflatten(treedef, noisy), CorrelatedNoiseState(step + 1, tuple(next_buffers))

    def dp_event(self, dpa: Any, noise_multiplier: float, steps: int, sampled: Any) -> Any:
        """One ``GaussianDpEvent(noise_multiplier)``: the whole run is one Gaussian release of
        ``C x`` with the sensitivity folded into the noise; ``steps`` and ``sampled`` do not
        enter (no amplification by sampling is claimed). With :attr:`sample_rate`, the
        amplified event of cyclic Poisson sampling: ``ceil(steps / min_separation)``
        self-composed Poisson-sampled Gaussian releases (:mod:`pergrad._src.dp.cyclic`)."""
        if self.sample_rate is not None:
            assert self._min_separation is not None  # checked with the sample_rate
            return amplified_event(dpa, noise_multiplier, steps, self._min_separation, sampled)
        return dpa.GaussianDpEvent(noise_multiplier)

    def _run_repr(self) -> str:
        separation = (
            "" if self._min_separation is None else f", min_separation={self._min_separation}"
        )
        rate = "" if self.sample_rate is None else f", sample_rate={self.sample_rate!r}"
        return f"steps={self._steps}, participations={self._participations}{separation}{rate}"

    @abc.abstractmethod
    def _key(self) -> tuple[Any, ...]: ...

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self._key()))


class ToeplitzNoise(CorrelatedNoise):
    """Correlated noise of a (banded) Toeplitz strategy matrix; see :func:`toeplitz`."""

    def __init__(
        self,
        strategy_coefs: Any,
        steps: int,
        participations: int | None = None,
        min_separation: int | None = None,
        sample_rate: float | None = None,
    ) -> None:
        fn = "toeplitz"
        if sample_rate is None:
            participations = 1 if participations is None else participations
            steps, participations, min_separation = check_run(
                fn, steps, participations, min_separation
            )
        else:  # the participations follow from the cyclic sampling
            steps, _, min_separation = check_run(fn, steps, 1, min_separation)
        coefs = _check_vector(fn, "strategy_coefs", strategy_coefs)
        if not 1 <= coefs.size <= steps:
            raise PergradValueError(
                f"{fn}: strategy_coefs must have between 1 and steps={steps} coefficients (the "
                f"first column of C, banded when shorter); got {coefs.size}."
            )
        if not coefs[0] > 0:
            raise PergradValueError(
                f"{fn}: strategy_coefs[0] must be > 0 (the diagonal of C, which must be "
                f"invertible); got {coefs[0]!r}."
            )
        if sample_rate is not None:
            sample_rate, participations = check_amplified_run(
                fn, coefs.size, steps, participations, min_separation, sample_rate
            )
        self._sample_rate = sample_rate
        self._bands_coefs = coefs
        full = np.zeros(steps)
        full[: coefs.size] = coefs
        super().__init__(fn, full, "strategy_coefs", steps, participations, min_separation)

    @property
    def sample_rate(self) -> float | None:
        """The Poisson rate within a group of cyclic Poisson sampling that the accounting
        assumes (amplified), or None (one Gaussian release, no sampling)."""
        return self._sample_rate

    @property
    def bands(self) -> int:
        """The number of nonzero diagonals of ``C`` kept: ``len(strategy_coefs)``."""
        return self._bands_coefs.size

    @property
    def num_buffers(self) -> int:
        return self.bands - 1

    def _compute_noising_coefs(self) -> np.ndarray:
        return rational_coefs([1.0], self._bands_coefs, self._steps)

    def _next_draw(self, z: Any, buffers: tuple[Any, ...], in_place: bool) -> tuple[Any, Any]:
        # Row t of C x = z: x_t = (z_t - sum_i c_i x_{t-i}) / c_0; buffers[i - 1] is x_{t-i}.
        del in_place  # z is this step's own draw; the past rows are kept, not rewritten
        coefs = self._bands_coefs
        for coef, past in zip(coefs[1:], buffers):
            if coef != 0.0:
                z -= float(coef) * past
        if coefs[0] != 1.0:
            z /= float(coefs[0])
        return z, ((z, *buffers[:-1]) if buffers else ())

    def _key(self) -> tuple[Any, ...]:
        return (tuple(self._bands_coefs.tolist()), self._steps, self._participations,
                self._min_separation, self._sample_rate)  # fmt: skip

    def __repr__(self) -> str:
        return f"ToeplitzNoise(strategy_coefs={self._bands_coefs.tolist()}, {self._run_repr()})"


class BLTNoise(CorrelatedNoise):
    """Correlated noise of a buffered linear Toeplitz strategy matrix; see :func:`blt`."""

    def __init__(
        self,
        buffer_decays: Any,
        output_scales: Any,
        steps: int,
        participations: int = 1,
        min_separation: int | None = None,
    ) -> None:
        fn = "blt"
        steps, participations, min_separation = check_run(fn, steps, participations, min_separation)
        decays = _check_vector(fn, "buffer_decays", buffer_decays)
        scales = _check_vector(fn, "output_scales", output_scales)
        if decays.size != scales.size:
            raise PergradValueError(
                f"{fn}: buffer_decays and output_scales must have the same length (one decay "
                f"and one scale per buffer); got {decays.size} and {scales.size}."
            )
        if np.any((decays < 0) | (decays > 1)):
            raise PergradValueError(
                f"{fn}: buffer_decays must be in [0, 1] (a decay above 1 makes C's "
                f"coefficients grow without bound, a negative one makes them oscillate); got "
                f"{decays.tolist()}."
            )
        self._decays, self._scales = decays, scales
        super().__init__(
            fn,
            blt_strategy_coefs(decays, scales, steps),
            "buffer_decays and output_scales",
            steps,
            participations,
            min_separation,
        )

    @property
    def buffer_decays(self) -> np.ndarray:
        """The decay of each buffer, ``(num_buffers,)`` (read-only)."""
        return self._decays

    @property
    def output_scales(self) -> np.ndarray:
        """The output scale of each buffer, ``(num_buffers,)`` (read-only)."""
        return self._scales

    @property
    def num_buffers(self) -> int:
        return self._decays.size

    def _compute_noising_coefs(self) -> np.ndarray:
        numerator, denominator = blt_rational(self._decays, self._scales)
        return rational_coefs(denominator, numerator, self._steps)

    def _next_draw(self, z: Any, buffers: tuple[Any, ...], in_place: bool) -> tuple[Any, Any]:
        # C = I + sum_j scale_j * (strictly lower Toeplitz of decay_j ** (i - 1)); buffer j
        # holds sum_{i >= 1} decay_j ** (i - 1) x_{t-i}, so x_t = z_t - sum_j scale_j buffer_j.
        for scale, buffer in zip(self._scales, buffers):
            z -= float(scale) * buffer
        updated = []
        for decay, buffer in zip(self._decays, buffers):
            if in_place:
                buffer *= float(decay)
                buffer += z
            else:
                buffer = float(decay) * buffer + z
            updated.append(buffer)
        return z, tuple(updated)

    def _key(self) -> tuple[Any, ...]:
        return (tuple(self._decays.tolist()), tuple(self._scales.tolist()), self._steps,
                self._participations, self._min_separation)  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"BLTNoise(buffer_decays={self._decays.tolist()}, "
            f"output_scales={self._scales.tolist()}, {self._run_repr()})"
        )


def toeplitz(
    strategy_coefs: Sequence[float] | np.ndarray,
    *,
    steps: int,
    participations: int | None = None,
    min_separation: int | None = None,
    sample_rate: float | None = None,
) -> ToeplitzNoise:
    """Correlated noise of a lower-triangular Toeplitz strategy matrix ``C`` with this first
    column (banded when shorter than the run).

    Example (banded matrix factorisation, two bands, 1000 steps, one epoch)::

        mech = pergrad.dp.toeplitz([1.0, 0.5], steps=1000)
        mech.sensitivity()     # ||C u|| at the worst participation: here sqrt(1.25)
        mech.noising_matrix()  # M = C^-1, (1000, 1000)
        opt = pergrad.dp.DPOptimizer(..., noise_multiplier=1.0, noise=mech)
        pergrad.dp.epsilon(noise_multiplier=1.0, delta=1e-5, noise=mech)

    ``toeplitz([1.0], steps=n)`` is DP-SGD's noise (``M = I``) accounted without sampling.
    The state keeps ``len(strategy_coefs) - 1`` arrays shaped like the model.

    With ``sample_rate`` (amplified banded matrix factorisation, Choquette-Choo et al. 2023),
    the data are split into ``min_separation`` groups and step ``t`` Poisson-samples group
    ``t % min_separation`` (:func:`pergrad.dp.cyclic_poisson_batches`,
    ``CyclicPoissonBatchSampler``); the strategy must have at most ``min_separation`` bands,
    the sensitivity is one column's norm, and the run is accounted as
    ``ceil(steps / min_separation)`` Poisson-sampled Gaussian steps at ``sample_rate``::

        mech = pergrad.dp.toeplitz([1.0, 0.5], steps=1000, min_separation=4, sample_rate=0.02)
        pergrad.dp.epsilon(noise_multiplier=1.0, delta=1e-5, noise=mech)   # amplified
        batches = pergrad.dp.cyclic_poisson_batches(len(X), noise=mech)
        # expected_batch_size = len(X) * sample_rate / min_separation

    Args:
      strategy_coefs: the first column of ``C``, 1 to ``steps`` finite numbers, the first
        ``> 0``; with ``participations > 1`` non-negative and non-increasing (so that the
        earliest participation pattern is the worst, see the module docstring).
      steps: the number of steps of the run, ``>= 1``.
      participations: the largest number of steps one example takes part in, ``>= 1`` (None:
        1; with ``sample_rate``, ``ceil(steps / min_separation)``, the only value allowed).
      min_separation: the smallest gap between two of them (1: consecutive steps allowed;
        None: 1). One epoch of ``b`` steps repeated in the same order is ``min_separation=b``.
        With ``sample_rate``: the number of groups, required, ``>= len(strategy_coefs)``.
      sample_rate: None (default: no sampling, one Gaussian release), or the Poisson rate
        within the step's group of cyclic Poisson sampling, in ``(0, 1]``.

    Raises:
      ValueError: an argument out of range (the message names it), participations that do
        not fit in the run, or a ``sample_rate`` without ``min_separation`` or with more than
        ``min_separation`` coefficients.
    """
    return ToeplitzNoise(strategy_coefs, steps, participations, min_separation, sample_rate)


def blt(
    buffer_decays: Sequence[float] | np.ndarray,
    output_scales: Sequence[float] | np.ndarray,
    *,
    steps: int,
    participations: int = 1,
    min_separation: int | None = None,
) -> BLTNoise:
    """Correlated noise of a buffered linear Toeplitz (BLT) strategy matrix ``C``: Toeplitz
    with first column ``1, t_1, t_2, ...``, ``t_i = sum_j output_scales[j] *
    buffer_decays[j] ** (i - 1)`` (jax-privacy's ``BufferedToeplitz``).

    Example::

        mech = pergrad.dp.blt([0.98, 0.73], [0.17, 0.31], steps=64)
        mech.sensitivity() ** 2 * mech.max_error()   # the loss optimal_blt minimises

    The state keeps ``len(buffer_decays)`` arrays shaped like the model. Empty lists give
    ``C = I`` (DP-SGD's noise).

    Args:
      buffer_decays: one decay per buffer, in ``[0, 1]``.
      output_scales: one scale per buffer, finite; with ``participations > 1`` the
        coefficients ``t_i`` must be non-negative and non-increasing (``output_scales >= 0``
        with ``sum(output_scales) <= 1`` ensures it).
      steps, participations, min_separation: as for :func:`toeplitz`.

    Raises:
      ValueError: an argument out of range (the message names it).
    """
    return BLTNoise(buffer_decays, output_scales, steps, participations, min_separation)


# --- validation and helpers ----------------------------------------------------------------


def check_run(
    fn: str, steps: Any, participations: Any, min_separation: Any
) -> tuple[int, int, int | None]:
    steps = check_count(fn, "steps", steps, minimum=1)
    participations = check_count(fn, "participations", participations, minimum=1)
    if min_separation is not None:
        min_separation = check_count(fn, "min_separation", min_separation, minimum=1)
    separation = min_separation or 1
    if (participations - 1) * separation + 1 > steps:
        raise PergradValueError(
            f"{fn}: participations={participations} steps at least min_separation="
            f"{separation} apart do not fit in steps={steps} (they span "
            f"{(participations - 1) * separation + 1} steps). Lower participations or "
            "min_separation, or raise steps."
        )
    return steps, participations, min_separation


def _check_vector(fn: str, name: str, value: Any) -> np.ndarray:
    """``value`` (a list, a numpy, JAX or CPU torch array) as 1-D finite float64 numbers."""
    problem = None
    if isinstance(value, (str, bytes)):
        problem = f"{type(value).__name__} {value!r}"
    else:
        try:
            raw = np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as err:
            problem = f"{type(value).__name__} ({err})"
        else:
            if raw.dtype.kind not in "iuf":
                problem = f"{type(value).__name__} of dtype {raw.dtype}"
    if problem is not None:
        raise PergradTypeError(
            f"{fn}: {name} must be a sequence of real numbers (a list or a 1-D array); got "
            f"{problem}."
        )
    array = raw.astype(np.float64)
    if array.ndim != 1:
        raise PergradValueError(f"{fn}: {name} must be 1-D; got shape {array.shape}.")
    if not np.all(np.isfinite(array)):
        raise PergradValueError(f"{fn}: {name} must be finite; got {array.tolist()}.")
    array.setflags(write=False)  # a copy of the caller's, shown by the mechanism's properties
    return array


def _check_earliest_pattern_is_worst(
    fn: str, name: str, coefs: np.ndarray, participations: int
) -> None:
    tolerance = _MONOTONE_TOLERANCE * float(np.max(np.abs(coefs)))
    negative = np.flatnonzero(coefs < -tolerance)
    rising = np.flatnonzero(np.diff(coefs) > tolerance)
    if negative.size == 0 and rising.size == 0:
        return
    if negative.size:
        where = f"coefficient {negative[0]} of C's first column is {coefs[negative[0]]:.6g} < 0"
    else:
        i = rising[0]
        where = (
            f"coefficient {i + 1} of C's first column is {coefs[i + 1]:.6g} > coefficient {i} "
            f"= {coefs[i]:.6g}"
        )
    raise PergradValueError(
        f"{fn}: with participations={participations} the sensitivity is computed at the "
        "earliest participation pattern, the worst one only for strategy coefficients that are "
        f"non-negative and non-increasing (Theorem 2 of arXiv:2405.13763); {name} give "
        f"coefficients that are not: {where}. Use participations=1 or such coefficients."
    )


def _check_state(
    func_name: str, state: Any, num_leaves: int, num_buffers: int
) -> tuple[Any, tuple[Any, ...]]:
    if not isinstance(state, tuple) or len(state) != 2:
        raise PergradTypeError(
            f"{func_name}: state must be what init() (or the last add()) returned; got "
            f"{type(state).__name__}."
        )
    step, buffers = state
    if len(buffers) != num_leaves or any(len(leaf) != num_buffers for leaf in buffers):
        raise PergradValueError(
            f"{func_name}: state was made for {len(buffers)} leaves but summed has "
            f"{num_leaves}; call init() with a template shaped like the clipped sums."
        )
    return step, buffers


def _zeros_like(bk: Any, leaf: Any) -> Any:
    # The backend protocol has no zeros_like: zero a finite copy, keeping dtype and device.
    return bk.stop_gradient(bk.where(bk.isfinite(leaf), leaf, 0.0)) * 0


def _add_into(total: Any, term: Any, in_place: bool) -> Any:
    """``total + term``; with ``in_place``, written into ``total`` where the framework allows
    it (a torch tensor; a JAX array is never written, ``+=`` makes a new one)."""
    if in_place:
        total += term
        return total
    return total + term
