"""Poisson sampling of batches: the sampling that DP-SGD's privacy accounting assumes.

    for indices in poisson_batches(num_examples=60000, sample_rate=256 / 60000, steps=1000):
        x, y = X[indices], Y[indices]            # a batch of about 256 examples, maybe 0

Each example joins each batch independently with probability ``sample_rate``, so batch sizes
vary (Binomial(num_examples, sample_rate)) and a batch may be empty. Under ``jax.jit`` a new
batch size means a new compilation; :func:`pad_batch` pads every batch to one size, with a mask
saying which rows are real, and :func:`max_batch_size_for` picks that size.

For PyTorch, ``PoissonBatchSampler`` (``torch/sampling.py``, ``pergrad.dp.PoissonBatchSampler``)
plugs into ``torch.utils.data.DataLoader(batch_sampler=...)``.
"""

from __future__ import annotations

import math
import numbers
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

# sample_rate and steps mean the same here as in the accounting, and are checked the same way.
from pergrad._src.dp.accounting import check_count, check_real, check_sample_rate
from pergrad._src.errors import (
    PergradTypeError,
    PergradValueError,
    PrivacyWarning,
    warn_from_caller,
)


def poisson_batches(
    num_examples: int, sample_rate: float, steps: int, seed: int | None = None
) -> Iterator[np.ndarray]:
    """Yields ``steps`` Poisson-sampled batches of example indices.

    Example::

        for indices in poisson_batches(len(X), sample_rate=256 / len(X), steps=1000):
            grads = per_example(params, X[indices], Y[indices])   # indices may be empty

    In every batch each example is included independently with probability ``sample_rate``:
    the batch size is Binomial(num_examples, sample_rate), mean ``num_examples * sample_rate``,
    and a batch can be empty. Empty batches are yielded too, never skipped: the privacy
    accountant counts every step. Each step draws the size from the binomial, then a uniform
    subset of that size (the same distribution as a coin per example): about ``O(batch size)``
    for small sample rates, at most ``O(num_examples)``.

    Args:
      num_examples: dataset size ``N``, an int ``>= 1``.
      sample_rate: inclusion probability, in ``(0, 1]``.
      steps: number of batches, an int ``>= 0``.
      seed: an int seed for numpy's ``Generator`` (reproducible batches, for tests and
        debugging), or ``None`` (default) for a fresh 128-bit seed from the operating system's
        secure source (``secrets.randbits(128)``). For a real privacy guarantee the sampling
        must be unpredictable to an adversary: do not use a fixed or guessable seed there.
        (numpy's PCG64 is a statistical generator, not a cryptographic one: a secure seed makes
        its batches unpredictable in practice, without a cryptographic guarantee.)

    Yields:
      ``steps`` arrays of indices, each 1-D ``int64`` of shape ``(batch_size,)``, sorted,
      distinct, in ``[0, num_examples)``.
    """
    fn = "poisson_batches"
    num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
    sample_rate = check_sample_rate(fn, sample_rate)
    steps = check_count(fn, "steps", steps, minimum=0)
    return _poisson_batches(num_examples, sample_rate, steps, generator_of_seed(fn, seed))


def generator_of_seed(fn: str, seed: Any) -> np.random.Generator:
    """numpy's ``Generator`` seeded with ``seed``, an int, or with a fresh 128-bit seed from
    the operating system's secure source where ``seed`` is None."""
    if seed is None:
        seed = secrets.randbits(128)
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise PergradTypeError(
            f"{fn}: seed must be an int or None (a secure random seed), got "
            f"{type(seed).__name__} {seed!r}."
        )
    return np.random.default_rng(int(seed))


def _poisson_batches(
    num_examples: int, sample_rate: float, steps: int, rng: np.random.Generator
) -> Iterator[np.ndarray]:
    # A generator of its own, so that poisson_batches validates its arguments when called.
    for _ in range(steps):
        batch_size = int(rng.binomial(num_examples, sample_rate))
        indices = rng.choice(num_examples, size=batch_size, replace=False)
        yield np.sort(indices).astype(np.int64, copy=False)


