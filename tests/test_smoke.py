"""The seed tutorials' small examples, end to end on both backends."""

import numpy as np

import pergrad


def test_scalar_w_exercise_jax_auto_and_explicit():
    import jax.numpy as jnp

    def loss(w, b, x, y):
        return (w * x - y) ** 2

    x, y = jnp.array([1.0, 2.0]), jnp.array([0.0, 0.0])
    expected = 2 * (1.0 * np.array([1.0, 2.0]) - 0.0) * np.array([1.0, 2.0])  # 2(wx - y)x
    auto = pergrad.per_example_grads(loss)(1.0, 0.0, x, y)
    explicit = pergrad.per_example_grads(loss, in_axes=(None, None, 0, 0))(1.0, 0.0, x, y)
    np.testing.assert_allclose(np.asarray(auto), expected)
    np.testing.assert_allclose(np.asarray(explicit), expected)
