"""``DPOptimizer`` on FSDP2 models: tied weights, mixed precision and user-level DP.

The harness of ``test_fsdp_torch.py`` (its models, data, sampler and helpers, imported): this
file, run as a script (``python test_fsdp_torch_more.py WORLD_SIZE RANK STORE OUT``), plays
each scenario on gloo processes and saves what it saw; the tests compare that with the
single-process ``DPOptimizer`` on the union of the processes' examples, computed here.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 is PyTorch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from pergrad import dp  # noqa: E402
from pergrad._src.errors import NonFiniteWarning  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (run as a script, too)
from test_fsdp_torch import (  # noqa: E402
    MAX_NORM,
    NOISE_MULTIPLIER,
    NOISE_SEED,
    NUM_EXAMPLES,
    STEPS,
    VOCAB,
    WIDTH,
    Block,
    assert_params_equal,
    batches,
    dp_optimizer,
    error_of,
    gathered,
    join_gloo,
    leave_gloo,
    make_data,
    make_mlp,
    make_tokens,
    noise_step,
    run_workers,
    shard,
    token_loss,
    with_nan_example,
)

USERS = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5, 5])  # 6 users of 1 to 3 examples
USER_SAMPLE_RATE = 0.5
BOUND_EXAMPLES = 4  # single-example steps of the clip-bound check
ACCUMULATED = list(range(NUM_EXAMPLES))  # every user in one step, in two micro-batches


class TiedGPT(nn.Module):
    """GPT-2's tie: the token embedding is also the output projection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = Block(WIDTH, heads=2)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


class TiedLinears(nn.Module):
    """Two linear layers sharing one weight: no cross rule for the pair."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(20, 20), nn.Linear(20, 20)
        self.second.weight = self.first.weight
        self.out = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))


def float32_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


def bf16_policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fp16_policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


def adaptive(count_noise_std: float = 0.0) -> Any:
    """Adaptive clipping that moves the bound fast (a few steps show it)."""
    return dp.adaptive(count_noise_std=count_noise_std, target_quantile=0.5, learning_rate=0.5)


def with_overflowing_example(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The data with an input past float16's range (65504) in the noise step's first example."""
    inputs = data[0].clone()
    inputs[batches()[noise_step()][0], 3] = 1e6
    return inputs, data[1]


def user_batches() -> list[list[int]]:
    """Each step's examples, Poisson-sampled by user (one process)."""
    generator = torch.Generator().manual_seed(3)
    return list(dp.UserPoissonBatchSampler(USERS, USER_SAMPLE_RATE, STEPS, generator))


def of_rank(indices: list[int], world_size: int, rank: int) -> list[int]:
    """The examples of the users this process holds (user ``u`` on rank ``u % world_size``)."""
    return [i for i in indices if int(USERS[i]) % world_size == rank]


def user_optimizer(model: nn.Module, loss_fn: Any = F.cross_entropy, **options: Any) -> Any:
    """``dp_optimizer`` with the expected number of users per batch."""
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=options.pop("lr", 0.5), momentum=0.9),
        model,
        loss_fn,
        max_norm=MAX_NORM,
        expected_batch_size=USER_SAMPLE_RATE * len(set(USERS.tolist())),
        **options,
    )


def single_step_optimizer(model: nn.Module, loss_fn: Any) -> Any:
    """SGD without momentum, lr 1, expected batch size 1, no noise: each update is minus the
    step's clipped sum."""
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        loss_fn,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=1,
        distributed=True,
    )


def clipped_sum_norms(model: nn.Module, optimizer: Any, rank: int, steps: list[Any]) -> list[float]:
    """The norm of each step's clipped sum (``.grad``, whole), the step's examples on one
    process: ``steps`` holds ``(rank holding them, example indices, by user)``. Inputs 100
    times larger than the data's: gradients far past max_norm, so every one is clipped."""
    inputs, targets = make_data()
    norms = []
    for holder, indices, by_user in steps:
        rows = indices if rank == holder else []
        users = {"user_ids": USERS[rows]} if by_user else {}
        optimizer.step(inputs[rows] * 100.0, targets[rows], **users)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        norms.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
    return norms


