"""Clipping policies: how each example's gradient is scaled before the clipped sum.

Every DP path (``clip``, ``clipped_sum``, ``private_mean``, ``clipped_sum_of``,
``private_grad_of``, ``optax_aggregate`` / ``dpsgd``, ``DPOptimizer``) takes one through
``clipping=``, on every strategy: the strategies compute each example's norm, then a weight per
example from the policy, then the weighted sum, so a policy is only the weight.

- ``None`` (the default): ``min(1, C / norm)`` (Abadi et al. 2016).
- :func:`automatic`: ``C / (norm + gamma)`` (Bu et al. 2022, "Automatic clipping"): every
  gradient is normalised, so each contribution has norm ``C * norm / (norm + gamma) < C``; the
  sensitivity and the noise are those of the bound ``C``.
- :func:`adaptive`: ``min(1, C / norm)``, with ``C`` following a quantile of the norms between
  steps (Andrew et al. 2021): after each step ``C <- C * exp(-learning_rate * (b - q))``, ``b``
  the fraction of examples with ``norm <= C``, released with Gaussian noise. That release costs
  privacy; the gradient noise multiplier is raised so that the two releases together cost what
  one Gaussian release of the user's ``noise_multiplier`` costs (:meth:`AdaptiveClipping.
  gradient_noise_multiplier`), so the accountant is asked with the user's ``noise_multiplier``.

The bound ``C`` is ``max_norm`` on every path: a number, a 0-d array (a bound that changes
between steps under ``jax.jit``) or, for per-group bounds, a pytree prefix of the gradients.
"""

from __future__ import annotations

import abc
import math
from typing import Any

from pergrad._src.backends import Backend, backend_of
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism, add_independent_gaussian
from pergrad._src.errors import PergradTypeError, PergradValueError


def clip_factors(norms: Any, bound: Any) -> Any:
    """min(1, bound / norm), written so that a zero norm gives 1 without a division by zero."""
    return bound / norms.clip(min=bound)


class ClippingPolicy(abc.ABC):
    """How an example's gradient of norm ``norm`` is scaled under the bound ``C``: the weight
    :meth:`factors` gives it in the clipped sum. Its contribution must have norm ``<= C`` for
    every ``norm`` (the sensitivity of the sum is ``C``)."""

    #: True where the bound changes between steps (:class:`AdaptiveClipping`)
    adaptive: bool = False

    @abc.abstractmethod
    def factors(self, norms: Any, bound: Any) -> Any:
        """``(B,)`` weights for the ``(B,)`` finite ``norms`` under ``bound``."""

    def rescaled(self, scale: float) -> ClippingPolicy:
        """The same policy for gradients ``scale`` times larger (a loss scaler's); the
        bound is scaled by the caller."""
        del scale
        return self


class StandardClipping(ClippingPolicy):
    """``min(1, C / norm)``: gradients within the bound are kept, the others scaled to it."""

    def factors(self, norms: Any, bound: Any) -> Any:
        return clip_factors(norms, bound)

    def __repr__(self) -> str:
        return "StandardClipping()"


STANDARD = StandardClipping()


