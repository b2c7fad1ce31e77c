"""Plug-in reductions on the JAX capture engine (issue 16): a reduction taught to a contraction
kind from outside the engine and the rules, here LoGra's per-layer Kronecker projection
(Choe et al. 2024) ``P_in^T G_b P_out = (A_b P_in)^T (D_b P_out)`` of a dense weight, computed
from the recorded layer inputs and output cotangents without forming ``G_b``; and the built-in
``per_example`` reduction every kind falls back to. Reference: ``jax.vmap(jax.grad(loss))``."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX capture engine")
import jax.numpy as jnp  # noqa: E402

from pergrad._src.api.reductions import layer_reductions_of  # noqa: E402
from pergrad._src.capture import jax_rules  # noqa: E402
from pergrad._src.capture.jax_contractions import dense_factors  # noqa: E402

BATCH, LENGTH, VOCAB = 3, 4, 11
NAME = "test_kronecker_projection"


@pytest.fixture
def projection():
    @jax_rules.register_reduction(NAME, "linear")
    def project(site, param, inputs, cotangents, projections):
        factors = dense_factors(site, inputs, cotangents)
        assert factors is not None and param.ndim == 2 and site.param_operand == 1
        a, d = factors
        p_in, p_out = projections[param.shape]
        return jnp.einsum("btk,kq,btf,fp->bqp", a, p_in, d, p_out)

    yield project
    jax_rules.rule_for_family("linear").plugins.pop(NAME)


def loss(params, ids, x, y):
    """An embedding lookup, a convolution, and two dense layers, over a sequence."""
    h = params["emb"][ids] + x @ params["w1"] + params["b1"]
    h = jax.lax.conv_general_dilated(
        h.T[None], params["kernel"], (1,), "SAME", dimension_numbers=("NCH", "OIH", "NCH")
    )[0].T
    return ((jnp.tanh(h) @ params["w2"] - y) ** 2).sum()


@jax.jit  # one compilation for every key, where op by op each array's draw compiles apart
def make(key):
    keys = jax.random.split(key, 7)
    params = {
        "emb": jax.random.normal(keys[0], (VOCAB, 6)),
        "w1": jax.random.normal(keys[1], (5, 6)),
        "b1": jax.random.normal(keys[2], (6,)),
        "kernel": jax.random.normal(keys[3], (6, 6, 3)) * 0.3,
        "w2": jax.random.normal(keys[4], (6, 2)),
    }
    ids = jax.random.randint(keys[5], (BATCH, LENGTH), 0, VOCAB).at[0, 1].set(3).at[0, 2].set(3)
    x = jax.random.normal(keys[6], (BATCH, LENGTH, 5))
    y = jnp.ones((BATCH, LENGTH, 2))
    return params, ids, x, y


def test_a_plug_in_reduction_runs_on_the_engines_records(projection):
    params, ids, x, y = make(jax.random.key(0))
    rng = np.random.default_rng(1)
    projections = {  # by the weight's shape: (P_in, P_out)
        (5, 6): (
            jnp.asarray(rng.normal(size=(5, 2)), jnp.float32),
            jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
        ),
        (6, 2): (jnp.eye(6)[:, :3], jnp.ones((2, 1))),
    }
    reference = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0))(params, ids, x, y)
    results = layer_reductions_of(
        loss, params, ids, x, y, reduction=NAME, reduction_args=(projections,)
    )
    names = sorted(params)  # a dict's leaves, in JAX's flat order
    assert len(results) == len(names)
    for name, result in zip(names, results):
        if name in ("w1", "w2"):  # dense weights: projected, by the plug-in
            assert result.reduced
            p_in, p_out = projections[params[name].shape]
            expected = jnp.einsum("kq,bkf,fp->bqp", p_in, reference[name], p_out)
            np.testing.assert_allclose(result.value, expected, rtol=1e-4, atol=1e-4)
        else:  # an embedding, a kernel, a bias: no plug-in, per-example gradients
            assert not result.reduced
            np.testing.assert_allclose(result.value, reference[name], rtol=1e-4, atol=1e-4)


def test_without_the_plug_in_every_leaf_comes_back_as_per_example_gradients():
    params, ids, x, y = make(jax.random.key(3))
    reference = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0))(params, ids, x, y)
    results = layer_reductions_of(loss, params, ids, x, y, reduction="not_registered_anywhere")
    for name, result in zip(sorted(params), results):
        assert not result.reduced
        np.testing.assert_allclose(result.value, reference[name], rtol=1e-4, atol=1e-4)


def test_built_in_reductions_and_unknown_plug_ins():
    rule = jax_rules.rule_for_family("conv")
    assert rule.reduction("squared_norms") is rule.squared_norms
    assert rule.reduction("per_example") is rule.per_example
    assert rule.reduction("no_such_reduction") is None


def test_register_reduction_refuses_an_unknown_family_or_a_built_in_name():
    with pytest.raises(ValueError, match="no layer family 'dense'.*'linear'"):
        jax_rules.register_reduction("x", "dense")
    with pytest.raises(ValueError, match="'weighted_sum' is a built-in"):
        jax_rules.register_reduction("weighted_sum", "linear")


def test_reduction_must_be_a_name():
    params, ids, x, y = make(jax.random.key(4))
    with pytest.raises(TypeError, match="reduction must be the name"):
        layer_reductions_of(loss, params, ids, x, y, reduction=len)
