"""DP-SGD across processes with ``torch.distributed``: what ``DPOptimizer(distributed=...)`` uses.

Data parallel DP-SGD: every process holds the same model, samples its own shard of each
Poisson batch (``PoissonBatchSampler(..., num_replicas=, rank=)``), computes the clipped sum of
its own examples, and the processes sum their contributions with one all-reduce. The Gaussian
noise is drawn **once per step, on rank 0 of the process group**, and added to rank 0's
contribution before the all-reduce, so every process ends the step with the same

    sum over all processes of the clipped per-example gradients + N(0, (noise_multiplier * C)^2)

which is exactly what a single process computes on the union of the shards: the privacy
analysis (and the :class:`pergrad.dp.Accountant`, fed the global sample rate) is the
single-process one. Why rank 0 and not an identically seeded generator on every rank: only one
generator has to be seeded securely, and nothing goes wrong if the ranks' generators differ
(they are not used), whereas identically seeded generators must be kept in lock-step by hand
and would leave every process able to subtract the noise. Noise on every rank instead would
add ``world_size`` draws: ``world_size`` times the variance the accountant assumes.

Do not wrap the model in ``DistributedDataParallel``: DDP all-reduces gradients during
``backward()``, i.e. the *unclipped* batch gradient, which DP-SGD must never release, and
pergrad computes clipped sums without calling ``backward()`` on the model's parameters, so
DDP's reducer would either wait for gradients that never come or double the communication.
Start every process from the same parameters instead (seed identically, or call
:func:`broadcast_parameters`); pergrad checks this when the optimizer is built and does the
all-reduce itself.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pergrad._src.errors import PergradTypeError, PergradValueError

# Fingerprints: the tensor's bytes read as int32 words, times position weights in [1, 251],
# summed in int64 chunks small enough not to overflow (2**31 * 251 * 251 * 2**14 < 2**63); a
# chunk length that is a multiple of 251 gives every chunk the same weights.
_WEIGHT_PERIOD = 251
_CHUNK_WORDS = _WEIGHT_PERIOD * 2**14
_MODULUS = 2**61 - 1
_INIT_HINT = (
    "call torch.distributed.init_process_group(backend='gloo' (CPU) or 'nccl' (GPU), ...) in "
    "every process first (torchrun sets up the environment it reads)"
)


class StepTotals(NamedTuple):
    """One step's noisy clipped sum, with the number of examples it covers and the share of
    them that were clipped (over all processes when distributed)."""

    sum: dict[str, torch.Tensor]
    count: float
    clip_fraction: float


def process_group_of(func_name: str, distributed: Any) -> Any:
    """The process group that ``distributed`` asks for, or None for ``distributed=False``.

    ``True`` is the default group (``torch.distributed.group.WORLD``); a
    ``torch.distributed.ProcessGroup`` is used as it is. Raises a :class:`PergradValueError`
    naming the process group when none is initialised or this process is not in the group.
    """
    if distributed is False:
        return None
    if not dist.is_available():
        raise PergradValueError(
            f"{func_name}: distributed={distributed!r} needs torch.distributed, which this "
            "PyTorch build does not provide."
        )
    # torch.distributed.new_group returns this int sentinel in processes outside the group.
    if type(distributed) is int and distributed == dist.GroupMember.NON_GROUP_MEMBER:
        raise PergradValueError(
            f"{func_name}: distributed is a process group that this process (global rank "
            f"{dist.get_rank()}) is not a member of; build the optimizer only in the group's "
            "processes."
        )
    if distributed is not True and not isinstance(distributed, dist.ProcessGroup):
        raise PergradTypeError(
            f"{func_name}: distributed must be False, True (the default torch.distributed "
            f"process group) or a torch.distributed.ProcessGroup; got "
            f"{type(distributed).__name__} {distributed!r}."
        )
    if not dist.is_initialized():
        raise PergradValueError(
            f"{func_name}: distributed={distributed!r} needs an initialised torch.distributed "
            f"process group, and the default process group is not initialised; {_INIT_HINT}."
        )
    return dist.group.WORLD if distributed is True else distributed


def _collective_device(group: Any) -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors (and CUDA ones, through the host).
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(values: list[int], group: Any) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in group-rank order."""
    local = torch.tensor(values, dtype=torch.int64, device=_collective_device(group))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [row.tolist() for row in gathered]


