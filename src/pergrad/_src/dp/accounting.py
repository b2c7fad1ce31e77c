"""Privacy accounting for DP-SGD, through Google's ``dp-accounting`` library.

    eps = epsilon(noise_multiplier=1.1, sample_rate=256 / 60000, steps=14062, delta=1e-5)
    sigma = noise_multiplier_for(target_epsilon=3.0, delta=1e-5, sample_rate=256 / 60000,
                                 steps=14062)
    accountant = Accountant(noise_multiplier=1.1, sample_rate=256 / 60000, delta=1e-5)
    accountant.step(); accountant.epsilon()

One DP-SGD step is modelled as a sampled Gaussian mechanism: a batch is sampled from the
dataset (Poisson sampling by default: each example independently with probability
``sample_rate``, see :mod:`pergrad._src.dp.sampling`), each example's gradient is clipped to norm
``C``, the clipped gradients are summed, and Gaussian noise of standard deviation
``noise_multiplier * C`` is added. ``steps`` such steps compose. No privacy math is written
here: the DpEvent describing the run is handed to ``dp_accounting``'s RDP or PLD accountant.

A noise mechanism made for one run (correlated noise: :func:`pergrad.dp.toeplitz`,
:func:`pergrad.dp.blt`, :func:`pergrad.dp.optimal_blt`) knows its ``steps`` and
``sample_rate``; with ``noise=`` such a mechanism they are taken from it (passing values that
disagree is an error)::

    mech = pergrad.dp.optimal_blt(steps=1000)
    eps = epsilon(noise_multiplier=4.0, delta=1e-5, noise=mech)   # one Gaussian release

``dp-accounting`` is an optional dependency (``pip install 'pergrad[dp]'``); it is imported
when a function here is called, not when pergrad is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pergrad._src.dp.accounting_checks import (
    check_choice,
    check_count,
    check_delta,
    check_noise_multiplier_value,
    check_real,
    check_sample_rate,
    import_dp_accounting,
    quiet_convergence_warnings,
)
from pergrad._src.dp.noise import NoiseMechanism, check_mechanism
from pergrad._src.errors import PergradTypeError, PergradValueError

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")

# noise_multiplier_for searches noise multipliers in [2**-20, 2**20]; outside that range no
# training run is sensible, and an unreachable target would otherwise search forever.
_MIN_NOISE_MULTIPLIER = 2.0**-20
_MAX_NOISE_MULTIPLIER = 2.0**20


@dataclass(frozen=True)
class _Setting:
    """Everything about a run except its noise multiplier and step count, validated.

    ``batch_size`` and ``num_examples`` are set for ``sampling="fixed"`` only.
    """

    sample_rate: float | None  # None: a mechanism accounted without sampling
    delta: float
    accountant: str
    sampling: str
    batch_size: int | None
    num_examples: int | None
    noise: NoiseMechanism

    @classmethod
    def validated(
        cls,
        fn: str,
        sample_rate: Any,
        delta: Any,
        accountant: Any,
        sampling: Any,
        num_examples: Any,
        noise: Any = None,
    ) -> _Setting:
        mechanism = check_mechanism(fn, noise)
        delta = check_delta(fn, delta)
        check_choice(fn, "accountant", accountant, ACCOUNTANTS)
        check_choice(fn, "sampling", sampling, SAMPLINGS)
        if sample_rate is None:  # _resolve_run allows it for a mechanism without sampling only
            if sampling != "poisson":
                raise PergradValueError(
                    f"{fn}: sampling={sampling!r} does not apply to noise={mechanism!r}: it is "
                    "accounted without sampling, for datasets that differ by adding or "
                    "removing one example (the relation its sensitivity is computed for). "
                    "Leave sampling out."
                )
            setting = cls(None, delta, accountant, sampling, None, None, mechanism)
            setting._check_supported(fn)
            return setting
        sample_rate = check_sample_rate(fn, sample_rate)
        if sampling == "poisson":
            setting = cls(sample_rate, delta, accountant, sampling, None, None, mechanism)
        else:
            num_examples, batch_size = _check_fixed_batch(fn, sample_rate, num_examples)
            setting = cls(
                sample_rate, delta, accountant, sampling, batch_size, num_examples, mechanism
            )
        setting._check_supported(fn)
        return setting

    def fresh_accountant(self, dpa: Any, accountant: str | None = None) -> Any:
        # Poisson sampling is analysed for add-or-remove-one neighbours, sampling without
        # replacement (fixed batch size) for replace-one neighbours: the relations
        # dp_accounting supports for each.
        relation = (
            dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
            if self.sampling == "poisson"
            else dpa.NeighboringRelation.REPLACE_ONE
        )
        if (accountant or self.accountant) == "rdp":
            return dpa.rdp.RdpAccountant(neighboring_relation=relation)
        return dpa.pld.PLDAccountant(neighboring_relation=relation)

    def sampled(self, dpa: Any, release: Any) -> Any:
        """The DpEvent of one step: ``release`` on a batch drawn by this run's sampling."""
        if self.sample_rate is None:
            raise PergradValueError(
                f"the DP event of noise={self.noise!r} asked for the run's sampling, but the "
                "mechanism declares sample_rate=None (no sampling)."
            )
        if self.sampling == "poisson":
            return dpa.PoissonSampledDpEvent(self.sample_rate, release)
        return dpa.SampledWithoutReplacementDpEvent(self.num_examples, self.batch_size, release)

    def event(self, dpa: Any, noise_multiplier: float, steps: int) -> Any:
        """The DpEvent of ``steps`` steps of this run's noise mechanism."""
        return self.noise.dp_event(
            dpa, noise_multiplier, steps, lambda release: self.sampled(dpa, release)
        )

    def epsilon(self, noise_multiplier: float, steps: int) -> float:
        if steps == 0:
            return 0.0  # nothing released; dp_accounting's conversion would report a small floor
        dpa = import_dp_accounting()
        accountant = self.fresh_accountant(dpa)
        with quiet_convergence_warnings():
            composed = accountant.compose(self.event(dpa, noise_multiplier, steps))
            return float(composed.get_epsilon(self.delta))

    def _check_supported(self, fn: str) -> None:
        dpa = import_dp_accounting()
        event = self.event(dpa, 1.0, 1)
        if self.fresh_accountant(dpa).supports(event):
            return
        others = [
            name
            for name in ACCOUNTANTS
            if name != self.accountant and self.fresh_accountant(dpa, name).supports(event)
        ]
        hint = (
            f"use accountant={others[0]!r}" if others else "no dp_accounting accountant supports it"
        )
        raise PergradValueError(
            f"{fn}: accountant={self.accountant!r} does not support sampling={self.sampling!r} "
            f"in the installed dp_accounting; {hint}."
        )


