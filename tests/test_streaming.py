"""influence.top_k streams batches and keeps the same top-k as the full score matrix."""

from __future__ import annotations

import numpy as np
import pytest

import pergrad
from pergrad import influence

RNG = np.random.default_rng(7)


def make_problem(fw, n_train=23, n_test=3, dim=4):
    w = RNG.normal(size=dim)
    x, y = RNG.normal(size=(n_train, dim)), RNG.normal(size=n_train)
    xt, yt = RNG.normal(size=(n_test, dim)), RNG.normal(size=n_test)

    def loss(w, x, y):
        return ((x * w).sum() - y) ** 2 + 0.05 * (w**2).sum()

    arrays = [fw.array(a) for a in (w, x, y, xt, yt)]
    return loss, arrays


def batches(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


@pytest.mark.parametrize("method", ["dot", "cosine", "influence"])
def test_streamed_top_k_equals_the_full_matrix(fw, method):
    loss, (w, x, y, xt, yt) = make_problem(fw)
    k = 4
    if method == "influence":
        full = influence.influence_function(loss, w, (x, y), (xt, yt), solver="exact")
    else:
        train_grads = pergrad.per_example_grads(loss)(w, x, y)
        test_grads = pergrad.per_example_grads(loss)(w, xt, yt)
        full = (influence.grad_dot if method == "dot" else influence.grad_cosine)(
            train_grads, test_grads
        )
    full = fw.to_numpy(full)
    result = influence.top_k(
        loss,
        w,
        batches(x, y, 5),
        (xt, yt),
        k=k,
        method=method,
        hessian_batch=(x, y),
        solver="exact",
        progress=False,
    )
    assert result.num_train == 23
    for j in range(full.shape[1]):
        np.testing.assert_array_equal(
            result.proponents[j], np.argsort(-full[:, j], kind="stable")[:k]
        )
        np.testing.assert_array_equal(
            result.opponents[j], np.argsort(full[:, j], kind="stable")[:k]
        )
        np.testing.assert_allclose(
            result.proponent_scores[j], np.sort(full[:, j])[::-1][:k], rtol=1e-4
        )


def test_bad_input(fw):
    loss, (w, x, y, xt, yt) = make_problem(fw)
    with pytest.raises(ValueError, match="k must be a positive int"):
        influence.top_k(loss, w, batches(x, y, 5), (xt, yt), k=0, method="dot")
    with pytest.raises(ValueError, match="method must be one of"):
        influence.top_k(loss, w, batches(x, y, 5), (xt, yt), method="trak")
    with pytest.raises(ValueError, match="needs hessian_batch"):
        influence.top_k(loss, w, batches(x, y, 5), (xt, yt), method="influence", progress=False)
    with pytest.raises(ValueError, match="yielded no examples"):
        influence.top_k(loss, w, [], (xt, yt), method="dot", progress=False)
