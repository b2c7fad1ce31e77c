"""One call to set up a DP-SGD run: the numbers that must agree, derived together.

    plan = pergrad.dp.plan(num_examples=60000, batch_size=256, epochs=60,
                           target_epsilon=3.0, delta=1e-5)
    plan.noise_multiplier, plan.sample_rate, plan.steps, plan.epsilon()

A DP-SGD run has one sample rate, and it goes into three places: the sampler (each example in
a batch with probability ``sample_rate``), the update (divided by ``expected_batch_size =
sample_rate * num_examples``, not by the realised batch size) and the accountant. The noise
multiplier comes from a target epsilon through the same accountant and the same number of
steps as the run. :class:`DPPlan` holds them, derived once from the dataset size, the batch
size, the epochs (or steps) and a target epsilon (or a noise multiplier);
:class:`RunBatches` draws the run's batches, one epoch per pass, and refuses to go past the
planned steps. The framework integrations build on them: ``pergrad.dp.make_private``
(``torch/make_private.py``: a ``DPOptimizer`` and a ``DataLoader``) and
``pergrad.dp.make_private_optax`` (``jax/make_private.py``: an optax transformation and a
loader of padded ``(x, y, mask)`` batches); both return a :class:`DPSetup`.

The sampling follows the noise mechanism: independent Gaussian noise (:func:`gaussian`, the
default) is accounted for Poisson sampling (:func:`poisson_batches`); a banded Toeplitz
mechanism made with ``sample_rate`` (:func:`toeplitz`) for cyclic Poisson sampling
(:func:`cyclic_poisson_batches`), whose run and rate it fixes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pergrad._src.backends import backend_of
from pergrad._src.dp.accounting import (
    ACCOUNTANTS,
    Accountant,
    check_count,
    check_real,
    epsilon,
    noise_multiplier_for,
)
from pergrad._src.dp.cyclic import cyclic_poisson_batches
from pergrad._src.dp.noise import NoiseMechanism, check_mechanism
from pergrad._src.dp.sampling import max_batch_size_for, pad_batch, poisson_batches
from pergrad._src.errors import PergradTypeError, PergradValueError

DEFAULT_ACCOUNTANT = "pld"


@dataclass(frozen=True, repr=False)
class DPPlan:
    """The numbers of one DP-SGD run, consistent with each other (made by :func:`plan`).

    Attributes:
      num_examples: the dataset size ``N``.
      expected_batch_size: the mean batch size, ``N * sample_rate`` (``N * sample_rate /
        min_separation`` under cyclic Poisson sampling): what the update divides by.
      sample_rate: the Poisson sample rate the accountant uses (within a group under cyclic
        Poisson sampling).
      steps: the run's number of steps (batches), empty batches included.
      steps_per_epoch: ``ceil(N / expected_batch_size)``, the batches of one pass of the
        loaders.
      noise_multiplier: the noise standard deviation over the clipping bound.
      delta: the delta of ``(epsilon, delta)``-DP.
      accountant: ``"pld"`` or ``"rdp"``.
      noise: the noise mechanism.
      target_epsilon: the epsilon asked for, or None where ``noise_multiplier`` was given.
      min_separation: the number of groups of cyclic Poisson sampling (1: plain Poisson).
    """

    num_examples: int
    expected_batch_size: float
    sample_rate: float
    steps: int
    steps_per_epoch: int
    noise_multiplier: float
    delta: float
    accountant: str
    noise: NoiseMechanism
    target_epsilon: float | None = None
    min_separation: int = 1
    _epsilon: list[float] = field(default_factory=list, compare=False, init=False)  # cache

    @property
    def epochs(self) -> float:
        """The expected number of passes over the data: ``steps * expected_batch_size / N``."""
        return self.steps * self.expected_batch_size / self.num_examples

    @property
    def cyclic(self) -> bool:
        """Whether the batches are drawn by cyclic Poisson sampling (a banded mechanism)."""
        return self.noise.steps is not None

    def epsilon(self) -> float:
        """The epsilon of the whole run (all :attr:`steps`), at :attr:`delta`, with
        :attr:`accountant`; at most :attr:`target_epsilon` where one was given. (An
        :class:`Accountant` counts what the steps taken so far spent.)"""
        if not self._epsilon:
            self._epsilon.append(self._account(epsilon, self.noise_multiplier))
        return self._epsilon[0]

    def make_accountant(self) -> Accountant:
        """A fresh :class:`Accountant` of this run (0 steps counted)."""
        if self.cyclic:
            return Accountant(
                self.noise_multiplier,
                delta=self.delta,
                accountant=self.accountant,
                noise=self.noise,
            )
        return Accountant(
            self.noise_multiplier, self.sample_rate, self.delta, self.accountant, noise=self.noise
        )

    def max_batch_size(self, overflow_probability: float | None = None) -> int:
        """The padded size of the run's batches (:func:`max_batch_size_for` of the per-step
        inclusion probability): by default, the chance that any of the :attr:`steps` batches
        exceeds it is at most ``1e-6``."""
        if overflow_probability is None:
            overflow_probability = 1e-6 / max(self.steps, 1)
        return max_batch_size_for(
            self.num_examples, self.sample_rate / self.min_separation, overflow_probability
        )

    def batches(self, seed: int | None = None) -> Iterator[np.ndarray]:
        """The run's :attr:`steps` batches of indices, in one stream (numpy ``int64``):
        :func:`poisson_batches`, or :func:`cyclic_poisson_batches` for a banded mechanism.
        ``seed``: as for :func:`poisson_batches` (None: a secure random seed)."""
        if self.cyclic:
            return cyclic_poisson_batches(self.num_examples, seed=seed, noise=self.noise)
        return poisson_batches(self.num_examples, self.sample_rate, self.steps, seed)

    def _account(self, compute: Callable[..., float], value: float) -> float:
        """``compute`` (:func:`epsilon` of a noise multiplier, or :func:`noise_multiplier_for`
        of a target epsilon) for this run."""
        rate = None if self.cyclic else {"sample_rate": self.sample_rate, "steps": self.steps}
        return compute(
            value, delta=self.delta, accountant=self.accountant, noise=self.noise, **(rate or {})
        )

    def __repr__(self) -> str:
        target = "" if self.target_epsilon is None else f", target_epsilon={self.target_epsilon:g}"
        cyclic = f", min_separation={self.min_separation}" if self.cyclic else ""
        return (
            f"DPPlan(num_examples={self.num_examples}, "
            f"expected_batch_size={self.expected_batch_size:g}, "
            f"sample_rate={self.sample_rate:.6g}{cyclic}, steps={self.steps}, "
            f"epochs={self.epochs:.4g}, noise_multiplier={self.noise_multiplier:.6g}"
            f"{target}, delta={self.delta:g}, accountant={self.accountant!r}, "
            f"noise={self.noise!r})"
        )


def plan(
    num_examples: int,
    batch_size: float | None = None,
    *,
    delta: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    noise: NoiseMechanism | None = None,
) -> DPPlan:
    """The numbers of a DP-SGD run, derived together from the dataset and the budget.

    Example (the classic MNIST setting)::

        run = pergrad.dp.plan(60000, batch_size=256, epochs=60, target_epsilon=3.0,
                              delta=1e-5)
        run.noise_multiplier   # about 0.97 ("pld"; 1.01 with accountant="rdp")
        run.sample_rate        # 256 / 60000
        run.steps              # 60 * ceil(60000 / 256) = 14100
        run.epsilon()          # <= 3.0

    ``sample_rate = batch_size / num_examples`` (each example joins each batch independently
    with this probability, so ``batch_size`` is the expected batch size, which the update
    divides by); ``steps_per_epoch = ceil(num_examples / batch_size)``, and ``epochs``
    gives ``steps = ceil(epochs * steps_per_epoch)`` (Opacus's count: epochs times the
    loader's length). With ``target_epsilon``, the noise multiplier is the smallest that keeps
    the run within it (:func:`noise_multiplier_for`, same accountant and steps).

    **The accountant.** ``"pld"`` (default) accounts the sampled Gaussian mechanism through
    privacy loss distributions: numerically close to exact, as Opacus's default PRV accountant
    is, so a run compares with Opacus's epsilon. ``"rdp"`` (Rényi DP, Opacus's
    ``accountant="rdp"``, TensorFlow Privacy's and JAX's example's) is an upper bound that is
    looser: the same noise reports a larger epsilon (2.60 against 2.38 for the MNIST setting
    with noise 1.1), so a target epsilon needs more noise (1.01 against 0.97 above), which
    costs accuracy for no privacy. PLD costs seconds to calibrate (about 10 s on 2 CPU cores),
    once per run; RDP well under a second.

    **Correlated noise.** ``noise=pergrad.dp.toeplitz(coefs, steps=, min_separation=,
    sample_rate=)`` (banded, with amplification by cyclic Poisson sampling) fixes the run: its
    ``steps`` and ``sample_rate`` are taken (``epochs``, ``steps`` and ``batch_size``, when
    given, must agree: ``batch_size`` with ``num_examples * sample_rate / min_separation``),
    and the batches are drawn by :func:`cyclic_poisson_batches`. A mechanism accounted without
    sampling (made without ``sample_rate``) needs batches this setup does not draw; set it up
    from the pieces (the DP-SGD guide).

    Args:
      num_examples: the dataset size, an int ``>= 1``.
      batch_size: the expected batch size, ``> 0`` and at most ``num_examples``; may be left
        out with a mechanism that fixes the sample rate.
      delta: the delta of ``(epsilon, delta)``-DP, in ``(0, 1)``; below ``1 / num_examples``.
      epochs: passes over the data (exactly one of ``epochs`` and ``steps``, unless the
        mechanism fixes the steps).
      steps: the number of steps.
      target_epsilon: the epsilon to reach (exactly one of ``target_epsilon`` and
        ``noise_multiplier``).
      noise_multiplier: the noise standard deviation over the clipping bound, ``>= 0``.
      accountant: ``"pld"`` (default) or ``"rdp"``.
      noise: the noise mechanism (None: :func:`pergrad.dp.gaussian`).

    Returns:
      A :class:`DPPlan`.

    Raises:
      ValueError, TypeError: an argument missing, out of range or of the wrong type, or
        arguments that disagree (with each other or with ``noise``); the message names them.
    """
    fn = "plan"
    num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
    mechanism = check_mechanism(fn, noise)
    _check_choice(fn, "accountant", accountant, ACCOUNTANTS)
    _check_one_of(fn, ("target_epsilon", target_epsilon), ("noise_multiplier", noise_multiplier))
    if mechanism.steps is not None:
        sample_rate, steps, min_separation, expected = _run_of_mechanism(
            fn, mechanism, num_examples, batch_size, epochs, steps
        )
        steps_per_epoch = math.ceil(num_examples / expected - 1e-9)
    else:
        _check_one_of(fn, ("epochs", epochs), ("steps", steps))
        expected = _check_batch_size(fn, batch_size, num_examples)
        sample_rate, min_separation = expected / num_examples, 1
        steps_per_epoch = math.ceil(num_examples / expected - 1e-9)
        steps = _steps_of(fn, epochs, steps, steps_per_epoch)
    delta = check_real(fn, "delta", delta)
    if not 0.0 < delta < 1.0:
        raise PergradValueError(
            f"{fn}: delta must be in (0, 1), typically below 1 / num_examples = "
            f"{1 / num_examples:.3g}, got {delta!r}."
        )
    run = DPPlan(
        num_examples=num_examples,
        expected_batch_size=expected,
        sample_rate=sample_rate,
        steps=steps,
        steps_per_epoch=max(steps_per_epoch, 1),
        noise_multiplier=0.0,
        delta=delta,
        accountant=accountant,
        noise=mechanism,
        min_separation=min_separation,
    )
    if target_epsilon is not None:
        sigma = run._account(noise_multiplier_for, target_epsilon)
        return dataclasses.replace(
            run, noise_multiplier=float(sigma), target_epsilon=float(target_epsilon)
        )
    sigma = check_real(fn, "noise_multiplier", noise_multiplier)
    if not 0.0 <= sigma < math.inf:
        raise PergradValueError(
            f"{fn}: noise_multiplier must be finite and >= 0 (the noise standard deviation "
            f"over the clipping bound), got {noise_multiplier!r}."
        )
    return dataclasses.replace(run, noise_multiplier=sigma)


def _check_choice(fn: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PergradValueError(f"{fn}: {name} must be one of {list(choices)}, got {value!r}.")


def _check_one_of(fn: str, first: tuple[str, Any], second: tuple[str, Any]) -> None:
    given = [name for name, value in (first, second) if value is not None]
    if len(given) != 1:
        got = "both" if given else "neither"
        raise PergradTypeError(
            f"{fn}: pass exactly one of {first[0]}= and {second[0]}=; got {got}."
        )


def _check_batch_size(fn: str, batch_size: Any, num_examples: int) -> float:
    if batch_size is None:
        raise PergradTypeError(
            f"{fn}: batch_size must be a number (the expected batch size, sample_rate * "
            f"num_examples), got None."
        )
    value = check_real(fn, "batch_size", batch_size)
    if not 0.0 < value <= num_examples:
        raise PergradValueError(
            f"{fn}: batch_size must be in (0, num_examples={num_examples}] (the expected batch "
            f"size), got {batch_size!r}."
        )
    return value


def _steps_of(fn: str, epochs: Any, steps: Any, steps_per_epoch: int) -> int:
    if steps is not None:
        return check_count(fn, "steps", steps, minimum=1)
    value = check_real(fn, "epochs", epochs)
    if not 0.0 < value < math.inf:
        raise PergradValueError(f"{fn}: epochs must be finite and > 0, got {epochs!r}.")
    # (1e-9: 0.3 * 10 is 3.0000000000000004, which is 3 steps, not 4)
    return max(1, math.ceil(value * steps_per_epoch - 1e-9))


def _run_of_mechanism(
    fn: str,
    mechanism: NoiseMechanism,
    num_examples: int,
    batch_size: Any,
    epochs: Any,
    steps: Any,
) -> tuple[float, int, int, float]:
    """``(sample_rate, steps, min_separation, expected batch size)`` of a mechanism made for
    one run, with the caller's values checked against them."""
    rate, min_separation = mechanism.sample_rate, getattr(mechanism, "min_separation", None)
    if rate is None or min_separation is None:
        raise PergradValueError(
            f"{fn}: noise={mechanism!r} is accounted without sampling (made without "
            f"sample_rate): each example must take part in at most its participations, "
            f"min_separation steps apart, and this setup draws Poisson batches, which do not "
            f"ensure that. Make it with pergrad.dp.toeplitz(..., min_separation=..., "
            f"sample_rate=...) for cyclic Poisson sampling, or set the run up from the pieces "
            f"(DPOptimizer / optax_aggregate with noise=, and your own batches)."
        )
    run_steps = mechanism.steps
    assert run_steps is not None
    expected = num_examples * rate / min_separation
    if steps is not None and steps != run_steps:
        raise PergradValueError(
            f"{fn}: steps={steps!r} disagrees with noise={mechanism!r}, made for "
            f"steps={run_steps}; leave steps out."
        )
    if epochs is not None:
        raise PergradValueError(
            f"{fn}: epochs={epochs!r} with noise={mechanism!r}, which fixes the run "
            f"({run_steps} steps, {run_steps * rate / min_separation:.4g} epochs); leave "
            f"epochs out."
        )
    if batch_size is not None and abs(check_real(fn, "batch_size", batch_size) - expected) > 1:
        raise PergradValueError(
            f"{fn}: batch_size={batch_size!r} disagrees with noise={mechanism!r}: its cyclic "
            f"Poisson batches hold num_examples * sample_rate / min_separation = "
            f"{num_examples} * {rate:g} / {min_separation} = {expected:.6g} examples on "
            f"average; leave batch_size out."
        )
    return rate, run_steps, min_separation, expected


class RunBatches:
    """The batches of one planned run, one epoch per pass, never more than its steps.

    Each ``iter()`` yields the next ``steps_per_epoch`` batches of the run's stream (fewer in
    the last pass) as numpy index arrays; once the run's :attr:`DPPlan.steps` are drawn,
    iterating again raises: the accounting covers those steps only, and more would spend
    privacy nobody accounted for. Every batch drawn calls ``on_batch`` (an
    :class:`Accountant`'s ``step``, for a loop that nothing else counts in).
    """

    def __init__(
        self,
        run: DPPlan,
        seed: int | None = None,
        on_batch: Callable[[], None] | None = None,
        stream: Iterator[Any] | None = None,
    ) -> None:
        self.plan = run
        self._stream = iter(run.batches(seed) if stream is None else stream)
        self._drawn = 0
        self._on_batch = on_batch

    @property
    def drawn(self) -> int:
        """The batches drawn so far."""
        return self._drawn

    def __len__(self) -> int:
        """The batches the next pass yields (0 once the run is spent)."""
        return min(self.plan.steps_per_epoch, self.plan.steps - self._drawn)

    def __iter__(self) -> Iterator[Any]:
        if self._drawn >= self.plan.steps:
            raise PergradValueError(
                f"the planned run of {self.plan.steps} steps is spent: its privacy accounting "
                f"(epsilon {self.plan.epsilon():.4g} at delta {self.plan.delta:g}) covers those "
                f"steps only. To train longer, plan a longer run (more epochs or steps, for the "
                f"same or a larger target_epsilon) and start again."
            )
        return self._epoch(len(self))

    def _epoch(self, count: int) -> Iterator[Any]:
        for _ in range(count):
            batch = next(self._stream)
            self._drawn += 1
            if self._on_batch is not None:
                self._on_batch()
            yield batch


@dataclass(frozen=True, repr=False)
class DPSetup:
    """What ``pergrad.dp.make_private`` / ``make_private_optax`` set up, consistent with
    each other; unpacks as ``optimizer, loader, accountant = setup``.

    Attributes:
      optimizer: a :class:`pergrad.dp.DPOptimizer` (PyTorch), or the optax transformation
        (JAX).
      loader: the run's batches, one epoch per pass: a ``torch.utils.data.DataLoader``
        (PyTorch) or a :class:`PaddedPoissonLoader` of ``(x, y, mask)`` (JAX).
      accountant: the run's :class:`Accountant`, stepped once per step (by the optimizer in
        PyTorch, by the loader in JAX).
      plan: the run's numbers (:class:`DPPlan`).
      max_norm: the clipping bound.
    """

    optimizer: Any
    loader: Any
    accountant: Accountant
    plan: DPPlan
    max_norm: Any

    def __iter__(self) -> Iterator[Any]:
        return iter((self.optimizer, self.loader, self.accountant))

    @property
    def noise_multiplier(self) -> float:
        return self.plan.noise_multiplier

    @property
    def sample_rate(self) -> float:
        return self.plan.sample_rate

    @property
    def steps(self) -> int:
        return self.plan.steps

    @property
    def expected_batch_size(self) -> float:
        return self.plan.expected_batch_size

    def epsilon(self) -> float:
        """The epsilon of the whole planned run (:meth:`DPPlan.epsilon`); the accountant's
        ``epsilon()`` is what the steps taken so far spent."""
        return self.plan.epsilon()

    def __repr__(self) -> str:
        return (
            f"DPSetup(optimizer={type(self.optimizer).__name__}, loader="
            f"{type(self.loader).__name__}, max_norm={self.max_norm!r}, plan={self.plan!r}, "
            f"steps taken={self.accountant.steps})"
        )


class PaddedPoissonLoader:
    """A run's batches of arrays, each padded to one size with its mask: ``(*arrays, mask)``.

    Example (JAX; ``pergrad.dp.make_private_optax`` makes one)::

        run = pergrad.dp.plan(len(X), batch_size=64, epochs=10, target_epsilon=3.0, delta=1e-5)
        loader = pergrad.dp.PaddedPoissonLoader(X, Y, plan=run, accountant=accountant)
        for epoch in range(10):
            for x, y, mask in loader:      # x (M, ...), y (M,), mask (M,): one shape, one jit
                params, state = step(params, state, x, y, mask)

    Each batch is the plan's (Poisson, or cyclic Poisson for a banded mechanism), padded by
    :func:`pad_batch` to :attr:`max_batch_size` (:meth:`DPPlan.max_batch_size`: no batch of
    the run exceeds it but with probability ``1e-6``), so ``jax.jit`` compiles one step; the
    padding rows are copies of example 0 and ``mask`` is False there, so pass ``mask`` to
    the DP reduction. Arrays of either framework (JAX arrays, torch tensors); the mask comes
    in the same framework. One pass is one epoch (:attr:`DPPlan.steps_per_epoch` batches;
    ``len(loader)``); iterating past the plan's steps raises. With ``accountant``, every batch
    drawn steps it (empty ones too), as the accounting assumes.

    Args:
      *arrays: the dataset, arrays with a leading axis of ``plan.num_examples``.
      plan: the run (:func:`pergrad.dp.plan`).
      seed: the sampling's seed (None: a secure random seed; see :func:`poisson_batches`).
      accountant: an :class:`Accountant` to step once per batch, or None.
      max_batch_size: the padded size (None: :meth:`DPPlan.max_batch_size`).
    """

    def __init__(
        self,
        *arrays: Any,
        plan: DPPlan,
        seed: int | None = None,
        accountant: Accountant | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        fn = "PaddedPoissonLoader"
        if not arrays:
            raise PergradTypeError(f"{fn}: pass the dataset's arrays (X, Y, ...); got none.")
        if not isinstance(plan, DPPlan):
            raise PergradTypeError(
                f"{fn}: plan must be a pergrad.dp.DPPlan (from pergrad.dp.plan), got "
                f"{type(plan).__name__}."
            )
        self._backend = backend_of(arrays, fn, "arrays")
        for position, array in enumerate(arrays):
            size = self._backend.shape(array)[0] if self._backend.shape(array) else None
            if size != plan.num_examples:
                raise PergradValueError(
                    f"{fn}: array {position} must have a leading axis of plan.num_examples="
                    f"{plan.num_examples} (one row per example), got shape "
                    f"{tuple(self._backend.shape(array))}."
                )
        if accountant is not None and not isinstance(accountant, Accountant):
            raise PergradTypeError(
                f"{fn}: accountant must be a pergrad.dp.Accountant or None, got "
                f"{type(accountant).__name__}."
            )
        self.arrays = arrays
        self.plan = plan
        self.max_batch_size = (
            plan.max_batch_size()
            if max_batch_size is None
            else check_count(fn, "max_batch_size", max_batch_size, minimum=1)
        )
        self._batches = RunBatches(plan, seed, None if accountant is None else accountant.step)

    def __len__(self) -> int:
        """The batches of the next pass (0 once the run is spent)."""
        return len(self._batches)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return self._padded(iter(self._batches))

    def _padded(self, epoch: Iterator[np.ndarray]) -> Iterator[tuple[Any, ...]]:
        like = self.arrays[0]
        for indices in epoch:
            padded, mask = pad_batch(indices, self.max_batch_size)
            rows = self._backend.from_numpy(padded, like)
            yield (
                *(array[rows] for array in self.arrays),
                self._backend.from_numpy(mask, like),
            )

    def __repr__(self) -> str:
        return (
            f"PaddedPoissonLoader({len(self.arrays)} arrays, max_batch_size="
            f"{self.max_batch_size}, batches drawn {self._batches.drawn} of {self.plan.steps})"
        )
