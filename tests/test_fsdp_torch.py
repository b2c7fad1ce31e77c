"""``DPOptimizer`` on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

As in ``test_distributed_torch.py``: the workers are processes joined by a gloo process group
(CPU), started once per world size; this file, run as a script (``python test_fsdp_torch.py
WORLD_SIZE RANK STORE OUT``), plays every scenario in turn and saves what it saw (parameters
gathered with ``full_tensor()``) to ``OUT/rank<r>.pt``. The tests compare that with the
single-process ``DPOptimizer`` (no FSDP, same model, the union of the processes' examples),
computed here, in one process: the independent reference.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 is PyTorch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from pergrad import dp  # noqa: E402
from pergrad._src.errors import (  # noqa: E402
    NonFiniteWarning,
    PergradTypeError,
    PergradValueError,
)

if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

NUM_EXAMPLES, SAMPLE_RATE, STEPS, SAMPLER_SEED = 12, 0.25, 5, 2
MAX_NORM, NOISE_MULTIPLIER, NOISE_SEED = 0.5, 1.0, 1234
EXPECTED_BATCH_SIZE = SAMPLE_RATE * NUM_EXAMPLES
VOCAB, WIDTH, LENGTH = 32, 16, 6


# --- shared by the workers and the single-process references ---------------------------------


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    # 10 output rows: uneven shards over 4 processes (3, 3, 3, 1)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 10))


class LoRAMLP(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it, and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(20, 64)
        self.down = nn.Linear(20, 4, bias=False)
        self.up = nn.Linear(4, 64, bias=False)
        self.head = nn.Linear(64, 10)
        self.base.requires_grad_(False)
        nn.init.normal_(self.up.weight, std=0.1)  # (LoRA starts it at 0: no gradient to down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x) + self.up(self.down(x))))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = Block(WIDTH, heads=2)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Scaled(nn.Module):
    """A learnable scale and no layer with a ghost rule: no part of the model can form its
    per-example gradients (beside a rule's layer, ``self.scale * self.fc(x)`` is read off the
    forward pass: ``test_fsdp_torch_root_params.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))  # (fully_shard refuses 0-d parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x[:, :10]


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_EXAMPLES, 20, generator=generator)
    return x, torch.randint(0, 10, (NUM_EXAMPLES,), generator=generator)