def _check_fixed_batch(fn: str, sample_rate: float, num_examples: Any) -> tuple[int, int]:
    """For ``sampling="fixed"``: the dataset size and the batch size it implies."""
    if num_examples is None:
        raise PergradValueError(
            f"{fn}: sampling='fixed' needs num_examples (the dataset size), so that the batch "
            "size is sample_rate * num_examples."
        )
    num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
    batch_size = round(sample_rate * num_examples)
    if abs(batch_size - sample_rate * num_examples) > 1e-6 * num_examples or batch_size < 1:
        raise PergradValueError(
            f"{fn}: with sampling='fixed', sample_rate * num_examples is the batch size and must "
            f"be a whole number >= 1, got {sample_rate!r} * {num_examples} = "
            f"{sample_rate * num_examples!r}. Pass sample_rate=batch_size / num_examples."
        )
    return num_examples, batch_size


def _resolve_run(
    fn: str,
    noise: NoiseMechanism,
    sample_rate: Any,
    steps: Any,
    *,
    with_steps: bool = True,
) -> tuple[Any, Any]:
    """``(sample_rate, steps)`` of the run: the caller's, or the mechanism's where it is made
    for one run (``noise.steps`` not None); values that disagree with the mechanism's are
    refused. ``with_steps=False`` (:class:`Accountant`, which counts its steps) skips steps."""
    if noise.steps is None:
        required = (("sample_rate", "a real number"), ("steps", "an int"))[: 1 + with_steps]
        for (name, kind), value in zip(required, (sample_rate, steps)):
            if value is None:
                raise PergradTypeError(
                    f"{fn}: {name} must be {kind}, got NoneType None: it is required with "
                    f"noise={noise!r} (only a mechanism made for one run, such as "
                    "pergrad.dp.toeplitz, blt or optimal_blt, supplies its own)."
                )
        return sample_rate, steps
    if with_steps and steps is not None:
        steps = check_count(fn, "steps", steps, minimum=0)
        if steps != noise.steps:
            raise PergradValueError(
                f"{fn}: steps={steps} disagrees with noise={noise!r}, made for "
                f"steps={noise.steps}; leave steps out (it is taken from the mechanism) or make "
                f"the mechanism for {steps} steps."
            )
    own_rate = noise.sample_rate
    if sample_rate is not None:
        if own_rate is None:
            raise PergradValueError(
                f"{fn}: sample_rate={sample_rate!r} disagrees with noise={noise!r}, whose "
                "sample_rate is None: it is accounted without amplification by sampling (the "
                "whole run is one Gaussian release), so no sample_rate applies. Leave it out."
            )
        if check_sample_rate(fn, sample_rate) != own_rate:
            raise PergradValueError(
                f"{fn}: sample_rate={sample_rate!r} disagrees with noise={noise!r}, whose "
                f"sample_rate is {own_rate!r}; leave sample_rate out."
            )
    return own_rate, noise.steps


