"""The JAX ghost strategy (``pergrad._src.strategies.ghost_jax``): norms and clipped sums from each
contraction's input and output cotangent, without per-example weight gradients.

Every result is checked against the materialised reference,
``pergrad.norms.per_example_norms(pergrad.per_example_grads(fn)(*args))`` and
``pergrad.dp.clipped_sum(...)`` of the same per-example gradients, which ``tests/test_jax_zoo.py``
checks against a loop of ``jax.grad``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax", reason="the JAX ghost strategy needs jax installed")
import jax.numpy as jnp  # noqa: E402

import pergrad  # noqa: E402
from pergrad._src.api.reductions import choose_strategy, per_example_norms_of  # noqa: E402
from pergrad._src.capture import cost, jax_contractions  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_of  # noqa: E402
from test_jax_zoo import ZOO, keys, mse_loss, normal, targets_for  # noqa: E402

# Small programs of many shapes, op by op: compiled without XLA's backend optimisations.
pytestmark = pytest.mark.usefixtures("fast_xla_compile")

RTOL = 1e-5  # relative to the largest entry of the reference, float32


def assert_close(actual: Any, expected: Any, rtol: float = RTOL) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def assert_trees_close(actual: Any, expected: Any, rtol: float = RTOL) -> None:
    a_leaves, a_def = jax.tree_util.tree_flatten(actual)
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    assert a_def == e_def
    for a, e in zip(a_leaves, e_leaves):
        assert_close(a, e, rtol)


def bound_between_norms(norms: np.ndarray) -> float:
    """A clipping bound near the median norm but not within rounding of any norm (examples with
    equal norms, as repeated ids give, would otherwise sit on the bound, where two correct
    computations may round to different sides of it)."""
    ordered = np.sort(norms)
    gaps = [
        (ordered[i] + ordered[i + 1]) / 2
        for i in range(len(ordered) - 1)
        if ordered[i + 1] > ordered[i] * (1 + 1e-4) + 1e-12
    ]
    if not gaps:  # all norms equal: clip every example, unless they are all zero
        return float(ordered[0]) / 2 or 1.0
    median = float(np.median(ordered))
    return float(min(gaps, key=lambda bound: abs(bound - median)))


def check_against_materialized(loss: Any, args: tuple, strategy: str = "ghost", **kw: Any):
    """Norms (global and per leaf) and a clipped sum that clips about half the examples."""
    grads = pergrad.per_example_grads(loss, **kw)(*args)
    norms = per_example_norms_of(loss, *args, strategy=strategy, **kw)
    assert_close(norms, pergrad.norms.per_example_norms(grads))
    per_leaf = per_example_norms_of(loss, *args, per_layer=True, strategy=strategy, **kw)
    assert_trees_close(per_leaf, pergrad.norms.per_example_norms(grads, per_layer=True))
    bound = bound_between_norms(np.asarray(norms))
    clipped = clipped_sum_of(loss, *args, max_norm=bound, strategy=strategy, **kw)
    expected = pergrad.dp.clipped_sum(grads, bound)
    assert_trees_close(clipped.sum, expected.sum)
    assert_close(clipped.norms, expected.norms)
    assert float(clipped.clip_fraction) == pytest.approx(float(expected.clip_fraction))
    return norms


# Zoo cases with no parameter inside a contraction: the ghost strategy has nothing to do there.
NO_CONTRACTION = {"group_norm", "instance_norm"}
GHOST_ZOO = [name for name in ZOO if name not in NO_CONTRACTION]


@pytest.mark.parametrize("name", GHOST_ZOO)
def test_zoo_matches_materialized(name):
    forward, params, xs = ZOO[name]()
    if name == "dense":  # its Python-float parameter: the core gives it a float32 gradient too
        params = {**params, "scale": jnp.float32(params["scale"])}
    ys = targets_for(forward, params, xs, seed=100)
    loss = mse_loss(forward)
    choice = choose_strategy(loss, params, xs, ys)
    assert choice.strategy == "ghost", choice
    assert choice.layers  # at least one contraction found
    check_against_materialized(loss, (params, xs, ys))


@pytest.mark.parametrize("strategy", ["ghost", "chunked", "materialize"])
@pytest.mark.parametrize(
    "name", ["conv2d_stride_pad_groups_dilation", "embedding_int_tokens", "transformer_block"]
)
def test_every_forced_strategy_takes_an_empty_batch(name, strategy):
    """An empty Poisson batch under jit: (0,) norms and zero sums shaped like the parameters."""
    forward, params, xs = ZOO[name]()
    ys = targets_for(forward, params, xs, seed=100)
    loss = mse_loss(forward)
    empty = jax.tree_util.tree_map(lambda v: v[:0], (xs, ys))

    @jax.jit
    def run(params, xs, ys):
        norms = per_example_norms_of(loss, params, xs, ys, strategy=strategy)
        return norms, clipped_sum_of(loss, params, xs, ys, max_norm=1.0, strategy=strategy)

    norms, clipped = run(params, *empty)
    assert norms.shape == (0,) and int(clipped.count) == 0
    for got, leaf in zip(jax.tree_util.tree_leaves(clipped.sum), jax.tree_util.tree_leaves(params)):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype
        assert float(jnp.abs(got).sum()) == 0


def test_what_the_plan_finds_in_a_dense_network():
    forward, params, xs = ZOO["transformer_block"]()
    ys = targets_for(forward, params, xs, seed=1)
    choice = choose_strategy(mse_loss(forward), params, xs, ys)
    assert choice.layers == {
        "['attn']['k']": "linear",
        "['attn']['o']": "linear",
        "['attn']['q']": "linear",
        "['attn']['v']": "linear",
        "['mlp']['w1']": "linear",
        "['mlp']['w2']": "linear",
    }
    # layer-norm scales and biases are not inside a contraction: formed per example
    assert len(choice.unsupported) == len(jax.tree_util.tree_leaves(params)) - 6
    assert set(choice.unsupported).isdisjoint(choice.layers)
    assert all("broadcast_in_dim" in why for why in choice.unsupported.values())


@pytest.mark.parametrize("name", sorted(NO_CONTRACTION))
def test_no_contraction_goes_chunked_under_auto_and_ghost_refuses(name):
    forward, params, xs = ZOO[name]()
    ys = targets_for(forward, params, xs, seed=2)
    loss = mse_loss(forward)
    choice = choose_strategy(loss, params, xs, ys)
    assert choice.strategy == "chunked"
    assert "no differentiated parameter enters the loss through a contraction" in choice.reason
    with pytest.raises(ValueError, match=r"strategy='ghost' found no parameter .* \['gamma'\]"):
        per_example_norms_of(loss, params, xs, ys, strategy="ghost")


def test_auto_takes_chunked_when_the_formed_gradients_would_be_large(monkeypatch):
    forward, params, xs = ZOO["layer_norm"]()
    ys = targets_for(forward, params, xs, seed=3)
    loss = mse_loss(forward)
    assert choose_strategy(loss, params, xs, ys).strategy == "ghost"
    monkeypatch.setattr(cost, "MAX_FORMED_NUMBERS", 10)  # B x 12 scale/shift > 10
    choice = choose_strategy(loss, params, xs, ys)
    assert choice.strategy == "chunked"
    assert "['gamma']: used by 'broadcast_in_dim'" in choice.reason
    # an explicit request still runs, with the scale and shift formed per example
    check_against_materialized(loss, (params, xs, ys))


# --- how parameters reach a contraction -------------------------------------------------------


def two_layer_problem(batch: int = 7, seed: int = 4) -> tuple[dict, Any, Any]:
    k = keys(seed, 4)
    params = {"w1": normal(k[0], (5, 6)), "w2": normal(k[1], (6, 3))}
    return params, normal(k[2], (batch, 5), 1.0), normal(k[3], (batch, 3), 1.0)


@jax.jit
def jitted_dense(x, w):  # a jitted function called inside the loss: its body is looked into
    return jnp.tanh(x @ w)


LOSSES = {
    "weight_as_lhs_transposed": lambda p, x, y: jnp.sum(
        (p["w2"].T @ jnp.tanh(p["w1"].T @ x) - y) ** 2
    ),
    "einsum_and_reshape": lambda p, x, y: jnp.sum(
        (jnp.einsum("k,kf->f", jnp.tanh(x @ p["w1"].reshape(5, 6)), p["w2"]) - y) ** 2
    ),
    "inside_a_jitted_function": lambda p, x, y: jnp.sum(
        (jitted_dense(x, p["w1"]) @ p["w2"] - y) ** 2
    ),
    "bfloat16_cast": lambda p, x, y: jnp.sum(
        (jnp.tanh(x @ p["w1"].astype(jnp.bfloat16)).astype(jnp.float32) @ p["w2"] - y) ** 2
    ),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_ways_parameters_reach_a_contraction(name):
    loss = LOSSES[name]
    args = two_layer_problem()
    choice = choose_strategy(loss, *args)
    assert choice.strategy == "ghost"
    assert choice.layers == {"['w1']": "linear", "['w2']": "linear"}
    assert choice.unsupported == {}
    if name == "bfloat16_cast":  # the gradient itself is rounded to bfloat16 on both paths
        grads = pergrad.per_example_grads(loss)(*args)
        norms = per_example_norms_of(loss, *args, strategy="ghost")
        assert_close(norms, pergrad.norms.per_example_norms(grads), rtol=2e-2)
    else:
        check_against_materialized(loss, args)


def test_a_shared_weight_is_formed_per_example():
    def loss(p, x, y):  # w1 used twice: its gradient is the sum of two outer products
        h = jnp.tanh(x @ p["w1"])
        return jnp.sum((jnp.tanh(h @ p["w1"].T) @ p["w1"] @ p["w2"] - y) ** 2)

    args = two_layer_problem()
    choice = choose_strategy(loss, *args)
    assert choice.layers == {"['w2']": "linear"}
    assert "used by 3 contractions" in choice.unsupported["['w1']"]
    check_against_materialized(loss, args)


def test_a_parameter_contracted_with_another_parameter_is_formed_per_example():
    def loss(p, x, y):
        return jnp.sum((x @ (p["w1"] @ p["w2"]) - y) ** 2)

    args = two_layer_problem()
    choice = choose_strategy(loss, *args)
    assert choice.layers == {}
    assert choice.strategy == "chunked"
    check_against_materialized(loss, args, strategy="auto")


def test_jit_mask_and_tuple_argnums():
    params, x, y = two_layer_problem(batch=9)
    mask = np.arange(9) % 3 != 0

    def loss(w1, w2, x, y):
        return jnp.sum((jnp.tanh(x @ w1) @ w2 - y) ** 2)

    @jax.jit
    def step(w1, w2, x, y, mask):
        return clipped_sum_of(loss, w1, w2, x, y, argnums=(0, 1), max_norm=0.5, mask=mask)

    clipped = step(params["w1"], params["w2"], x, y, mask)
    grads = pergrad.per_example_grads(loss, argnums=(0, 1))(params["w1"], params["w2"], x, y)
    expected = pergrad.dp.clipped_sum(grads, 0.5, mask=mask)
    assert float(clipped.count) == 6
    assert_trees_close(clipped.sum, expected.sum)
    choice = choose_strategy(loss, params["w1"], params["w2"], x, y, argnums=(0, 1))
    assert choice.layers == {
        "argument 0 (the whole argument)": "linear",
        "argument 1 (the whole argument)": "linear",
    }


def test_shared_arguments_and_per_example_keys():
    """A shared (unbatched) argument and dropout with one key per example."""
    params, x, y = two_layer_problem(batch=6)
    scale = jnp.asarray(1.5)
    example_keys = jax.random.split(jax.random.key(5), 6)

    def loss(p, scale, x, y, key):
        h = jnp.tanh(x @ p["w1"]) * scale
        keep = jax.random.bernoulli(key, 0.7, h.shape)
        return jnp.sum((jnp.where(keep, h / 0.7, 0.0) @ p["w2"] - y) ** 2)

    args = (params, scale, x, y, example_keys)
    assert choose_strategy(loss, *args).strategy == "ghost"
    check_against_materialized(loss, args)


# --- embedding lookups ------------------------------------------------------------------------

VOCAB, DIM, LENGTH = 11, 4, 6

LOOKUPS = {
    "index": lambda table, ids: table[ids],
    "take": lambda table, ids: jnp.take(table, ids, axis=0),
    "take_clip": lambda table, ids: jnp.take(table, ids, axis=0, mode="clip"),
    "take_fill_zero": lambda table, ids: jnp.take(table, ids, axis=0, mode="fill", fill_value=0),
    "two_dimensional_ids": lambda table, ids: table[ids.reshape(2, 3)].reshape(LENGTH, DIM),
    # equinox's Embedding under jax.vmap: a clamped dynamic slice per id
    "vmapped_row": lambda table, ids: jax.vmap(lambda i: table[i])(ids),
}
# the ids these lookups define: out of range only where the mode says what happens
ID_RANGE = {
    "index": (-VOCAB, VOCAB + 3),  # an id past the end reads a clamped row but gets no gradient
    "take": (-VOCAB, VOCAB),
    "take_clip": (-3, VOCAB + 3),
    "take_fill_zero": (-3, VOCAB + 3),
    "two_dimensional_ids": (0, VOCAB),
    "vmapped_row": (-3, VOCAB + 3),
}


@pytest.mark.parametrize("name", list(LOOKUPS))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), repeats=st.integers(0, LENGTH - 1))
def test_embedding_lookups_match_the_formed_gradient(name, seed, repeats):
    """Repeated ids add their rows' gradients; out-of-range ids follow the lookup's mode."""
    rng = np.random.default_rng(seed)
    params = {
        "table": jnp.asarray(rng.standard_normal((VOCAB, DIM)), jnp.float32),
        "head": jnp.asarray(rng.standard_normal((DIM, 3)), jnp.float32),
    }
    low, high = ID_RANGE[name]
    ids = rng.integers(low, high, (5, LENGTH))
    ids[:, 1 : 1 + repeats] = ids[:, :1]  # the first id read again
    ids = jnp.asarray(ids, jnp.int32)

    def loss(p, ids):
        return jnp.sum(jnp.sin(LOOKUPS[name](p["table"], ids) @ p["head"]))

    assert choose_strategy(loss, params, ids).layers == {
        "['table']": "embedding",
        "['head']": "linear",
    }
    check_against_materialized(loss, (params, ids))


def tied_lm_problem(batch=5, vocab=VOCAB, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "table": jnp.asarray(rng.standard_normal((vocab, DIM)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((DIM, DIM)) / DIM**0.5, jnp.float32),
    }
    ids = jnp.asarray(rng.integers(0, vocab, (batch, LENGTH)), jnp.int32)  # repeats ids
    return params, ids


def test_a_tied_embedding_and_output_projection_take_the_ghost_path():
    params, ids = tied_lm_problem()

    def loss(p, ids):  # the same table embeds the tokens and scores the next one
        logits = jnp.tanh(p["table"][ids] @ p["w"]) @ p["table"].T
        return -jnp.sum(jax.nn.log_softmax(logits)[:-1] * jax.nn.one_hot(ids[1:], VOCAB))

    choice = choose_strategy(loss, params, ids)
    assert choice.strategy == "ghost"
    assert choice.layers == {"['table']": "tied: embedding + linear", "['w']": "linear"}
    assert choice.unsupported == {}
    check_against_materialized(loss, (params, ids))
    step = jax.jit(lambda p, ids: clipped_sum_of(loss, p, ids, max_norm=0.3, strategy="ghost"))
    expected = pergrad.dp.clipped_sum(pergrad.per_example_grads(loss)(params, ids), 0.3)
    assert_trees_close(step(params, ids).sum, expected.sum)


def test_a_table_read_twice_and_tied_to_the_head():
    """T5's shared embedding: the encoder's and the decoder's tokens read the same table,
    which also scores the output; and two lookups without a head."""
    params, ids = tied_lm_problem(seed=1)
    rng = np.random.default_rng(2)
    targets = jnp.asarray(rng.integers(0, VOCAB, ids.shape), jnp.int32)

    def loss(p, ids, targets):
        context = jnp.tanh(p["table"][ids]).mean(0)
        h = jnp.tanh(p["table"][targets] @ p["w"] + context)
        return jnp.sum(jax.nn.logsumexp(h @ p["table"].T, axis=-1))

    def lookups_only(p, ids, targets):
        return jnp.sum(jnp.tanh(p["table"][ids] @ p["w"]) * p["table"][targets])

    for fn, kinds in ((loss, "embedding + embedding + linear"), (lookups_only, None)):
        choice = choose_strategy(fn, params, ids, targets)
        assert choice.strategy == "ghost"
        if kinds is not None:
            assert choice.layers["['table']"] == f"tied: {kinds}"
        check_against_materialized(fn, (params, ids, targets))


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_a_tied_table_with_out_of_range_ids(mode):
    """Padding ids outside the table: "fill" reads no row (no gradient), "clip" the last."""
    params, ids = tied_lm_problem(seed=3)
    ids = ids.at[0, :2].set(-1).at[1, -1].set(VOCAB + 3)

    def loss(p, ids):
        x = jnp.take(p["table"], ids, axis=0, mode=mode, fill_value=0.0 if mode == "fill" else None)
        return jnp.sum(jax.nn.logsumexp(jnp.tanh(x @ p["w"]) @ p["table"].T, axis=-1))

    assert choose_strategy(loss, params, ids).layers["['table']"].startswith("tied")
    check_against_materialized(loss, (params, ids))


def test_a_flax_embed_with_attend_takes_the_ghost_path():
    nn = pytest.importorskip("flax.linen", reason="flax's Embed.attend ties the output layer")

    class TiedLM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(VOCAB, DIM)
            h = nn.LayerNorm()(jnp.tanh(nn.Dense(DIM)(embed(ids))))
            return embed.attend(h)

    model = TiedLM()
    _, ids = tied_lm_problem(seed=4)
    params = model.init(jax.random.key(0), ids[0])

    def loss(p, ids):
        logits = model.apply(p, ids)
        return -jnp.mean(jax.nn.log_softmax(logits)[:-1] * jax.nn.one_hot(ids[1:], VOCAB)) * VOCAB

    choice = choose_strategy(loss, params, ids)
    assert choice.strategy == "ghost"
    assert choice.layers["['params']['Embed_0']['embedding']"] == "tied: embedding + linear"
    check_against_materialized(loss, (params, ids))


def test_a_table_whose_rows_are_contracted_is_formed_per_example():
    """``h @ table`` sums over the rows, so a row's use is not its own output column: not a
    tied output projection, and the table's gradient is formed per example."""
    params, ids = tied_lm_problem(seed=5)

    def loss(p, ids):
        weights = jax.nn.softmax(jnp.tanh(p["table"][ids] @ p["w"]) @ p["table"].T)
        return jnp.sum(jnp.tanh(weights @ p["table"]))

    choice = choose_strategy(loss, params, ids)
    assert "['table']" in choice.unsupported
    assert "used by 3 contractions" in choice.unsupported["['table']"]
    check_against_materialized(loss, (params, ids), strategy="auto")


