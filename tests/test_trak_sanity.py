"""TRAK that makes sense out of the box (issue 35): the classification margin and weight helpers
equal their formulas on both frameworks and stay on the vectorised path (no loop fallback), and
on a well-fit digits MLP TRAK without a weight (the default), damped on the kernel's scale,
finds proponents of the target's class nearly always; the ``1 - p_y`` weight, which the guide
used to show, does not."""

from __future__ import annotations

import numpy as np
import pytest

import pergrad
from pergrad import influence


def reference_margin(logits, label):
    others = np.delete(logits, label)
    return logits[label] - (others.max() + np.log(np.exp(others - others.max()).sum()))


def reference_weight(logits, label):
    p = np.exp(logits - logits.max())
    return 1 - p[label] / p.sum()


def test_margin_and_weight_equal_their_formulas_and_vectorise_in_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w = torch.tensor(rng.normal(size=(4, 6)), dtype=torch.float64)
    x = torch.tensor(rng.normal(size=(7, 4)), dtype=torch.float64)
    y = torch.tensor(rng.integers(0, 6, 7))

    def margin(p, xi, yi):
        return influence.classification_margin(xi @ p, yi)

    def weight(p, xi, yi):
        return influence.classification_weight(xi @ p, yi)

    logits = (x @ w).numpy()
    for fn, reference in ((margin, reference_margin), (weight, reference_weight)):
        values = torch.func.vmap(fn, in_dims=(None, 0, 0))(w, x, y).numpy()
        expected = [reference(logits[i], int(y[i])) for i in range(7)]
        np.testing.assert_allclose(values, expected, rtol=1e-12)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.FallbackWarning)  # no loop fallback
        grads = pergrad.per_example_grads(margin)(w, x, y)
    loop = [torch.func.grad(margin)(w, x[i], y[i]) for i in range(7)]
    torch.testing.assert_close(grads, torch.stack(loop))


def test_margin_and_weight_equal_their_formulas_in_jax():
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 6)).astype(np.float32)
    labels = rng.integers(0, 6, 5)
    margins = jax.vmap(influence.classification_margin)(logits, labels)
    weights = jax.vmap(influence.classification_weight)(logits, labels)
    np.testing.assert_allclose(
        margins, [reference_margin(logits[i], labels[i]) for i in range(5)], rtol=1e-5
    )
    np.testing.assert_allclose(
        weights, [reference_weight(logits[i], labels[i]) for i in range(5)], rtol=1e-5, atol=1e-7
    )


def test_bad_logits_are_refused_by_name():
    jnp = pytest.importorskip("jax").numpy
    with pytest.raises(ValueError, match=r"logits must be the \(C,\) logits of ONE example"):
        influence.classification_margin(jnp.zeros((3, 4)), 1)
    with pytest.raises(TypeError, match="logits must be a torch tensor or a JAX array; got list"):
        influence.classification_weight([0.0, 1.0], 1)


def test_default_trak_finds_proponents_of_the_targets_class_on_a_well_fit_model():
    jax = pytest.importorskip("jax")
    sklearn = pytest.importorskip("sklearn.datasets", reason="scikit-learn's bundled digits")
    jnp = jax.numpy
    digits = sklearn.load_digits()
    X = np.asarray(digits.data / 16.0, np.float32)
    Y = np.asarray(digits.target, np.int32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(X))
    train, target = order[:500], order[500:560]
    x, y, xt, yt = X[train], Y[train], X[target], Y[target]

    def logits_of(p, xi):
        return jnp.tanh(xi @ p["w1"] + p["b1"]) @ p["w2"]

    def loss(p, xb, yb):
        return -jnp.mean(jax.nn.log_softmax(logits_of(p, xb))[jnp.arange(len(yb)), yb])

    @jax.jit
    def train_step(p):
        return jax.tree.map(lambda a, g: a - 0.5 * g, p, jax.grad(loss)(p, x, y))

    params = {
        "w1": jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.normal(size=(32, 10)) / 6, jnp.float32),
    }
    for _ in range(400):
        params = train_step(params)
    accuracy = float(jnp.mean(jnp.argmax(logits_of(params, x), 1) == y))
    assert accuracy > 0.97  # well fit: most training examples have p_y near 1

    def margin(p, xi, yi):
        return influence.classification_margin(logits_of(p, xi), yi)

    def weight(p, xi, yi):
        return influence.classification_weight(logits_of(p, xi), yi)

    def same_class_share(scores):
        top = np.argsort(-np.asarray(scores), axis=0)[:10]  # (10, n_target) proponents
        return float(np.mean(y[top] == yt[None, :]))

    # a damping on the scale of the kernel (here 100, against the pseudo-inverse's 0): on a
    # well-fit model the smallest directions of Phi^T Phi are noise, which damping 0 amplifies
    options = {"proj_dim": 256, "damping": 100.0}
    default = influence.trak(margin, [params], (x, y), (xt, yt), **options)
    weighted = influence.trak(margin, [params], (x, y), (xt, yt), weight_fn=weight, **options)
    # chance is about 10%: the default's proponents share the target's class nearly always;
    # the 1 - p_y weight hands every list to the few examples the model gets wrong
    assert same_class_share(default) > 0.85
    assert same_class_share(weighted) < same_class_share(default) - 0.3