def _require_delta(fn: str, delta: Any) -> Any:
    if delta is None:
        raise PergradTypeError(
            f"{fn}: delta is required (the delta of (epsilon, delta)-DP, e.g. 1e-5)."
        )
    return delta


# --- public API ---------------------------------------------------------------------------


def epsilon(
    noise_multiplier: float,
    sample_rate: float | None = None,
    steps: int | None = None,
    delta: float | None = None,
    accountant: str = "rdp",
    *,
    sampling: str = "poisson",
    num_examples: int | None = None,
    noise: NoiseMechanism | None = None,
) -> float:
    """The epsilon of a DP-SGD run: ``(epsilon, delta)``-DP after ``steps`` noisy steps.

    Example (the classic MNIST setting: batches of 256 of 60000 examples, 60 epochs)::

        eps = epsilon(noise_multiplier=1.1, sample_rate=256 / 60000, steps=60 * 60000 // 256,
                      delta=1e-5)   # about 2.6 with "rdp", 2.4 with "pld"

    Args:
      noise_multiplier: noise standard deviation divided by the clipping norm, ``>= 0``. With
        0 (no noise) and ``steps >= 1`` the answer is ``math.inf``.
      sample_rate: probability that an example is in a batch, in ``(0, 1]``
        (``expected_batch_size / num_examples``). Taken from ``noise`` where it is made for
        one run (then None, or the same value).
      steps: number of noisy steps taken, an int ``>= 0``; 0 steps give ``0.0``. Taken from
        ``noise`` where it is made for one run (then None, or the same value).
      delta: the delta of ``(epsilon, delta)``-DP, in ``(0, 1)``; usually below
        ``1 / num_examples``. Required.
      accountant: ``"rdp"`` (Rényi DP, ``dp_accounting.rdp.RdpAccountant`` with its default
        orders; fast, a few tens of ms) or ``"pld"`` (privacy loss distributions,
        ``dp_accounting.pld.PLDAccountant``; tighter, i.e. smaller epsilon, but slower: about
        0.5 s for the example above, several seconds for noise multipliers below 0.5).
      sampling: how batches are drawn. ``"poisson"`` (default): each example independently
        with probability ``sample_rate`` (use :func:`poisson_batches` or
        ``PoissonBatchSampler``); the guarantee is for neighbouring datasets that differ by
        adding or removing one example. ``"fixed"``: batches of exactly
        ``sample_rate * num_examples`` examples drawn uniformly without replacement; the
        guarantee is for datasets that differ by *replacing* one example, a different notion
        whose epsilon is larger for the same noise (5.2 instead of 2.6 in the example above):
        the two numbers are not comparable. Only ``"rdp"`` supports ``"fixed"``. Shuffling and
        walking through the data in order is neither, and neither analysis applies to it.
      num_examples: the dataset size; needed for ``sampling="fixed"`` only.
      noise: the run's noise mechanism, whose DP event is accounted (None:
        :func:`pergrad.dp.gaussian`, independent Gaussian noise at every step). Correlated
        noise (:func:`pergrad.dp.toeplitz`, :func:`pergrad.dp.blt`,
        :func:`pergrad.dp.optimal_blt`) is one Gaussian release of ``noise_multiplier`` for
        the whole run, without sampling: ``epsilon(noise_multiplier=..., delta=...,
        noise=mech)``.

    Returns:
      epsilon as a float (``math.inf`` when there is no noise).

    Raises:
      ImportError: dp-accounting is not installed (``pip install 'pergrad[dp]'``).
      ValueError, TypeError: an argument out of range or of the wrong type; the message names it.
    """
    fn = "epsilon"
    noise_multiplier = check_noise_multiplier_value(fn, noise_multiplier)
    delta = _require_delta(fn, delta)
    mechanism = check_mechanism(fn, noise)
    sample_rate, steps = _resolve_run(fn, mechanism, sample_rate, steps)
    steps = check_count(fn, "steps", steps, minimum=0)
    setting = _Setting.validated(
        fn, sample_rate, delta, accountant, sampling, num_examples, mechanism
    )
    return setting.epsilon(noise_multiplier, steps)