def make_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (NUM_EXAMPLES, LENGTH + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def with_nan_example(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The data with a nan in the first example of the noise step's batch."""
    inputs = data[0].clone()
    inputs[batches()[noise_step()][0], 3] = float("nan")
    return inputs, data[1]


def batches(num_replicas: int = 1, rank: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(SAMPLER_SEED)
    sampler = dp.PoissonBatchSampler(
        NUM_EXAMPLES, SAMPLE_RATE, STEPS, generator, num_replicas=num_replicas, rank=rank
    )
    return list(sampler)


def correlated_mechanisms() -> dict[str, Any]:
    """A banded Toeplitz mechanism (3 bands, 2 past draws kept) and a BLT (2 buffers), each
    made for the run of STEPS steps."""
    return {
        "toeplitz": dp.toeplitz([1.0, 0.5, 0.25], steps=STEPS),
        "blt": dp.blt([0.9, 0.5], [0.3, 0.1], steps=STEPS),
    }


def dp_optimizer(model: nn.Module, loss_fn: Any = F.cross_entropy, **options: Any) -> Any:
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=options.pop("lr", 0.5), momentum=0.9),
        model,
        loss_fn,
        max_norm=MAX_NORM,
        expected_batch_size=EXPECTED_BATCH_SIZE,
        **options,
    )


# --- the worker: every scenario, in one process group --------------------------------------


def shard(model: nn.Module, layers: list[nn.Module], **options: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (``full_tensor()``: a collective, the same order everywhere)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def local_numel(tensors: Any) -> int:
    return sum(t.to_local().numel() for t in tensors)


def error_of(build: Any) -> str:
    try:
        build()
    except (PergradValueError, PergradTypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def train(model: nn.Module, optimizer: Any, data: Any, world_size: int, rank: int) -> list[Any]:
    inputs, targets = data
    return [optimizer.step(inputs[i], targets[i]) for i in batches(world_size, rank)]


def join_gloo(world_size: int, rank: int, store: str, timeout: float = 60.0) -> None:
    """This worker process in the gloo group of ``world_size`` (one torch thread each); a
    collective waits ``timeout`` seconds at most."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout),
    )


def leave_gloo(seen: dict[str, Any], out: str, rank: int) -> None:
    """Save what this worker ``seen`` to ``OUT/rank<r>.pt``, leave the gloo group with the
    others, and exit."""
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()  # leave together: tearing gloo down under a peer aborts it
    torch.distributed.destroy_process_group()
    # gloo can still abort in C++ destructors at interpreter exit (exit -6): skip them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(world_size: int, rank: int, store: str, out: str) -> None:
    join_gloo(world_size, rank, store)
    seen: dict[str, Any] = {}
    data = make_data()

    # Zero noise, SGD with momentum over every sampled step, empty shards included.
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)
    seen["stats"] = train(model, optimizer, data, world_size, rank)
    seen["zero noise"] = gathered(model)
    seen["memory"] = {
        "parameters": local_numel(model.parameters()),
        "gradients": local_numel(p.grad for p in model.parameters()),
        "momentum": local_numel(
            optimizer.optimizer.state[p]["momentum_buffer"] for p in model.parameters()
        ),
    }

    # Noise, one step; each rank seeds its generator differently: only rank 0's may count.
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = dp_optimizer(
        model,
        lr=1.0,
        noise_multiplier=NOISE_MULTIPLIER,
        generator=torch.Generator().manual_seed(NOISE_SEED + rank),
        distributed=True,
    )
    indices = batches(world_size, rank)[noise_step()]
    optimizer.step(data[0][indices], data[1][indices])
    seen["noise"] = gathered(model)

    # Correlated noise over the whole run, then a step past it; rank seeds differ as above.
    for kind, mechanism in correlated_mechanisms().items():
        model = make_mlp()
        shard(model, [model[0], model[2]])
        optimizer = dp_optimizer(
            model,
            noise_multiplier=NOISE_MULTIPLIER,
            generator=torch.Generator().manual_seed(NOISE_SEED + rank),
            distributed=True,
            noise=mechanism,
        )
        train(model, optimizer, data, world_size, rank)
        seen[kind] = gathered(model)
        seen[f"{kind} state"] = sum(b.numel() for bs in optimizer._noise_state.buffers for b in bs)
        past_the_run = functools.partial(optimizer.step, data[0][:1], data[1][:1])
        seen[f"{kind} past the run"] = error_of(past_the_run)

    # Gradient accumulation: one step's shard in two micro-batches (either may be empty).
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)
    indices = batches(world_size, rank)[noise_step()]
    half = len(indices) // 2
    optimizer.accumulate(data[0][indices[:half]], data[1][indices[:half]])
    seen["accumulate stats"] = optimizer.step(data[0][indices[half:]], data[1][indices[half:]])
    seen["accumulate"] = gathered(model)

    # An example whose gradient is not finite (a nan in its input) is left out on its rank.
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)
    inputs, targets = with_nan_example(data)
    indices = batches(world_size, rank)[noise_step()]
    seen["nonfinite stats"] = optimizer.step(inputs[indices], targets[indices])
    seen["nonfinite"] = gathered(model)

    # Frozen base layer, trainable adapter and head.
    model = LoRAMLP()
    shard(model, [model.base, model.head])
    optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)
    train(model, optimizer, data, world_size, rank)
    seen["frozen"] = gathered(model)

    # What the norm pass holds: spied on, one step with examples on every rank.
    seen["held"] = held_in_the_passes(world_size, rank, data)

    # What this version refuses, by name.
    seen["refused"] = refusals(world_size)

    if os.environ.get("PERGRAD_FSDP_TRANSFORMER") == "1":
        model = TinyLM()
        shard(model, [model.embed, model.block, model.head])
        optimizer = dp_optimizer(model, token_loss, noise_multiplier=0.0, distributed=True)
        seen["transformer stats"] = train(model, optimizer, make_tokens(), world_size, rank)
        seen["transformer"] = gathered(model)

    leave_gloo(seen, out, rank)


def held_in_the_passes(world_size: int, rank: int, data: Any) -> dict[str, Any]:
    """One step with spies: by layer, whether each call's output (weakly referenced before
    the norm pass's backward pass) is alive when the last layer's norms are computed in that
    pass, and whether each call's recorded inputs are alive when the weighted pass begins."""
    from pergrad._src.torch import fsdp

    outputs: dict[str, list[Any]] = {}
    inputs: dict[str, list[Any]] = {}
    held: dict[str, Any] = {}
    targets, norms, weighted = fsdp._backward_targets, fsdp._norms_in_hook, fsdp._weighted_backward

    def targets_spy(total: Any, records: dict[str, list[Any]], unit_targets: Any) -> Any:
        for name, layer_records in records.items():
            outputs[name] = [weakref.ref(r.output) for r in layer_records if r.hooked]
            inputs[name] = [weakref.ref(x) for r in layer_records for x in r.inputs]
        return targets(total, records, unit_targets)

    def norms_spy(computed: Any, name: str, layer: Any, records: Any) -> bool:
        if name == "2":
            held["outputs"] = {n: [r() is not None for r in refs] for n, refs in outputs.items()}
        return norms(computed, name, layer, records)

    def weighted_spy(*args: Any, **kwargs: Any) -> Any:
        held["inputs"] = {n: [r() is not None for r in refs] for n, refs in inputs.items()}
        return weighted(*args, **kwargs)

    fsdp._backward_targets, fsdp._norms_in_hook = targets_spy, norms_spy
    fsdp._weighted_backward = weighted_spy
    try:
        model = make_mlp()
        shard(model, [model[0], model[2]])
        optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)
        rows = [rank, rank + world_size]
        optimizer.step(data[0][rows], data[1][rows])
    finally:
        fsdp._backward_targets, fsdp._norms_in_hook = targets, norms
        fsdp._weighted_backward = weighted
    held["params"] = gathered(model)
    return held


def refusals(world_size: int) -> dict[str, str]:
    """Construction (or a step) refused on every rank alike, before any collective (tied
    weights, mixed precision and user_ids: ``test_fsdp_torch_more.py``)."""
    refused = {}
    model = make_mlp()
    shard(model, [model[0], model[2]])
    refused["not distributed"] = error_of(lambda: dp_optimizer(model, noise_multiplier=1.0))
    refused["another strategy"] = error_of(
        lambda: dp_optimizer(model, noise_multiplier=1.0, distributed=True, strategy="ghost-lowmem")
    )
    refused["chunk size"] = error_of(
        lambda: dp_optimizer(model, noise_multiplier=1.0, distributed=True, chunk_size=1)
    )
    scaled = Scaled()
    shard(scaled, [])
    refused["no rule"] = error_of(
        lambda: dp_optimizer(scaled, noise_multiplier=0.0, distributed=True)
    )
    return refused


def run_workers(
    world_size: int,
    directory: Path,
    transformer: bool,
    script: str = __file__,
    timeout: float = 240.0,
) -> list[dict[str, Any]]:
    """Run ``script`` (this file, or another that plays its own scenarios) as ``world_size``
    worker processes, failing if they take more than ``timeout`` seconds; what each saw, by
    rank."""
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PERGRAD_FSDP_TRANSFORMER": "1" if transformer else "0",
    }
    store = directory / "store"
    processes = [
        subprocess.Popen(
            [sys.executable, script, str(world_size), str(rank), str(store), str(directory)],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"{world_size} workers did not finish in {timeout} s: a collective hung")
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"
    return [
        torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)
    ]


SLOW_FOUR = pytest.mark.slow(reason="4 processes and a transformer block: about 1 minute")


@pytest.fixture(
    scope="module",
    params=[2, pytest.param(4, marks=SLOW_FOUR)],
    ids=lambda n: f"{n} processes",
)
def workers(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    directory = tmp_path_factory.mktemp(f"fsdp{world_size}")
    return world_size, run_workers(world_size, directory, transformer=world_size == 4)


# --- the single-process references ------------------------------------------------------------


def noise_step() -> int:
    """The first step with at least two examples."""
    return next(t for t, batch in enumerate(batches()) if len(batch) >= 2)


def single_process(model: nn.Module, data: Any, loss_fn: Any = F.cross_entropy) -> Any:
    optimizer = dp_optimizer(model, loss_fn, noise_multiplier=0.0)
    stats = train(model, optimizer, data, 1, 0)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return stats, params


def assert_params_equal(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_sampled_steps_leave_some_rank_without_examples():
    for world_size in (2, 4):
        shards = [batches(world_size, rank) for rank in range(world_size)]
        assert any(
            not shards[r][t] and batches()[t] for r in range(world_size) for t in range(STEPS)
        )


def test_zero_noise_steps_equal_the_single_process_steps_on_the_union(workers):
    world_size, seen = workers
    stats, expected = single_process(make_mlp(), make_data())
    for rank in range(world_size):
        assert_params_equal(seen[rank]["zero noise"], expected)
        got = seen[rank]["stats"]
        assert [s.batch_size for s in got] == [s.batch_size for s in stats]
        assert [s.clip_fraction for s in got] == pytest.approx([s.clip_fraction for s in stats])
        assert {s.strategy for s in got} == {"ghost-fsdp"}
    assert len({s.clip_fraction for s in stats}) > 1  # clipping acts, and not on everything
    moved = sum(
        float((expected[n] - p.detach()).abs().max()) for n, p in make_mlp().named_parameters()
    )
    assert moved > 1e-2  # the steps did move the parameters


def test_the_noise_is_the_single_process_noise_from_rank_0s_generator(workers):
    world_size, seen = workers
    x, y = make_data()
    indices = batches()[noise_step()]
    model = make_mlp()
    generator = torch.Generator().manual_seed(NOISE_SEED)
    reference = dp_optimizer(model, lr=1.0, noise_multiplier=NOISE_MULTIPLIER, generator=generator)
    reference.step(x[indices], y[indices])
    quiet = make_mlp()
    dp_optimizer(quiet, lr=1.0, noise_multiplier=0.0).step(x[indices], y[indices])
    for rank in range(world_size):
        for name, p in model.named_parameters():
            got = seen[rank]["noise"][name]
            torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-6, msg=name)
            # the noise itself is there: std 0.5 / 3 per coordinate, far above the tolerance
            noise = got - quiet.get_parameter(name).detach()
            assert float(noise.std()) > 0.05, name


@pytest.mark.parametrize("kind", ["toeplitz", "blt"])
def test_correlated_noise_is_the_single_process_noise_over_the_run(workers, kind):
    world_size, seen = workers
    mechanism = correlated_mechanisms()[kind]
    generator = torch.Generator().manual_seed(NOISE_SEED)
    model = make_mlp()
    reference = dp_optimizer(
        model, noise_multiplier=NOISE_MULTIPLIER, generator=generator, noise=mechanism
    )
    train(model, reference, make_data(), 1, 0)
    for rank in range(world_size):
        got, quiet = seen[rank][kind], seen[rank]["zero noise"]  # (the same run, no noise)
        assert_params_equal(got, dict(model.named_parameters()))
        for name, value in got.items():  # the noise itself is there, far above the tolerance
            assert float((value - quiet[name]).std()) > 0.05, name


@pytest.mark.parametrize("kind", ["toeplitz", "blt"])
def test_correlated_noise_refuses_a_step_past_its_run_on_every_process(workers, kind):
    world_size, seen = workers
    for rank in range(world_size):
        got = seen[rank][f"{kind} past the run"]
        assert got.startswith("PergradValueError: ") and f"run of steps={STEPS}" in got, got


@pytest.mark.parametrize("kind", ["toeplitz", "blt"])
def test_each_process_holds_a_1_over_n_share_of_the_correlated_noise_state(workers, kind):
    world_size, seen = workers
    buffers = correlated_mechanisms()[kind].num_buffers
    sizes = [p.shape for p in make_mlp().parameters()]
    total = buffers * sum(math.prod(s) for s in sizes)
    largest = buffers * sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in sizes)
    counts = [seen[rank][f"{kind} state"] for rank in range(world_size)]
    assert sum(counts) == total
    assert max(counts) <= largest < 1.1 * total / world_size, counts


def test_accumulated_micro_batches_step_as_one_batch(workers):
    world_size, seen = workers
    x, y = make_data()
    indices = batches()[noise_step()]
    model = make_mlp()
    expected_stats = dp_optimizer(model, noise_multiplier=0.0).step(x[indices], y[indices])
    for rank in range(world_size):
        assert_params_equal(seen[rank]["accumulate"], dict(model.named_parameters()))
        assert seen[rank]["accumulate stats"].batch_size == expected_stats.batch_size


def test_an_example_with_a_nan_adds_nothing_as_in_one_process(workers):
    world_size, seen = workers
    inputs, targets = with_nan_example(make_data())
    indices = batches()[noise_step()]
    model = make_mlp()
    with pytest.warns(NonFiniteWarning):
        dp_optimizer(model, noise_multiplier=0.0).step(inputs[indices], targets[indices])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for rank in range(world_size):
        assert_params_equal(seen[rank]["nonfinite"], dict(model.named_parameters()))
    assert sum(seen[rank]["nonfinite stats"].nonfinite for rank in range(world_size)) == 1


def test_each_process_holds_a_1_over_n_share_of_parameters_gradients_and_momentum(workers):
    world_size, seen = workers
    sizes = [p.shape for p in make_mlp().parameters()]
    total = sum(math.prod(s) for s in sizes)
    # torch.chunk's shards: ceil(rows / N) rows each, the last ones smaller or empty
    largest = sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in sizes)
    for kind in ("parameters", "gradients", "momentum"):
        counts = [seen[rank]["memory"][kind] for rank in range(world_size)]
        assert sum(counts) == total, kind
        assert max(counts) <= largest < 1.1 * total / world_size, (kind, counts)


