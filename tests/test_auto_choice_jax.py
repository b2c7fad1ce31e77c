"""``strategy="auto"`` on a JAX loss: the ghost norms or materialised per-example gradients (issue 36).

Both routes are exact. ``capture/jax_cost.py`` estimates each one's extra work from the traced
contractions; where materialising is estimated faster, XLA's compiled temporary memory of both
decides (``api/compiled.py``): XLA sums a dense layer's per-example gradients without keeping
them, but keeps a row lookup's, so a tied token table (read by the lookups and the output
projection, one dense contraction) materialises and an untied one does not. Nothing here is
timed: the tests check that the choice follows the model and XLA's memory, that
``choose_strategy`` says why, and that every route gives the same clipped sums as a loop of
single-example gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX route choice")
import jax.numpy as jnp  # noqa: E402

import pergrad  # noqa: E402
import pergrad.dp  # noqa: E402
import pergrad.norms  # noqa: E402
from pergrad._src.api import compiled  # noqa: E402
from pergrad._src.capture import cost, jax_cost  # noqa: E402
from pergrad._src.capture.jax_engine import plan  # noqa: E402
from pergrad._src.core.call import Spec, analyse_call  # noqa: E402

VOCAB, WIDTH, TOKENS = 1024, 128, 96
MAX_NORM = 0.05


def head_loss(tied: bool):
    """A token table, one dense layer at every position, and an output projection by the
    table itself (``tied``) or by a head of its own: the shape of a language model's ends."""

    def loss(params, ids):
        h = jnp.tanh(params["embed"][ids] @ params["w"])
        head = params["embed"] if tied else params["head"]
        logits = h @ head.T
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, None], 1).mean()

    return loss


def head_call(tied: bool, batch: int = 8):
    rng = np.random.default_rng(0)
    params = {
        "embed": jnp.asarray(rng.normal(size=(VOCAB, WIDTH)) / 8, jnp.float32),
        "w": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / 8, jnp.float32),
    }
    if not tied:
        params["head"] = jnp.asarray(rng.normal(size=(VOCAB, WIDTH)) / 8, jnp.float32)
    ids = jnp.asarray(rng.integers(0, VOCAB, (batch, TOKENS)), jnp.int32)
    return head_loss(tied), params, ids


def reference_clipped_sum(loss, params, ids):
    """Each example's gradient by ``jax.grad``, one at a time, clipped at ``MAX_NORM`` in
    float64 numpy, and summed."""
    total = None
    for i in range(ids.shape[0]):
        grads = jax.grad(loss)(params, ids[i])
        flat = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = np.sqrt(sum((g**2).sum() for g in flat.values()))
        factor = min(1.0, MAX_NORM / norm)
        scaled = {k: factor * g for k, g in flat.items()}
        total = scaled if total is None else {k: total[k] + scaled[k] for k in total}
    return total


def assert_close_to(got, want):
    for key, value in want.items():
        np.testing.assert_allclose(np.asarray(got[key]), value, rtol=2e-4, atol=1e-7)


def test_a_tied_table_materialises_where_xla_holds_no_more():
    loss, params, ids = head_call(tied=True)
    choice = pergrad.norms.choose_strategy(loss, params, ids, clipped_sum=True)
    assert choice.strategy == "materialize", choice.reason
    assert "XLA's temporary memory" in choice.reason
    assert "ghost norms" in choice.reason and "multiply-adds" in choice.reason


def test_an_untied_table_keeps_the_ghost_norms_by_memory():
    """The untied table's per-example gradients come from a scatter, which XLA keeps: ``B x
    V x d`` numbers more than the ghost norms hold."""
    loss, params, ids = head_call(tied=False)
    choice = pergrad.norms.choose_strategy(loss, params, ids, clipped_sum=True)
    assert choice.strategy == "ghost", choice.reason
    assert "the ghost norms hold less memory" in choice.reason


@pytest.mark.parametrize("tied", [True, False])
def test_every_route_gives_the_clipped_sum_of_a_loop(tied):
    loss, params, ids = head_call(tied)
    want = reference_clipped_sum(loss, params, ids)

    def clipped(strategy):
        def step(p, x):
            return pergrad.dp.clipped_sum_of(loss, p, x, max_norm=MAX_NORM, strategy=strategy)

        return jax.jit(step)(params, ids).sum

    for strategy in ("auto", "ghost", "materialize"):
        assert_close_to(clipped(strategy), want)


def test_the_choice_follows_the_memory_margin(monkeypatch):
    """The same calls with the margin widened (the untied table materialises) and made
    negative (nothing may hold even as much as the ghost norms: the tied table stays ghost)."""
    loss, params, ids = head_call(tied=False)
    monkeypatch.setattr(cost, "XLA_MEMORY_MARGIN", 1.0)
    assert pergrad.norms.choose_strategy(loss, params, ids).strategy == "materialize"
    loss, params, ids = head_call(tied=True)
    monkeypatch.setattr(cost, "XLA_MEMORY_MARGIN", -0.5)
    assert pergrad.norms.choose_strategy(loss, params, ids).strategy == "ghost"


