"""Poisson sampling for PyTorch's DataLoader (imports torch; loaded on first use).

loader = torch.utils.data.DataLoader(
    dataset,
    batch_sampler=PoissonBatchSampler(len(dataset), sample_rate=256 / len(dataset), steps=1000),
    collate_fn=collate_with_empty_batches(dataset),
)
for x, y in loader:          # x: (batch_size, ...), batch_size varies and may be 0
    ...

Across processes, each one passes ``num_replicas=world_size, rank=rank`` and gets its own shard
of every batch; the union of the shards is the Poisson batch.

``CyclicPoissonBatchSampler`` draws the cyclic Poisson batches that a banded mechanism made with
``sample_rate`` is accounted for (:mod:`pergrad._src.dp.cyclic`); ``UserPoissonBatchSampler``
samples users, with their examples, for user-level DP (:mod:`pergrad._src.dp.users`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler
from torch.utils.data.dataloader import default_collate

from pergrad._src.dp.accounting import check_count, check_sample_rate
from pergrad._src.dp.cyclic import group_members, resolve_cyclic_sampling
from pergrad._src.dp.noise import NoiseMechanism
from pergrad._src.dp.users import check_cap, user_members
from pergrad._src.errors import PergradTypeError, PergradValueError


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``steps`` Poisson-sampled batches of indices, for ``DataLoader(batch_sampler=)``.

    In every batch each of the ``num_examples`` examples is included independently with
    probability ``sample_rate``, as DP-SGD's privacy accounting assumes (the same sampling as
    :func:`poisson_batches`). Batch sizes vary and a batch may be empty; empty batches are
    yielded as ``[]``, not skipped, since the accountant counts every step. PyTorch's default
    collate cannot stack an empty batch: pass ``collate_fn=collate_with_empty_batches(dataset)``.

    ``len(sampler) == steps``. Iterating again draws new batches (the generator moves on).
    Each step draws ``num_examples`` uniform numbers: ``O(num_examples)``.

    **Across processes** (data-parallel DP-SGD with ``DPOptimizer(distributed=True)``): every
    process passes ``num_replicas`` (the world size) and its ``rank``. Example ``i`` belongs to
    the shard of rank ``i % num_replicas``; each process draws the coin of every example, as
    above, and keeps the included examples of its own shard. The union of the shards is thus a
    Poisson sample of the whole dataset at ``sample_rate`` (every example independently with
    that probability, in exactly one shard), whether the processes' generators are seeded alike
    or not; seeded alike, it is exactly the batch this sampler yields with
    ``num_replicas=1``. Every process yields ``steps`` batches, empty shards included, so all
    of them take part in every step's all-reduce. Indices are into the whole dataset: give
    every process's DataLoader the whole dataset.

    Args:
      num_examples: dataset size, an int ``>= 1``.
      sample_rate: inclusion probability, in ``(0, 1]``.
      steps: batches per pass over the sampler, an int ``>= 0``.
      generator: a ``torch.Generator`` (seed it for reproducible batches in tests), or ``None``
        (default) for one seeded from the operating system's secure source
        (``secrets.randbits(64)``). For a real privacy guarantee the sampling must be
        unpredictable to an adversary: do not use a fixed or guessable seed there.
      num_replicas: the number of processes the batches are split across (the world size), an
        int ``>= 1``; 1 (default) yields whole batches.
      rank: this process's shard, an int in ``[0, num_replicas)``.
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float,
        steps: int,
        generator: torch.Generator | None = None,
        *,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__()
        fn = "PoissonBatchSampler"
        self.num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
        self.sample_rate = check_sample_rate(fn, sample_rate)
        self.steps = check_count(fn, "steps", steps, minimum=0)
        self.num_replicas, self.rank = _check_shard(fn, num_replicas, rank)
        self.generator = _check_generator(fn, generator)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            draws = torch.rand(self.num_examples, generator=self.generator)
            included = torch.nonzero(draws < self.sample_rate).flatten()
            if self.num_replicas > 1:
                included = included[included % self.num_replicas == self.rank]
            yield included.tolist()

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        shard = f", num_replicas={self.num_replicas}, rank={self.rank}"
        shard = shard if self.num_replicas > 1 else ""
        return (
            f"PoissonBatchSampler(num_examples={self.num_examples}, "
            f"sample_rate={self.sample_rate:g}, steps={self.steps}{shard})"
        )


class CyclicPoissonBatchSampler(Sampler[list[int]]):
    """Yields cyclic Poisson batches of indices, for ``DataLoader(batch_sampler=)``: the
    sampling that a banded mechanism made with ``sample_rate`` is accounted for.

    Example::

        mech = pergrad.dp.toeplitz([1.0, 0.5], steps=1000, min_separation=4, sample_rate=0.02)
        sampler = CyclicPoissonBatchSampler(len(dataset), noise=mech)   # 1000 batches
        loader = DataLoader(dataset, batch_sampler=sampler,
                            collate_fn=collate_with_empty_batches(dataset))
        opt = pergrad.dp.DPOptimizer(..., noise=mech,
                                     expected_batch_size=sampler.expected_batch_size)

    The examples are split at random into ``min_separation`` groups when the sampler is made
    (each example's group uniform and independent, drawn from ``generator``); batch ``t`` holds
    each example of group ``t % min_separation`` independently with probability
    ``sample_rate`` (the sampling of :func:`pergrad.dp.cyclic_poisson_batches`). Batch sizes
    vary, mean :attr:`expected_batch_size`, and a batch may be empty (``[]``, yielded, not
    skipped). Each step draws one uniform number per member of its group.

    ``len(sampler) == steps``. Iterating again continues the same run: the groups stay and
    the cycle goes on from the step the last pass stopped at, so an example's steps stay
    ``min_separation`` apart across passes (a mechanism made for ``E * steps`` steps covers
    ``E`` passes). Do not drop batches the sampler yielded: the cycle counts them.

    **Across processes**: as for ``PoissonBatchSampler``, every process passes
    ``num_replicas`` and its ``rank`` and keeps the included examples ``i`` with ``i %
    num_replicas == rank``; the union of the shards is the cyclic Poisson batch (each example
    drawn by its own rank's groups and coins, whether the generators are seeded alike or not;
    seeded alike, exactly the batch of ``num_replicas=1``).

    Args:
      num_examples: dataset size, an int ``>= 1``.
      sample_rate: the inclusion probability within the step's group, in ``(0, 1]``.
      min_separation: the number of groups, an int ``>= 1``.
      steps: batches per pass over the sampler, an int ``>= 0``.
      generator: a ``torch.Generator``, or ``None`` (default) for one seeded from the
        operating system's secure source (see ``PoissonBatchSampler``).
      noise: a mechanism made with ``sample_rate`` (:func:`pergrad.dp.toeplitz`), whose
        ``sample_rate``, ``min_separation`` and ``steps`` are then taken (the arguments
        above may be left out; given, they must agree).
      num_replicas, rank: as for ``PoissonBatchSampler``.
    """

    def __init__(
        self,
        num_examples: int,
        sample_rate: float | None = None,
        min_separation: int | None = None,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        *,
        noise: NoiseMechanism | None = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        super().__init__()
        fn = "CyclicPoissonBatchSampler"
        self.num_examples = check_count(fn, "num_examples", num_examples, minimum=1)
        self.sample_rate, self.min_separation, self.steps = resolve_cyclic_sampling(
            fn, sample_rate, min_separation, steps, noise
        )
        self.num_replicas, self.rank = _check_shard(fn, num_replicas, rank)
        self.generator = _check_generator(fn, generator)
        groups = torch.randint(
            self.min_separation, (self.num_examples,), generator=self.generator
        ).numpy()
        self._members = [
            torch.from_numpy(members) for members in group_members(groups, self.min_separation)
        ]
        self._next_step = 0

    @property
    def expected_batch_size(self) -> float:
        """The mean size of a whole batch (all shards), ``num_examples * sample_rate /
        min_separation``: pass it to ``DPOptimizer(expected_batch_size=)``."""
        return self.num_examples * self.sample_rate / self.min_separation

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            members = self._members[self._next_step % self.min_separation]
            self._next_step += 1
            draws = torch.rand(members.numel(), generator=self.generator)
            included = members[draws < self.sample_rate]
            if self.num_replicas > 1:
                included = included[included % self.num_replicas == self.rank]
            yield included.tolist()

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        shard = f", num_replicas={self.num_replicas}, rank={self.rank}"
        shard = shard if self.num_replicas > 1 else ""
        return (
            f"CyclicPoissonBatchSampler(num_examples={self.num_examples}, "
            f"sample_rate={self.sample_rate:g}, min_separation={self.min_separation}, "
            f"steps={self.steps}{shard})"
        )


class UserPoissonBatchSampler(Sampler[list[int]]):
    """Yields batches of indices Poisson-sampled by USER, for ``DataLoader(batch_sampler=)``:
    the sampling of user-level DP-SGD.

    Example::

        sampler = UserPoissonBatchSampler(user_ids, sample_rate=64 / num_users, steps=1000)
        loader = DataLoader(dataset, batch_sampler=sampler,      # dataset[i]: (x, y, user)
                            collate_fn=collate_with_empty_batches(dataset))
        opt = pergrad.dp.DPOptimizer(..., expected_batch_size=sampler.expected_batch_size)
        for x, y, users in loader:
            opt.step(x, y, user_ids=users)

    In every batch each distinct user is included independently with probability
    ``sample_rate``, with all its examples or, with ``max_examples_per_user=k``, a uniform
    random subset of ``min(k, n_u)`` of them drawn afresh each step (the sampling of
    :func:`pergrad.dp.poisson_user_batches`). The number of users per batch varies, mean
    :attr:`expected_batch_size`; a batch may be empty (``[]``, yielded, not skipped). Account
    with this ``sample_rate`` (users sampled / number of users). One process only.

    ``len(sampler) == steps``; iterating again draws new batches. Each step draws one uniform
    number per user.

    Args:
      user_ids: ``(N,)`` non-negative integer user ids, one per example of the dataset (a
        tensor, numpy array or list).
      sample_rate: each user's inclusion probability, in ``(0, 1]``.
      steps: batches per pass over the sampler, an int ``>= 0``.
      generator: a ``torch.Generator``, or ``None`` (default) for one seeded from the
        operating system's secure source (see ``PoissonBatchSampler``).
      max_examples_per_user: None (all of a sampled user's examples), or an int ``>= 1``.
    """

    def __init__(
        self,
        user_ids: Any,
        sample_rate: float,
        steps: int,
        generator: torch.Generator | None = None,
        *,
        max_examples_per_user: int | None = None,
    ) -> None:
        super().__init__()
        fn = "UserPoissonBatchSampler"
        if isinstance(user_ids, torch.Tensor):
            user_ids = user_ids.detach().cpu().numpy()
        self._members = [torch.from_numpy(m) for m in user_members(fn, user_ids)]
        self.sample_rate = check_sample_rate(fn, sample_rate)
        self.steps = check_count(fn, "steps", steps, minimum=0)
        self.max_examples_per_user = check_cap(fn, max_examples_per_user)
        self.generator = _check_generator(fn, generator)

    @property
    def num_users(self) -> int:
        """The number of distinct users in the dataset."""
        return len(self._members)

    @property
    def expected_batch_size(self) -> float:
        """The expected number of users per batch, ``sample_rate * num_users``: pass it to
        ``DPOptimizer(expected_batch_size=)``."""
        return self.sample_rate * self.num_users

    def __iter__(self) -> Iterator[list[int]]:
        cap = self.max_examples_per_user
        for _ in range(self.steps):
            draws = torch.rand(self.num_users, generator=self.generator)
            picked = []
            for user in torch.nonzero(draws < self.sample_rate).flatten().tolist():
                examples = self._members[user]
                if cap is not None and examples.numel() > cap:
                    order = torch.randperm(examples.numel(), generator=self.generator)
                    examples = examples[order[:cap]]
                picked.append(examples)
            yield torch.cat(picked).sort().values.tolist() if picked else []

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        cap = self.max_examples_per_user
        return (
            f"UserPoissonBatchSampler(num_users={self.num_users}, "
            f"sample_rate={self.sample_rate:g}, steps={self.steps}"
            f"{'' if cap is None else f', max_examples_per_user={cap}'})"
        )


def _check_shard(fn: str, num_replicas: Any, rank: Any) -> tuple[int, int]:
    num_replicas = check_count(fn, "num_replicas", num_replicas, minimum=1)
    rank = check_count(fn, "rank", rank, minimum=0)
    if rank >= num_replicas:
        raise PergradValueError(
            f"{fn}: rank must be in [0, num_replicas={num_replicas}) (this process's shard), "
            f"got {rank!r}."
        )
    return num_replicas, rank


def _check_generator(fn: str, generator: Any) -> torch.Generator:
    if generator is None:
        return torch.Generator().manual_seed(secrets.randbits(64))
    if not isinstance(generator, torch.Generator):
        raise PergradTypeError(
            f"{fn}: generator must be a torch.Generator or None (securely seeded), got "
            f"{type(generator).__name__}."
        )
    return generator


def collate_with_empty_batches(
    dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None
) -> Callable[[list[Any]], Any]:
    """A DataLoader ``collate_fn`` that also turns an empty batch into empty tensors.

    Non-empty batches go to ``collate_fn`` (default: PyTorch's ``default_collate``). An empty
    batch is collated as ``[dataset[0]]`` and every tensor in the result cut to length 0 along
    dim 0, so it keeps the structure, dtypes and trailing shapes of a real batch: e.g.
    ``(x, y)`` with ``x`` of shape ``(0, 1, 28, 28)`` and ``y`` of shape ``(0,)``.
    pergrad's per-example gradients accept such batches (``B == 0``).

    Args:
      dataset: the DataLoader's dataset (indexable; ``dataset[0]`` is read for empty batches).
      collate_fn: the collate function for non-empty batches, or ``None`` for
        ``default_collate``.
    """
    collate = default_collate if collate_fn is None else collate_fn

    def collate_allowing_empty(batch: list[Any]) -> Any:
        if len(batch) > 0:
            return collate(batch)
        return _empty_like(collate([dataset[0]]))

    return collate_allowing_empty


def _empty_like(collated: Any) -> Any:
    """Cuts a collated batch of one example to zero examples, keeping its structure."""
    if isinstance(collated, torch.Tensor):
        return collated[:0]
    if isinstance(collated, Mapping):
        return type(collated)({key: _empty_like(value) for key, value in collated.items()})
    if isinstance(collated, (list, tuple)):
        if all(isinstance(item, (str, bytes)) for item in collated):
            return type(collated)()  # one entry per example, e.g. collated strings
        items = [_empty_like(item) for item in collated]
        return type(collated)(*items) if hasattr(collated, "_fields") else type(collated)(items)
    return collated
