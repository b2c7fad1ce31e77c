"""``DPOptimizer`` on an FSDP2 model: a micro-batch that fails on one process alone stops every
process at once, with an error that says which process failed and why, instead of leaving the
others waiting in a collective until the process group's timeout.

The harness of ``test_fsdp_torch.py``: this file, run as a script (``python
test_fsdp_torch_failures.py WORLD_SIZE RANK STORE OUT``), plays each failure on gloo processes
(process 1 gets the bad micro-batch, the others a good one) and saves what each process
raised, how long it took, and whether the model was left as it was; then it trains the whole
run with the same optimizer, which the tests compare with the single-process run.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 is PyTorch")

from pergrad._src.errors import PergradValueError  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (run as a script, too)
from test_fsdp_torch import (  # noqa: E402
    assert_params_equal,
    dp_optimizer,
    gathered,
    join_gloo,
    leave_gloo,
    make_data,
    make_mlp,
    run_workers,
    shard,
    single_process,
    train,
)
from test_fsdp_torch_more import (  # noqa: E402
    ACCUMULATED,
    USERS,
    of_rank,
    reference_steps,
    user_optimizer,
)

BAD = 1  # the process that gets the bad micro-batch
COLLECTIVE_TIMEOUT = 30.0  # a process left waiting in a collective fails after this long
PROMPT = 10.0  # seconds: far below COLLECTIVE_TIMEOUT, far above a step under load


# --- the worker -------------------------------------------------------------------------------


def make_mlp_sharded() -> Any:
    model = make_mlp()
    return shard(model, [model[0], model[2]])


def micro_batches(rank: int) -> dict[str, tuple[Any, ...]]:
    """Each case's micro-batch for this process: good everywhere but on process ``BAD``."""
    x, y = make_data()
    rows = [rank, rank + 2]
    good = (x[rows], y[rows])
    bad = {
        "float64 inputs": (x[rows].double(), y[rows]),
        "an empty batch without its feature axis": (torch.empty(0), y[:0]),
        "inputs without a tensor": (x[rows].tolist(), y[rows]),
        "a label past the classes": (x[rows], torch.tensor([3, 99])),
        "targets of another length": (x[rows], y[rows][:1]),
    }
    return {case: batch if rank == BAD else good for case, batch in bad.items()}


def failed(step: Any, model: Any) -> dict[str, Any]:
    """What ``step()`` raised, how long it took, and whether the model is as it was (its
    parameters the same DTensor shards, no ``.grad``)."""
    from torch.distributed.tensor import DTensor

    before = {name: p.to_local().clone() for name, p in model.named_parameters()}
    start = time.perf_counter()
    try:
        step()
        error = "no error"
    except Exception as err:  # noqa: BLE001  (what each process raises is the result)
        error = f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - start
    params = dict(model.named_parameters())
    untouched = list(params) == list(before) and all(
        isinstance(p, DTensor) and p.grad is None and torch.equal(p.to_local(), before[name])
        for name, p in params.items()
    )
    return {"error": error, "seconds": seconds, "untouched": untouched}


def worker(world_size: int, rank: int, store: str, out: str) -> None:
    from pergrad._src.torch import fsdp

    join_gloo(world_size, rank, store, timeout=COLLECTIVE_TIMEOUT)
    seen: dict[str, Any] = {}
    model = make_mlp()
    shard(model, [model[0], model[2]])
    optimizer = dp_optimizer(model, noise_multiplier=0.0, distributed=True)

    for case, batch in micro_batches(rank).items():
        seen[case] = failed(lambda batch=batch: optimizer.step(*batch), model)

    # The caller's own refusal of the micro-batch (DPOptimizer's checks of its user_ids).
    good = micro_batches(0)["float64 inputs"]
    refusal = (
        PergradValueError("DPOptimizer: a refusal of process 1's own") if rank == BAD else None
    )

    def refused() -> None:
        fsdp.clipped_sum_run(
            optimizer._sharded, optimizer._loss, good, max_norm=1.0, clipping=None, refused=refusal
        )

    seen["refused by the caller"] = failed(refused, model)

    # The norms fail after the backward pass, on one process (as out of memory would).
    original = fsdp._squared_norms

    def out_of_memory(*args: Any) -> Any:
        raise RuntimeError("out of memory (simulated) on this process")

    fsdp._squared_norms = out_of_memory if rank == BAD else original
    try:
        seen["norms failing"] = failed(lambda: optimizer.step(*good), model)
    finally:
        fsdp._squared_norms = original

    # DPOptimizer's own refusal on one process: a user met again in a later micro-batch of
    # the step; the step is then retried with the right micro-batch.
    users = user_optimizer(make_mlp_sharded(), noise_multiplier=0.0, distributed=True)
    mine = of_rank(ACCUMULATED, world_size, rank)
    first = [i for i in mine if int(USERS[i]) < 3]
    second = [i for i in mine if int(USERS[i]) >= 3]
    x, y = make_data()
    users.accumulate(x[first], y[first], user_ids=USERS[first])
    again = first if rank == BAD else second
    step = lambda: users.step(x[again], y[again], user_ids=USERS[again])  # noqa: E731
    seen["a user met again"] = failed(step, users.model)
    users.step(x[second], y[second], user_ids=USERS[second])
    seen["users after"] = gathered(users.model)

    # The same optimizer then trains the whole run, as if nothing had failed.
    train(model, optimizer, make_data(), world_size, rank)
    seen["after"] = gathered(model)

    leave_gloo(seen, out, rank)


