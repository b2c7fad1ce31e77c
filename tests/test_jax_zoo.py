"""A zoo of JAX models checked against a loop of ``jax.grad``, one example at a time.

Every expected value comes from plain JAX written here or in ``_reference.py`` (``jax.grad``
per example, or a hand-written ``jax.vmap(jax.grad(...))``), never from pergrad itself. Models
are tiny and batches small: compile time dominates on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX zoo needs jax installed")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import pergrad  # noqa: E402
from _reference import jax_loop_grads  # noqa: E402

# Small programs of many shapes, op by op: compiled without XLA's backend optimisations.
pytestmark = pytest.mark.usefixtures("fast_xla_compile")

RTOL, ATOL = 1e-4, 1e-5
B = 3  # batch size of the zoo


# --------------------------------------------------------------------------------------------
# helpers


def assert_trees_close(actual: Any, expected: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same tree structure, and every leaf close (shape included)."""
    a_leaves, a_def = jax.tree_util.tree_flatten(actual)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    assert a_def == e_def, f"tree structures differ:\n{a_def}\n{e_def}"
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def loop_losses(loss: Callable[..., Any], params: Any, *batched: Any) -> Any:
    """``(B,)`` losses, one example at a time."""
    n = jax.tree_util.tree_leaves(batched)[0].shape[0]
    return jnp.stack(
        [loss(params, *jax.tree_util.tree_map(lambda b, i=i: b[i], batched)) for i in range(n)]
    )


def loop_values_and_grads(loss: Callable[..., Any], params: Any, *batched: Any) -> tuple:
    """``(losses (B,), grads)`` by a jitted ``jax.value_and_grad`` one example at a time.

    The same loop as ``_reference.jax_loop_grads``, returning the losses from the same compile.
    """
    n = jax.tree_util.tree_leaves(batched)[0].shape[0]
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    outs = [
        value_and_grad(params, *jax.tree_util.tree_map(lambda b, i=i: b[i], batched))
        for i in range(n)
    ]
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outs)


def normal(
    rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.5, loc: float = 0.0
) -> Any:
    """A float32 JAX array drawn with numpy (no eager JAX op to compile per shape)."""
    return jnp.asarray((loc + scale * rng.standard_normal(shape)).astype(np.float32))


def positive(rng: np.random.Generator, shape: tuple[int, ...]) -> Any:
    return jnp.asarray((0.5 + np.abs(rng.standard_normal(shape))).astype(np.float32))


def keys(seed: int, n: int) -> list[np.random.Generator]:
    return [np.random.default_rng([seed, i]) for i in range(n)]