def pad_batch(indices: Any, max_batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pads a batch of indices to a fixed size, so that ``jax.jit`` compiles once.

    Example::

        padded, mask = pad_batch(indices, max_batch_size=320)     # both shape (320,)
        grads = per_example(params, X[padded], Y[padded])           # rows where ~mask are
        # copies of example 0: give them zero weight, e.g. clip factors * mask, before summing

    The padded entries point at example 0 (a valid index, so gathering works) and ``mask`` is
    ``False`` there. Never truncate a batch that is too large instead: dropping examples
    changes the sampling, and the privacy analysis no longer applies. Pass ``mask`` on to the
    DP reduction: one that gets no mask for a batch of ``max_batch_size`` examples right after
    ``pad_batch`` warns (:class:`pergrad.PrivacyWarning`), since the padding would then count.

    Args:
      indices: 1-D integer indices of one batch, shape ``(batch_size,)`` (a numpy array,
        list or anything ``np.asarray`` accepts), possibly empty.
      max_batch_size: the fixed size ``M >= batch_size``; choose it with
        :func:`max_batch_size_for`.

    Returns:
      ``(padded_indices, mask)``: ``int64`` of shape ``(M,)`` whose first ``batch_size``
      entries are ``indices``, and ``bool`` of shape ``(M,)``, ``True`` on those entries.

    Raises:
      ValueError: the batch is larger than ``max_batch_size`` (the message suggests a size),
        or ``indices`` is not 1-D.
      TypeError: ``indices`` is not integer, ``max_batch_size`` not an int.
    """
    fn = "pad_batch"
    max_batch_size = check_count(fn, "max_batch_size", max_batch_size, minimum=0)
    indices = np.asarray(indices)
    if indices.ndim != 1:
        raise PergradValueError(
            f"{fn}: indices must be 1-D (one batch of example indices), got shape {indices.shape}."
        )
    if indices.size == 0:
        indices = indices.astype(np.int64)
    elif indices.dtype.kind not in "iu":
        raise PergradTypeError(f"{fn}: indices must be integers, got dtype {indices.dtype}.")
    batch_size = indices.shape[0]
    if batch_size > max_batch_size:
        raise PergradValueError(
            f"{fn}: the batch has {batch_size} examples, more than max_batch_size="
            f"{max_batch_size}. Poisson batch sizes vary: pick max_batch_size with "
            "max_batch_size_for(num_examples, sample_rate, overflow_probability) (about the "
            "expected size plus a few standard deviations). Do not drop the extra examples: "
            "the privacy analysis assumes the whole batch is used."
        )
    padded = np.zeros(max_batch_size, dtype=np.int64)
    padded[:batch_size] = indices
    mask = np.zeros(max_batch_size, dtype=bool)
    mask[:batch_size] = True
    _last_padding.size = max_batch_size
    return padded, mask


# The size pad_batch padded to last, in this thread, until a DP reduction has looked at it:
# the padded indices lose their identity once they gather the data (x[padded]), so a
# reduction that gets no mask can only tell a padded batch by its size.
_last_padding = threading.local()


def warn_if_mask_forgotten(func_name: str, batch_size: int, mask: Any) -> None:
    """Says so, with a :class:`pergrad.PrivacyWarning`, when a DP reduction (``clipped_sum``,
    ``optax_aggregate``, ``clipped_sum_of``, ``private_grad_of``) gets no ``mask`` for a batch
    of exactly the size :func:`pad_batch` padded to last: its padding rows, copies of example
    0, would count as real examples. Each :func:`pad_batch` is checked by the first reduction
    after it, once (under ``jax.jit``, when the step is traced)."""
    padded_size = getattr(_last_padding, "size", None)
    if padded_size is None:
        return
    _last_padding.size = None
    if mask is not None or batch_size != padded_size:
        return
    warn_from_caller(
        f"{func_name}: got no mask for a batch of {batch_size} examples, the size "
        f"pergrad.dp.pad_batch just padded a batch to. If this batch is padded, its padding "
        f"rows (copies of example 0) count as real examples: the update changes, and example 0 "
        f"contributes several times, past the clipping bound the privacy accounting assumes. "
        f"Pass the mask pad_batch returned: tx.update(grads, state, params, mask=mask), "
        f"clipped_sum(..., mask=mask), clipped_sum_of(..., mask=mask) or "
        f"private_grad_of(..., mask=mask) (pergrad.dp.make_private_optax's loader yields "
        f"(x, y, mask)). For a batch without padding, pass an all-True mask to say so.",
        PrivacyWarning,
    )


def max_batch_size_for(
    num_examples: int, sample_rate: float, overflow_probability: float = 1e-6
) -> int:
    """The smallest size ``M`` with P(Poisson batch size > M) <= ``overflow_probability``.

    Example::

        max_batch_size_for(60000, 256 / 60000)                 # 335: mean 256, std 16
        max_batch_size_for(60000, 256 / 60000, 1e-6 / 14062)   # 365: no batch of a
        # 14062-step run overflows, with probability at least 1 - 1e-6

    The batch size is Binomial(num_examples, sample_rate); ``M`` comes from its exact upper
    tail, summed in log space over a window around the mean. The window's edges are set by
    Bernstein's inequality so that the mass outside it is below ``overflow_probability *
    1e-6``, and that mass is counted as overflow, so the bound holds without approximation.
    The probability is per batch: for ``T`` batches the chance that any overflows is at most
    ``T * overflow_probability`` (union bound), so pass ``overflow_probability / T`` to cover a
    whole run. Costs ``O(std)`` arithmetic: milliseconds.

    Args:
      num_examples: dataset size, an int ``>= 1``.
      sample_rate: inclusion probability, in ``(0, 1]``.
      overflow_probability: allowed chance that one batch exceeds ``M``, in ``(0, 1)``.

    Returns:
      ``M``, an int in ``[0, num_examples]``.
    """
    fn = "max_batch_size_for"
    num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
    sample_rate = check_sample_rate(fn, sample_rate)
    overflow_probability = check_real(fn, "overflow_probability", overflow_probability)
    if not 0.0 < overflow_probability < 1.0:
        raise PergradValueError(
            f"{fn}: overflow_probability must be in (0, 1), got {overflow_probability!r}."
        )
    if sample_rate == 1.0:
        return num_examples
    low, high = _bernstein_window(num_examples, sample_rate, overflow_probability * 1e-6)
    sizes = np.arange(low, high + 1)
    pmf = np.exp(_binomial_log_pmf(num_examples, sample_rate, sizes))
    # upper_tail[i] = P(size > sizes[i]) = mass in (sizes[i], high] + mass above the window.
    mass_above_window = overflow_probability * 1e-6 if high < num_examples else 0.0
    upper_tail = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]]) + mass_above_window
    # The tail is summed from exponentials of log-space terms, a few ulps off: a tail equal
    # to overflow_probability may come out just above it (N=1, q=0.01: 0.010000000000000004).
    within = np.flatnonzero(upper_tail <= overflow_probability * (1 + 1e-12))
    return int(sizes[within[0]])


def _bernstein_window(num_examples: int, sample_rate: float, outside: float) -> tuple[int, int]:
    """Sizes ``[low, high]`` such that each tail beyond them has mass <= ``outside``.

    Bernstein: P(|X - mean| >= t) <= exp(-t^2 / (2 (var + t / 3))) for a sum of Bernoulli
    variables; solve exp(...) = outside for t.
    """
    mean = num_examples * sample_rate
    variance = mean * (1.0 - sample_rate)
    log_term = math.log(1.0 / outside)
    t = log_term / 3.0 + math.sqrt(log_term**2 / 9.0 + 2.0 * log_term * variance)
    return max(0, math.floor(mean - t)), min(num_examples, math.ceil(mean + t))


def _binomial_log_pmf(num_examples: int, sample_rate: float, sizes: np.ndarray) -> np.ndarray:
    # log pmf at sizes[0] from log-gamma, then the ratios pmf(k+1) / pmf(k) accumulated.
    first = int(sizes[0])
    log_first = (
        math.lgamma(num_examples + 1)
        - math.lgamma(first + 1)
        - math.lgamma(num_examples - first + 1)
        + first * math.log(sample_rate)
        + (num_examples - first) * math.log1p(-sample_rate)
    )
    k = sizes[:-1].astype(np.float64)
    log_ratios = np.log((num_examples - k) / (k + 1)) + math.log(sample_rate / (1 - sample_rate))
    return log_first + np.concatenate([[0.0], np.cumsum(log_ratios)])


FIXED_SIZE_BATCHES = """\
{func_name}: the last {run} steps all had exactly {size} examples, but the accountant assumes \
Poisson sampling (sample_rate={sample_rate:g}), under which batch sizes vary around \
{expected:g} (std {std:.2g}): {run} equal sizes in a row has probability {probability:.1e}. \
These are fixed-size batches (a DataLoader with batch_size=, shuffled or not), which the \
accountant's epsilon does not cover. Draw Poisson batches: \
DataLoader(dataset, batch_sampler=pergrad.dp.PoissonBatchSampler(len(dataset), \
sample_rate={sample_rate:g}, steps=steps)), or the loader pergrad.dp.make_private returns; or, \
for fixed-size batches, account them as such: pergrad.dp.Accountant(..., sampling="fixed", \
num_examples=len(dataset))."""


class FixedSizeCheck:
    """Says once, with a :class:`pergrad.PrivacyWarning`, when the batches of a run accounted
    with Poisson sampling keep one size for longer than Poisson sampling plausibly would: the
    mark of fixed-size batches (a plain ``DataLoader(batch_size=)``).

    A Poisson batch's size is Binomial(``expected_batch_size / sample_rate``,
    ``sample_rate``); ``run`` equal sizes in a row have probability ``sum_k P(k)**run``. The
    warning comes at the first run whose probability is below ``false_alarm`` (1e-9: a correct
    run of a million steps warns with probability under 1e-3). Batches that are the whole data
    set (``sample_rate`` near 1) never warn: their size does not vary.
    """

    def __init__(
        self, func_name: str, sample_rate: float, expected_batch_size: float, false_alarm=1e-9
    ) -> None:
        self.func_name = func_name
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        num_examples = max(int(round(self.expected_batch_size / self.sample_rate)), 1)
        pmf = _binomial_pmf(num_examples, self.sample_rate)
        #: the run of equal sizes that warns (None: never, the size barely varies)
        self.run_needed: int | None = None
        self.probability = 1.0
        if pmf.max() < 0.99:
            run = 2
            while float(np.sum(pmf**run)) >= false_alarm:
                run += 1
            self.run_needed, self.probability = run, float(np.sum(pmf**run))
        self.std = math.sqrt(num_examples * self.sample_rate * (1 - self.sample_rate))
        self._size: int | None = None
        self._run = 0
        self.warned = False

    @classmethod
    def of(cls, func_name: str, accountant: Any, expected_batch_size: Any) -> FixedSizeCheck | None:
        """The check for an accountant of (plain or cyclic) Poisson sampling with an expected
        batch size; None where there is nothing to check."""
        from pergrad._src.dp.accounting import Accountant

        if not isinstance(accountant, Accountant) or expected_batch_size is None:
            return None
        if accountant.sampling != "poisson" or accountant.sample_rate is None:
            return None
        return cls(func_name, accountant.sample_rate, expected_batch_size)

    def observe(self, batch_size: int) -> None:
        """Count one step's realised batch size (the whole logical batch)."""
        if self.run_needed is None or self.warned:
            return
        if batch_size == self._size:
            self._run += 1
        else:
            self._size, self._run = batch_size, 1
        if self._run >= self.run_needed and batch_size > 0:
            self.warned = True
            warn_from_caller(
                FIXED_SIZE_BATCHES.format(
                    func_name=self.func_name,
                    run=self._run,
                    size=batch_size,
                    sample_rate=self.sample_rate,
                    expected=self.expected_batch_size,
                    std=self.std,
                    probability=self.probability,
                ),
                PrivacyWarning,
            )


def _binomial_pmf(num_examples: int, sample_rate: float) -> np.ndarray:
    """Binomial(num_examples, sample_rate) probabilities over a window of +-12 std around the
    mean (the mass outside it is negligible for the sums above)."""
    mean = num_examples * sample_rate
    std = math.sqrt(max(mean * (1 - sample_rate), 1e-12))
    low = max(0, int(mean - 12 * std - 2))
    high = min(num_examples, int(mean + 12 * std + 2))
    k = np.arange(low, high + 1, dtype=np.float64)
    if sample_rate >= 1.0:
        return np.array([1.0])
    log_pmf = (
        math.lgamma(num_examples + 1)
        - np.array([math.lgamma(v + 1) + math.lgamma(num_examples - v + 1) for v in k])
        + k * math.log(sample_rate)
        + (num_examples - k) * math.log1p(-sample_rate)
    )
    return np.exp(log_pmf)


def warn_unsampled_batch(func_name: str) -> None:
    """Says so, with a :class:`pergrad.PrivacyWarning`, when the transformation of
    :func:`pergrad.dp.make_private_optax` gets a batch without a mask: its accounting assumes
    the Poisson batches of its loader, which always come with their mask, so a batch without
    one was drawn otherwise (fixed-size batches, or a padded batch whose mask was dropped).
    Takes the place of :func:`warn_if_mask_forgotten`'s warning for that batch."""
    _last_padding.size = None
    warn_from_caller(
        f"{func_name}: the transformation got a batch without mask=, but its accounting "
        f"assumes the Poisson batches of the loader make_private_optax returned, which always "
        f"come with their mask. Fixed-size batches (a shuffled batch_size= loop of your own) "
        f"are not Poisson sampling, and the accountant's epsilon does not cover them; a padded "
        f"batch without its mask counts its padding rows as examples. Iterate "
        f"`for x, y, mask in loader` and pass tx.update(grads, state, params, mask=mask). "
        f"(For Poisson batches you draw yourself without padding, pass an all-True mask.)",
        PrivacyWarning,
    )