def test_frozen_parameters_stay_and_the_adapter_trains_as_in_one_process(workers):
    world_size, seen = workers
    _, expected = single_process(LoRAMLP(), make_data())
    initial = dict(LoRAMLP().named_parameters())
    for rank in range(world_size):
        got = seen[rank]["frozen"]
        assert_params_equal(got, expected)
        assert torch.equal(got["base.weight"], initial["base.weight"])
        assert not torch.equal(got["down.weight"], initial["down.weight"])


def test_the_norm_pass_lets_go_of_the_logits_and_its_records_before_the_next_pass(workers):
    """The norm pass differentiates the first layer's output only (the last layer's output
    leads to it): the last layer's output, the logits, is freed before its norms are computed
    in the backward pass, not held through it; the records (each layer's inputs) are freed
    before the weighted pass, not held by the norm pass's graph; and the step is the
    single-process step on the union of the examples."""
    world_size, seen = workers
    rows = [i for rank in range(world_size) for i in (rank, rank + world_size)]
    model = make_mlp()
    dp_optimizer(model, noise_multiplier=0.0).step(*(x[rows] for x in make_data()))
    for rank in range(world_size):
        held = seen[rank]["held"]
        assert held["outputs"] == {"0": [True], "2": [False]}, held["outputs"]
        # (layer 0's input is the step's argument, held by the caller)
        assert held["inputs"]["2"] == [False], held["inputs"]
        assert_params_equal(held["params"], dict(model.named_parameters()))