def mse_loss(forward: Callable[[Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    """The loss of one example: mean squared error of ``forward(params, x)`` against ``y``."""

    def loss(params: Any, x: Any, y: Any) -> Any:
        return jnp.mean((forward(params, x) - y) ** 2)

    return loss


def targets_for(forward: Callable[[Any, Any], Any], params: Any, xs: Any, seed: int) -> Any:
    """Random targets shaped like ``forward``'s output for one example, batched."""
    one = jax.tree_util.tree_map(lambda b: b[0], xs)
    out = jax.eval_shape(forward, params, one)
    return normal(np.random.default_rng(seed), (xs.shape[0], *out.shape), 1.0)


# --------------------------------------------------------------------------------------------
# 1. a layer zoo on jax.lax / jax.nn, params as nested dicts


def _layer_norm(x: Any, gamma: Any, beta: Any, axes: Any, eps: float = 1e-5) -> Any:
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.var(x, axis=axes, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * gamma + beta


def dense_case() -> tuple:
    k = keys(1, 4)
    params = {
        "hidden": {"w": normal(k[0], (4, 5)), "b": normal(k[1], (5,))},
        "out": {"w": normal(k[2], (5, 2)), "b": jnp.asarray(np.zeros(2, np.float32))},
        "scale": 0.7,  # a Python float parameter
    }

    def forward(p, x):
        h = jax.nn.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"])
        return p["scale"] * (h @ p["out"]["w"] + p["out"]["b"])

    return forward, params, normal(k[3], (B, 4), 1.0)


def conv1d_case() -> tuple:
    k = keys(2, 3)
    params = {"w": normal(k[0], (3, 2, 4)), "b": normal(k[1], (4,))}

    def forward(p, x):  # x (L, C)
        y = lax.conv_general_dilated(
            x[None], p["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )[0]
        return jax.nn.relu(y + p["b"]).mean(axis=0)

    return forward, params, normal(k[2], (B, 7, 2), 1.0)


def conv2d_case() -> tuple:
    """Stride, explicit asymmetric padding, groups and kernel dilation together."""
    k = keys(3, 3)
    groups, c_in, c_out = 2, 4, 4
    params = {"w": normal(k[0], (3, 2, c_in // groups, c_out)), "b": normal(k[1], (c_out,))}

    def forward(p, x):  # x (H, W, C)
        y = lax.conv_general_dilated(
            x[None],
            p["w"],
            window_strides=(2, 1),
            padding=((1, 0), (2, 1)),
            rhs_dilation=(2, 1),
            feature_group_count=groups,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )[0]
        return jnp.tanh(y + p["b"])

    return forward, params, normal(k[2], (B, 7, 5, c_in), 1.0)


def conv3d_case() -> tuple:
    k = keys(4, 3)
    params = {"w": normal(k[0], (2, 2, 2, 2, 3)), "b": normal(k[1], (3,))}

    def forward(p, x):  # x (D, H, W, C)
        y = lax.conv_general_dilated(
            x[None], p["w"], (1, 1, 1), "VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
        )[0]
        return jnp.tanh(y + p["b"]).sum(axis=(0, 1, 2))

    return forward, params, normal(k[2], (B, 3, 3, 3, 2), 1.0)


def conv_transpose_case() -> tuple:
    k = keys(5, 3)
    params = {"w": normal(k[0], (3, 3, 2, 3)), "b": normal(k[1], (3,))}

    def forward(p, x):  # x (H, W, C) -> (2H, 2W, 3)
        y = lax.conv_transpose(
            x[None], p["w"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )[0]
        return jnp.tanh(y + p["b"])

    return forward, params, normal(k[2], (B, 3, 3, 2), 1.0)


def embedding_case() -> tuple:
    """Integer token inputs: batched data, never differentiated."""
    k = keys(6, 4)
    vocab, dim = 7, 4
    params = {
        "embed": normal(k[0], (vocab, dim)),
        "head": {"w": normal(k[1], (dim, 2)), "b": normal(k[2], (2,))},
    }

    def forward(p, tokens):  # tokens (T,) int32
        e = jnp.take(p["embed"], tokens, axis=0)
        return jnp.tanh(e).mean(axis=0) @ p["head"]["w"] + p["head"]["b"]

    tokens = jnp.asarray(k[3].integers(0, vocab, (B, 5)), dtype=jnp.int32)
    return forward, params, tokens


def layer_norm_case() -> tuple:
    k = keys(7, 4)
    params = {
        "gamma": normal(k[0], (6,), loc=1.0),
        "beta": normal(k[1], (6,)),
        "w": normal(k[2], (6, 2)),
    }

    def forward(p, x):  # x (T, 6): normalise each token over the features
        return _layer_norm(x, p["gamma"], p["beta"], axes=-1) @ p["w"]

    return forward, params, normal(k[3], (B, 3, 6), 1.0)


def group_norm_case() -> tuple:
    k = keys(8, 3)
    groups, c = 2, 4
    params = {"gamma": normal(k[0], (c,), loc=1.0), "beta": normal(k[1], (c,))}

    def forward(p, x):  # x (H, W, C): statistics over (H, W, C // groups) per group
        h, w, _ = x.shape
        xg = x.reshape(h, w, groups, c // groups)
        mean = xg.mean(axis=(0, 1, 3), keepdims=True)
        var = xg.var(axis=(0, 1, 3), keepdims=True)
        xn = ((xg - mean) / jnp.sqrt(var + 1e-5)).reshape(h, w, c)
        return jnp.tanh(xn * p["gamma"] + p["beta"])

    return forward, params, normal(k[2], (B, 3, 3, c), 1.0)


def instance_norm_case() -> tuple:
    k = keys(9, 3)
    c = 3
    params = {"gamma": normal(k[0], (c,), loc=1.0), "beta": normal(k[1], (c,))}

    def forward(p, x):  # x (H, W, C): statistics over (H, W) per channel
        return jnp.tanh(_layer_norm(x, p["gamma"], p["beta"], axes=(0, 1)))

    return forward, params, normal(k[2], (B, 4, 3, c), 1.0)


def rnn_case() -> tuple:
    k = keys(10, 5)
    d_in, d_h = 3, 4
    params = {
        "wx": normal(k[0], (d_in, d_h)),
        "wh": normal(k[1], (d_h, d_h)),
        "b": normal(k[2], (d_h,)),
        "out": normal(k[3], (d_h, 2)),
    }

    def forward(p, xs):  # xs (T, d_in)
        def step(h, x):
            h = jnp.tanh(x @ p["wx"] + h @ p["wh"] + p["b"])
            return h, h

        h_last, hs = lax.scan(step, jnp.zeros(d_h), xs)
        return h_last @ p["out"] + 0.1 * hs.mean()

    return forward, params, normal(k[4], (B, 4, d_in), 1.0)


def _attention_params(key: np.random.Generator, dim: int, heads: int, head_dim: int) -> dict:
    k = [key] * 4
    return {
        "q": normal(k[0], (dim, heads, head_dim)),
        "k": normal(k[1], (dim, heads, head_dim)),
        "v": normal(k[2], (dim, heads, head_dim)),
        "o": normal(k[3], (heads, head_dim, dim)),
    }


def _self_attention(p: dict, x: Any, causal: bool = False) -> Any:
    """x (T, D) -> (T, D); heads from the shapes of the projections."""
    q = jnp.einsum("td,dhk->htk", x, p["q"])
    k = jnp.einsum("td,dhk->htk", x, p["k"])
    v = jnp.einsum("td,dhk->htk", x, p["v"])
    logits = jnp.einsum("hqk,hsk->hqs", q, k) / jnp.sqrt(q.shape[-1])
    if causal:
        t = x.shape[0]
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    attn = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("hqs,hsk,hkd->qd", attn, v, p["o"])


def attention_1head_case() -> tuple:
    k = keys(11, 2)
    params = _attention_params(k[0], dim=4, heads=1, head_dim=4)
    return (lambda p, x: _self_attention(p, x)), params, normal(k[1], (B, 3, 4), 1.0)


def attention_multihead_case() -> tuple:
    k = keys(12, 2)
    params = _attention_params(k[0], dim=4, heads=2, head_dim=2)
    return (
        (lambda p, x: _self_attention(p, x, causal=True)),
        params,
        normal(k[1], (B, 3, 4), 1.0),
    )


def transformer_block_case() -> tuple:
    k = keys(13, 6)
    dim, hidden = 4, 8
    params = {
        "attn": _attention_params(k[0], dim=dim, heads=2, head_dim=2),
        "ln1": {
            "gamma": normal(k[1], (dim,), loc=1.0),
            "beta": jnp.asarray(np.zeros(dim, np.float32)),
        },
        "ln2": {"gamma": jnp.asarray(np.ones(dim, np.float32)), "beta": normal(k[2], (dim,))},
        "mlp": {
            "w1": normal(k[3], (dim, hidden)),
            "b1": jnp.asarray(np.zeros(hidden, np.float32)),
            "w2": normal(k[4], (hidden, dim)),
            "b2": jnp.asarray(np.zeros(dim, np.float32)),
        },
    }

    def forward(p, x):  # pre-norm encoder block, x (T, D)
        h = _layer_norm(x, p["ln1"]["gamma"], p["ln1"]["beta"], axes=-1)
        x = x + _self_attention(p["attn"], h)
        h = _layer_norm(x, p["ln2"]["gamma"], p["ln2"]["beta"], axes=-1)
        m = p["mlp"]
        return x + jax.nn.gelu(h @ m["w1"] + m["b1"]) @ m["w2"] + m["b2"]

    return forward, params, normal(k[5], (B, 3, dim), 1.0)


ZOO = {
    "dense": dense_case,
    "conv1d": conv1d_case,
    "conv2d_stride_pad_groups_dilation": conv2d_case,
    "conv3d": conv3d_case,
    "conv_transpose": conv_transpose_case,
    "embedding_int_tokens": embedding_case,
    "layer_norm": layer_norm_case,
    "group_norm": group_norm_case,
    "instance_norm": instance_norm_case,
    "rnn_scan": rnn_case,
    "attention_1head": attention_1head_case,
    "attention_multihead": attention_multihead_case,
    "transformer_block": transformer_block_case,
}


# Eager vmap dispatches op by op (slow on CPU), so the zoo runs pergrad under jax.jit, except
# "dense", whose Python-float parameter only stays a Python float outside jit.
EAGER = {"dense"}


@pytest.mark.parametrize("name", list(ZOO))
def test_layer_zoo_matches_loop(name):
    forward, params, xs = ZOO[name]()
    ys = targets_for(forward, params, xs, seed=100)
    loss = mse_loss(forward)
    f = pergrad.value_and_per_example_grads(loss)
    losses, grads = (f if name in EAGER else jax.jit(f))(params, xs, ys)
    expected_losses, expected = loop_values_and_grads(loss, params, xs, ys)
    assert_trees_close(grads, expected)
    np.testing.assert_allclose(losses, expected_losses, rtol=RTOL, atol=ATOL)
    # Guard the case itself: the examples' gradients differ, so mixing them up would show.
    flat = np.concatenate([np.reshape(g, (B, -1)) for g in jax.tree_util.tree_leaves(expected)], 1)
    assert np.abs(flat[0] - flat[1]).max() > 1e-4


def test_batch_norm_eval_shares_state_with_counter():
    """The tutorial form ``loss(params, state, x, y)``, batch size == number of channels."""
    c = 4
    k = keys(14, 6)
    params = {
        "gamma": normal(k[0], (c,), loc=1.0),
        "beta": normal(k[1], (c,)),
        "w": normal(k[2], (c,)),
    }
    state = {
        "mean": normal(k[3], (c,), 1.0),
        "var": positive(k[4], (c,)),
        "num_batches_tracked": jnp.array(7, dtype=jnp.int32),
    }
    xs = normal(k[5], (c, c), 1.0)  # B == C: only the 0-d counter tells state apart
    ys = jnp.linspace(-1.0, 1.0, c)

    def loss(params, state, x, y):
        xn = (x - state["mean"]) / jnp.sqrt(state["var"] + 1e-5)
        out = jnp.tanh(xn * params["gamma"] + params["beta"]) @ params["w"]
        return (out - y) ** 2 * (1.0 + 0.0 * state["num_batches_tracked"])

    grads = pergrad.per_example_grads(loss)(params, state, xs, ys)
    expected = jax_loop_grads(lambda p, x, y: loss(p, state, x, y), params, xs, ys)
    assert_trees_close(grads, expected)


# --------------------------------------------------------------------------------------------
# 2. flax (linen, nnx) and equinox


def test_flax_linen_dense_conv_layernorm():
    pytest.importorskip("flax", reason="flax models need flax installed")
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(3, (3, 3))(x)
            x = nn.LayerNorm()(x)
            x = jnp.tanh(x).reshape((x.shape[0], -1))
            return nn.Dense(2)(x)

    model = Net()
    k = keys(20, 3)
    xs = normal(k[0], (B, 4, 4, 2), 1.0)
    ys = normal(k[1], (B, 2), 1.0)
    params = model.init(jax.random.key(20), xs[:1])["params"]

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x[None])[0] - y) ** 2)

    # Under jit: flax's Python-heavy apply is slow to dispatch op by op.
    grads = jax.jit(pergrad.per_example_grads(loss))(params, xs, ys)
    assert_trees_close(grads, jax_loop_grads(loss, params, xs, ys))


@pytest.mark.parametrize("batch", [4, 3], ids=["auto_B_ne_C", "explicit_B_eq_C"])
def test_flax_linen_batchnorm_running_stats_as_argument(batch):
    pytest.importorskip("flax", reason="flax models need flax installed")
    import flax.linen as nn

    features = 3

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(features)(x)
            x = nn.BatchNorm(use_running_average=True)(x)
            return nn.Dense(1)(jnp.tanh(x))[..., 0]

    model = Net()
    k = keys(21, 5)
    xs = normal(k[0], (batch, 2), 1.0)
    ys = normal(k[1], (batch,), 1.0)
    variables = model.init(jax.random.key(21), xs[:1])
    params = variables["params"]
    # Non-trivial running statistics, so batching them by mistake would change the result.
    batch_stats = {
        "BatchNorm_0": {
            "mean": normal(k[3], (features,), 1.0),
            "var": positive(k[4], (features,)),
        }
    }

    def loss(p, batch_stats, x, y):
        out = model.apply({"params": p, "batch_stats": batch_stats}, x[None])[0]
        return (out - y) ** 2

    # With B == C the running stats look like data: auto refuses to guess (axes.py rule 6).
    if batch == features:
        with pytest.raises(ValueError, match=r"argument 1 \('batch_stats'\).*1-D of length 3"):
            pergrad.per_example_grads(loss)(params, batch_stats, xs, ys)
    in_axes = "auto" if batch != features else (None, None, 0, 0)
    grads = pergrad.per_example_grads(loss, in_axes=in_axes)(params, batch_stats, xs, ys)
    expected = jax_loop_grads(lambda p, x, y: loss(p, batch_stats, x, y), params, xs, ys)
    assert_trees_close(grads, expected)


def test_flax_nnx_split_state():
    pytest.importorskip("flax", reason="flax models need flax installed")
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin1 = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.LayerNorm(4, rngs=rngs)
            self.lin2 = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.lin2(jnp.tanh(self.norm(self.lin1(x))))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))
    k = keys(22, 2)
    xs = normal(k[0], (B, 3), 1.0)
    ys = normal(k[1], (B, 2), 1.0)

    def loss(state, x, y):
        return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

    grads = pergrad.per_example_grads(loss)(state, xs, ys)
    assert_trees_close(grads, jax_loop_grads(loss, state, xs, ys))


def test_equinox_mlp_as_differentiated_argument():
    eqx = pytest.importorskip("equinox", reason="equinox models need equinox installed")
    k = keys(23, 3)
    mlp = eqx.nn.MLP(
        3, 2, width_size=4, depth=2, activation=jax.nn.softplus, key=jax.random.key(23)
    )
    xs = normal(k[1], (B, 3), 1.0)
    ys = normal(k[2], (B, 2), 1.0)

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    grads = pergrad.per_example_grads(loss)(mlp, xs, ys)

    arrays, static = eqx.partition(mlp, eqx.is_array)
    expected = jax_loop_grads(lambda p, x, y: loss(eqx.combine(p, static), x, y), arrays, xs, ys)
    # The activation functions ride along as constants and come back as None.
    assert grads.activation is None and grads.final_activation is None
    assert_trees_close(eqx.filter(grads, eqx.is_array), expected)


# --------------------------------------------------------------------------------------------
# 3. composition with jax transforms


def _mlp_problem(batch: int = 4, seed: int = 30) -> tuple:
    k = keys(seed, 4)
    params = {"w1": normal(k[0], (3, 4)), "b1": normal(k[1], (4,)), "w2": normal(k[2], (4,))}
    xs = normal(k[3], (batch, 3), 1.0)
    ys = jnp.sin(jnp.arange(batch, dtype=jnp.float32))
    return params, xs, ys


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"] - y) ** 2


def mlp_loss_aux(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return (pred - y) ** 2, {"pred": pred, "err": pred - y}


def test_jit_of_per_example_grads_matches_unjitted_and_loop():
    params, xs, ys = _mlp_problem()
    f = pergrad.per_example_grads(mlp_loss)
    jitted = jax.jit(f)(params, xs, ys)
    expected = jax_loop_grads(mlp_loss, params, xs, ys)
    assert_trees_close(jitted, expected)
    assert_trees_close(jitted, f(params, xs, ys))


def test_jit_of_value_and_per_example_grads():
    params, xs, ys = _mlp_problem()
    losses, grads = jax.jit(pergrad.value_and_per_example_grads(mlp_loss))(params, xs, ys)
    np.testing.assert_allclose(losses, loop_losses(mlp_loss, params, xs, ys), rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, jax_loop_grads(mlp_loss, params, xs, ys))


def _sum_sq_norms(grads: Any) -> Any:
    return sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_grad_through_per_example_grads(chunk_size):
    """Second order: d/dparams of the sum of squared per-example gradient norms."""
    params, xs, ys = _mlp_problem()

    def via_pergrad(p):
        return _sum_sq_norms(pergrad.per_example_grads(mlp_loss, chunk_size=chunk_size)(p, xs, ys))

    def by_hand(p):
        return _sum_sq_norms(jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0))(p, xs, ys))

    np.testing.assert_allclose(via_pergrad(params), by_hand(params), rtol=RTOL, atol=ATOL)
    assert_trees_close(jax.grad(via_pergrad)(params), jax.grad(by_hand)(params))


def test_pergrad_inside_vmap_over_parameter_sets():
    n_sets = 2
    params, xs, ys = _mlp_problem()
    stacked = jax.tree_util.tree_map(
        lambda p: jnp.stack([p * (1.0 + 0.5 * i) for i in range(n_sets)]), params
    )
    out = jax.vmap(lambda p: pergrad.per_example_grads(mlp_loss)(p, xs, ys))(stacked)
    per_set = [
        jax_loop_grads(mlp_loss, jax.tree_util.tree_map(lambda s, i=i: s[i], stacked), xs, ys)
        for i in range(n_sets)
    ]
    expected = jax.tree_util.tree_map(lambda *g: jnp.stack(g), *per_set)
    assert_trees_close(out, expected)


# --------------------------------------------------------------------------------------------
# 4. chunk_size


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_chunk_size_with_remainder_matches_unchunked(jit):
    params, xs, ys = _mlp_problem(batch=10)
    chunked = pergrad.per_example_grads(mlp_loss, chunk_size=3)
    if jit:
        chunked = jax.jit(chunked)
    got = chunked(params, xs, ys)
    assert_trees_close(got, jax_loop_grads(mlp_loss, params, xs, ys))
    assert_trees_close(got, pergrad.per_example_grads(mlp_loss)(params, xs, ys))


def test_chunk_size_with_aux():
    params, xs, ys = _mlp_problem(batch=10)
    (losses, aux), grads = pergrad.value_and_per_example_grads(
        mlp_loss_aux, has_aux=True, chunk_size=3
    )(params, xs, ys)
    assert_trees_close(grads, jax_loop_grads(lambda *a: mlp_loss_aux(*a)[0], params, xs, ys))
    pred = jnp.tanh(xs @ params["w1"] + params["b1"]) @ params["w2"]  # by hand, batched
    assert_trees_close(aux, {"pred": pred, "err": pred - ys})
    np.testing.assert_allclose(losses, (pred - ys) ** 2, rtol=RTOL, atol=ATOL)
    grads_only, aux_only = pergrad.per_example_grads(mlp_loss_aux, has_aux=True, chunk_size=3)(
        params, xs, ys
    )
    assert_trees_close(grads_only, grads)
    assert_trees_close(aux_only, aux)


# --------------------------------------------------------------------------------------------
# 5. seed tutorials


def test_tutorial_linear_regression_mean_equals_batch_grad():
    d, batch = 5, 32
    k = keys(40, 3)
    w = normal(k[0], (d,))
    xs = normal(k[1], (batch, d), 1.0)
    ys = normal(k[2], (batch,), 1.0)

    def loss(w, x, y):
        return (x @ w - y) ** 2

    grads = pergrad.per_example_grads(loss)(w, xs, ys)
    assert grads.shape == (batch, d)
    batch_grad = jax.grad(lambda w: jnp.mean((xs @ w - ys) ** 2))(w)
    np.testing.assert_allclose(grads.mean(axis=0), batch_grad, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grads, jax_loop_grads(loss, w, xs, ys), rtol=RTOL, atol=ATOL)


def test_tutorial_sum_of_per_example_grads_is_grad_of_sum():
    def f(w, x):
        return (w * x) ** 2

    w = jnp.array(1.0)
    xs = jnp.array([1.0, 2.0])
    grads = pergrad.per_example_grads(f)(w, xs)
    by_hand = jax.vmap(jax.grad(f), in_axes=(None, 0))(w, xs)  # 2 w x**2 = [2, 8]
    np.testing.assert_allclose(grads, by_hand, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grads, 2 * w * xs**2, rtol=RTOL, atol=ATOL)
    grad_of_sum = jax.grad(lambda w: jax.vmap(f, in_axes=(None, 0))(w, xs).sum())(w)  # 10
    np.testing.assert_allclose(grads.sum(), grad_of_sum, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------
# 6. randomness: per-example keys as a batched argument


def dropout_loss(params, key, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    h = jnp.where(keep, h / 0.5, 0.0)
    return (h @ params["w2"] - y) ** 2


@pytest.mark.parametrize("key_kind", ["legacy_uint32", "typed"])
def test_dropout_with_batched_keys(key_kind):
    params, xs, ys = _mlp_problem(batch=6)
    root = jax.random.PRNGKey(5) if key_kind == "legacy_uint32" else jax.random.key(5)
    ks = jax.random.split(root, xs.shape[0])
    if key_kind == "legacy_uint32":
        assert ks.shape == (6, 2) and ks.dtype == jnp.uint32
    else:
        assert ks.shape == (6,) and jnp.issubdtype(ks.dtype, jax.dtypes.prng_key)

    grads = pergrad.per_example_grads(dropout_loss)(params, ks, xs, ys)
    expected = jax_loop_grads(dropout_loss, params, ks, xs, ys)
    assert_trees_close(grads, expected)
    # The masks really differ between examples (otherwise the keys were shared).
    shared_keys = jnp.stack([ks[0]] * xs.shape[0])
    same_key = jax_loop_grads(dropout_loss, params, shared_keys, xs, ys)
    assert not np.allclose(np.asarray(expected["w1"]), np.asarray(same_key["w1"]))


# --------------------------------------------------------------------------------------------
# 7. explicit in_axes on a non-zero axis


def test_explicit_in_axes_nonzero_axis():
    params, xs, ys = _mlp_problem(batch=5)
    xs_t = xs.T  # (D, B): the batch on axis 1
    on_axis_1 = pergrad.per_example_grads(mlp_loss, in_axes=(None, 1, 0))(params, xs_t, ys)
    on_axis_0 = pergrad.per_example_grads(mlp_loss, in_axes=(None, 0, 0))(params, xs, ys)
    assert_trees_close(on_axis_1, on_axis_0)
    assert_trees_close(on_axis_1, jax_loop_grads(mlp_loss, params, xs, ys))


# --------------------------------------------------------------------------------------------
# 8. an empty batch


@pytest.mark.parametrize("mode", ["eager", "jit", "chunked"])
def test_empty_batch_returns_empty_arrays(mode):
    params, _, _ = _mlp_problem()
    xs = jnp.zeros((0, 3))
    ys = jnp.zeros((0,))
    f = pergrad.value_and_per_example_grads(mlp_loss, chunk_size=3 if mode == "chunked" else None)
    losses, grads = (jax.jit(f) if mode == "jit" else f)(params, xs, ys)
    expected = jax.tree_util.tree_map(lambda p: np.zeros((0, *p.shape), p.dtype), params)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(expected)
    for g, e in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected)):
        assert g.shape == e.shape and g.dtype == e.dtype
    assert losses.shape == (0,)


def test_empty_batch_with_aux_and_keys():
    params, _, _ = _mlp_problem()
    ks = jax.random.split(jax.random.key(0), 2)[:0]

    def loss(params, key, x, y):
        return dropout_loss(params, key, x, y), {"x": x}

    grads, aux = pergrad.per_example_grads(loss, has_aux=True)(
        params, ks, jnp.zeros((0, 3)), jnp.zeros((0,))
    )
    for g, p in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(params)):
        assert g.shape == (0, *p.shape)
    assert aux["x"].shape == (0, 3)