class AutomaticClipping(ClippingPolicy):
    """Automatic (normalised) clipping, Bu et al. 2022: each gradient scaled by
    ``C / (norm + gamma)``. Made by :func:`automatic`."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def factors(self, norms: Any, bound: Any) -> Any:
        return bound / (norms + self.gamma)

    def rescaled(self, scale: float) -> ClippingPolicy:
        return AutomaticClipping(self.gamma * scale)

    def __repr__(self) -> str:
        return f"AutomaticClipping(gamma={self.gamma!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is AutomaticClipping and other.gamma == self.gamma

    def __hash__(self) -> int:
        return hash((AutomaticClipping, self.gamma))


class AdaptiveClipping(ClippingPolicy):
    """Quantile-adaptive clipping with an accounted bound, Andrew et al. 2021 (made by
    :func:`adaptive`). Each step clips at the current bound ``C`` (``min(1, C / norm)``), then
    releases the number of examples with ``norm <= C``, centred (each example adds ``+1/2`` or
    ``-1/2``, sensitivity 1/2) plus ``N(0, count_noise_std^2)``, and moves ``C`` geometrically
    towards the ``target_quantile`` of the norms."""

    adaptive = True

    def __init__(self, target_quantile: float, learning_rate: float, count_noise_std: float):
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.count_noise_std = count_noise_std

    def factors(self, norms: Any, bound: Any) -> Any:
        return clip_factors(norms, bound)

    def gradient_noise_multiplier(self, noise_multiplier: float, num_groups: int = 1) -> float:
        """The gradient's noise multiplier that makes one step (the noisy clipped sum and the
        noisy counts) cost exactly one Gaussian release of ``noise_multiplier``:
        ``(noise_multiplier^-2 - num_groups * (2 * count_noise_std)^-2)^(-1/2)``.

        Every DP path uses it in place of ``noise_multiplier`` under adaptive clipping, so the
        accountant (``pergrad.dp.epsilon(noise_multiplier=...)``, ``Accountant``) takes the
        user's ``noise_multiplier`` unchanged. ``num_groups`` counts the per-group bounds, each
        with its own noisy count. Needs ``count_noise_std > sqrt(num_groups) *
        noise_multiplier / 2``.
        """
        func_name = "AdaptiveClipping.gradient_noise_multiplier"
        sigma = _check_number(func_name, "noise_multiplier", noise_multiplier, minimum=0.0)
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise PergradValueError(
                f"{func_name}: num_groups must be an int >= 1; got {num_groups!r}."
            )
        if sigma == 0.0:
            return 0.0  # no privacy asked: the counts need no share of it
        floor = math.sqrt(num_groups) * sigma / 2
        if not self.count_noise_std > floor:
            raise PergradValueError(
                f"adaptive clipping: count_noise_std must exceed sqrt(num_groups) * "
                f"noise_multiplier / 2 = sqrt({num_groups}) * {sigma:g} / 2 = {floor:g}, so "
                f"that the noisy counts leave part of the privacy budget to the gradient; got "
                f"count_noise_std={self.count_noise_std!r}. Andrew et al. 2021 suggest about "
                f"expected_batch_size / 20."
            )
        remaining = sigma**-2 - num_groups * (2 * self.count_noise_std) ** -2
        return remaining**-0.5

    def unclipped_counts(
        self, bk: Backend, group_norms: list[Any], bounds: list[Any], mask: Any
    ) -> list[Any]:
        """Per group, the number of real examples whose finite norm is ``<= bound`` (0-d
        arrays); padding (``mask`` False) and non-finite norms count as not unclipped."""
        counts = []
        for norms, bound in zip(group_norms, bounds):
            real = norms * 0 + 1 if mask is None else bk.where(mask, norms * 0 + 1, 0.0)
            below = bk.isfinite(norms) & (norms <= bound)
            counts.append(bk.where(below, real, 0.0).sum())
        return counts

    def noisy_counts(self, unclipped: list[Any], rng: Any) -> list[Any]:
        """``unclipped`` (one count per group, arrays) plus ``N(0, count_noise_std^2)`` each:
        the step's release."""
        return add_independent_gaussian(unclipped, self.count_noise_std, rng)

    def bounds_from(
        self,
        bounds: list[Any],
        noisy_unclipped: list[Any],
        count: Any,
        expected_batch_size: float | None,
    ) -> list[Any]:
        """The next bounds from the noisy counts of one step among ``count`` real examples.

        The count is centred (each example ``+1/2`` within the bound, ``-1/2`` outside it, so
        one example moves it by at most 1/2, whatever the batch size): the noisy fraction is
        ``b = (noisy - count / 2) / expected_batch_size + 1/2`` (None: divided by ``count``),
        and ``C <- C * exp(-learning_rate * (b - target_quantile))``."""
        if expected_batch_size is None:
            denominator = count.clip(min=1.0) if hasattr(count, "clip") else max(count, 1.0)
        else:
            denominator = float(expected_batch_size)
        return [
            bound
            * math.e
            ** (-self.learning_rate * ((n - count / 2) / denominator + 0.5 - self.target_quantile))
            for bound, n in zip(bounds, noisy_unclipped)
        ]

    def next_bounds(
        self,
        bounds: list[Any],
        unclipped: list[Any],
        count: Any,
        rng: Any,
        expected_batch_size: float | None,
    ) -> list[Any]:
        """:meth:`bounds_from` the :meth:`noisy_counts` of ``unclipped``."""
        noisy = self.noisy_counts(unclipped, rng)
        return self.bounds_from(bounds, noisy, count, expected_batch_size)

    def next_max_norm(
        self,
        max_norm: Any,
        clipped: Any,
        rng: Any,
        expected_batch_size: float | None = None,
        mask: Any = None,
    ) -> Any:
        """The bound of the next step, for a loop of your own around ``private_mean`` /
        ``private_grad_of`` (``DPOptimizer`` and ``optax_aggregate`` do this themselves).

        Releases this step's count of examples within the bound with noise of std
        ``count_noise_std``: account for it by passing ``clipping=`` this policy to the
        gradient's path, which then uses :meth:`gradient_noise_multiplier`.

        Args:
          max_norm: the bound the step clipped at (a number, a 0-d array or a per-group
            pytree prefix).
          clipped: the step's :class:`pergrad.dp.ClippedSum` (its ``norms`` and ``count``).
          rng: a JAX key (use a fresh one, not the gradient noise's), a ``torch.Generator``
            or a :class:`pergrad.dp.SecureRandom`.
          expected_batch_size: as for ``private_mean``.
          mask: the step's ``(B,)`` real-example mask, if it had one.

        Returns:
          The next bound: 0-d arrays of the gradients' framework, in ``max_norm``'s structure.
        """
        func_name = "AdaptiveClipping.next_max_norm"
        norms = getattr(clipped, "norms", None)
        group_norms = norms if isinstance(norms, list) else [norms]
        bk = backend_of(group_norms[0], func_name, "clipped.norms")
        _, bounds, bounds_def = bk.flatten(max_norm)
        if len(bounds) != len(group_norms):
            raise PergradValueError(
                f"{func_name}: max_norm has {len(bounds)} bounds but clipped has "
                f"{len(group_norms)} group norms; pass the max_norm the step clipped at."
            )
        if expected_batch_size is not None:
            _check_number(func_name, "expected_batch_size", expected_batch_size, minimum=None)
        unclipped = self.unclipped_counts(bk, group_norms, bounds, mask)
        new = self.next_bounds(bounds, unclipped, clipped.count, rng, expected_batch_size)
        return bk.unflatten(bounds_def, new)

    def __repr__(self) -> str:
        return (
            f"AdaptiveClipping(target_quantile={self.target_quantile!r}, learning_rate="
            f"{self.learning_rate!r}, count_noise_std={self.count_noise_std!r})"
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is AdaptiveClipping and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


def _check_number(func_name: str, name: str, value: Any, minimum: float | None) -> float:
    """A real number, ``>= minimum`` (None: ``> 0``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = value > 0 if minimum is None else value >= minimum
    if not ok:
        expected = "a positive number" if minimum is None else f"a number >= {minimum:g}"
        raise PergradValueError(f"{func_name}: {name} must be {expected}; got {value!r}.")
    return float(value)


def automatic(gamma: float = 0.01) -> AutomaticClipping:
    """Automatic clipping (Bu et al. 2022): each example's gradient times
    ``max_norm / (norm + gamma)``, so every example counts (none is dropped to the bound's
    share) and its contribution has norm below ``max_norm``.

    Pass it as ``clipping=`` to any DP path; ``max_norm`` is the bound as before, the
    sensitivity of the sum and the noise scale (``noise_multiplier * max_norm``). With
    automatic clipping ``max_norm`` only scales the update: tune the learning rate instead.

    Args:
      gamma: the stability constant, > 0 (in gradient-norm units): gradients much smaller
        than ``gamma`` are not blown up to the bound.
    """
    return AutomaticClipping(_check_number("automatic", "gamma", gamma, minimum=None))


def adaptive(
    *,
    count_noise_std: float,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
) -> AdaptiveClipping:
    """Quantile-adaptive clipping (Andrew et al. 2021), its privacy cost accounted.

    Pass it as ``clipping=`` to any DP path, with ``max_norm`` the initial bound. After each
    step the bound moves geometrically towards the ``target_quantile`` of the examples' norms:
    ``C <- C * exp(-learning_rate * (b - target_quantile))``, ``b`` the fraction of examples
    with ``norm <= C`` released with noise of std ``count_noise_std / expected_batch_size``.
    The gradient's noise multiplier is raised to
    ``(noise_multiplier^-2 - (2 * count_noise_std)^-2)^(-1/2)`` so that the step costs one
    Gaussian release of ``noise_multiplier``: account with the ``noise_multiplier`` you pass.
    ``DPOptimizer.max_norm`` and ``PrivateAggregateState.max_norm`` hold the current bound.

    Per-group bounds (a pytree ``max_norm``) each follow their own quantile, each with its own
    noisy count; ``count_noise_std`` must then exceed ``sqrt(groups) * noise_multiplier / 2``.

    Args:
      count_noise_std: std of the noise on the count of unclipped examples, ``>= 0`` and more
        than ``noise_multiplier / 2``; about ``expected_batch_size / 20`` is usual.
      target_quantile: the quantile of the norms the bound follows, in (0, 1).
      learning_rate: the step of the geometric update, > 0 (0.2 in the paper).

    Example::

        policy = pergrad.dp.adaptive(count_noise_std=256 / 20, target_quantile=0.5)
        opt = pergrad.dp.DPOptimizer(sgd, model, F.cross_entropy, max_norm=0.1,
                                     noise_multiplier=1.1, expected_batch_size=256,
                                     clipping=policy)
    """
    quantile = _check_number("adaptive", "target_quantile", target_quantile, minimum=None)
    if not quantile < 1:
        raise PergradValueError(
            f"adaptive: target_quantile must be in (0, 1); got {target_quantile!r}."
        )
    rate = _check_number("adaptive", "learning_rate", learning_rate, minimum=None)
    count_std = _check_number("adaptive", "count_noise_std", count_noise_std, minimum=0.0)
    return AdaptiveClipping(quantile, rate, count_std)


def check_clipping(func_name: str, clipping: Any) -> ClippingPolicy:
    """``clipping`` as a policy: None is :class:`StandardClipping`."""
    if clipping is None:
        return STANDARD
    if not isinstance(clipping, ClippingPolicy):
        raise PergradTypeError(
            f"{func_name}: clipping must be None (min(1, max_norm / norm)), "
            f"pergrad.dp.automatic(...) or pergrad.dp.adaptive(...); got "
            f"{type(clipping).__name__}."
        )
    return clipping


def check_adaptive_noise(
    func_name: str,
    policy: AdaptiveClipping,
    noise: NoiseMechanism,
    noise_multiplier: float,
    groups: int,
) -> float:
    """The gradient's noise multiplier under adaptive clipping, refusing a mechanism other
    than independent Gaussian noise (the split of one Gaussian release between the gradient
    and the counts holds step by step, which correlated noise does not account)."""
    if not isinstance(noise, GaussianNoise):
        raise PergradValueError(
            f"{func_name}: adaptive clipping needs independent Gaussian noise (noise=None or "
            f"pergrad.dp.gaussian()); got noise={noise!r}, whose accounting does not cover the "
            f"noisy counts. Use a fixed max_norm (or clipping=pergrad.dp.automatic()) with "
            f"correlated noise."
        )
    return policy.gradient_noise_multiplier(noise_multiplier, groups)


def num_groups(norms: Any) -> int:
    """How many bound groups a :class:`ClippedSum`'s ``norms`` cover."""
    return len(norms) if isinstance(norms, list) else 1


def gradient_noise_multiplier(
    policy: ClippingPolicy, noise_multiplier: float, groups: int = 1
) -> float:
    """The noise multiplier the gradient gets under ``policy`` (see
    :meth:`AdaptiveClipping.gradient_noise_multiplier`)."""
    if isinstance(policy, AdaptiveClipping):
        return policy.gradient_noise_multiplier(noise_multiplier, groups)
    return noise_multiplier
