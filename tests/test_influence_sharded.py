"""Top-k influence over a training set split into shards equals the single-process top-k.

Each shard is scored on its own with global indices (``offset=``) and the shards' results are
merged; the reference is one ``top_k`` streaming the whole training set. Duplicated training
examples in different shards make exact ties, which must rank as in one process (lower global
index first).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

import pergrad
from pergrad import influence

BATCH = 5  # training examples per streamed batch; shards are whole batches


def make_problem(fw, n_train=30, n_test=3, dim=4, seed=0):
    """A regression loss and data in which examples 3 and 21 are identical (exact ties)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=dim)
    x, y = rng.normal(size=(n_train, dim)), rng.normal(size=n_train)
    x[21], y[21] = x[3], y[3]
    xt, yt = rng.normal(size=(n_test, dim)), rng.normal(size=n_test)

    def loss(w, x, y):
        return ((x * w).sum() - y) ** 2 + 0.05 * (w**2).sum()

    return loss, [fw.array(a) for a in (w, x, y, xt, yt)]


def batches(x, y, start, stop):
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(start, stop, BATCH)]


SHARDINGS = [[0, 10, 30], [0, 15, 20, 30]]  # shard boundaries (2 and 3 shards)


@pytest.mark.parametrize("bounds", SHARDINGS)
@pytest.mark.parametrize("method", ["dot", "cosine", "influence"])
def test_merged_shards_equal_one_stream(fw, method, bounds):
    loss, (w, x, y, xt, yt) = make_problem(fw)
    options = dict(k=6, method=method, hessian_batch=(x, y), solver="exact", progress=False)
    single = influence.top_k(loss, w, batches(x, y, 0, 30), (xt, yt), **options)
    shards = [
        influence.top_k(loss, w, batches(x, y, lo, hi), (xt, yt), offset=lo, **options)
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    merged = influence.merge_top_k(shards[::-1])  # the order of the shards does not matter
    assert merged.num_train == single.num_train == 30
    for field in ("proponents", "opponents", "proponent_scores", "opponent_scores"):
        np.testing.assert_array_equal(getattr(merged, field), getattr(single, field))


def test_ties_across_shards_rank_by_lower_global_index(fw):
    loss, (w, x, y, xt, yt) = make_problem(fw)
    train_grads = pergrad.per_example_grads(loss)(w, x, y)
    scores = fw.to_numpy(
        influence.grad_dot(train_grads, pergrad.per_example_grads(loss)(w, xt, yt))
    )
    assert (scores[3] == scores[21]).all()  # the duplicated example: exact ties
    k = 30  # keep everything, so both copies are in every column
    shards = [
        influence.top_k(
            loss, w, batches(x, y, 20, 30), (xt, yt), k=k, method="dot", offset=20, progress=False
        ),
        influence.top_k(loss, w, batches(x, y, 0, 20), (xt, yt), k=k, method="dot", progress=False),
    ]
    merged = influence.merge_top_k(shards)
    for row in list(merged.proponents) + list(merged.opponents):
        position = {int(index): p for p, index in enumerate(row)}
        assert position[21] == position[3] + 1
    reference = np.argsort(-scores, axis=0, kind="stable")[:k].T
    np.testing.assert_array_equal(merged.proponents, reference)


@pytest.mark.parametrize("bounds", SHARDINGS)
def test_projected_scores_of_shards_merge_to_the_full_projection(fw, bounds):
    loss, (w, x, y, xt, yt) = make_problem(fw, dim=12)
    grads = pergrad.per_example_grads(loss)
    test_small = influence.project(grads(w, xt, yt), k=8, seed=3)
    full = influence.grad_dot(influence.project(grads(w, x, y), k=8, seed=3), test_small)
    single = influence.top_k_from_scores(full, k=5)
    shards = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        shard_small = influence.project(grads(w, x[lo:hi], y[lo:hi]), k=8, seed=3)
        shard_scores = influence.grad_dot(shard_small, test_small)
        shards.append(influence.top_k_from_scores(shard_scores, k=5, offset=lo))
    merged = influence.merge_top_k(shards)
    np.testing.assert_array_equal(merged.proponents, single.proponents)
    np.testing.assert_array_equal(merged.opponents, single.opponents)
    np.testing.assert_allclose(merged.proponent_scores, single.proponent_scores, rtol=1e-5)
    full = fw.to_numpy(full)
    np.testing.assert_array_equal(single.proponents, np.argsort(-full, 0, kind="stable")[:5].T)


def test_top_k_from_scores_matches_top_k(fw):
    loss, (w, x, y, xt, yt) = make_problem(fw)
    grads = pergrad.per_example_grads(loss)
    scores = influence.grad_dot(grads(w, x, y), grads(w, xt, yt))
    streamed = influence.top_k(
        loss, w, batches(x, y, 0, 30), (xt, yt), k=4, method="dot", progress=False
    )
    from_scores = influence.top_k_from_scores(scores, k=4)
    np.testing.assert_array_equal(from_scores.proponents, streamed.proponents)
    np.testing.assert_array_equal(from_scores.opponents, streamed.opponents)


def test_small_shards_keep_fewer_than_k_and_still_merge():
    scores = np.array([[3.0], [1.0], [2.0], [5.0], [4.0]])
    shards = [
        influence.top_k_from_scores(scores[:2], k=3),
        influence.top_k_from_scores(scores[2:], k=3, offset=2),
    ]
    assert shards[0].proponents.shape == (1, 2)
    merged = influence.merge_top_k(shards)
    np.testing.assert_array_equal(merged.proponents, [[3, 4, 0]])
    np.testing.assert_array_equal(merged.opponents, [[1, 2, 0]])
    assert (merged.num_train, merged.k) == (5, 3)


def test_merge_bad_input():
    scores = np.arange(12.0).reshape(6, 2)
    first = influence.top_k_from_scores(scores[:3], k=2)
    with pytest.raises(ValueError, match="appears in more than one shard.*offset="):
        influence.merge_top_k([first, influence.top_k_from_scores(scores[3:], k=2)])
    with pytest.raises(ValueError, match="different numbers of test examples"):
        influence.merge_top_k([first, influence.top_k_from_scores(scores[3:, :1], k=2, offset=3)])
    with pytest.raises(ValueError, match=r"results\[1\] kept 1 entries"):
        influence.merge_top_k([first, influence.top_k_from_scores(scores[3:], k=1, offset=3)], k=2)
    with pytest.raises(TypeError, match="non-empty list of TopK"):
        influence.merge_top_k([])
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        influence.top_k_from_scores(scores, offset=-1)
    with pytest.raises(ValueError, match=r"\(n_train, n_test\) matrix"):
        influence.top_k_from_scores(scores[:, 0])


# --------------------------------------------------------------------------------------------
# torch.distributed: two gloo processes, each scores half, all_gather_top_k merges.

_WORKER = """
import os, sys, json
import numpy as np, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_influence_sharded import make_problem, batches
from conftest import _torch_framework
from pergrad import influence

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
loss, (w, x, y, xt, yt) = make_problem(_torch_framework())
lo, hi = (0, 15) if rank == 0 else (15, 30)
mine = influence.top_k(loss, w, batches(x, y, lo, hi), (xt, yt), k=6, method="dot",
                       offset=lo, progress=False)
merged = influence.all_gather_top_k(mine)
dist.barrier()  # leave together: tearing gloo down under a peer aborts it
dist.destroy_process_group()
print(json.dumps({{"proponents": merged.proponents.tolist(),
                  "opponents": merged.opponents.tolist(), "num_train": merged.num_train}}),
      flush=True)
# gloo can still abort in C++ destructors at interpreter exit (exit -6): skip them
os._exit(0)
"""


def test_all_gather_top_k_over_two_gloo_processes(tmp_path):
    torch = pytest.importorskip("torch", reason="torch.distributed")
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    import json
    import subprocess

    from conftest import _torch_framework

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(tests=str(Path(__file__).parent), port=port))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    for worker, (_, err) in zip(workers, outputs):
        assert worker.returncode == 0, err
    loss, (w, x, y, xt, yt) = make_problem(_torch_framework())
    single = influence.top_k(
        loss, w, batches(x, y, 0, 30), (xt, yt), k=6, method="dot", progress=False
    )
    for out, _ in outputs:
        merged = json.loads(out.strip().splitlines()[-1])
        assert merged["num_train"] == 30
        np.testing.assert_array_equal(merged["proponents"], single.proponents)
        np.testing.assert_array_equal(merged["opponents"], single.opponents)


def test_all_gather_top_k_needs_an_initialised_process_group():
    pytest.importorskip("torch", reason="torch.distributed")
    result = influence.top_k_from_scores(np.ones((3, 1)), k=1)
    with pytest.raises(ValueError, match="init_process_group"):
        influence.all_gather_top_k(result)