def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sample_rate: float | None = None,
    steps: int | None = None,
    accountant: str = "rdp",
    *,
    sampling: str = "poisson",
    num_examples: int | None = None,
    tolerance: float = 1e-4,
    noise: NoiseMechanism | None = None,
) -> float:
    """The smallest noise multiplier whose run stays within ``(target_epsilon, delta)``.

    Example::

        sigma = noise_multiplier_for(target_epsilon=3.0, delta=1e-5, sample_rate=256 / 60000,
                                     steps=60 * 60000 // 256)   # about 1.0 with "rdp"

    The answer ``sigma`` satisfies ``epsilon(sigma, ...) <= target_epsilon`` (never more
    privacy spent than asked) and is within ``tolerance`` (absolute, in noise-multiplier
    units) of the exact smallest such value. It is found by bracketing (doubling / halving from
    1) and then ``dp_accounting.calibrate_dp_mechanism`` (Brent's method); it costs some
    10-30 calls of :func:`epsilon`: well under a second with ``"rdp"``, several seconds with
    ``"pld"``.

    Args:
      target_epsilon: the epsilon to reach, ``> 0``.
      delta: as for :func:`epsilon`.
      sample_rate: as for :func:`epsilon` (taken from ``noise`` where it is made for one run).
      steps: as for :func:`epsilon` (taken from ``noise`` where it is made for one run). With
        ``steps == 0`` nothing is released and the answer is ``0.0``.
      accountant: as for :func:`epsilon`.
      sampling: as for :func:`epsilon`.
      num_examples: as for :func:`epsilon`.
      tolerance: absolute tolerance on the returned noise multiplier, ``> 0``.
      noise: as for :func:`epsilon`.

    Returns:
      the noise multiplier, a float.

    Raises:
      ValueError: the target needs a noise multiplier above ``2**20`` (a tiny target with a
        huge number of steps), or an argument is out of range (the message names it).
      ImportError: dp-accounting is not installed (``pip install 'pergrad[dp]'``).
    """
    fn = "noise_multiplier_for"
    target_epsilon = check_real(fn, "target_epsilon", target_epsilon)
    if not 0.0 < target_epsilon < math.inf:
        raise PergradValueError(
            f"{fn}: target_epsilon must be finite and > 0, got {target_epsilon!r}."
        )
    mechanism = check_mechanism(fn, noise)
    sample_rate, steps = _resolve_run(fn, mechanism, sample_rate, steps)
    steps = check_count(fn, "steps", steps, minimum=0)
    setting = _Setting.validated(
        fn, sample_rate, delta, accountant, sampling, num_examples, mechanism
    )
    tolerance = check_real(fn, "tolerance", tolerance)
    if not 0.0 < tolerance < math.inf:
        raise PergradValueError(f"{fn}: tolerance must be finite and > 0, got {tolerance!r}.")
    if steps == 0:
        return 0.0
    low, high = _bracket(
        fn, lambda sigma: setting.epsilon(sigma, steps), target_epsilon, accountant
    )
    dpa = import_dp_accounting()
    with quiet_convergence_warnings():
        calibrated = dpa.calibrate_dp_mechanism(
            make_fresh_accountant=lambda: setting.fresh_accountant(dpa),
            make_event_from_param=lambda sigma: setting.event(dpa, sigma, steps),
            target_epsilon=target_epsilon,
            target_delta=setting.delta,
            bracket_interval=dpa.ExplicitBracketInterval(low, high),
            tol=tolerance,
        )
    return float(calibrated)