SLOW_FOUR = pytest.mark.slow(reason="4 processes on 2 cores: about 20 s")


@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=SLOW_FOUR)], ids=lambda n: f"{n} processes"
)
def workers(request, tmp_path_factory) -> list[dict[str, Any]]:
    """What each process saw, by rank; a collective left waiting would fail its process after
    COLLECTIVE_TIMEOUT seconds, and the run after 120 s."""
    world_size = request.param
    directory = tmp_path_factory.mktemp(f"fsdp_failures{world_size}")
    return run_workers(world_size, directory, transformer=False, script=__file__, timeout=120.0)


# --- the tests ----------------------------------------------------------------------------------


def assert_failed_together(seen: list[dict[str, Any]], case: str, own: str, reason: str) -> None:
    """Process BAD raised ``own`` (its own error), every other process a PergradValueError
    naming process BAD and ``reason``; each promptly, the model as it was."""
    for rank, saw in enumerate(seen):
        got = saw[case]
        if rank == BAD:
            assert got["error"].startswith(own) and reason in got["error"], got["error"]
        else:
            assert got["error"].startswith(f"PergradValueError: DPOptimizer: process {BAD} ")
            assert reason in got["error"], got["error"]
        assert got["seconds"] < PROMPT, (case, rank, got)
        assert got["untouched"], (case, rank)


def test_a_batch_of_another_dtype_on_one_process_is_refused_on_every_process(workers):
    good = [rank for rank in range(len(workers)) if rank != BAD]
    for saw in workers:  # the same error everywhere: no process is the odd one by itself
        got = saw["float64 inputs"]
        assert got["error"] == (
            f"PergradValueError: DPOptimizer: the processes' micro-batches differ at model input "
            f"0: processes {good} pass a 2-d torch.float32 tensor; processes [1] pass a 2-d "
            "torch.float64 tensor. On an FSDP2 model every process passes a micro-batch of the "
            "same structure, dtypes and numbers of dimensions (its own batch size; an empty "
            "batch as x[:0]), or the model's collectives would not match."
        )
        assert got["seconds"] < PROMPT and got["untouched"]


def test_an_empty_batch_of_another_shape_is_refused_on_every_process(workers):
    for saw in workers:
        got = saw["an empty batch without its feature axis"]
        assert "differ at model input 0: processes" in got["error"], got["error"]
        assert "processes [1] pass a 1-d torch.float32 tensor" in got["error"]
        assert got["seconds"] < PROMPT and got["untouched"]


def test_a_batch_one_process_refuses_is_refused_on_every_process(workers):
    reason = "the model inputs must hold a tensor batched on axis 0"
    assert_failed_together(workers, "inputs without a tensor", "PergradValueError", reason)
    reason = "a refusal of process 1's own"
    assert_failed_together(workers, "refused by the caller", "PergradValueError", reason)


def test_a_loss_failing_on_one_process_stops_every_process_before_the_backward_pass(workers):
    reason = "Target 99 is out of bounds"
    assert_failed_together(workers, "a label past the classes", "IndexError", reason)
    reason = "multi-target not supported"
    assert_failed_together(workers, "targets of another length", "RuntimeError", reason)


def test_norms_failing_on_one_process_stop_every_process_after_the_backward_pass(workers):
    reason = "out of memory (simulated) on this process"
    assert_failed_together(workers, "norms failing", "RuntimeError", reason)


def test_a_refusal_by_dp_optimizer_on_one_process_stops_every_process(workers):
    reason = "are in an earlier micro-batch of this step too"
    assert_failed_together(workers, "a user met again", "PergradValueError", reason)
    _, expected = reference_steps(
        make_mlp(), make_data(), [ACCUMULATED], users=True, noise_multiplier=0.0
    )
    for saw in workers:  # (the retried step: the refused micro-batch was not added)
        assert_params_equal(saw["users after"], expected)


def test_the_steps_after_the_failures_are_the_single_process_steps(workers):
    _, expected = single_process(make_mlp(), make_data())
    for saw in workers:
        assert_params_equal(saw["after"], expected)


if __name__ == "__main__":
    world_size_arg, rank_arg, store_arg, out_arg = sys.argv[1:]
    worker(int(world_size_arg), int(rank_arg), store_arg, out_arg)