# --- dtypes ----------------------------------------------------------------------------------
# (found by review: each of these gave a silently wrong norm before the fix)


def test_float16_compute_with_float32_weights_does_not_overflow():
    """Mixed precision: |a|^2 of a wide float16 activation is past float16's 65504, although
    every gradient entry is small; the norms are computed in float32."""
    k = keys(40, 2)
    x = jnp.asarray(4.0 + k[0].standard_normal((3, 4096)), jnp.float16)
    params = {"w": jnp.asarray(k[1].standard_normal((4096, 2)) * 1e-3, jnp.float32)}

    def loss(p, x):
        return jnp.sum(x @ p["w"].astype(jnp.float16)).astype(jnp.float32) * 1e-3

    grads = pergrad.per_example_grads(loss)(params, x)
    norms = per_example_norms_of(loss, params, x)
    assert choose_strategy(loss, params, x).layers == {"['w']": "linear"}
    assert np.isfinite(np.asarray(norms)).all()
    assert_close(norms, pergrad.norms.per_example_norms(grads), rtol=1e-2)  # float16 rounding


@pytest.mark.parametrize("shape", [(3, 64), (3, 2, 64)], ids=["vector", "sequence_gram"])
def test_integer_layer_inputs(shape):
    """uint8 inputs (quantised data) contracted with a float weight: no integer overflow."""
    x = jnp.asarray(np.random.default_rng(41).integers(0, 255, shape), jnp.uint8)
    params = {"w": jnp.asarray(np.random.default_rng(42).standard_normal((64, 64)) * 0.01)}
    contract = (((len(shape) - 2,), (0,)), ((), ()))

    def loss(p, x):
        h = jax.lax.dot_general(x, p["w"], contract, preferred_element_type=jnp.float32)
        return jnp.sum(jnp.tanh(h))

    assert choose_strategy(loss, params, x).layers == {"['w']": "linear"}
    check_against_materialized(loss, (params, x))