def _bracket(
    fn: str, epsilon_at: Any, target_epsilon: float, accountant: str
) -> tuple[float, float]:
    """Noise multipliers ``low < high`` with ``epsilon(low) > target >= epsilon(high)``.

    Epsilon decreases as the noise grows, so double (or halve) from 1 until the target is
    crossed. Brent's method then works inside the bracket.
    """
    sigma = 1.0
    if epsilon_at(sigma) > target_epsilon:
        while True:
            low, sigma = sigma, 2.0 * sigma
            reached = epsilon_at(sigma)
            if reached <= target_epsilon:
                return low, sigma
            if sigma >= _MAX_NOISE_MULTIPLIER:
                raise PergradValueError(
                    f"{fn}: target_epsilon={target_epsilon!r} cannot be reached with a "
                    f"noise_multiplier up to {_MAX_NOISE_MULTIPLIER:g}: that one gives "
                    f"epsilon={reached:.4g} with accountant={accountant!r}. Ask for a larger "
                    "target_epsilon or delta, fewer steps or a smaller sample_rate."
                )
    while True:
        high, sigma = sigma, 0.5 * sigma
        if epsilon_at(sigma) > target_epsilon:
            return sigma, high
        if sigma <= _MIN_NOISE_MULTIPLIER:
            # Epsilon grows without bound as the noise vanishes: only an absurd target ends here.
            raise PergradValueError(
                f"{fn}: target_epsilon={target_epsilon!r} is reached even with "
                f"noise_multiplier={sigma:g}; such a target gives no meaningful privacy."
            )