# --- the worker -------------------------------------------------------------------------------


def noisy(rank: int) -> dict[str, Any]:
    """One noisy step's options; each rank seeds its generator differently: only rank 0's
    may count."""
    generator = torch.Generator().manual_seed(NOISE_SEED + rank)
    return {"generator": generator, "lr": 1.0, "noise_multiplier": NOISE_MULTIPLIER}


def worker(world_size: int, rank: int, store: str, out: str) -> None:
    join_gloo(world_size, rank, store)
    seen: dict[str, Any] = {}
    tokens, data = make_tokens(), make_data()

    # Tied weights, the embedding and the head in the root's FSDP unit.
    for case, options in (("tied", {"noise_multiplier": 0.0}), ("tied noise", noisy(rank))):
        model = TiedGPT()
        shard(model, [model.block])
        optimizer = dp_optimizer(model, token_loss, distributed=True, **options)
        steps = range(STEPS) if case == "tied" else [noise_step()]
        for step in steps:
            indices = batches(world_size, rank)[step]
            optimizer.step(tokens[0][indices], tokens[1][indices])
        seen[case] = gathered(model)
    # ... and in one FSDP group of their own (fully_shard([embed, head])).
    model = TiedGPT()
    shard(model, [[model.embed, model.head], model.block])
    optimizer = dp_optimizer(model, token_loss, noise_multiplier=0.0, distributed=True)
    for indices in batches(world_size, rank):
        optimizer.step(tokens[0][indices], tokens[1][indices])
    seen["tied group"] = gathered(model)

    # Mixed precision: bfloat16 parameters in the passes, float32 shards and sums; the same in
    # float16, whose range ends at 65504 (the records' norms and sums must not be formed in it).
    seen.update(mixed_precision_steps("mixed", bf16_policy(), with_nan_example, world_size, rank))
    seen.update(
        mixed_precision_steps("fp16", fp16_policy(), with_overflowing_example, world_size, rank)
    )

    # Adaptive clipping: the bound moves as in one process, by example and by user, and with
    # the count's noise drawn on rank 0 (each rank seeds its generator differently).
    for case, options in (
        ("adaptive", {"noise_multiplier": 0.0, "clipping": adaptive()}),
        ("adaptive noise", {**noisy(rank), "clipping": adaptive(count_noise_std=1.0)}),
    ):
        model = make_mlp()
        shard(model, [model[0], model[2]])
        optimizer = dp_optimizer(model, distributed=True, **options)
        stats = [optimizer.step(data[0][i], data[1][i]) for i in batches(world_size, rank)]
        seen[case], seen[f"{case} bounds"] = gathered(model), [s.max_norm for s in stats]
        seen[f"{case} final bound"] = optimizer.max_norm
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = user_optimizer(model, noise_multiplier=0.0, clipping=adaptive(), distributed=True)
    for step in range(STEPS):
        mine = of_rank(user_batches()[step], world_size, rank)
        optimizer.step(data[0][mine], data[1][mine], user_ids=USERS[mine])
    seen["adaptive users"], seen["adaptive users bound"] = gathered(model), optimizer.max_norm

    # torch.autocast around the step, float32 shards.
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = dp_optimizer(model, float32_loss, noise_multiplier=0.0, distributed=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for indices in batches(world_size, rank):
            optimizer.step(data[0][indices], data[1][indices])
    seen["autocast"] = gathered(model)

    # User-level DP: each user's examples on one process.
    for case, options in (("users", {"noise_multiplier": 0.0}), ("users noise", noisy(rank))):
        model = make_mlp()
        shard(model, [model[0], model[2]])
        optimizer = user_optimizer(model, distributed=True, **options)
        steps = range(STEPS) if case == "users" else [1]
        stats = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in steps:
                mine = of_rank(user_batches()[step], world_size, rank)
                stats.append(optimizer.step(data[0][mine], data[1][mine], user_ids=USERS[mine]))
        seen[case], seen[f"{case} stats"] = gathered(model), stats
        seen[f"{case} warnings"] = [
            str(w.message) for w in caught if "DPOptimizer" in str(w.message)
        ]

    # One step's users in two micro-batches on each process (accumulate, then step).
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = user_optimizer(model, noise_multiplier=0.0, distributed=True)
    mine = of_rank(ACCUMULATED, world_size, rank)
    first = [i for i in mine if int(USERS[i]) < 3]
    second = [i for i in mine if int(USERS[i]) >= 3]
    optimizer.accumulate(data[0][first], data[1][first], user_ids=USERS[first])
    seen["users accumulate stats"] = optimizer.step(
        data[0][second], data[1][second], user_ids=USERS[second]
    )
    seen["users accumulate"] = gathered(model)

    # One user's examples in one step (user 1 on rank 0, user 5 on rank 1): clipped as one.
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = single_step_optimizer(model, F.cross_entropy)
    steps = [(0, [2, 3, 4], True), (1, [9, 10, 11], True)]
    seen["users bound"] = clipped_sum_norms(model, optimizer, rank, steps)

    # All three at once: a tied model in bfloat16, by user.
    model = TiedGPT()
    shard(model, [model.block], mp_policy=bf16_policy())
    optimizer = user_optimizer(model, loss_fn=token_loss, noise_multiplier=0.0, distributed=True)
    for indices in user_batches():
        mine = of_rank(indices, world_size, rank)
        optimizer.step(tokens[0][mine], tokens[1][mine], user_ids=USERS[mine])
    seen["users tied mixed"] = gathered(model)

    # What stays refused.
    seen["refused"] = refusals(world_size, rank)
    seen["low memory alive"], seen["low memory"] = low_memory_steps(world_size, rank, data)

    leave_gloo(seen, out, rank)


def mixed_precision_steps(
    case: str, policy: Any, unusual: Any, world_size: int, rank: int
) -> dict[str, Any]:
    """The MLP sharded with the mixed-precision ``policy``: the steps (``case``, with their
    statistics), the single-example clipped sums' norms (``case bound``), and one step on the
    data with an example made non-finite by ``unusual`` (``case nonfinite``)."""
    data, seen = make_data(), {}
    model = make_mlp()
    shard(model, [model[0], model[2]], mp_policy=policy)
    optimizer = dp_optimizer(model, float32_loss, noise_multiplier=0.0, distributed=True)
    seen[f"{case} stats"] = [
        optimizer.step(data[0][i], data[1][i]) for i in batches(world_size, rank)
    ]
    seen[case] = gathered(model)
    model = make_mlp()
    shard(model, [model[0], model[2]], mp_policy=policy)
    optimizer = single_step_optimizer(model, float32_loss)
    steps = [(0, [i], False) for i in range(BOUND_EXAMPLES)]
    seen[f"{case} bound"] = clipped_sum_norms(model, optimizer, rank, steps)
    model = make_mlp()
    shard(model, [model[0], model[2]], mp_policy=policy)
    optimizer = dp_optimizer(model, float32_loss, noise_multiplier=0.0, distributed=True)
    indices = batches(world_size, rank)[noise_step()]
    inputs, targets = unusual(data)
    seen[f"{case} nonfinite stats"] = optimizer.step(inputs[indices], targets[indices])
    seen[f"{case} nonfinite"] = gathered(model)
    return seen


def low_memory_steps(world_size: int, rank: int, data: Any) -> tuple[list[int], Any]:
    """The float32 example-level steps, with a spy on the norms computed in the backward pass:
    at each layer's, how many output gradients of the layers completed before are still held
    (the low-memory norm pass drops them), and the parameters after the steps."""
    from pergrad._src.torch import fsdp

    original, completed, alive = fsdp._norms_in_hook, [], []

    def spy(computed: Any, name: str, layer: Any, records: list[Any]) -> bool:
        alive.append(sum(r.output_grad is not None for rs in completed for r in rs))
        done = original(computed, name, layer, records)
        completed.append(records)
        return done

    fsdp._norms_in_hook = spy
    try:
        model = make_mlp()
        shard(model, [model[0], model[2]])
        optimizer = dp_optimizer(model, F.cross_entropy, noise_multiplier=0.0, distributed=True)
        for indices in batches(world_size, rank):
            completed.clear()
            optimizer.step(data[0][indices], data[1][indices])
    finally:
        fsdp._norms_in_hook = original
    return alive, gathered(model)


def refusals(world_size: int, rank: int) -> dict[str, str]:
    refused = {}
    tied = TiedLinears()
    shard(tied, [])
    refused["tie without cross rule"] = error_of(
        lambda: dp_optimizer(tied, noise_multiplier=0.0, distributed=True)
    )
    x, y = make_data()
    rows = [rank, rank + world_size]
    cases = {
        # user 7 on every process: its examples would be clipped apart
        "user on two processes": torch.tensor([7, 8 + rank]),
        "user_ids of a wrong shape on one process": USERS[:2] if rank == 0 else USERS[:3],
        "user_ids on one process only": USERS[:2] if rank == 0 else None,
    }
    for case, user_ids in cases.items():
        model = make_mlp()
        shard(model, [model[0], model[2]])
        optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)
        step = functools.partial(optimizer.step, x[rows], y[rows], user_ids=user_ids)
        refused[case] = error_of(step)
    plain = make_mlp()  # data-parallel, not sharded
    optimizer = dp_optimizer(plain, noise_multiplier=0.0, distributed=True)
    step = functools.partial(optimizer.step, x[rows], y[rows], user_ids=USERS[:2])
    refused["user_ids data-parallel"] = error_of(step)
    return refused