def test_byte_ids_into_a_table_longer_than_256_rows():
    rng = np.random.default_rng(43)
    params = {"table": jnp.asarray(rng.standard_normal((259, 4)), jnp.float32)}
    ids = jnp.asarray(rng.integers(0, 256, (4, 9)), jnp.uint8)

    def loss(p, ids):
        return jnp.sum(jnp.sin(jnp.take(p["table"], ids, axis=0)))

    assert choose_strategy(loss, params, ids).layers == {"['table']": "embedding"}
    check_against_materialized(loss, (params, ids))


def test_a_weight_cast_through_an_integer_has_no_gradient():
    """Fake quantisation ``w.astype(int8)``: jax.grad through it is zero, so the weight is not
    a ghost parameter (its formed per-example gradients are zero)."""
    params, x, y = two_layer_problem()
    params = {"w1": params["w1"] * 3, "w2": params["w2"]}

    def loss(p, x, y):
        quantised = p["w1"].astype(jnp.int8).astype(jnp.float32)
        return jnp.sum((jnp.tanh(x @ quantised) @ p["w2"] - y) ** 2)

    choice = choose_strategy(loss, params, x, y)
    assert "['w1']" not in choice.layers and choice.layers["['w2']"] == "linear"
    norms = check_against_materialized(loss, (params, x, y), strategy="auto")
    assert float(np.abs(np.asarray(norms)).max()) > 0


