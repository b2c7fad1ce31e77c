"""JAX models as users write them: flax linen, flax NNX and equinox, with state (BatchNorm
statistics in eval mode) and dropout driven by one key per example.

Each against ``jax.grad`` one example at a time (``_reference.jax_loop_grads``), with the same
keys; the strategy (``"vmap"``) is asserted, and the ``"loop"`` strategy must agree.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import pergrad  # noqa: E402
from _reference import jax_loop_grads  # noqa: E402

# Small programs of many shapes, op by op: compiled without XLA's backend optimisations.
pytestmark = pytest.mark.usefixtures("fast_xla_compile")

B, D, C = 6, 5, 3


def assert_trees_close(got, want, rtol=1e-4, atol=1e-6):
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape
        assert jnp.allclose(g, w, rtol=rtol, atol=atol), float(jnp.max(jnp.abs(g - w)))


def data(seed: int = 0):
    kx, ky, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    xs = jax.random.normal(kx, (B, D))
    ys = jax.random.randint(ky, (B,), 0, C)
    keys = jax.random.split(kd, B)
    return xs, ys, keys


def cross_entropy(logits, y):
    return -jax.nn.log_softmax(logits)[y]


def check(loss, params, shared, *batched):
    """vmap strategy == loop strategy == jax.grad per example, for ``loss(params, shared, key,
    x, y)`` (``shared``: model state, the same for every example; None for no state)."""
    args = (params, shared, *batched)
    fn = pergrad.per_example_grads(loss)
    grads = fn(*args)
    assert fn.last_strategy == "vmap"
    assert_trees_close(grads, jax_loop_grads(lambda p, *b: loss(p, shared, *b), params, *batched))
    looped = pergrad.per_example_grads(loss, strategy="loop")(*args)
    assert_trees_close(grads, looped)
    return grads


def test_flax_linen_batchnorm_eval_and_dropout_keys():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16)(x)
            x = nn.BatchNorm(use_running_average=True)(x)
            x = nn.Dropout(0.5, deterministic=False)(nn.relu(x))
            return nn.Dense(C)(x)

    xs, ys, keys = data(1)
    variables = Net().init({"params": jax.random.PRNGKey(0)}, xs[0])
    batch_stats = jax.tree_util.tree_map(
        lambda v: v + 0.3, variables["batch_stats"]
    )  # non-trivial running statistics

    def loss(params, batch_stats, key, x, y):
        logits = Net().apply(
            {"params": params, "batch_stats": batch_stats}, x, rngs={"dropout": key}
        )
        return cross_entropy(logits, y)

    grads = check(loss, variables["params"], batch_stats, keys, xs, ys)
    # different keys, different masks: the first layer's gradients differ in their zero pattern
    kernel = grads["Dense_1"]["kernel"]
    assert not jnp.array_equal(kernel[0] == 0, kernel[1] == 0)


def test_flax_nnx_dropout_keys():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(D, 16, rngs=rngs)
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.5)
            self.fc2 = nnx.Linear(16, C, rngs=rngs)

        def __call__(self, x, key):
            h = self.norm(jax.nn.relu(self.fc1(x)))
            return self.fc2(self.drop(h, rngs=nnx.Rngs(dropout=key)))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))
    xs, ys, keys = data(2)

    def loss(state, unused, key, x, y):
        return cross_entropy(nnx.merge(graphdef, state)(x, key), y)

    check(loss, state, None, keys, xs, ys)


def test_equinox_batchnorm_state_and_dropout_keys():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        fc1: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        drop: eqx.nn.Dropout
        fc2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.fc1 = eqx.nn.Linear(D, 16, key=k1)
            self.norm = eqx.nn.BatchNorm(16, axis_name="batch", inference=True)
            self.drop = eqx.nn.Dropout(0.5)
            self.fc2 = eqx.nn.Linear(16, C, key=k2)

        def __call__(self, x, state, key):
            h, state = self.norm(jax.nn.relu(self.fc1(x)), state)
            return self.fc2(self.drop(h, key=key)), state

    model, state = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    xs, ys, keys = data(3)

    def loss(params, state, key, x, y):
        logits, _ = eqx.combine(params, static)(x, state, key)
        return cross_entropy(logits, y)

    check(loss, params, state, keys, xs, ys)


def equinox_filter_grads_loop(loss, model, *batched):
    """``eqx.filter_grad`` one example at a time, stacked: equinox's own convention."""
    eqx = pytest.importorskip("equinox")
    rows = [eqx.filter_grad(loss)(model, *(b[i] for b in batched)) for i in range(len(batched[0]))]
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *rows)


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("strategy", ["auto", "loop"])
def test_equinox_float_fields_are_constants_as_in_filter_grad(strategy, inference):
    """Every eqx.nn.MultiheadAttention holds an eqx.nn.Dropout whose p is the Python float
    0.0, which equinox skips only as a literal: turned into a differentiated array it asked
    for a key (inference=False), or came back with a gradient filter_grad does not give
    (inference=True: 5 leaves against 4)."""
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MultiheadAttention(2, 8, key=jax.random.PRNGKey(0), inference=inference)
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, 4, 8))

    def loss(model, x):
        return jnp.sum(model(x, x, x) ** 2)

    grads = pergrad.per_example_grads(loss, strategy=strategy)(model, xs)
    assert grads.dropout.p is None  # a constant, as filter_grad has it
    assert_trees_close(grads, equinox_filter_grads_loop(loss, model, xs))
    norms = pergrad.norms.per_example_norms_of(loss, model, xs)
    assert jnp.allclose(norms, pergrad.norms.per_example_norms(grads), rtol=1e-4)
    clipped = pergrad.dp.clipped_sum_of(loss, model, xs, max_norm=1.0)
    assert_trees_close(clipped.sum, pergrad.dp.clipped_sum(grads, 1.0).sum)


def test_python_floats_outside_equinox_modules_are_still_differentiated():
    """A float in a plain dict is a parameter, as jax.grad treats it (documented)."""
    xs = jax.random.normal(jax.random.PRNGKey(2), (B, D))
    params = {"w": jnp.ones(D), "scale": 2.0}

    def loss(params, x):
        return params["scale"] * jnp.sum(jnp.tanh(params["w"] * x))

    grads = pergrad.per_example_grads(loss)(params, xs)
    assert grads["scale"].shape == (B,)
    assert_trees_close(grads["scale"], jnp.sum(jnp.tanh(xs), axis=1))
