"""Leaves held as their formed per-example gradients in the JAX ghost DP step (issue 36).

Where a clipped sum follows, a dense or convolution leaf whose per-example gradients are no
more numbers than its contraction's cotangents (``B p q`` against ``B T q``: a long sequence
over a narrow layer) is formed once (``ghost_jax._held``); its certified norms and its weighted
sum both come from those numbers. The clipped sums must equal those of per-example gradients
from a loop of ``jax.grad`` (``tests/_reference.py``), each example must stay within the bound,
and lookups, wider layers and norms alone keep the records; a table tied across uses is held
where all its uses' cotangents outnumber its per-example gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX ghost strategy needs jax installed")
import jax.numpy as jnp  # noqa: E402

import pergrad  # noqa: E402
from _reference import jax_loop_grads  # noqa: E402
from pergrad._src.capture import cost, jax_contractions  # noqa: E402
from pergrad._src.dp.from_loss import clipped_sum_of  # noqa: E402
from pergrad._src.strategies import ghost_jax  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_xla_compile")

TOKENS = 12
RTOL = 1e-5  # relative to the largest entry of the reference, float32


def sequence_loss(params: dict, ids: Any, labels: Any) -> Any:
    """Over 12 tokens: ``w_in`` (6 x 16 = 96 numbers per example against 12 x 16 = 192
    cotangents) and the per-head ``w_heads`` (a ``dot_general`` with batch dimensions: 2 x 6 x 3
    = 36 against 2 x 12 x 3 = 72) are held; ``w_wide`` (16 x 24 = 384 against 288) keeps its
    records, and so does the table (a lookup: never held, though 30 is below 72)."""
    h = params["table"][ids]
    h = jnp.tanh(h @ params["w_in"] + params["b_in"])
    h = jnp.tanh(h @ params["w_wide"])
    heads = h.reshape(TOKENS, 4, 6)[:, :2].transpose(1, 0, 2)  # (2, T, 6)
    logits = jnp.einsum("htd,hde->hte", heads, params["w_heads"]).sum(axis=0)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


SEQUENCE_HELD = {"w_in", "w_heads"}


def sequence_params() -> dict:
    keys = jax.random.split(jax.random.key(0), 5)
    return {
        "table": jax.random.normal(keys[0], (5, 6)),
        "w_in": jax.random.normal(keys[1], (6, 16)) / 2,
        "b_in": 0.1 * jax.random.normal(keys[2], (16,)),
        "w_wide": jax.random.normal(keys[3], (16, 24)) / 4,
        "w_heads": jax.random.normal(keys[4], (2, 6, 3)),
    }


def sequence_batch(size: int, seed: int = 1) -> tuple[Any, Any]:
    keys = jax.random.split(jax.random.key(seed), 2)
    return (
        jax.random.randint(keys[0], (size, TOKENS), 0, 5),
        jax.random.randint(keys[1], (size, TOKENS), 0, 3),
    )


def image_loss(params: dict, image: Any, label: Any) -> Any:
    """An 8 x 8 image: ``k1`` (4 x 1 x 3 x 3 = 36 numbers per example against 4 x 6 x 6 = 144
    cotangents) is held; ``k2`` (144 against 64) and ``head`` (192 against 3) are not."""
    h = jnp.tanh(jax.lax.conv(image[None], params["k1"], (1, 1), "VALID"))
    h = jnp.tanh(jax.lax.conv(h, params["k2"], (1, 1), "VALID"))
    logits = h.reshape(-1) @ params["head"]
    return -jax.nn.log_softmax(logits)[label]


IMAGE_HELD = {"k1"}


def image_workload(size: int) -> tuple[dict, Any, Any]:
    keys = jax.random.split(jax.random.key(3), 5)
    params = {
        "k1": jax.random.normal(keys[0], (4, 1, 3, 3)),
        "k2": jax.random.normal(keys[1], (4, 4, 3, 3)) / 3,
        "head": jax.random.normal(keys[2], (64, 3)) / 8,
    }
    images = jax.random.normal(keys[3], (size, 1, 8, 8))
    labels = jax.random.randint(keys[4], (size,), 0, 3)
    return params, images, labels


@pytest.fixture
def held_names(monkeypatch) -> list[set[str]]:
    """Per ghost call that held any leaf: the names of the leaves it held (dict parameters:
    the leaves in sorted key order)."""
    calls: list[set[str]] = []
    held = ghost_jax._held

    def spying(found: Any) -> dict[int, Any]:
        formed = held(found)
        calls.append(set(formed))
        return formed

    monkeypatch.setattr(ghost_jax, "_held", spying)
    return calls


def reference(
    loss: Any, params: dict, *batch: Any, max_norm: float | None = None
) -> tuple[dict, Any]:
    """The clipped sums and norms of a loop of single-example gradients, in float64; without
    ``max_norm``, clipped at the median norm (about half the examples)."""
    grads = {k: np.asarray(g, np.float64) for k, g in jax_loop_grads(loss, params, *batch).items()}
    size = batch[0].shape[0]
    norms = np.sqrt(sum((g.reshape(size, -1) ** 2).sum(axis=1) for g in grads.values()))
    bound = float(np.median(norms)) if max_norm is None else max_norm
    factors = np.minimum(1.0, bound / norms)
    return {k: np.tensordot(factors, g, axes=1) for k, g in grads.items()}, norms


def assert_close(actual: Any, expected: Any) -> None:
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=RTOL * scale)


def names_of(params: dict, indices: set[int]) -> set[str]:
    return {sorted(params)[k] for k in indices}


@pytest.mark.parametrize(
    "model",
    ["sequence", pytest.param("image", marks=pytest.mark.slow)],  # (3 s of CPU each)
)
def test_held_leaves_give_the_loops_clipped_sum(held_names, model):
    if model == "sequence":
        loss, params, batch, held = (
            sequence_loss,
            sequence_params(),
            sequence_batch(6),
            SEQUENCE_HELD,
        )
    else:
        params, images, labels = image_workload(6)
        loss, batch, held = image_loss, (images, labels), IMAGE_HELD
    want, norms = reference(loss, params, *batch)
    max_norm = float(np.median(norms))
    step = jax.jit(lambda p, *b: clipped_sum_of(loss, p, *b, max_norm=max_norm, strategy="ghost"))
    got = step(params, *batch)
    (indices,) = held_names
    assert names_of(params, indices) == held
    assert_close(got.norms, norms)
    for name, value in want.items():
        assert_close(got.sum[name], value)


@pytest.mark.slow  # about 2 s of CPU: five compiled masked steps
def test_each_held_example_stays_within_the_bound(held_names):
    params, (ids, labels) = sequence_params(), sequence_batch(5, seed=2)
    max_norm = 1e-3  # far below every example's norm

    @jax.jit
    def alone(k: Any) -> Any:
        mask = jnp.arange(5) == k
        return clipped_sum_of(
            sequence_loss, params, ids, labels, max_norm=max_norm, mask=mask, strategy="ghost"
        ).sum

    for k in range(5):
        total = np.sqrt(
            sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in alone(k).values())
        )
        assert max_norm * 0.99 <= total <= max_norm * (1 + 1e-6)
    assert names_of(params, held_names[-1]) == SEQUENCE_HELD


@pytest.mark.slow  # about 8 s of CPU: two steps run op by op
def test_without_hold_formed_nothing_is_held_and_the_sum_agrees(held_names, monkeypatch):
    params, batch = sequence_params(), sequence_batch(4, seed=3)
    held = clipped_sum_of(sequence_loss, params, *batch, max_norm=0.3, strategy="ghost")
    monkeypatch.setattr(cost, "HOLD_FORMED", False)
    records = clipped_sum_of(sequence_loss, params, *batch, max_norm=0.3, strategy="ghost")
    assert [names_of(params, c) for c in held_names] == [SEQUENCE_HELD, set()]
    want, _ = reference(sequence_loss, params, *batch, max_norm=0.3)
    for name, value in want.items():
        assert_close(records.sum[name], value)
        assert_close(held.sum[name], value)


@pytest.mark.slow  # about 5 s of CPU: norms run op by op
def test_norms_alone_hold_nothing(held_names):
    params, batch = sequence_params(), sequence_batch(4)
    norms = pergrad.norms.per_example_norms_of(sequence_loss, params, *batch, strategy="ghost")
    _, want = reference(sequence_loss, params, *batch)
    assert_close(norms, want)
    assert held_names == [set()] * len(held_names)


@pytest.mark.slow  # about 4 s of CPU: a step run op by op
def test_an_example_that_is_not_finite_adds_nothing(held_names):
    params, images, labels = image_workload(4)
    images = images.at[2, 0, 3, 3].set(jnp.nan)  # its gradients are nan: weight 0
    got = clipped_sum_of(image_loss, params, images, labels, max_norm=0.5, strategy="ghost")
    keep = np.array([0, 1, 3])
    want, _ = reference(image_loss, params, images[keep], labels[keep], max_norm=0.5)
    assert names_of(params, held_names[-1]) == IMAGE_HELD
    for name, value in want.items():
        assert_close(got.sum[name], value)


@pytest.mark.slow  # about 2 s of CPU: two compilations
def test_the_held_step_needs_less_of_xlas_temporary_memory(monkeypatch):
    """A long sequence over narrow layers: the formed gradients (``p q`` per example) replace
    the records (``T (p + q)``) held to the clipped sum; XLA's own account of the compiled
    step."""

    def loss(params: dict, x: Any, y: Any) -> Any:
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((jnp.tanh(h @ params["w2"]) @ params["w3"] - y) ** 2)

    keys = jax.random.split(jax.random.key(4), 5)
    params = {
        "w1": jax.random.normal(keys[0], (8, 16)),
        "w2": jax.random.normal(keys[1], (16, 16)) / 4,
        "w3": jax.random.normal(keys[2], (16, 4)),
    }
    x, y = jax.random.normal(keys[3], (8, 256, 8)), jax.random.normal(keys[4], (8, 256, 4))

    def temp_bytes() -> int:
        step = jax.jit(lambda p, x, y: clipped_sum_of(loss, p, x, y, max_norm=1.0).sum)
        return step.lower(params, x, y).compile().memory_analysis().temp_size_in_bytes

    held = temp_bytes()
    monkeypatch.setattr(cost, "HOLD_FORMED", False)
    assert held < 0.8 * temp_bytes()


@pytest.mark.parametrize(
    ("shape", "dtype"), [((300, 97), jnp.float32), ((2, 8, 6, 5), jnp.float16)]
)
def test_formed_norms_are_certified(shape, dtype):
    """The squared norm of exactly the formed numbers is within the certified bound of the
    estimate (float16: the conversion's rounding too), and the bound is no looser than the
    sum's worst case over the split axes (``(300, 97)``: 20 + 15 + 97 additions, not 397)."""
    spread = 4.0 if dtype == jnp.float32 else 1.0  # a wide range; float16's squares stay finite
    scales = jnp.exp(spread * jax.random.normal(jax.random.key(5), (3, *shape)))
    grads = (scales * jax.random.normal(jax.random.key(6), (3, *shape))).astype(dtype)
    found = jax.jit(jax_contractions.formed_squared_norms)(grads)
    assert found.estimate.dtype == found.bound.dtype == dtype
    exact = (np.asarray(grads, np.float64).reshape(3, -1) ** 2).sum(axis=1)
    estimate, bound = np.asarray(found.estimate, np.float64), np.asarray(found.bound, np.float64)
    assert np.all(np.abs(estimate - exact) <= bound)
    if dtype == jnp.float32:
        assert np.all(bound <= 300 * 2.0**-24 * exact)


def tied_lm_loss(params: dict, ids: Any) -> Any:
    """A table (11 x 4) that embeds the tokens and scores the next one."""
    logits = jnp.tanh(params["table"][ids] @ params["w"]) @ params["table"].T
    return -jnp.sum(jax.nn.log_softmax(logits)[:-1] * jax.nn.one_hot(ids[1:], 11))


@pytest.mark.parametrize("tokens", [6, 2])
def test_a_tied_table_is_held_over_a_long_enough_sequence(held_names, tokens):
    """Per example, the table's gradient (11 x 4 = 44 numbers) against its uses' cotangents,
    ``T (11 + 4)``: held at 6 tokens (90), its cross terms never formed; at 2 tokens (30) from
    the records (``w``, 16 numbers against ``4 T``, likewise). Both give the loop's clipped
    sum."""
    keys = jax.random.split(jax.random.key(4), 3)
    params = {
        "table": jax.random.normal(keys[0], (11, 4)),
        "w": jax.random.normal(keys[1], (4, 4)) / 2,
    }
    ids = jax.random.randint(keys[2], (5, tokens), 0, 11)  # ids repeat within examples
    want, norms = reference(tied_lm_loss, params, ids)
    max_norm = float(np.median(norms))
    step = jax.jit(lambda p, i: clipped_sum_of(tied_lm_loss, p, i, max_norm=max_norm))
    got = step(params, ids)
    (indices,) = held_names
    assert names_of(params, indices) == {6: {"table", "w"}, 2: set()}[tokens]
    assert_close(got.norms, norms)
    for name, value in want.items():
        assert_close(got.sum[name], value)