# --- the formulas -----------------------------------------------------------------------------

# (einsum of one example, input shape, parameter shape): the parameter is the second operand
# unless the spec names it first (then "param_first").
EINSUMS = {
    "vector": ("k,kf->f", ("k",), ("k", "f")),
    "sequence": ("tk,kf->tf", ("t", "k"), ("k", "f")),
    "sequence_param_first": ("kf,tk->ft", ("k", "f"), ("t", "k")),
    "two_free_two_contracted": ("tsgk,gkf->tsf", ("t", "s", "g", "k"), ("g", "k", "f")),
    "heads_as_batch": ("thk,hkf->thf", ("t", "h", "k"), ("h", "k", "f")),
}


@pytest.mark.parametrize("name", list(EINSUMS))
@settings(max_examples=6, deadline=None)
@given(
    t=st.integers(1, 5),
    s=st.integers(1, 3),
    k=st.integers(1, 6),
    f=st.integers(1, 6),
    g=st.integers(1, 3),
    h=st.integers(1, 3),
    batch=st.integers(1, 4),
)
def test_contractions_match_the_formed_gradient(name, t, s, k, f, g, h, batch):
    """Vector (|a|^2 |dz|^2), Gram (small T) and formed (large T) paths, several layouts."""
    spec, input_dims, param_dims = EINSUMS[name]
    sizes = {"t": t, "s": s, "k": k, "f": f, "g": g, "h": h}
    param_first = spec.split(",")[0] == "".join(param_dims)
    rng = np.random.default_rng(t * 1000 + k * 100 + f)
    shape = tuple(sizes[d] for d in param_dims if d)
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((batch, *(sizes[d] for d in input_dims))), jnp.float32)

    def loss(w, x):
        out = jnp.einsum(spec, w, x) if param_first else jnp.einsum(spec, x, w)
        return jnp.sum(jnp.sin(out))

    grads = pergrad.per_example_grads(loss)(w, x)
    norms = per_example_norms_of(loss, w, x, strategy="ghost")
    assert_close(norms, pergrad.norms.per_example_norms(grads), rtol=1e-4)