class Accountant:
    """Tracks the privacy spent by a DP-SGD training run, step by step.

    Example::

        accountant = Accountant(noise_multiplier=1.1, sample_rate=256 / 60000, delta=1e-5)
        for indices in poisson_batches(60000, 256 / 60000, steps=1000):
            ...                          # one DP-SGD step on the batch (empty batches too)
            accountant.step()
        accountant.steps                 # 1000
        accountant.epsilon()             # epsilon spent so far, at delta=1e-5

    Count every step, including steps whose Poisson batch happened to be empty: the analysis
    assumes each step releases a noisy sum, whatever the batch. :meth:`epsilon` recomputes
    from the start (the value is cached until the next :meth:`step`): tens of ms with
    ``"rdp"``, up to seconds with ``"pld"``, so ask once per epoch or log interval rather than
    every step.

    Args:
      noise_multiplier: as for :func:`epsilon`.
      sample_rate: as for :func:`epsilon`.
      delta: as for :func:`epsilon`.
      accountant: as for :func:`epsilon`.
      sampling: as for :func:`epsilon` (``"fixed"``, fixed-size batches drawn without
        replacement, is analysed for replace-one neighbours and needs ``accountant="rdp"`` and
        ``num_examples``).
      num_examples: as for :func:`epsilon`.
      noise: as for :func:`epsilon`; a ``DPOptimizer`` or ``DPTrainer`` given this accountant
        must add the same mechanism's noise. A mechanism made for one run (correlated noise)
        supplies ``sample_rate`` (None: no sampling); its run is one Gaussian release, so from
        the first step :meth:`epsilon` is the whole run's, and :meth:`step` refuses steps past
        the mechanism's ``steps``.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sample_rate: float | None = None,
        delta: float | None = None,
        accountant: str = "rdp",
        *,
        sampling: str = "poisson",
        num_examples: int | None = None,
        noise: NoiseMechanism | None = None,
    ) -> None:
        fn = "Accountant"
        self._noise_multiplier = check_noise_multiplier_value(fn, noise_multiplier)
        delta = _require_delta(fn, delta)
        mechanism = check_mechanism(fn, noise)
        sample_rate, _ = _resolve_run(fn, mechanism, sample_rate, None, with_steps=False)
        self._setting = _Setting.validated(
            fn, sample_rate, delta, accountant, sampling, num_examples, mechanism
        )
        self._steps = 0
        self._cached: tuple[int, float] | None = None

    @property
    def noise_multiplier(self) -> float:
        return self._noise_multiplier

    @property
    def sample_rate(self) -> float | None:
        """The Poisson sample rate; None for a mechanism accounted without sampling."""
        return self._setting.sample_rate

    @property
    def delta(self) -> float:
        return self._setting.delta

    @property
    def accountant(self) -> str:
        return self._setting.accountant

    @property
    def sampling(self) -> str:
        return self._setting.sampling

    @property
    def noise(self) -> NoiseMechanism:
        """The noise mechanism whose DP event is accounted."""
        return self._setting.noise

    @property
    def steps(self) -> int:
        """The number of steps recorded so far."""
        return self._steps

    def step(self, n: int = 1) -> None:
        """Records ``n`` more DP-SGD steps (``n >= 0``, an int)."""
        n = check_count("Accountant.step", "n", n, minimum=0)
        limit = self._setting.noise.steps
        if limit is not None and self._steps + n > limit:
            raise PergradValueError(
                f"Accountant.step: noise={self._setting.noise!r} is made for a run of "
                f"steps={limit}, and {self._steps} + {n} steps were recorded; its accounting "
                "covers that run only."
            )
        self._steps += n

    def epsilon(self) -> float:
        """The epsilon spent so far at this accountant's delta; ``0.0`` before any step."""
        if self._cached is None or self._cached[0] != self._steps:
            value = self._setting.epsilon(self._noise_multiplier, self._steps)
            self._cached = (self._steps, value)
        return self._cached[1]

    def __repr__(self) -> str:
        setting = self._setting
        fixed = f", num_examples={setting.num_examples}" if setting.sampling == "fixed" else ""
        rate = "None" if setting.sample_rate is None else f"{setting.sample_rate:g}"
        return (
            f"Accountant(noise_multiplier={self._noise_multiplier:g}, "
            f"sample_rate={rate}, delta={setting.delta:g}, "
            f"accountant={setting.accountant!r}, sampling={setting.sampling!r}{fixed}, "
            f"steps={self._steps})"
        )


def check_accountant_noise(func_name: str, accountant: Any, noise: NoiseMechanism) -> None:
    """Refuse an accountant that accounts for another mechanism than the one whose noise is
    added: its epsilon would not describe the run."""
    accounted = getattr(accountant, "noise", None)
    if isinstance(accountant, Accountant) and accounted != noise:
        raise PergradValueError(
            f"{func_name}: the accountant accounts for {accounted!r} but noise={noise!r} is "
            f"added; pass the same mechanism to both (Accountant(..., noise=...))."
        )
