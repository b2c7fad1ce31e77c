"""User-level clipping by JAX's ghost strategy (``capture/jax_users.py``): each user's summed
gradient's norm from the batch's contraction records, static shapes (traced user ids under
``jax.jit``).

The reference is independent of pergrad: each user's gradient from ``jax.grad`` of the user's
summed loss (a loop over users), clipped and summed by hand in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from pergrad import dp  # noqa: E402
from pergrad._src.capture import cost  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_run  # noqa: E402

USERS = np.array([4, 0, 4, 7, 0, 4, 9, 7, 4, 12])  # unsorted, not contiguous, one singleton
VOCAB, WIDTH, POSITIONS = 13, 6, 5


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "emb": jnp.asarray(rng.normal(size=(VOCAB, WIDTH)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)), jnp.float32),
        "b": jnp.zeros(WIDTH, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(WIDTH, 3)), jnp.float32),
    }


def loss(p, x, y):
    """One example: token lookups, a dense layer over the positions, a head on their mean."""
    h = jnp.tanh(p["emb"][x] @ p["w"] + p["b"])
    return jnp.sum(((h @ p["head"]).mean(0) - y) ** 2)


def batch(size, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, VOCAB, (size, POSITIONS)))
    return x, jnp.asarray(rng.normal(size=(size, 3)), jnp.float32)


def user_reference(params, x, y, user_ids, max_norm, keep=None):
    keep = np.ones(len(user_ids), bool) if keep is None else keep
    total = {k: np.zeros(v.shape) for k, v in params.items()}
    for user in np.unique(user_ids[keep]):
        rows = np.flatnonzero((user_ids == user) & keep)
        grads = jax.grad(lambda p, rows=rows: sum(loss(p, x[r], y[r]) for r in rows))(params)
        grads = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = np.sqrt(sum((g**2).sum() for g in grads.values()))
        factor = min(1.0, max_norm / max(norm, 1e-300))
        for k in total:
            total[k] += factor * grads[k]
    return total


def assert_close(found, expected, rtol=2e-4, atol=2e-5):
    for k, value in expected.items():
        np.testing.assert_allclose(np.asarray(found[k], np.float64), value, rtol=rtol, atol=atol)


# (each case compiles its own step, about 7 s: the default run keeps one route unmasked and the
# other masked, the two crossings are slow)
@pytest.mark.parametrize(
    ("route", "masked"),
    [
        ("formed", False),
        ("gram", True),
        pytest.param("formed", True, marks=pytest.mark.slow(reason="about 7 s; a crossing")),
        pytest.param("gram", False, marks=pytest.mark.slow(reason="about 7 s; a crossing")),
    ],
)
def test_ghost_equals_per_user_grad_reference(route, masked, monkeypatch):
    if route == "gram":  # every dense layer's per-example gradients "too large": P x P Gram
        monkeypatch.setattr(cost, "MAX_FORMED_NUMBERS", 0)
    params = make_params()
    x, y = batch(len(USERS))
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], bool) if masked else None
    found = clipped_sum_run(
        loss,
        params,
        x,
        y,
        max_norm=0.3,
        strategy="ghost",
        user_ids=jnp.asarray(USERS),
        mask=None if mask is None else jnp.asarray(mask),
    )
    assert found.strategy == "ghost"
    assert float(found.clipped.count) == len(np.unique(USERS[mask if masked else slice(None)]))
    assert float(found.clipped.clip_fraction) > 0
    assert_close(found.clipped.sum, user_reference(params, x, y, USERS, 0.3, mask))


def test_under_jit_with_traced_user_ids():
    params = make_params()
    x, y = batch(len(USERS))

    @jax.jit
    def clipped(p, x, y, ids):
        return dp.clipped_sum_of(loss, p, x, y, max_norm=0.3, strategy="ghost", user_ids=ids).sum

    assert_close(
        clipped(params, x, y, jnp.asarray(USERS)), user_reference(params, x, y, USERS, 0.3)
    )
    permuted = np.array([1, 1, 2, 2, 3, 3, 3, 3, 0, 5])  # another grouping, same compiled step
    assert_close(
        clipped(params, x, y, jnp.asarray(permuted)), user_reference(params, x, y, permuted, 0.3)
    )


def test_a_user_with_a_nonfinite_example_contributes_nothing_and_padding_is_left_out():
    params = make_params()
    x, y = batch(len(USERS))
    y = y.at[2, 0].set(jnp.nan)  # user 4 (rows 0, 2, 5, 8)
    y = y.at[6, 0].set(jnp.inf)  # user 9 (row 6): masked out, so padding
    mask = np.ones(len(USERS), bool)
    mask[6] = False
    found = dp.clipped_sum_of(
        loss, params, x, y, max_norm=0.5, strategy="ghost", user_ids=USERS, mask=jnp.asarray(mask)
    )
    keep = (USERS != 4) & mask
    assert_close(found.sum, user_reference(params, x, y, USERS, 0.5, keep))
    assert int(found.nonfinite) == 1


def test_cancelling_examples_of_one_user_stay_within_the_bound(monkeypatch):
    """Two examples of one user whose dense gradients nearly cancel (large inputs, opposite
    output errors): in float32 the user's norm is tiny next to its examples'; the certified
    bound keeps what is released within max_norm, by both routes."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(8, 16)) * 30, jnp.float32)
    x = jnp.stack([a, a * (1 + 1e-6)])
    out = x @ w
    y = jnp.stack([out[0] + 1.0, out[1] - 1.0])

    def dense(p, x, y):
        return jnp.sum((x @ p["w"] - y) ** 2)

    for limit in (cost.MAX_FORMED_NUMBERS, 0):
        monkeypatch.setattr(cost, "MAX_FORMED_NUMBERS", limit)
        found = dp.clipped_sum_of(
            dense, {"w": w}, x, y, max_norm=1e-3, strategy="ghost", user_ids=np.array([3, 3])
        )
        released = float(np.linalg.norm(np.asarray(found.sum["w"], np.float64)))
        assert released <= 1e-3 * (1 + 1e-5)