def test_dense_rule_picks_gram_or_formed_by_cost():
    a = jnp.ones((2, 3, 100))
    d = jnp.ones((2, 3, 100))
    long_a, long_d = jnp.ones((2, 300, 4)), jnp.ones((2, 300, 5))
    # both give |sum_t a_t d_t^T|^2 = (T^2) K F for all-ones inputs (the estimate of the
    # certified pair, cost.Certified)
    gram = jax_contractions._dense_squared_norms(a, d).estimate
    formed = jax_contractions._dense_squared_norms(long_a, long_d).estimate
    assert_close(gram, np.full(2, 9.0 * 100 * 100))
    assert_close(formed, np.full(2, 300.0**2 * 20))


# --- per-group clipping ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ghost", "chunked"])
def test_per_group_bounds_without_materializing(strategy):
    """A group per part of a transformer block (attention, MLP, two layer norms), under jit."""
    forward, params, xs = ZOO["transformer_block"]()
    ys = targets_for(forward, params, xs, seed=8)
    loss = mse_loss(forward)
    grads = pergrad.per_example_grads(loss)(params, xs, ys)
    per_leaf = pergrad.norms.per_example_norms(grads, per_layer=True)

    def median_norm(group: str) -> float:
        squares = sum(np.asarray(n) ** 2 for n in jax.tree_util.tree_leaves(per_leaf[group]))
        return float(np.median(np.sqrt(squares)))

    # attention and MLP at their median norm: some examples clipped in each group, some not
    bounds = {group: median_norm(group) if group in ("attn", "mlp") else 1.0 for group in params}
    mask = jnp.asarray([True, False, True])
    expected = pergrad.dp.clipped_sum(grads, bounds, mask=mask)
    clipped = jax.jit(
        lambda p, x, y, m: clipped_sum_of(loss, p, x, y, max_norm=bounds, mask=m, strategy=strategy)
    )(params, xs, ys, mask)
    assert_trees_close(clipped.sum, expected.sum)
    assert len(clipped.norms) == len(expected.norms) == len(bounds)
    for actual, reference in zip(clipped.norms, expected.norms):
        assert_close(actual, reference)
    assert clipped.sensitivity == pytest.approx(expected.sensitivity)
    assert float(clipped.count) == 2