def _fingerprint(tensor: torch.Tensor) -> int:
    """An exact, order-independent checksum of a tensor's bytes: position-weighted sums in
    integer arithmetic, so equal tensors give equal fingerprints on any device and thread
    count, and a changed element changes it (a swap of two elements too, unless their
    positions are equal modulo 251)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    padding = -raw.numel() % 4
    if padding:
        raw = torch.cat([raw, raw.new_zeros(padding)])
    words = raw.view(torch.int32)
    weights = torch.arange(min(words.numel(), _CHUNK_WORDS), device=words.device)
    weights = weights % _WEIGHT_PERIOD + 1
    total = 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64)
        total += int((chunk * weights[: chunk.numel()]).sum())
    return total % _MODULUS


def _structure(named: Mapping[str, torch.Tensor]) -> int:
    layout = ";".join(
        f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}" for name, t in named.items()
    )
    return zlib.crc32(layout.encode())


def _float_bits(value: float | str | None) -> int:
    """A float setting as the int64 with its bits (None as -1.0), for the int64 gather; a text
    setting (a clipping policy's repr) as its CRC."""
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    as_float = torch.tensor(-1.0 if value is None else value, dtype=torch.float64)
    return int(as_float.view(torch.int64))


def check_same_across_ranks(
    func_name: str,
    group: Any,
    named_params: Mapping[str, torch.Tensor],
    settings: Mapping[str, float | str | None],
    values: bool = True,
) -> None:
    """Raises unless every rank of ``group`` has the same parameters and ``settings``.

    Two all-gathers: first the parameters' names, shapes, dtypes and ``requires_grad`` flags
    (one CRC) and the settings (``max_norm``, ...); then one exact fingerprint per parameter
    (:func:`_fingerprint`). Costs one pass over the parameters' bytes, once, at construction.
    Every rank sees the same gathered values, so every rank raises the same error.
    ``values=False`` compares the structure and settings only (an FSDP2 model's parameters
    are shards, different on each rank by design).
    """
    names = list(named_params)
    header = [_structure(named_params), len(names), *(_float_bits(v) for v in settings.values())]
    headers = _all_gather(header, group)
    if any(row[:2] != headers[0][:2] for row in headers):
        raise PergradValueError(
            f"{func_name}: the model's parameters (names, shapes, dtypes, requires_grad) differ "
            "across ranks; every process must build the same model."
        )
    for position, name in enumerate(settings, start=2):
        column = [row[position] for row in headers]
        if any(bits != column[0] for bits in column):
            values = [_from_bits(bits) for bits in column]
            raise PergradValueError(
                f"{func_name}: {name} must be the same on every rank; got {values} (by rank). "
                "Pass the global values (e.g. expected_batch_size = sample_rate * dataset "
                "size) on every process."
            )
    if not values:
        return
    fingerprints = _all_gather([_fingerprint(named_params[name]) for name in names], group)
    for index, name in enumerate(names):
        column = [row[index] for row in fingerprints]
        differing = [rank for rank, value in enumerate(column) if value != column[0]]
        if differing:
            raise PergradValueError(
                f"{func_name}: parameter {name!r} differs across ranks (rank 0 and rank(s) "
                f"{differing} hold different values). Every process must start from the same "
                "parameters: seed identically before building the model, or call "
                "pergrad.dp.broadcast_parameters(model) before building the optimizer."
            )


def _from_bits(bits: int) -> float | None:
    value = float(torch.tensor(bits, dtype=torch.int64).view(torch.float64))
    return None if value == -1.0 else value


def all_reduce_totals(
    summed: dict[str, torch.Tensor], count: torch.Tensor, clip_fraction: torch.Tensor, group: Any
) -> StepTotals:
    """Sums ``summed`` (already noised on rank 0), the example counts and the clipped counts
    over ``group`` in ONE all-reduce of ``P + 2`` numbers (in the parameters' promoted dtype),
    and returns the global :class:`StepTotals`, identical on every rank."""
    names = sorted(summed)  # the same order on every rank, however each built its dict
    leaves = [summed[name] for name in names]
    dtype = torch.float32
    for leaf in leaves:
        dtype = torch.promote_types(dtype, leaf.dtype)
    device = leaves[0].device if leaves else _collective_device(group)
    clipped = clip_fraction * count.clamp(min=1.0)
    counts = torch.stack([count, clipped]).to(device=device, dtype=dtype)
    buffer = torch.cat([leaf.reshape(-1).to(dtype) for leaf in leaves] + [counts])
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    sizes = [leaf.numel() for leaf in leaves]
    pieces = buffer[: sum(sizes)].split(sizes) if sizes else []
    total_sum = {
        name: piece.reshape(leaf.shape).to(leaf.dtype)
        for name, leaf, piece in zip(names, leaves, pieces)
    }
    total_count, total_clipped = buffer[-2:].tolist()
    return StepTotals(total_sum, total_count, total_clipped / max(total_count, 1.0))


def is_noise_rank(group: Any) -> bool:
    """Whether this process draws the step's noise: rank 0 of ``group``."""
    return dist.get_rank(group) == 0


def broadcast_parameters(
    model: torch.nn.Module, src: int = 0, distributed: bool | Any = True
) -> None:
    """Copies the parameters and buffers of rank ``src``'s ``model`` into every process's model.

    Example (every process, after ``init_process_group`` and building the model)::

        pergrad.dp.broadcast_parameters(model)       # rank 0's initial weights everywhere
        optimizer = pergrad.dp.DPOptimizer(..., distributed=True)

    This is what ``DistributedDataParallel`` does at construction, for DP-SGD users who must
    not wrap their model in it. It writes the model's tensors in place;
    call it in every process of the group, with the same ``src``: one broadcast per tensor.

    Args:
      model: the ``nn.Module``, the same architecture in every process.
      src: the rank (within the group) whose values everyone receives.
      distributed: ``True`` for the default process group, or a
        ``torch.distributed.ProcessGroup``.
    """
    func_name = "broadcast_parameters"
    if not isinstance(model, torch.nn.Module):
        raise PergradTypeError(
            f"{func_name}: model must be a torch.nn.Module; got {type(model).__name__}."
        )
    if distributed is False:
        raise PergradValueError(
            f"{func_name}: distributed must be True or a torch.distributed.ProcessGroup; got "
            "False (there is nothing to broadcast in one process)."
        )
    group = process_group_of(func_name, distributed)
    world_size = dist.get_world_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world_size:
        raise PergradValueError(
            f"{func_name}: src must be a rank in [0, {world_size}); got {src!r}."
        )
    source = dist.get_global_rank(group, src)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.detach(), src=source, group=group)