@pytest.mark.slow  # each example traces the loss afresh, for both routes: ~20 s a batch shape
@settings(max_examples=8, deadline=None)
@given(ids=st.lists(st.integers(0, 3), min_size=0, max_size=7), max_norm=st.floats(0.05, 3.0))
def test_ghost_matches_the_formed_users_sum(ids, max_norm):
    ids = np.array(ids, np.int64)
    params = make_params(len(ids))
    x, y = batch(len(ids), seed=len(ids) + 7)
    ghost = dp.clipped_sum_of(loss, params, x, y, max_norm=max_norm, user_ids=ids)
    formed = dp.clipped_sum_of(
        loss, params, x, y, max_norm=max_norm, strategy="materialize", user_ids=ids
    )
    assert float(ghost.count) == len(np.unique(ids))
    for k in params:
        np.testing.assert_allclose(ghost.sum[k], formed.sum[k], rtol=2e-4, atol=2e-5)


def test_optax_adaptive_clipping_counts_users_within_the_bound(monkeypatch):
    """optax_aggregate(clipping=adaptive(...)) with user_ids: the bound moves by the count of
    USERS within it (the count's noise set to 0 here), by the closed-form update."""
    import math

    from pergrad._src.dp.clipping_policies import AdaptiveClipping

    monkeypatch.setattr(AdaptiveClipping, "noisy_counts", lambda self, counts, rng: counts)
    params = make_params()
    x, y = batch(len(USERS))
    grads = jax.vmap(jax.grad(loss), (None, 0, 0))(params, x, y)
    norms = []
    for user in np.unique(USERS):
        summed = [np.asarray(g, np.float64)[np.equal(USERS, user)].sum(0) for g in grads.values()]
        norms.append(float(np.sqrt(sum((s**2).sum() for s in summed))))
    ordered = sorted(norms)
    bound = (ordered[2] + ordered[3]) / 2  # 3 users within it, 2 not, none near it
    policy = dp.adaptive(count_noise_std=2.0, target_quantile=0.7, learning_rate=0.3)
    tx = dp.optax_aggregate(bound, 0.0, 0, expected_batch_size=4.0, clipping=policy)
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads, state, params, user_ids=jnp.asarray(USERS))
    within, count = sum(n <= bound for n in norms), len(norms)
    expected = bound * math.exp(-0.3 * ((within - count / 2) / 4.0 + 0.5 - 0.7))
    assert float(state.count) == count and 0 < within < count
    assert float(state.max_norm) == pytest.approx(expected, rel=1e-5)
