"""Invariants of per-example gradients, over random shapes and batch sizes (hypothesis).

References are the frameworks' own batch gradients of a loss written for the whole batch, so
they share nothing with pergrad's vmap path.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pergrad

jax = pytest.importorskip("jax", reason="property tests compare both backends")
jnp = pytest.importorskip("jax.numpy", reason="property tests compare both backends")
torch = pytest.importorskip("torch", reason="property tests compare both backends")

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.tuples(
    st.integers(1, 9),  # batch size
    st.integers(1, 5),  # input dim
    st.integers(1, 6),  # hidden width
    st.integers(0, 2**31 - 1),  # seed
)


def make_problem(batch_size, dim, width, seed):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(dim, width)).astype(np.float32),
        "b1": rng.normal(size=width).astype(np.float32),
        "w2": rng.normal(size=width).astype(np.float32),
    }
    x = rng.normal(size=(batch_size, dim)).astype(np.float32)
    y = rng.normal(size=batch_size).astype(np.float32)
    return params, x, y


def mlp_loss(params, x, y, tanh):
    """One example (x of shape (D,)) or a batch (x of shape (B, D)): squared errors."""
    hidden = tanh(x @ params["w1"] + params["b1"])
    return (hidden @ params["w2"] - y) ** 2


def jax_loss(params, x, y):
    return mlp_loss(params, x, y, jnp.tanh)


def torch_loss(params, x, y):
    return mlp_loss(params, x, y, torch.tanh)


def jax_batch_grad(params, x, y, reduce):
    # Under jit: one compilation per shape, where op by op every primitive compiles on its own.
    return jax.jit(jax.grad(lambda p, x, y: reduce(jax_loss(p, x, y))))(params, x, y)


def torch_batch_grad(params, x, y, reduce):
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    loss = reduce(torch_loss(leaves, torch.tensor(x), torch.tensor(y)))
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def assert_trees_close(actual, expected, rtol=2e-4, atol=2e-5):
    assert set(actual) == set(expected)
    for k in expected:
        np.testing.assert_allclose(
            np.asarray(actual[k]), np.asarray(expected[k]), rtol=rtol, atol=atol, err_msg=k
        )


def to_numpy(tree):
    return {
        k: v.detach().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        for k, v in tree.items()
    }


@SETTINGS
@given(shapes)
def test_jax_mean_and_sum_equal_batch_gradients(shape):
    params, x, y = make_problem(*shape)
    grads = pergrad.per_example_grads(jax_loss)(params, jnp.asarray(x), jnp.asarray(y))
    grads = {k: np.asarray(g, np.float64) for k, g in grads.items()}  # no compile per shape
    mean = {k: g.mean(0) for k, g in grads.items()}
    total = {k: g.sum(0) for k, g in grads.items()}
    assert_trees_close(mean, jax_batch_grad(params, x, y, jnp.mean))
    assert_trees_close(total, jax_batch_grad(params, x, y, jnp.sum))


@SETTINGS
@given(shapes)
def test_torch_mean_and_sum_equal_batch_gradients(shape):
    params, x, y = make_problem(*shape)
    torch_params = {k: torch.tensor(v) for k, v in params.items()}
    grads = pergrad.per_example_grads(torch_loss)(torch_params, torch.tensor(x), torch.tensor(y))
    mean = {k: g.mean(0) for k, g in grads.items()}
    total = {k: g.sum(0) for k, g in grads.items()}
    assert_trees_close(to_numpy(mean), to_numpy(torch_batch_grad(params, x, y, torch.mean)))
    assert_trees_close(to_numpy(total), to_numpy(torch_batch_grad(params, x, y, torch.sum)))


@SETTINGS
@given(shapes, st.integers(1, 10))
@example(shape=(7, 4, 2, 555333), chunk_size=1)  # torch: 1.03e-5 apart on a 1.9e-3 entry
def test_chunked_equals_unchunked_on_both_backends(shape, chunk_size):
    params, x, y = make_problem(*shape)
    jax_args = ({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x), jnp.asarray(y))
    torch_args = ({k: torch.tensor(v) for k, v in params.items()}, torch.tensor(x), torch.tensor(y))
    for loss, args in ((jax_loss, jax_args), (torch_loss, torch_args)):
        whole = pergrad.per_example_grads(loss)(*args)
        chunked = pergrad.per_example_grads(loss, chunk_size=chunk_size)(*args)
        # Chunks run smaller matmuls, whose float32 sums round differently: ~1e-5 relative to
        # the terms summed, which can be absolute on an entry far smaller than they are.
        assert_trees_close(to_numpy(chunked), to_numpy(whole), rtol=1e-4, atol=2e-5)


@SETTINGS
@given(shapes)
def test_jax_and_torch_agree_on_the_same_weights(shape):
    params, x, y = make_problem(*shape)
    from_jax = pergrad.per_example_grads(jax_loss)(
        {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x), jnp.asarray(y)
    )
    from_torch = pergrad.per_example_grads(torch_loss)(
        {k: torch.tensor(v) for k, v in params.items()}, torch.tensor(x), torch.tensor(y)
    )
    assert_trees_close(to_numpy(from_jax), to_numpy(from_torch))