def test_the_choice_follows_the_work_model(monkeypatch):
    """Materialising made costlier than the ghost norms: nothing is compiled to compare."""
    loss, params, ids = head_call(tied=True)
    monkeypatch.setattr(cost, "MATERIALIZED_NUMBER_COST", 10**6)
    monkeypatch.setattr(compiled, "registry", None)  # compiling anything would fail
    choice = pergrad.norms.choose_strategy(loss, params, ids)
    assert choice.strategy == "ghost"
    assert "the ghost norms are cheaper" in choice.reason


def test_small_calls_keep_the_ghost_norms_without_estimating(monkeypatch):
    loss, params, ids = head_call(tied=True, batch=2)
    monkeypatch.setattr(cost, "MIN_CHOICE_NUMBERS", 10**9)
    monkeypatch.setattr(compiled, "registry", None)
    choice = pergrad.norms.choose_strategy(loss, params, ids)
    assert choice.strategy == "ghost"
    assert "estimated" not in choice.reason


def test_the_memory_of_each_route_is_compiled_once_per_shape(monkeypatch):
    loss, params, ids = head_call(tied=True)
    assert pergrad.norms.choose_strategy(loss, params, ids).strategy == "materialize"
    monkeypatch.setattr(compiled, "registry", None)  # compiling again would fail
    assert pergrad.norms.choose_strategy(loss, params, ids).strategy == "materialize"
    assert jax.jit(lambda p, x: pergrad.norms.per_example_norms_of(loss, p, x))(
        params, ids
    ).shape == (ids.shape[0],)


def test_a_loss_that_cannot_be_compiled_alone_keeps_the_ghost_norms(monkeypatch):
    """Where XLA cannot compile the call alone, the ghost norms are kept, and the choice
    says so."""
    loss, params, ids = head_call(tied=True)

    def refuse(self, *args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    choice = pergrad.norms.choose_strategy(loss, params, ids, clipped_sum=True)
    assert choice.strategy == "ghost"
    assert "could not be compiled alone" in choice.reason and "RuntimeError" in choice.reason


def test_a_loss_reading_a_value_of_the_enclosing_jit():
    """The loss closes over a traced value of the ``jit`` it is called in: the choice is made
    (compiled alone, the value stays abstract) and the clipped sum is the loop's."""
    base, params, ids = head_call(tied=True)
    seen = []

    def step(p, x, scale):
        def loss(q, y):
            return scale * base(q, y)

        seen.append(pergrad.norms.choose_strategy(loss, p, x, clipped_sum=True))
        return pergrad.dp.clipped_sum_of(loss, p, x, max_norm=MAX_NORM).sum

    got = jax.jit(step)(params, ids, jnp.float32(1.0))
    assert seen[0].strategy in ("ghost", "materialize") and "XLA" in seen[0].reason
    assert_close_to(got, reference_clipped_sum(base, params, ids))


def test_named_strategies_are_not_overruled(monkeypatch):
    loss, params, ids = head_call(tied=True)
    monkeypatch.setattr(compiled, "registry", None)
    assert pergrad.norms.choose_strategy(loss, params, ids, strategy="ghost").strategy == "ghost"


def test_each_site_as_the_work_model_sees_it():
    """The table's lookup works on its output's numbers; the dense layer and the head form a
    ``(positions, width in, width out)`` product per example."""
    loss, params, ids = head_call(tied=False)
    spec = Spec.create("t", loss, 0, "auto", False, None, None, None)
    call = analyse_call(spec, (params, ids))
    found = plan(spec, call)
    names = ["embed", "head", "w"]  # the flat order of the dict's keys
    sizes = [VOCAB * WIDTH, VOCAB * WIDTH, WIDTH * WIDTH]
    works = {names[k]: jax_cost.site_work(site, sizes[k]) for k, site in found.sites.items()}
    assert works["embed"].kind == "light" and works["embed"].widths == (TOKENS * WIDTH,)
    assert works["w"][:3] == ("dense", TOKENS, (WIDTH, WIDTH))
    assert works["head"][:3] == ("dense", TOKENS, (WIDTH, VOCAB))
    costs = jax_cost.route_costs(found, 8, sizes, clipped=False)
    per_example = sum(cost.layer_norm_work(work) for work in works.values())
    assert costs.ghost == 8 * per_example  # no fixed cost per layer under jit
    assert costs.materialize == cost.MATERIALIZED_NUMBER_COST * 8 * sum(sizes)


def test_a_clipped_sum_counts_the_leaves_its_ghost_step_holds():
    """A dense layer over more positions than its width has fewer per-example gradient numbers
    than cotangents: a clipped sum's ghost step forms them once (``ghost_jax._held``), at
    materialising's cost on its numbers; its norms alone take the formed route's work."""
    width, positions, batch = 16, 64, 4

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w = jnp.ones((width, width), jnp.float32)
    x = jnp.ones((batch, positions, width), jnp.float32)
    spec = Spec.create("t", loss, 0, "auto", False, None, None, None)
    call = analyse_call(spec, (w, x))
    found = plan(spec, call)
    held = jax_cost.route_costs(found, batch, [width * width], clipped=True)
    assert held.ghost == batch * cost.MATERIALIZED_NUMBER_COST * width * width
    norms = jax_cost.route_costs(found, batch, [width * width], clipped=False)
    (site,) = found.sites.values()
    dense = cost.LayerWork("dense", positions, (width, width), 1, width * width)
    assert jax_cost.site_work(site, width * width) == dense
    assert norms.ghost == batch * cost.layer_norm_work(dense)