def test_what_is_not_supported_is_refused_by_name(workers):
    world_size, seen = workers
    expected = {
        "not distributed": "the model is sharded with FSDP2 (its parameters are DTensors); "
        "pass distributed=True",
        "no rule": "the trainable parameter(s) ['scale'] belong to no layer with a ghost rule",
        "another strategy": "steps take the ghost strategy only (each layer's norms from its "
        "records, 'ghost-fsdp'); got strategy='ghost-lowmem', chunk_size=None",
        "chunk size": "got strategy='auto', chunk_size=1",
    }
    for rank in range(world_size):
        for case, message in expected.items():
            got = seen[rank]["refused"][case]
            assert got.startswith("PergradValueError: DPOptimizer: ") and message in got, got


@SLOW_FOUR
@pytest.mark.parametrize("workers", [4], indirect=True, ids=["4 processes"])
def test_a_transformer_block_equals_the_single_process_steps(workers):
    world_size, seen = workers
    stats, expected = single_process(TinyLM(), make_tokens(), token_loss)
    assert "ghost" in {s.strategy for s in stats}  # (an empty batch takes "materialize")
    for rank in range(world_size):
        assert_params_equal(seen[rank]["transformer"], expected)
        got = [s.clip_fraction for s in seen[rank]["transformer stats"]]
        assert got == pytest.approx([s.clip_fraction for s in stats])


if __name__ == "__main__":
    world_size_arg, rank_arg, store_arg, out_arg = sys.argv[1:]
    worker(int(world_size_arg), int(rank_arg), store_arg, out_arg)
