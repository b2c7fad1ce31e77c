"""Cyclic Poisson sampling, and the amplified accounting of banded strategies that it allows.

    mech = pergrad.dp.toeplitz([1.0, 0.6, 0.3], steps=1000, min_separation=4, sample_rate=0.02)
    for indices in cyclic_poisson_batches(len(X), noise=mech):
        ...   # step t: a Poisson sample, at rate 0.02, of group t % 4

**The sampling.** The examples are split once, at random, into ``min_separation`` groups: each
example's group is drawn uniformly, independently of the others' (jax-privacy's
``PartitionType.INDEPENDENT``). Step ``t`` draws its batch from group ``t % min_separation``
alone, each of the group's examples independently with probability ``sample_rate``. An example
thus takes part only in steps ``min_separation`` apart, at most ``ceil(steps / min_separation)``
times. Over the split and the coins, each example is in step ``t``'s batch with probability
``sample_rate / min_separation``, independently of the others: the batch size is
Binomial(num_examples, sample_rate / min_separation), its mean ``num_examples * sample_rate /
min_separation`` is the ``expected_batch_size`` to normalise by, and
``max_batch_size_for(num_examples, sample_rate / min_separation)`` bounds it.

**The accounting** (Choquette-Choo et al. 2023, "(Amplified) banded matrix factorization",
arXiv:2306.08153, Theorem 4). With a banded strategy matrix ``C`` of at most
``min_separation`` bands, the rows of ``C x`` that one participation of an example touches (the
``bands`` nonzero rows of its column) are disjoint from those of its next participation, and
each round of ``min_separation`` steps Poisson-samples every group once. The run is then a
post-processing of ``ceil(steps / min_separation)`` adaptively composed Poisson-sampled Gaussian
mechanisms at rate ``sample_rate``, each of the sensitivity of ONE column of ``C``
(``||strategy_coefs||`` times ``max_norm``): the DP event of DP-SGD with fewer steps,
jax-privacy 2.0.0's ``amplified_bandmf_event``. The independent split keeps the analysis valid
for datasets that differ by adding or removing one example, the relation of pergrad's Poisson
accounting: adding an example moves no other between groups. (jax-privacy's default, an equal
split of a shuffle, is analysed for replace-one neighbours instead.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pergrad._src.dp.accounting import check_count, check_sample_rate
from pergrad._src.dp.noise import NoiseMechanism, check_mechanism
from pergrad._src.dp.sampling import generator_of_seed
from pergrad._src.errors import PergradTypeError, PergradValueError

# --- the mechanism's side ------------------------------------------------------------------


def rounds(steps: int, min_separation: int) -> int:
    """The most steps one example takes part in: those of group 0, ``ceil(steps /
    min_separation)`` (jax-privacy's ``math.ceil(iterations / num_bands)``)."""
    return -(-steps // min_separation)


def check_amplified_run(
    fn: str,
    bands: int,
    steps: int,
    participations: Any,
    min_separation: int | None,
    sample_rate: Any,
) -> tuple[float, int]:
    """``(sample_rate, participations)`` of a banded strategy of ``bands`` coefficients
    accounted with cyclic Poisson sampling; ``steps`` and ``min_separation`` already checked."""
    sample_rate = check_sample_rate(fn, sample_rate)
    if min_separation is None:
        raise PergradValueError(
            f"{fn}: sample_rate={sample_rate!r} (cyclic Poisson sampling, amplified accounting) "
            "needs min_separation, the number of groups the data are split into, at least the "
            f"{bands} coefficients of strategy_coefs; got None. Pass e.g. "
            f"min_separation={bands}."
        )
    if bands > min_separation:
        raise PergradValueError(
            f"{fn}: sample_rate (amplified accounting) needs a banded strategy of at most "
            f"min_separation={min_separation} coefficients, so that one example's "
            f"participations touch disjoint rows of C x; strategy_coefs has {bands}. Raise "
            f"min_separation to {bands}, cut strategy_coefs to {min_separation} bands, or "
            "leave sample_rate out (one Gaussian release, no amplification)."
        )
    most = rounds(steps, min_separation)
    if participations is not None:
        participations = check_count(fn, "participations", participations, minimum=1)
        if participations != most:
            raise PergradValueError(
                f"{fn}: with sample_rate, an example takes part in the steps of its group, at "
                f"most ceil(steps / min_separation) = ceil({steps} / {min_separation}) = {most}"
                f"; participations={participations} says otherwise. Leave participations out."
            )
    return sample_rate, most


def amplified_event(
    dpa: Any, noise_multiplier: float, steps: int, min_separation: int, sampled: Any
) -> Any:
    """The DP event of ``steps`` steps of a banded strategy under cyclic Poisson sampling:
    ``ceil(steps / min_separation)`` self-composed Poisson-sampled Gaussian releases (see the
    module docstring); ``sampled`` wraps a release in the run's sampling."""
    release = sampled(dpa.GaussianDpEvent(noise_multiplier))
    if not isinstance(release, dpa.PoissonSampledDpEvent):
        raise PergradValueError(
            "the amplified accounting of banded noise assumes cyclic Poisson sampling "
            "(pergrad.dp.cyclic_poisson_batches or CyclicPoissonBatchSampler); sampling='fixed' "
            "does not apply to it. Leave sampling out."
        )
    return dpa.SelfComposedDpEvent(release, rounds(steps, min_separation))


# --- the sampler's side --------------------------------------------------------------------


def resolve_cyclic_sampling(
    fn: str, sample_rate: Any, min_separation: Any, steps: Any, noise: Any
) -> tuple[float, int, int]:
    """``(sample_rate, min_separation, steps)`` of a cyclic Poisson sampler, validated: the
    caller's, or those of ``noise`` (a mechanism made with ``sample_rate``), with which the
    caller's must then agree."""
    given = {"sample_rate": sample_rate, "min_separation": min_separation, "steps": steps}
    if given["sample_rate"] is not None:
        given["sample_rate"] = check_sample_rate(fn, sample_rate)
    if given["min_separation"] is not None:
        given["min_separation"] = check_count(fn, "min_separation", min_separation, minimum=1)
    if given["steps"] is not None:
        given["steps"] = check_count(fn, "steps", steps, minimum=0)
    if noise is not None:
        mechanism = check_mechanism(fn, noise)
        own = {
            "sample_rate": mechanism.sample_rate,
            "min_separation": getattr(mechanism, "min_separation", None),
            "steps": mechanism.steps,
        }
        if own["sample_rate"] is None or own["min_separation"] is None:
            raise PergradValueError(
                f"{fn}: noise={mechanism!r} is not accounted for cyclic Poisson sampling (its "
                "sample_rate or min_separation is None); make it with pergrad.dp.toeplitz(..., "
                "min_separation=..., sample_rate=...), or leave noise out and pass "
                "sample_rate, min_separation and steps."
            )
        for name, value in given.items():
            if value is not None and value != own[name]:
                raise PergradValueError(
                    f"{fn}: {name}={value!r} disagrees with noise={mechanism!r}, whose "
                    f"{name} is {own[name]!r}; leave {name} out (it is taken from noise)."
                )
        given = own
    for name, kind in (("sample_rate", "a real number"), ("min_separation", "an int")):
        if given[name] is None:
            raise PergradTypeError(
                f"{fn}: {name} must be {kind}, got NoneType None: it is required unless "
                "noise= (a mechanism made with sample_rate) supplies it."
            )
    if given["steps"] is None:
        raise PergradTypeError(
            f"{fn}: steps must be an int, got NoneType None: it is required unless noise= "
            "supplies it."
        )
    return given["sample_rate"], given["min_separation"], given["steps"]


def group_members(groups: np.ndarray, num_groups: int) -> list[np.ndarray]:
    """The examples of each group, ``num_groups`` sorted ``int64`` arrays, from the group of
    each example (``groups``: ``(num_examples,)`` integers in ``[0, num_groups)``)."""
    order = np.argsort(groups, kind="stable").astype(np.int64)
    counts = np.bincount(groups, minlength=num_groups)
    return np.split(order, np.cumsum(counts)[:-1])


def cyclic_poisson_batches(
    num_examples: int,
    sample_rate: float | None = None,
    min_separation: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    *,
    noise: NoiseMechanism | None = None,
) -> Iterator[np.ndarray]:
    """Yields ``steps`` batches of example indices drawn by cyclic Poisson sampling.

    Example (the sampling a banded mechanism with ``sample_rate`` is accounted for)::

        mech = pergrad.dp.toeplitz([1.0, 0.5], steps=1000, min_separation=4, sample_rate=0.02)
        for indices in cyclic_poisson_batches(len(X), noise=mech):   # 1000 batches
            grads = per_example(params, X[indices], Y[indices])       # indices may be empty

    The examples are split at random into ``min_separation`` groups (each example's group
    uniform and independent), fixed for the run; batch ``t`` holds each example of group ``t %
    min_separation`` independently with probability ``sample_rate``. The batch size is
    Binomial(num_examples, sample_rate / min_separation), mean ``num_examples * sample_rate /
    min_separation`` (the ``expected_batch_size``); a batch can be empty and is yielded all
    the same, since the accounting counts every step. Costs ``O(num_examples)`` once for the
    split, then about ``O(batch size)`` per step. See :mod:`pergrad._src.dp.cyclic` for the
    accounting this sampling allows.

    Args:
      num_examples: dataset size ``N``, an int ``>= 1``.
      sample_rate: the inclusion probability within the step's group, in ``(0, 1]``.
      min_separation: the number of groups, an int ``>= 1`` (1 is plain Poisson sampling).
      steps: the number of batches, an int ``>= 0``.
      seed: an int seed for numpy's ``Generator`` (reproducible batches), or ``None``
        (default) for a fresh 128-bit seed from the operating system's secure source; as for
        :func:`pergrad.dp.poisson_batches`, a real privacy guarantee needs sampling an
        adversary cannot predict.
      noise: a mechanism made with ``sample_rate`` (:func:`pergrad.dp.toeplitz`), whose
        ``sample_rate``, ``min_separation`` and ``steps`` are then taken (the three arguments
        above may be left out; given, they must agree).

    Yields:
      ``steps`` arrays of indices, each 1-D ``int64``, sorted, distinct, in ``[0, N)``.

    Raises:
      ValueError, TypeError: an argument out of range or of the wrong type, a value that
        disagrees with ``noise``'s, or a ``noise`` made without ``sample_rate``.
    """
    fn = "cyclic_poisson_batches"
    num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
    sample_rate, min_separation, steps = resolve_cyclic_sampling(
        fn, sample_rate, min_separation, steps, noise
    )
    rng = generator_of_seed(fn, seed)
    return _cyclic_batches(num_examples, sample_rate, min_separation, steps, rng)


def _cyclic_batches(
    num_examples: int,
    sample_rate: float,
    min_separation: int,
    steps: int,
    rng: np.random.Generator,
) -> Iterator[np.ndarray]:
    # A generator of its own, so that cyclic_poisson_batches validates its arguments when called.
    groups = group_members(rng.integers(min_separation, size=num_examples), min_separation)
    for step in range(steps):
        members = groups[step % min_separation]
        # a binomial size, then a uniform subset of it: a coin per member, in O(batch size)
        batch_size = int(rng.binomial(members.size, sample_rate))
        chosen = rng.choice(members.size, size=batch_size, replace=False)
        yield np.sort(members[chosen])
