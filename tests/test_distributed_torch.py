"""DP-SGD across processes: ``DPOptimizer(distributed=True)`` and the sharded PoissonBatchSampler.

The distributed checks run in worker processes joined by a gloo process group (CPU). Starting
processes that import torch costs seconds, so each world size starts its workers once: this
file, run as a script (``python test_distributed_torch.py WORLD_SIZE RANK STORE OUT``), plays
every scenario in turn and saves what it saw to ``OUT/rank<r>.pt``; the tests compare that with
references computed here, in one process, by the single-process ``DPOptimizer``.

The noise test is statistical, with a fixed seed (so deterministic); its threshold would fail
a correct implementation with probability ``FALSE_ALARM`` over random seeds.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch.distributed is PyTorch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from pergrad import dp  # noqa: E402
from pergrad._src.errors import PergradTypeError, PergradValueError  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

FALSE_ALARM = 1e-6
NUM_EXAMPLES, SAMPLE_RATE, STEPS, SAMPLER_SEED = 12, 0.2, 8, 5
MAX_NORM, NOISE_MULTIPLIER, NOISE_SEED = 0.5, 1.0, 1234
EXPECTED_BATCH_SIZE = SAMPLE_RATE * NUM_EXAMPLES
PERTURBED = "2.weight"  # the parameter the last rank changes in the mismatch scenario
# adaptive clipping: the bound moves fast, its noisy count drawn from rank 0's generator
ADAPTIVE = dp.adaptive(count_noise_std=0.5, target_quantile=0.3, learning_rate=0.8)


# --- shared by the workers and the single-process references ---------------------------------


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 10))  # 1994 parameters


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_EXAMPLES, 20, generator=generator)
    return x, torch.randint(0, 10, (NUM_EXAMPLES,), generator=generator)


def batches(num_replicas: int = 1, rank: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(SAMPLER_SEED)
    sampler = dp.PoissonBatchSampler(
        NUM_EXAMPLES, SAMPLE_RATE, STEPS, generator, num_replicas=num_replicas, rank=rank
    )
    return list(sampler)


def noise_step(world_size: int) -> int:
    """The first step where the noise rank (0) has an empty shard and the batch is not empty."""
    shards = batches(world_size, 0)
    return next(t for t, whole in enumerate(batches()) if whole and not shards[t])


def dp_optimizer(model: nn.Module, lr: float, momentum: float, **options: Any) -> dp.DPOptimizer:
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        expected_batch_size=EXPECTED_BATCH_SIZE,
        **options,
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --- the worker: every scenario, in one process group --------------------------------------


def error_of(build: Any) -> str:
    try:
        build()
    except (PergradValueError, PergradTypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def worker(world_size: int, rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=60),
    )
    seen: dict[str, Any] = {}
    x, y = make_data()

    model = make_model()
    if rank == world_size - 1:
        with torch.no_grad():
            model.get_parameter(PERTURBED)[0, 0] += 1e-6
    seen["mismatch"] = error_of(
        lambda: dp_optimizer(model, 0.1, 0.0, noise_multiplier=0.0, distributed=True)
    )
    dp.broadcast_parameters(model)  # rank 0's values everywhere: now the check passes
    seen["after broadcast"] = error_of(
        lambda: dp_optimizer(model, 0.1, 0.0, noise_multiplier=0.0, distributed=True)
    )
    seen["broadcast"] = params_of(model)
    same = make_model()
    seen["setting mismatch"] = error_of(
        lambda: dp.DPOptimizer(
            torch.optim.SGD(same.parameters(), lr=0.1),
            same,
            F.cross_entropy,
            max_norm=MAX_NORM,
            noise_multiplier=0.0,
            expected_batch_size=EXPECTED_BATCH_SIZE / world_size + rank,  # a local size
            distributed=True,
        )
    )
    ddp_model = nn.parallel.DistributedDataParallel(make_model())
    seen["ddp"] = error_of(
        lambda: dp_optimizer(ddp_model, 0.1, 0.0, noise_multiplier=0.0, distributed=True)
    )

    # Zero noise, SGD with momentum over every sampled step, empty shards included.
    model = make_model()
    optimizer = dp_optimizer(model, 0.5, 0.9, noise_multiplier=0.0, distributed=True)
    seen["stats"] = [optimizer.step(x[i], y[i]) for i in batches(world_size, rank)]
    seen["zero noise"] = params_of(model)

    # Noise, one step where rank 0 (which draws it) has no examples. Each rank seeds its
    # generator differently: only rank 0's may count.
    model = make_model()
    optimizer = dp_optimizer(
        model,
        1.0,
        0.0,
        noise_multiplier=NOISE_MULTIPLIER,
        generator=torch.Generator().manual_seed(NOISE_SEED + rank),
        distributed=True,
    )
    indices = batches(world_size, rank)[noise_step(world_size)]
    optimizer.step(x[indices], y[indices])
    seen["noise"] = params_of(model)

    # Adaptive clipping, the gradient's noise off, the count's on: each rank seeds its
    # generator differently, and only rank 0's may draw the count noise.
    model = make_model()
    optimizer = dp_optimizer(
        model,
        0.5,
        0.9,
        noise_multiplier=0.0,
        generator=torch.Generator().manual_seed(NOISE_SEED + rank),
        clipping=ADAPTIVE,
        distributed=True,
    )
    seen["adaptive stats"] = [optimizer.step(x[i], y[i]) for i in batches(world_size, rank)]
    seen["adaptive bound"] = optimizer.max_norm
    seen["adaptive"] = params_of(model)

    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()  # leave together: tearing gloo down under a peer aborts it
    torch.distributed.destroy_process_group()
    # gloo can still abort in C++ destructors at interpreter exit (exit -6): skip them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(world_size: int, directory: Path) -> list[dict[str, Any]]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    store = directory / "store"
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, str(world_size), str(rank), str(store), str(directory)],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        outputs = [process.communicate(timeout=120)[0] for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"{world_size} workers did not finish in 120 s: a collective hung")
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} failed:\n{output}"
    return [
        torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)
    ]


@pytest.fixture(
    scope="module",
    params=[2, pytest.param(4, marks=pytest.mark.slow(reason="four gloo processes: about 30 s"))],
    ids=lambda n: f"{n} processes",
)
def workers(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    return world_size, run_workers(world_size, tmp_path_factory.mktemp(f"world{world_size}"))


# --- the single-process references ------------------------------------------------------------


def single_process_run() -> tuple[list[dp.DPStep], dict[str, torch.Tensor]]:
    x, y = make_data()
    model = make_model()
    optimizer = dp_optimizer(model, 0.5, 0.9, noise_multiplier=0.0)
    stats = [optimizer.step(x[i], y[i]) for i in batches()]
    return stats, params_of(model)


def single_process_adaptive_run() -> tuple[list[dp.DPStep], float, dict[str, torch.Tensor]]:
    x, y = make_data()
    model = make_model()
    optimizer = dp_optimizer(
        model,
        0.5,
        0.9,
        noise_multiplier=0.0,
        generator=torch.Generator().manual_seed(NOISE_SEED),
        clipping=ADAPTIVE,
    )
    stats = [optimizer.step(x[i], y[i]) for i in batches()]
    return stats, optimizer.max_norm, params_of(model)


def test_adaptive_clipping_moves_every_rank_to_the_single_process_bounds(workers):
    """Adaptive clipping across processes: the unclipped count is summed over the ranks and
    noised once (rank 0's generator) before the bound moves, so every rank clips each step at
    the single-process bound of the union, ends with the same bound and the same weights.
    A rank that moved on its own count, or a count noised on every rank, would not."""
    world_size, seen = workers
    stats, bound, expected = single_process_adaptive_run()
    trajectory = [s.max_norm for s in stats] + [bound]
    assert len(set(np.round(trajectory, 6))) > 3  # the bound moves from step to step
    for rank in range(world_size):
        got = [s.max_norm for s in seen[rank]["adaptive stats"]] + [seen[rank]["adaptive bound"]]
        np.testing.assert_allclose(got, trajectory, rtol=1e-5)
        assert got == [s.max_norm for s in seen[0]["adaptive stats"]] + [seen[0]["adaptive bound"]]
        for name, value in expected.items():
            torch.testing.assert_close(seen[rank]["adaptive"][name], value, rtol=1e-5, atol=1e-6)
            assert torch.equal(seen[rank]["adaptive"][name], seen[0]["adaptive"][name])
        assert [s.batch_size for s in seen[rank]["adaptive stats"]] == [s.batch_size for s in stats]


def test_the_sampled_steps_include_empty_shards_on_every_rank():
    # The scenario is only meaningful if some ranks sit out steps that others take.
    for world_size in (2, 4):
        shards = [batches(world_size, rank) for rank in range(world_size)]
        for rank in range(world_size):
            assert any(not shards[rank][t] and batches()[t] for t in range(STEPS)), rank


def test_zero_noise_steps_equal_the_single_process_steps_on_the_union(workers):
    world_size, seen = workers
    stats, expected = single_process_run()
    for rank in range(world_size):
        for name, value in expected.items():
            torch.testing.assert_close(seen[rank]["zero noise"][name], value, rtol=1e-5, atol=1e-6)
            assert torch.equal(seen[rank]["zero noise"][name], seen[0]["zero noise"][name])
        assert [s.batch_size for s in seen[rank]["stats"]] == [s.batch_size for s in stats]
        got = [s.clip_fraction for s in seen[rank]["stats"]]
        np.testing.assert_allclose(got, [s.clip_fraction for s in stats], atol=1e-6)
    assert len({s.clip_fraction for s in stats}) > 1  # clipping acts, and not on everything


def test_the_noise_is_one_draw_for_the_whole_step(workers):
    """Noisy params minus the noise-free single-process step are -noise / B (SGD, lr 1)."""
    chi2 = pytest.importorskip("scipy.stats", reason="chi-square quantiles").chi2
    world_size, seen = workers
    x, y = make_data()
    model = make_model()
    indices = batches()[noise_step(world_size)]
    dp_optimizer(model, 1.0, 0.0, noise_multiplier=0.0).step(x[indices], y[indices])
    residual = torch.cat(
        [(seen[0]["noise"][name] - p).flatten() for name, p in params_of(model).items()]
    ).double()
    std = NOISE_MULTIPLIER * MAX_NORM / EXPECTED_BATCH_SIZE
    statistic = float(((residual / std) ** 2).sum())  # chi2(P) for one draw
    num_params = residual.numel()
    low, high = chi2.ppf([FALSE_ALARM / 2, 1 - FALSE_ALARM / 2], num_params)
    assert low < statistic < high, (statistic / num_params, world_size)
    # world_size draws would give world_size * chi2(P): this test would miss that with
    # probability below FALSE_ALARM.
    assert chi2.cdf(high / world_size, num_params) < FALSE_ALARM
    for rank in range(world_size):  # every process holds the same noisy parameters
        assert all(torch.equal(seen[rank]["noise"][k], v) for k, v in seen[0]["noise"].items())


def test_construction_refuses_differing_parameters_naming_the_first(workers):
    world_size, seen = workers
    for rank in range(world_size):
        message = seen[rank]["mismatch"]
        assert message.startswith("PergradValueError: DPOptimizer: parameter '2.weight' differs")
        assert f"rank(s) [{world_size - 1}]" in message and "broadcast_parameters" in message


def test_broadcast_parameters_makes_the_ranks_agree(workers):
    world_size, seen = workers
    expected = params_of(make_model())  # rank 0's; the last rank had changed one entry
    for rank in range(world_size):
        assert seen[rank]["after broadcast"] == "no error"
        assert all(torch.equal(seen[rank]["broadcast"][k], v) for k, v in expected.items())


def test_construction_refuses_settings_that_differ_across_ranks(workers):
    world_size, seen = workers
    expected = [EXPECTED_BATCH_SIZE / world_size + rank for rank in range(world_size)]
    for rank in range(world_size):
        assert seen[rank]["setting mismatch"] == (
            f"PergradValueError: DPOptimizer: expected_batch_size must be the same on every "
            f"rank; got {expected} (by rank). Pass the global values (e.g. expected_batch_size "
            "= sample_rate * dataset size) on every process."
        )


def test_a_ddp_wrapped_model_is_refused(workers):
    world_size, seen = workers
    for rank in range(world_size):
        assert seen[rank]["ddp"].startswith(
            "PergradTypeError: DPOptimizer: model is wrapped in "
            "torch.nn.parallel.DistributedDataParallel; pass the plain module (model.module)"
        )


# --- in this process: no process group ----------------------------------------------------


def test_distributed_without_a_process_group_names_it():
    assert not torch.distributed.is_initialized()
    model = make_model()
    with pytest.raises(PergradValueError, match="the default process group is not initialised"):
        dp_optimizer(model, 0.1, 0.0, noise_multiplier=1.0, distributed=True)
    with pytest.raises(PergradValueError, match="^broadcast_parameters: .* not initialised"):
        dp.broadcast_parameters(model)
    with pytest.raises(PergradTypeError, match="distributed must be False, True .* got str"):
        dp_optimizer(model, 0.1, 0.0, noise_multiplier=1.0, distributed="gloo")


# --- the sharded sampler, in this process --------------------------------------------------


def sharded(num_replicas: int, seeds: list[int], num_examples: int, rate: float, steps: int):
    """Each rank's batches, rank r's generator seeded with seeds[r]."""
    return [
        list(
            dp.PoissonBatchSampler(
                num_examples,
                rate,
                steps,
                torch.Generator().manual_seed(seed),
                num_replicas=num_replicas,
                rank=rank,
            )
        )
        for rank, seed in enumerate(seeds)
    ]


def test_shards_are_disjoint_and_their_union_is_the_unsharded_batch():
    num_replicas = 3
    shards = sharded(num_replicas, [7] * num_replicas, 50, 0.3, 40)
    whole = list(dp.PoissonBatchSampler(50, 0.3, 40, torch.Generator().manual_seed(7)))
    for step, batch in enumerate(whole):
        union = [i for rank in range(num_replicas) for i in shards[rank][step]]
        assert sorted(union) == batch  # disjoint (no repeats) and covering
        for rank in range(num_replicas):
            assert all(i % num_replicas == rank for i in shards[rank][step])


def test_independently_seeded_shards_form_a_poisson_sample():
    from test_dp_sampling import assert_poisson_inclusion

    num_replicas, num_examples, rate, steps = 3, 100, 0.25, 4000
    shards = sharded(num_replicas, [11, 12, 13], num_examples, rate, steps)
    unions = [
        np.array([i for rank in range(num_replicas) for i in shards[rank][step]], dtype=np.int64)
        for step in range(steps)
    ]
    assert all(len(set(union)) == len(union) for union in unions)
    assert_poisson_inclusion(unions, num_examples, rate)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(num_replicas=0), PergradValueError, "num_replicas must be >= 1, got 0"),
        (dict(num_replicas=2.0), PergradTypeError, "num_replicas must be an int, got float"),
        (dict(num_replicas=2, rank=2), PergradValueError, r"rank must be in \[0, num_replicas=2\)"),
        (dict(num_replicas=2, rank=-1), PergradValueError, "rank must be >= 0, got -1"),
    ],
)
def test_sharded_sampler_rejects_bad_input(options, error, message):
    with pytest.raises(error, match="^PoissonBatchSampler: " + message):
        dp.PoissonBatchSampler(10, 0.1, 5, **options)


# --- the example and the benchmark run -----------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow(reason="the example in two gloo processes: about 12 s on 2 CPU cores")
def test_the_distributed_example_trains_two_processes_to_the_same_parameters():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("dp_accounting", reason="the example calibrates the noise")
    script = REPO_ROOT / "examples" / "dp_sgd_distributed_torch.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "2 processes, 40 steps" in result.stdout
    assert "epsilon 3.00 at delta 1e-05" in result.stdout
    assert result.stdout.strip().endswith("parameters identical on every process: True")


@pytest.mark.slow(reason="the scaling benchmark in gloo processes: about 9 s on 2 CPU cores")
def test_the_scaling_benchmark_runs(tmp_path):
    out = tmp_path / "scaling_torch.md"
    script = REPO_ROOT / "benchmarks" / "scaling_torch.py"
    command = [sys.executable, str(script), "--quick", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]  # the worker's traceback, if one failed
    text = out.read_text()
    assert text.startswith("# pergrad DP-SGD scaling over processes (PyTorch, CPU)")
    assert "| DPOptimizer (one process) | 1 |" in text
    assert "| DPOptimizer(distributed=True) | 2 |" in text


if __name__ == "__main__":
    world_size_arg, rank_arg, store_arg, out_arg = sys.argv[1:]
    worker(int(world_size_arg), int(rank_arg), store_arg, out_arg)