SLOW_FOUR = pytest.mark.slow(reason="4 processes on 2 cores: about 1 minute")


@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=SLOW_FOUR)], ids=lambda n: f"{n} processes"
)
def workers(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    """Every scenario's results, by rank; with 4 processes, shards of 10 rows are uneven."""
    world_size = request.param
    directory = tmp_path_factory.mktemp(f"fsdp_more{world_size}")
    return world_size, run_workers(world_size, directory, transformer=False, script=__file__)


# --- the single-process references ------------------------------------------------------------


def reference_steps(model: nn.Module, data: Any, steps: list[list[int]], **options: Any) -> Any:
    """The single-process DPOptimizer over ``steps`` (lists of example indices)."""
    loss_fn = options.pop("loss_fn", F.cross_entropy)
    users = options.pop("users", False)
    optimizer = (user_optimizer if users else dp_optimizer)(model, loss_fn, **options)
    stats = []
    for indices in steps:
        extra = {"user_ids": USERS[indices]} if users else {}
        stats.append(optimizer.step(data[0][indices], data[1][indices], **extra))
    return stats, {name: p.detach().clone() for name, p in model.named_parameters()}


def autocast_reference(
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """The single-process ghost steps of the MLP under autocast to ``dtype``, no noise: their
    statistics and the parameters after them."""
    with torch.autocast("cpu", dtype=dtype):
        return reference_steps(
            make_mlp(),
            make_data(),
            batches(),
            loss_fn=float32_loss,
            noise_multiplier=0.0,
            strategy="ghost",
        )


def assert_moved(got: dict[str, torch.Tensor], initial: nn.Module, far: float) -> None:
    moved = max(float((got[n] - p.detach()).abs().max()) for n, p in initial.named_parameters())
    assert moved > far, moved


@pytest.fixture(scope="module")
def tied_reference() -> dict[str, torch.Tensor]:
    """The single-process steps of the tied model, no noise."""
    _, expected = reference_steps(
        TiedGPT(), make_tokens(), batches(), loss_fn=token_loss, noise_multiplier=0.0
    )
    return expected


def test_tied_weights_in_one_unit_step_as_in_one_process(workers, tied_reference):
    world_size, seen = workers
    for rank in range(world_size):
        assert_params_equal(seen[rank]["tied"], tied_reference)
    assert_moved(tied_reference, TiedGPT(), 1e-2)


def test_tied_weights_in_a_group_of_their_own_step_as_in_one_process(workers, tied_reference):
    world_size, seen = workers
    for rank in range(world_size):
        assert_params_equal(seen[rank]["tied group"], tied_reference)


def test_tied_weights_get_the_single_process_noise(workers):
    world_size, seen = workers
    generator = torch.Generator().manual_seed(NOISE_SEED)
    _, expected = reference_steps(
        TiedGPT(),
        make_tokens(),
        [batches()[noise_step()]],
        loss_fn=token_loss,
        noise_multiplier=NOISE_MULTIPLIER,
        generator=generator,
        lr=1.0,
    )
    _, quiet = reference_steps(
        TiedGPT(),
        make_tokens(),
        [batches()[noise_step()]],
        loss_fn=token_loss,
        noise_multiplier=0.0,
        lr=1.0,
    )
    for rank in range(world_size):
        assert_params_equal(seen[rank]["tied noise"], expected)
        noise = seen[rank]["tied noise"]["embed.weight"] - quiet["embed.weight"]
        assert float(noise.std()) > 0.05


PRECISIONS = pytest.mark.parametrize(
    "case, dtype", [("mixed", torch.bfloat16), ("fp16", torch.float16)], ids=["bf16", "fp16"]
)


@PRECISIONS
def test_mixed_precision_steps_as_one_process_under_autocast(workers, case, dtype):
    world_size, seen = workers
    stats, expected = autocast_reference(dtype)
    for rank in range(world_size):
        for name, value in expected.items():  # (FSDP casts the inputs to dtype too)
            torch.testing.assert_close(seen[rank][case][name], value, rtol=1e-3, atol=5e-4)
        got = [s.clip_fraction for s in seen[rank][f"{case} stats"]]
        assert got == pytest.approx([s.clip_fraction for s in stats])
    assert_moved(expected, make_mlp(), 5e-2)


@PRECISIONS
def test_mixed_precision_keeps_every_example_within_max_norm(workers, case, dtype):
    """Inputs 100 times the data's: gradients far past max_norm, and each example's ``|x|^2``
    (about 2e5) past float16's range; each is clipped to max_norm, not dropped."""
    world_size, seen = workers
    for rank in range(world_size):
        norms = seen[rank][f"{case} bound"]
        assert len(norms) == BOUND_EXAMPLES
        for norm in norms:  # clipped, and to float32 rounding
            assert MAX_NORM * (1 - 1e-3) < norm <= MAX_NORM * (1 + 1e-5), norms


def test_float16_leaves_out_an_example_past_its_range(workers):
    """An input past float16's range becomes inf in the passes (FSDP casts it): the example
    adds nothing (counted in ``nonfinite``), the others step as in one process without it.
    (Not autocast's step with it: autocast records the layer's float32 input, which is
    finite.)"""
    world_size, seen = workers
    indices = batches()[noise_step()]
    with torch.autocast("cpu", dtype=torch.float16):
        _, expected = reference_steps(
            make_mlp(),
            make_data(),
            [indices[1:]],  # (expected_batch_size fixed: the same denominator)
            loss_fn=float32_loss,
            noise_multiplier=0.0,
            strategy="ghost",
        )
    for rank in range(world_size):
        for name, value in expected.items():
            got = seen[rank]["fp16 nonfinite"][name]
            torch.testing.assert_close(got, value, rtol=1e-3, atol=5e-4, msg=name)
    assert sum(seen[rank]["fp16 nonfinite stats"].nonfinite for rank in range(world_size)) == 1
    assert_moved(expected, make_mlp(), 1e-2)


@pytest.mark.parametrize("case", ["adaptive", "adaptive noise"])
def test_adaptive_clipping_moves_the_bound_as_in_one_process(workers, case):
    world_size, seen = workers
    options = {"noise_multiplier": 0.0, "clipping": adaptive()}
    if case == "adaptive noise":  # both noises drawn from rank 0's generator
        generator = torch.Generator().manual_seed(NOISE_SEED)
        options = {
            "noise_multiplier": NOISE_MULTIPLIER,
            "generator": generator,
            "lr": 1.0,
            "clipping": adaptive(count_noise_std=1.0),
        }
    model = make_mlp()
    optimizer = dp_optimizer(model, **options)
    stats = [optimizer.step(*(t[i] for t in make_data())) for i in batches()]
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    bounds = [s.max_norm for s in stats]
    assert len(set(bounds)) == len(bounds)  # it moves at every step
    for rank in range(world_size):
        assert seen[rank][f"{case} bounds"] == pytest.approx(bounds, rel=1e-6)
        assert seen[rank][f"{case} final bound"] == pytest.approx(optimizer.max_norm, rel=1e-6)
        assert_params_equal(seen[rank][case], expected)


def test_adaptive_clipping_by_user_moves_the_bound_as_in_one_process(workers):
    world_size, seen = workers
    model = make_mlp()
    optimizer = user_optimizer(model, noise_multiplier=0.0, clipping=adaptive())
    data = make_data()
    for indices in user_batches():
        optimizer.step(data[0][indices], data[1][indices], user_ids=USERS[indices])
    assert optimizer.max_norm != MAX_NORM
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for rank in range(world_size):
        assert seen[rank]["adaptive users bound"] == pytest.approx(optimizer.max_norm, rel=1e-6)
        assert_params_equal(seen[rank]["adaptive users"], expected)


def test_user_level_micro_batches_step_as_one_batch(workers):
    world_size, seen = workers
    stats, expected = reference_steps(
        make_mlp(), make_data(), [ACCUMULATED], users=True, noise_multiplier=0.0
    )
    for rank in range(world_size):
        assert_params_equal(seen[rank]["users accumulate"], expected)
        assert seen[rank]["users accumulate stats"].batch_size == stats[0].batch_size == 6


def test_user_level_clips_each_users_sum_to_max_norm(workers):
    world_size, seen = workers
    for rank in range(world_size):
        norms = seen[rank]["users bound"]
        assert len(norms) == 2
        for norm in norms:  # one user of 3 examples: max_norm in all, not 3 max_norm
            assert MAX_NORM * (1 - 1e-3) < norm <= MAX_NORM * (1 + 1e-5), norms


def test_a_tied_model_in_mixed_precision_by_user_steps_as_in_one_process(workers):
    world_size, seen = workers
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, expected = reference_steps(
            TiedGPT(),
            make_tokens(),
            user_batches(),
            users=True,
            loss_fn=token_loss,
            noise_multiplier=0.0,
            strategy="ghost",
        )
    for rank in range(world_size):
        for name, value in expected.items():
            got = seen[rank]["users tied mixed"][name]
            # FSDP runs the whole block in bfloat16, autocast its norms and softmax in float32:
            # about 1% of the moves apart
            torch.testing.assert_close(got, value, rtol=1e-3, atol=2e-3, msg=name)
    assert_moved(expected, TiedGPT(), 5e-2)


def test_mixed_precision_leaves_out_an_example_with_a_nan_as_in_one_process(workers):
    world_size, seen = workers
    inputs, targets = with_nan_example(make_data())
    indices = batches()[noise_step()]
    model = make_mlp()
    optimizer = dp_optimizer(model, float32_loss, noise_multiplier=0.0, strategy="ghost")
    with pytest.warns(NonFiniteWarning), torch.autocast("cpu", dtype=torch.bfloat16):
        optimizer.step(inputs[indices], targets[indices])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for rank in range(world_size):
        for name, value in model.named_parameters():
            got = seen[rank]["mixed nonfinite"][name]
            torch.testing.assert_close(got, value.detach(), rtol=1e-3, atol=5e-4, msg=name)
    assert sum(seen[rank]["mixed nonfinite stats"].nonfinite for rank in range(world_size)) == 1


def test_autocast_steps_as_one_process_under_autocast(workers):
    world_size, seen = workers
    _, expected = autocast_reference()
    for rank in range(world_size):
        for name, value in expected.items():
            torch.testing.assert_close(seen[rank]["autocast"][name], value, rtol=1e-4, atol=1e-5)


def test_user_level_steps_as_in_one_process(workers):
    world_size, seen = workers
    stats, expected = reference_steps(
        make_mlp(), make_data(), user_batches(), users=True, noise_multiplier=0.0
    )
    assert any(len(set(USERS[b].tolist())) < len(b) for b in user_batches())  # users of 2+
    for rank in range(world_size):
        assert_params_equal(seen[rank]["users"], expected)
        got = seen[rank]["users stats"]
        assert [s.batch_size for s in got] == [s.batch_size for s in stats]  # users, not examples
        assert seen[rank]["users warnings"] == []  # (no per-example gradients formed here)
        assert [s.clip_fraction for s in got] == pytest.approx([s.clip_fraction for s in stats])
    assert_moved(expected, make_mlp(), 1e-2)


def test_user_level_noise_is_the_single_process_noise(workers):
    world_size, seen = workers
    generator = torch.Generator().manual_seed(NOISE_SEED)
    _, expected = reference_steps(
        make_mlp(),
        make_data(),
        [user_batches()[1]],
        users=True,
        noise_multiplier=NOISE_MULTIPLIER,
        generator=generator,
        lr=1.0,
    )
    for rank in range(world_size):
        assert_params_equal(seen[rank]["users noise"], expected)


def test_what_stays_refused_is_refused_by_name(workers):
    world_size, seen = workers
    expected = {
        "tie without cross rule": "no cross rule for ('linear', 'linear')",
        "user on two processes": "user_ids: user(s) [7] are in the batches of processes "
        f"{list(range(world_size))}",
        "user_ids of a wrong shape on one process": "user_ids must have shape (2,), one user id "
        "per example of the batch; got shape (3,)",
        "user_ids on one process only": f"user_ids: the processes {list(range(1, world_size))} "
        "stepped without user_ids",
        "user_ids data-parallel": "user_ids (user-level clipping) is not supported with "
        "data-parallel distributed yet",
    }
    for rank in range(world_size):
        for case, message in expected.items():
            got = seen[rank]["refused"][case]
            assert got.startswith("PergradValueError: DPOptimizer") and message in got, got


def test_the_norm_pass_drops_each_layers_output_gradients_once_its_norms_are_in(workers):
    """Low memory on FSDP2 (float32, example level): each layer's norms are computed in the
    backward pass, and no layer completed before still holds its output gradients then; the
    steps are the single-process steps."""
    world_size, seen = workers
    _, expected = reference_steps(make_mlp(), make_data(), batches(), noise_multiplier=0.0)
    for rank in range(world_size):
        alive = seen[rank]["low memory alive"]
        assert len(alive) >= 2 * STEPS and set(alive) == {0}, alive  # two layers a step
        assert_params_equal(seen[rank]["low memory"], expected)


def test_the_user_batches_hold_users_of_several_examples_on_both_processes():
    steps = user_batches()
    assert len(USERS) == NUM_EXAMPLES
    assert any(of_rank(b, 2, 0) and of_rank(b, 2, 1) for b in steps)


if __name__ == "__main__":
    world_size_arg, rank_arg, store_arg, out_arg = sys.argv[1:]
    worker(int(world_size_arg), int(rank_arg), store_arg, out_arg)
