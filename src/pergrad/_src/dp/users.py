"""User-level differential privacy: examples carry a user id, and the unit that is clipped,
sampled and accounted is the user, not the example.

    for indices in poisson_user_batches(dataset_user_ids, sample_rate=64 / num_users, steps=1000):
        clipped = clipped_sum(grads_of(X[indices]), 1.0, user_ids=dataset_user_ids[indices])

Three pieces, one concept:

- **Grouping** (:func:`user_slots`): a batch's examples grouped by user, as a ``(B, B)`` 0/1
  matrix whose row ``k`` holds the examples of the user whose first real example in the batch
  is row ``k`` (rows of the other examples are zero). It is made from comparisons of the ids
  alone, so it has static shapes and runs under ``jax.jit`` with traced ids; ``slots @ g``
  sums each user's per-example gradients ``g`` (``(B, P)``) into its row. ``clipping.py``
  clips those sums (``clipped_sum(..., user_ids=)``); the DP reductions of a loss
  (``from_loss.py``) form the per-example gradients first.
- **Sampling** (:func:`poisson_user_batches`, and ``UserPoissonBatchSampler`` for PyTorch in
  ``torch/sampling.py``): each user joins each batch independently with probability
  ``sample_rate`` and brings its examples (all of them, or at most ``max_examples_per_user``).
- **Accounting**: unchanged, with the user-level sample rate (users sampled / number of users):
  ``epsilon(noise_multiplier=, sample_rate=, steps=, delta=)`` then bounds what any one user's
  data, however many examples, can reveal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from pergrad._src.backends import Backend
from pergrad._src.dp.accounting import check_count, check_sample_rate
from pergrad._src.dp.sampling import generator_of_seed
from pergrad._src.errors import PergradTypeError, PergradValueError


def check_user_ids(func_name: str, bk: Backend, user_ids: Any, batch_size: int, like: Any) -> Any:
    """``user_ids`` as a ``(batch_size,)`` integer array of ``bk``'s framework (a numpy array
    or a list is converted, onto ``like``'s device), every id ``>= 0`` where that can be read
    (not under ``jax.jit``)."""
    if not bk.is_array(user_ids):
        if not isinstance(user_ids, (np.ndarray, list, tuple)):
            raise PergradTypeError(
                f"{func_name}: user_ids must be a ({batch_size},) integer array (of the "
                f"gradients' framework, or numpy), one user id per example; got "
                f"{type(user_ids).__name__}."
            )
        array = np.asarray(user_ids)
        if array.size and array.dtype.kind not in "iu":
            raise PergradTypeError(
                f"{func_name}: user_ids must be integers (one user id per example); got dtype "
                f"{array.dtype}."
            )
        _check_shape(func_name, array.shape, batch_size)
        if array.size and array.min() < 0:
            raise PergradValueError(
                f"{func_name}: user_ids must be >= 0 (one user id per example; mark padding "
                f"with mask=, not with a negative id); got {int(array.min())}."
            )
        return bk.from_numpy(array.astype(np.int64), like)
    dtype = bk.dtype_name(user_ids)
    if "int" not in dtype or dtype == "bool":
        raise PergradTypeError(
            f"{func_name}: user_ids must be integers (one user id per example); got dtype {dtype}."
        )
    _check_shape(func_name, bk.shape(user_ids), batch_size)
    if bk.known_all(user_ids >= 0) is False:  # readable, so not traced
        raise PergradValueError(
            f"{func_name}: user_ids must be >= 0 (one user id per example; mark padding with "
            f"mask=, not with a negative id); got {int(bk.to_numpy(user_ids).min())}."
        )
    return user_ids


def _check_shape(func_name: str, shape: tuple[int, ...], batch_size: int) -> None:
    if tuple(shape) != (batch_size,):
        raise PergradValueError(
            f"{func_name}: user_ids must have shape ({batch_size},), one user id per example "
            f"of the batch; got shape {tuple(shape)}."
        )


class UserSlots(NamedTuple):
    """A batch's examples grouped by user (:func:`user_slots`).

    Attributes:
      slots: ``(B, B)`` 0/1 in the gradients' dtype: ``slots[k, i] = 1`` where example ``i``
        is real and its user's first real example in the batch is row ``k``.
      real: ``(B,)`` 1 where row ``k`` is a user's first real example (a user's row), else 0:
        ``real.sum()`` is the number of users in the batch.
    """

    slots: Any
    real: Any


def user_slots(bk: Backend, user_ids: Any, mask: Any, unit: Any) -> UserSlots:
    """The grouping of a batch by user, from ``(B,)`` ids (and an optional ``(B,)`` mask,
    False for padding, whose rows join no user). ``unit``: a 0-d 1 in the gradients' dtype.
    ``O(B^2)`` comparisons; no sorting or scatter, so shapes are static under ``jax.jit``."""
    batch_size = bk.shape(user_ids)[0]
    real = user_ids >= 0 if mask is None else mask != 0
    same = (user_ids[:, None] == user_ids[None, :]) & real[None, :] & real[:, None]
    before = bk.from_numpy(np.tri(batch_size, batch_size, -1, dtype=bool), user_ids)
    first = real & ~(same & before).any(1)
    zero = unit * 0
    return UserSlots(bk.where(same & first[:, None], unit, zero), bk.where(first, unit, zero))


def poisson_user_batches(
    user_ids: Any,
    sample_rate: float,
    steps: int,
    seed: int | None = None,
    max_examples_per_user: int | None = None,
) -> Iterator[np.ndarray]:
    """Yields ``steps`` batches of example indices, Poisson-sampled by user.

    Example::

        num_users = len(np.unique(user_ids))               # user_ids: (N,), one per example
        rate = 64 / num_users                              # about 64 users a batch
        for indices in poisson_user_batches(user_ids, rate, steps=1000):
            grad, _ = pergrad.dp.private_grad_of(loss, params, X[indices], Y[indices],
                                                 user_ids=user_ids[indices], max_norm=1.0,
                                                 noise_multiplier=1.1, rng=key,
                                                 expected_batch_size=rate * num_users)
        pergrad.dp.epsilon(noise_multiplier=1.1, sample_rate=rate, steps=1000, delta=1e-6)

    In every batch each distinct user is included independently with probability
    ``sample_rate``, with its examples: all of them, or, with ``max_examples_per_user=k``, a
    uniform random subset of ``min(k, n_u)`` of them, drawn afresh each step (bounded work for
    a user with many examples; the privacy guarantee does not depend on the cap, since each
    user's summed gradient is clipped as a whole). The number of users per batch is
    Binomial(number of users, ``sample_rate``); a batch may be empty and is yielded, not
    skipped. The privacy accounting takes this ``sample_rate`` (users sampled / number of
    users) and counts users: ``expected_batch_size`` (the divisor of a mean) is then the
    expected number of USERS per batch, ``sample_rate * number of users``.

    Args:
      user_ids: ``(N,)`` non-negative integer user ids, one per example of the dataset (numpy,
        a list, or anything ``np.asarray`` accepts). Ids need not be contiguous.
      sample_rate: each user's inclusion probability, in ``(0, 1]``.
      steps: number of batches, an int ``>= 0``.
      seed: an int for reproducible batches (tests, debugging), or None (default) for a fresh
        128-bit seed from the operating system's secure source; see
        :func:`pergrad.dp.poisson_batches`.
      max_examples_per_user: None (all of a user's examples), or an int ``>= 1``.

    Yields:
      ``steps`` sorted ``int64`` arrays of distinct example indices into ``user_ids``.
    """
    fn = "poisson_user_batches"
    members = user_members(fn, user_ids)
    sample_rate = check_sample_rate(fn, sample_rate)
    steps = check_count(fn, "steps", steps, minimum=0)
    cap = check_cap(fn, max_examples_per_user)
    return _user_batches(members, sample_rate, steps, cap, generator_of_seed(fn, seed))


def user_members(fn: str, user_ids: Any) -> list[np.ndarray]:
    """Each distinct user's example indices (in increasing user id), from a dataset's ``(N,)``
    non-negative integer ids."""
    ids = np.asarray(user_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise PergradValueError(
            f"{fn}: user_ids must be 1-D with at least one entry (one user id per example of "
            f"the dataset); got shape {ids.shape}."
        )
    if ids.dtype.kind not in "iu":
        raise PergradTypeError(
            f"{fn}: user_ids must be integers (one user id per example); got dtype {ids.dtype}."
        )
    if ids.min() < 0:
        raise PergradValueError(f"{fn}: user_ids must be >= 0; got {int(ids.min())}.")
    order = np.argsort(ids, kind="stable")
    starts = np.flatnonzero(np.diff(ids[order], prepend=ids[order][0] - 1))
    return np.split(order.astype(np.int64), starts[1:])


def check_cap(fn: str, max_examples_per_user: Any) -> int | None:
    if max_examples_per_user is None:
        return None
    return check_count(fn, "max_examples_per_user", max_examples_per_user, minimum=1)


def sample_users(
    members: list[np.ndarray],
    sample_rate: float,
    cap: int | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """One batch: each user in with probability ``sample_rate`` (the number of users from the
    binomial, then a uniform subset of that size), with its examples (at most ``cap``)."""
    num_users = len(members)
    chosen = rng.choice(num_users, size=int(rng.binomial(num_users, sample_rate)), replace=False)
    picked = []
    for user in chosen:
        examples = members[user]
        if cap is not None and len(examples) > cap:
            examples = rng.choice(examples, size=cap, replace=False)
        picked.append(examples)
    if not picked:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(picked)).astype(np.int64, copy=False)


def _user_batches(
    members: list[np.ndarray],
    sample_rate: float,
    steps: int,
    cap: int | None,
    rng: np.random.Generator,
) -> Iterator[np.ndarray]:
    # A generator of its own, so that poisson_user_batches validates its arguments when called.
    for _ in range(steps):
        yield sample_users(members, sample_rate, cap, rng)
