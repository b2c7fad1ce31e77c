"""DP-SGD on JAX transformers as users write them (issue 19): flax linen, flax NNX and equinox
language models (token embedding tied to the output layer where the library offers it,
multi-head self-attention, layer norm, MLP), one private step through ``private_grad_of`` and an
optax optimizer under ``jax.jit``.

The reference is independent of pergrad: ``jax.vmap(jax.grad(loss))`` over the batch, each
example's gradient clipped by hand with numpy's norm, averaged. At zero noise the private
gradient must equal it; the strategy must be the ghost one (no per-example gradient of the
embedding table or the attention projections formed).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX transformers need jax")
optax = pytest.importorskip("optax", reason="the private step feeds an optax optimizer")
import jax.numpy as jnp  # noqa: E402

import pergrad  # noqa: E402
from pergrad._src.api.reductions import choose_strategy  # noqa: E402

VOCAB, WIDTH, HEADS, LENGTH, BATCH = 13, 16, 2, 6, 5
# The models are tiny, so XLA's compile time is what these tests wait for: the private step and
# the reference are compiled at the backend's lowest optimisation level (half the time; the
# result changes only by rounding), as in tests/test_layouts_jax.py.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tokens(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (BATCH, LENGTH)), jnp.int32)


def next_token_loss(logits, ids):
    """The mean next-token cross-entropy of one sequence."""
    logp = jax.nn.log_softmax(logits[:-1])
    return -jnp.mean(jnp.take_along_axis(logp, ids[1:, None], axis=1))


def reference_private_grad(loss, params, ids):
    """Clip each example's gradient (from jax.vmap(jax.grad)) to the median of their norms
    (about half the examples clipped), average. Returns the mean and that bound."""
    # One program, where op by op every primitive would compile on its own.
    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)), compiler_options=FAST_COMPILE)
    grads = grads(params, ids)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    flat = np.concatenate([np.asarray(g, np.float64).reshape(BATCH, -1) for g in leaves], 1)
    norms = np.linalg.norm(flat, axis=1)
    max_norm = float(np.median(norms))
    factors = np.minimum(1.0, max_norm / norms)
    means = [np.tensordot(factors, np.asarray(g, np.float64), axes=1) / BATCH for g in leaves]
    return jax.tree_util.tree_unflatten(treedef, means), max_norm


def check_private_step(loss, params, ids, expect_in_layers):
    choice = choose_strategy(loss, params, ids)
    assert choice.strategy == "ghost", choice
    for fragment, kind in expect_in_layers.items():
        found = [name for name in choice.layers if fragment in name]
        assert found, f"no ghost layer named like {fragment!r} in {sorted(choice.layers)}"
        assert all(choice.layers[name] == kind for name in found), choice.layers
    want, max_norm = reference_private_grad(loss, params, ids)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def step(params, opt_state, ids, key):
        grad, stats = pergrad.dp.private_grad_of(
            loss,
            params,
            ids,
            max_norm=max_norm,
            noise_multiplier=0.0,
            rng=key,
            expected_batch_size=BATCH,
            strategy="ghost",
        )
        updates, opt_state = tx.update(grad, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grad, stats

    tx = optax.sgd(1.0)
    new_params, _, grad, stats = step(params, tx.init(params), ids, jax.random.key(0))
    # Relative to the largest entry of each leaf, or of the whole gradient for leaves whose
    # exact gradient is zero (an attention key bias: softmax ignores a shift of every score).
    overall = max(float(np.abs(e).max()) for e in jax.tree_util.tree_leaves(want))
    for got, expected in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(want)):
        atol = 2e-5 * float(np.abs(expected).max()) + 1e-6 * overall
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=0, atol=atol)
    assert 0 < float(stats.clip_fraction) < 1
    moved = jax.tree_util.tree_map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params, new_params
    )
    assert all(m > 0 for m in jax.tree_util.tree_leaves(moved))  # every parameter trained


def test_flax_linen_transformer_with_tied_embedding():
    nn = pytest.importorskip("flax.linen", reason="a flax linen transformer")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            causal = nn.make_causal_mask(jnp.ones(h.shape[0]))[0]
            h = h + nn.MultiHeadDotProductAttention(HEADS)(nn.LayerNorm()(h), mask=causal)
            return h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(VOCAB, WIDTH)
            h = embed(ids) + self.param("position", nn.initializers.normal(0.1), (LENGTH, WIDTH))
            return embed.attend(nn.LayerNorm()(Block()(h)))

    model = LM()
    init = jax.jit(model.init, compiler_options=FAST_COMPILE)  # one program, not one per op
    params = init(jax.random.key(0), tokens()[0])

    def loss(params, ids):
        return next_token_loss(model.apply(params, ids), ids)

    check_private_step(
        loss,
        params,
        tokens(1),
        {
            "['Embed_0']['embedding']": "tied: embedding + linear",
            "['query']['kernel']": "linear",
            "['out']['kernel']": "linear",
            "['Dense_0']['kernel']": "linear",
        },
    )


def test_flax_nnx_transformer():
    nnx = pytest.importorskip("flax.nnx", reason="a flax NNX transformer")

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
            self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
            self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, ids):
            h = self.embed(ids)
            causal = nnx.make_causal_mask(jnp.ones(ids.shape[0]))[0]
            h = h + self.attention(self.norm(h), mask=causal)
            h = h + self.down(jax.nn.gelu(self.up(h)))
            return self.embed.attend(h)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LM(nnx.Rngs(0))))
    # The weights made by one program, not one per op.
    state = jax.jit(lambda: nnx.split(LM(nnx.Rngs(0)))[1], compiler_options=FAST_COMPILE)()

    def loss(state, ids):
        return next_token_loss(nnx.merge(graphdef, state)(ids), ids)

    check_private_step(
        loss,
        state,
        tokens(2),
        {"embedding": "tied: embedding + linear", "query": "linear", "up": "linear"},
    )


@pytest.mark.slow(
    reason="about 7 s on 2 cores; equinox models stay in the default run through "
    "test_jax_models_in_the_wild.py, and flax transformers through this module's other tests"
)
def test_equinox_transformer():
    eqx = pytest.importorskip("equinox", reason="an equinox transformer")

    class LM(eqx.Module):
        embed: eqx.nn.Embedding
        norm: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 5)
            self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
            self.norm = eqx.nn.LayerNorm(WIDTH)
            self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=keys[1])
            self.up = eqx.nn.Linear(WIDTH, 2 * WIDTH, key=keys[2])
            self.down = eqx.nn.Linear(2 * WIDTH, WIDTH, key=keys[3])
            self.head = eqx.nn.Linear(WIDTH, VOCAB, key=keys[4])

        def __call__(self, ids):
            h = jax.vmap(self.embed)(ids)
            x = jax.vmap(self.norm)(h)
            causal = jnp.tril(jnp.ones((ids.shape[0], ids.shape[0]), bool))
            h = h + self.attention(x, x, x, mask=causal)
            h = h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))
            return jax.vmap(self.head)(h)

    model = eqx.filter_jit(LM, compiler_options=FAST_COMPILE)(jax.random.key(0))  # one program
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, ids):
        return next_token_loss(eqx.combine(params, static)(ids), ids)

    check_private_step(
        loss,
        params,
        tokens(3),
        {".embed.weight": "embedding", ".query_proj.weight": "linear", ".head.weight": "linear"},
    )