# --- DP-SGD through the ghost path -----------------------------------------------------------


def test_dp_step_through_the_ghost_path_equals_the_materialized_one():
    optax = pytest.importorskip("optax", reason="the DP step test uses optax")
    forward, params, xs = ZOO["transformer_block"]()
    ys = targets_for(forward, params, xs, seed=6)
    loss = mse_loss(forward)
    tx = optax.sgd(0.1)
    state = tx.init(params)
    key = jax.random.key(0)

    assert choose_strategy(loss, params, xs, ys).strategy == "ghost"
    grad, stats = pergrad.dp.private_grad_of(
        loss, params, xs, ys, max_norm=0.3, noise_multiplier=0.0, rng=key
    )
    ghost_updates, _ = tx.update(grad, state, params)

    per_example = pergrad.per_example_grads(loss)(params, xs, ys)
    reference, _ = pergrad.dp.private_mean(per_example, 0.3, 0.0, key)
    reference_updates, _ = tx.update(reference, state, params)
    assert_trees_close(ghost_updates, reference_updates)
    assert 0 < float(stats.clip_fraction) <= 1


def test_auto_runs_ghost_under_jit_without_a_warning():
    params, x, y = two_layer_problem()

    def loss(p, x, y):
        return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning: the ghost path ran
        norms = jax.jit(lambda p, x, y: per_example_norms_of(loss, p, x, y))(params, x, y)
    assert isinstance(norms, jax.Array) and norms.shape == (7,)
