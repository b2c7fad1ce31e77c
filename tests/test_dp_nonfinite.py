"""Non-finite per-example gradients are zeroed and counted on every DP reduction path.

One example of the batch gets a nan (or inf) input, so its gradient is not finite. On every
path (``pergrad.dp.clip`` / ``clipped_sum`` / ``private_mean`` on materialised gradients,
``clipped_sum_of`` / ``private_grad_of`` with each strategy, the optax transform and
``DPOptimizer``), in both frameworks, the clipped sum must equal the reference: a loop of
single-example gradients (``tests/_reference.py``) of the other examples, clipped by hand and
summed; ``nonfinite`` must be 1 and ``count`` the whole batch.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pergrad
from _reference import jax_loop_grads, torch_loop_grads
from pergrad import dp

MAX_NORM = 0.5
BATCH = 6
BAD = 2  # the example made non-finite


def reference_clipped_sum(per_example: dict, max_norm: float, skip: set[int]) -> dict:
    """``sum_i min(1, C / |g_i|) g_i`` over the examples not in ``skip``, in float64 numpy."""
    grads = {k: np.asarray(v, dtype=np.float64) for k, v in per_example.items()}
    batch_size = len(next(iter(grads.values())))
    keep = np.array([i not in skip for i in range(batch_size)])
    flat = np.concatenate([g.reshape(batch_size, -1) for g in grads.values()], axis=1)
    norms = np.linalg.norm(np.where(keep[:, None], flat, 0.0), axis=1)
    factors = np.where(keep, np.minimum(1.0, max_norm / np.maximum(norms, 1e-30)), 0.0)
    return {
        k: np.tensordot(factors, np.where(keep.reshape(-1, *[1] * (g.ndim - 1)), g, 0.0), 1)
        for k, g in grads.items()
    }


def assert_sums_close(got: dict, expected: dict, to_numpy) -> None:
    assert set(got) == set(expected)
    for k in expected:
        np.testing.assert_allclose(to_numpy(got[k]), expected[k], rtol=2e-4, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# PyTorch


def torch_setup(bad_value: float = float("nan")):
    import torch
    from torch import nn

    class Scale(nn.Module):
        """A learnable per-feature scale: no ghost rule, so the ghost strategy runs it alone
        (per-example gradients of its parameter), a third kind of masked record."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

        def forward(self, x):
            return x * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), Scale(5), nn.Linear(5, 3)
    ).double()
    x = torch.randn(BATCH, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH,))
    x[BAD, 1] = bad_value
    return model, x, y


def torch_reference(model, x, y, max_norm: float = MAX_NORM, skip=(BAD,)) -> dict:
    import torch
    import torch.nn.functional as F

    def loss_of_one(params, xi, yi):
        out = torch.func.functional_call(model, params, (xi[None],))
        return F.cross_entropy(out, yi[None])

    params = {k: v.detach() for k, v in model.named_parameters()}
    per_example = torch_loop_grads(loss_of_one, params, x, y)
    return reference_clipped_sum(
        {k: v.numpy() for k, v in per_example.items()}, max_norm, set(skip)
    )


def torch_to_numpy(t):
    return t.detach().cpu().numpy()


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem", "chunked", "materialize"])
def test_torch_clipped_sum_of_zeroes_and_counts(strategy, bad_value):
    import torch.nn.functional as F

    model, x, y = torch_setup(bad_value)
    loss = pergrad.module_loss(model, F.cross_entropy)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y, strategy=strategy)
    assert choice.strategy == strategy
    result = dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=MAX_NORM, strategy=strategy)
    assert_sums_close(result.sum, torch_reference(model, x, y), torch_to_numpy)
    assert float(result.nonfinite) == 1.0
    assert float(result.count) == BATCH
    assert not np.isfinite(torch_to_numpy(result.norms)[BAD])


def test_torch_ghost_uses_the_generic_unit_and_rules():
    """The model above keeps the ghost path (Linear, LayerNorm rules; Scale run alone), so the
    ghost test covers the masked records of each kind."""
    import torch.nn.functional as F

    model, x, y = torch_setup()
    loss = pergrad.module_loss(model, F.cross_entropy)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y)
    assert choice.strategy == "ghost"
    assert set(choice.layers.values()) == {"linear", "layer_norm", "generic"}


def test_torch_chunked_loop_fallback_zeroes_and_counts():
    """A GRU, which torch.func cannot vectorise: the chunked strategy's one-at-a-time loop."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(3, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.gru(x)[0][:, -1])

    torch.manual_seed(1)
    model = Recurrent().double()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    x[1, 0, 0] = float("nan")
    loss = pergrad.module_loss(model, F.cross_entropy)
    with pytest.warns(pergrad.FallbackWarning, match="one example at a time"):
        result = dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=MAX_NORM, strategy="chunked")
    assert_sums_close(result.sum, torch_reference(model, x, y, skip=(1,)), torch_to_numpy)
    assert float(result.nonfinite) == 1.0


def test_torch_materialised_clip_clipped_sum_private_mean():
    import torch
    import torch.nn.functional as F

    model, x, y = torch_setup()
    loss = pergrad.module_loss(model, F.cross_entropy)
    grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    expected = torch_reference(model, x, y)
    result = dp.clipped_sum(grads, MAX_NORM)
    assert_sums_close(result.sum, expected, torch_to_numpy)
    assert float(result.nonfinite) == 1.0 and float(result.count) == BATCH
    clipped = dp.clip(grads, MAX_NORM)
    assert all(bool((v[BAD] == 0).all()) for v in clipped.values())
    assert_sums_close({k: v.sum(0) for k, v in clipped.items()}, expected, torch_to_numpy)
    mean, stats = dp.private_mean(grads, MAX_NORM, 0.0, torch.Generator().manual_seed(0))
    assert_sums_close(mean, {k: v / BATCH for k, v in expected.items()}, torch_to_numpy)
    assert float(stats.nonfinite) == 1.0


def test_torch_private_grad_of_zeroes_the_example():
    import torch
    import torch.nn.functional as F

    model, x, y = torch_setup()
    loss = pergrad.module_loss(model, F.cross_entropy)
    grad, stats = dp.private_grad_of(
        loss,
        loss.params(),
        x,
        y,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        rng=torch.Generator().manual_seed(0),
        expected_batch_size=4.0,
    )
    expected = {k: v / 4.0 for k, v in torch_reference(model, x, y).items()}
    assert_sums_close(grad, expected, torch_to_numpy)
    assert float(stats.nonfinite) == 1.0


def test_padding_is_not_counted_as_non_finite(fw):
    """A padding example (mask False) with a nan gradient contributes nothing and is neither
    a real example nor a non-finite one; a real nan example is."""
    rng = np.random.default_rng(3)
    grads = {"w": rng.normal(size=(5, 3, 2)), "b": rng.normal(size=(5, 2))}
    grads["w"][1, 0, 0] = np.nan
    grads["b"][4, 1] = np.inf
    mask = np.array([True, True, True, True, False])
    result = dp.clipped_sum({k: fw.array(v) for k, v in grads.items()}, 1.0, mask=fw.array(mask))
    expected = reference_clipped_sum(grads, 1.0, skip={1, 4})
    assert_sums_close(result.sum, expected, fw.to_numpy)
    assert float(result.nonfinite) == 1.0
    assert float(result.count) == 4.0


def test_torch_ghost_padding_with_a_nan_is_masked_but_not_counted():
    import torch
    import torch.nn.functional as F

    model, x, y = torch_setup()
    loss = pergrad.module_loss(model, F.cross_entropy)
    mask = torch.ones(BATCH, dtype=torch.bool)
    mask[BAD] = False
    result = dp.clipped_sum_of(
        loss, loss.params(), x, y, max_norm=MAX_NORM, strategy="ghost", mask=mask
    )
    assert_sums_close(result.sum, torch_reference(model, x, y), torch_to_numpy)
    assert (float(result.nonfinite), float(result.count)) == (0.0, BATCH - 1)


def test_every_example_non_finite_gives_a_zero_sum(fw):
    rng = np.random.default_rng(4)
    grads = {"w": rng.normal(size=(3, 4))}
    grads["w"][:, 0] = np.nan
    result = dp.clipped_sum({k: fw.array(v) for k, v in grads.items()}, 1.0)
    np.testing.assert_array_equal(fw.to_numpy(result.sum["w"]), np.zeros(4))
    assert float(result.nonfinite) == 3.0
    assert float(result.clip_fraction) == 0.0


def test_per_group_clipping_zeroes_the_example_in_every_group():
    """Per-layer bounds: a nan in one group's gradient zeroes the example in all groups."""
    import torch
    import torch.nn.functional as F

    model, x, y = torch_setup()
    loss = pergrad.module_loss(model, F.cross_entropy)
    bounds = {name: 0.3 for name in loss.params()}
    grads = pergrad.per_example_grads(loss)(loss.params(), x, y)
    result = dp.clipped_sum(grads, bounds)
    ghost = dp.clipped_sum_of(loss, loss.params(), x, y, max_norm=bounds, strategy="ghost")
    # reference: each parameter its own group, clipped by hand over the finite examples
    expected = {}
    for name, g in grads.items():
        expected.update(reference_clipped_sum({name: torch_to_numpy(g)}, 0.3, {BAD}))
    for clipped in (result, ghost):
        assert_sums_close(clipped.sum, expected, torch_to_numpy)
        assert float(clipped.nonfinite) == 1.0
    assert all(torch.isfinite(v).all() for v in ghost.sum.values())


# ---------------------------------------------------------------------------------------------
# DPOptimizer


def dp_optimizer(model, **kwargs):
    import torch
    import torch.nn.functional as F

    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        **kwargs,
    )


def test_dp_optimizer_zeroes_counts_and_warns_once():
    model, x, y = torch_setup()
    expected = torch_reference(model, x, y)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = dp_optimizer(model)
    with pytest.warns(pergrad.NonFiniteWarning, match="1 of 6 examples.*still counts"):
        stats = optimizer.step(x, y)
    assert stats.nonfinite == 1 and stats.batch_size == BATCH and not stats.skipped
    for name, param in model.named_parameters():
        np.testing.assert_allclose(
            torch_to_numpy(before[name] - param), expected[name] / BATCH, rtol=2e-4, atol=2e-7
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", pergrad.NonFiniteWarning)
        assert optimizer.step(x, y).nonfinite == 1  # said once per optimizer
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_dp_optimizer_accumulation_adds_the_counts():
    model, x, y = torch_setup()
    expected = torch_reference(model, x, y)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = dp_optimizer(model)
    with pytest.warns(pergrad.NonFiniteWarning):
        first = optimizer.accumulate(x[:3], y[:3])
        second = optimizer.accumulate(x[3:], y[3:])
    stats = optimizer.step()
    assert (first.nonfinite, second.nonfinite, stats.nonfinite) == (1, 0, 1)
    assert stats.batch_size == BATCH
    for name, param in model.named_parameters():
        np.testing.assert_allclose(
            torch_to_numpy(before[name] - param), expected[name] / BATCH, rtol=2e-4, atol=2e-7
        )


# ---------------------------------------------------------------------------------------------
# JAX


def jax_setup(bad_value: float = float("nan")):
    jnp = pytest.importorskip("jax.numpy", reason="the JAX paths need jax")
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
        "scale": jnp.asarray(np.linspace(0.5, 1.5, 5), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
    }
    x = rng.normal(size=(BATCH, 4)).astype(np.float32)
    x[BAD, 1] = bad_value
    y = rng.integers(0, 3, size=BATCH)
    return params, jnp.asarray(x), jnp.asarray(y)


def jax_loss(params, x, y):
    import jax
    import jax.numpy as jnp

    hidden = jnp.tanh(x @ params["w1"] + params["b1"]) * params["scale"]
    return -jax.nn.log_softmax(hidden @ params["w2"])[y]


def jax_reference(params, x, y, max_norm: float = MAX_NORM) -> dict:
    per_example = jax_loop_grads(jax_loss, params, x, y)
    return reference_clipped_sum(
        {k: np.asarray(v) for k, v in per_example.items()}, max_norm, {BAD}
    )


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
@pytest.mark.parametrize("strategy", ["ghost", "chunked", "materialize"])
def test_jax_clipped_sum_of_under_jit(strategy, bad_value):
    import jax

    params, x, y = jax_setup(bad_value)
    assert pergrad.norms.choose_strategy(jax_loss, params, x, y, strategy=strategy)
    run = jax.jit(
        lambda p, a, b: dp.clipped_sum_of(jax_loss, p, a, b, max_norm=MAX_NORM, strategy=strategy)
    )
    result = run(params, x, y)
    assert_sums_close(result.sum, jax_reference(params, x, y), np.asarray)
    assert float(result.nonfinite) == 1.0
    assert float(result.count) == BATCH


def test_jax_ghost_masks_sites_and_other_leaves():
    """The JAX loss keeps ghost for w1, w2 (dense contractions) and forms per-example
    gradients for b1 and scale in the same pass: both kinds of records are masked."""
    params, x, y = jax_setup()
    choice = pergrad.norms.choose_strategy(jax_loss, params, x, y)
    assert choice.strategy == "ghost"
    assert set(choice.layers.values()) == {"linear"} and len(choice.unsupported) == 2


def test_jax_every_example_non_finite_gives_a_zero_sum_on_the_chunked_path():
    """Every weight 0: the chunked weighted loss has no finite stand-in to run."""
    import jax
    import jax.numpy as jnp

    params, x, y = jax_setup()
    x = jnp.full_like(x, jnp.nan)
    for strategy in ("chunked", "ghost"):
        result = jax.jit(
            lambda p, a, b, s=strategy: dp.clipped_sum_of(
                jax_loss, p, a, b, max_norm=1.0, strategy=s
            )
        )(params, x, y)
        assert all(bool((v == 0).all()) for v in jax.tree.leaves(result.sum))
        assert float(result.nonfinite) == BATCH


def test_jax_materialised_private_mean_and_optax_under_jit():
    import jax
    import optax

    params, x, y = jax_setup()
    expected = jax_reference(params, x, y)
    grads = jax.jit(pergrad.per_example_grads(jax_loss))(params, x, y)

    mean, stats = jax.jit(lambda g: dp.private_mean(g, MAX_NORM, 0.0, jax.random.key(0)))(grads)
    assert_sums_close(mean, {k: v / BATCH for k, v in expected.items()}, np.asarray)
    assert float(stats.nonfinite) == 1.0

    tx = optax.chain(dp.optax_aggregate(MAX_NORM, 0.0, 0), optax.sgd(1.0))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert_sums_close(updates, {k: -v / BATCH for k, v in expected.items()}, np.asarray)
    assert float(state[0].nonfinite) == 1.0 and float(state[0].count) == BATCH


def test_jax_private_grad_of_under_jit():
    import jax

    params, x, y = jax_setup()
    grad, stats = jax.jit(
        lambda p, a, b: dp.private_grad_of(
            jax_loss, p, a, b, max_norm=MAX_NORM, noise_multiplier=0.0, rng=jax.random.key(0)
        )
    )(params, x, y)
    expected = jax_reference(params, x, y)
    assert_sums_close(grad, {k: v / BATCH for k, v in expected.items()}, np.asarray)
    assert float(stats.nonfinite) == 1.0


# ---------------------------------------------------------------------------------------------
# The bound, as a property


@settings(max_examples=15, deadline=None)
@given(
    batch_size=st.integers(1, 8),
    max_norm=st.floats(0.01, 10.0),
    scale=st.floats(0.01, 100.0),
    bad=st.lists(st.tuples(st.integers(0, 7), st.sampled_from([np.nan, np.inf, -np.inf]))),
    framework=st.sampled_from(["jax", "torch"]),
    seed=st.integers(0, 2**16),
)
def test_clipped_contributions_never_exceed_the_bound(
    batch_size, max_norm, scale, bad, framework, seed
):
    """With some examples made non-finite, every clipped contribution is within the bound,
    the non-finite ones are exactly zero, and the clipped sum is the sum of the clipped
    contributions."""
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy", reason="the JAX backend needs jax")
        array, to_numpy = (lambda v: jnp.asarray(v, jnp.float32)), np.asarray
    else:
        torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch")
        array, to_numpy = (lambda v: torch.tensor(v, dtype=torch.float32)), torch_to_numpy
    rng = np.random.default_rng(seed)
    grads = {
        "w": scale * rng.normal(size=(batch_size, 3, 2)),
        "b": scale * rng.normal(size=(batch_size, 2)),
    }
    broken = set()
    for index, value in bad:
        if index < batch_size:
            grads["w" if index % 2 else "b"][index].flat[0] = value
            broken.add(index)
    arrays = {k: array(v) for k, v in grads.items()}
    clipped = {k: to_numpy(v).astype(np.float64) for k, v in dp.clip(arrays, max_norm).items()}
    flat = np.concatenate([v.reshape(batch_size, -1) for v in clipped.values()], axis=1)
    assert np.isfinite(flat).all()
    norms = np.linalg.norm(flat, axis=1)
    assert (norms <= max_norm * (1 + 1e-5)).all()
    assert all(norms[i] == 0 for i in broken)
    result = dp.clipped_sum(arrays, max_norm)
    assert float(result.nonfinite) == len(broken)
    for k in grads:
        np.testing.assert_allclose(
            to_numpy(result.sum[k]), clipped[k].sum(0), rtol=1e-4, atol=1e-5 * max_norm
        )


# ---------------------------------------------------------------------------------------------
# benchmarks/nonfinite_cost.py: its step without the cleaning is the same step, minus it


def nonfinite_cost_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "nonfinite_cost.py"
    spec = importlib.util.spec_from_file_location("nonfinite_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_benchmark_without_cleaning_skips_it_and_restores_it(fw, strategy):
    """Inside ``without_nonfinite_cleaning`` a nan example poisons the clipped sum on the
    paths the benchmark times (so the cleaning really is gone there); after it, the example
    is zeroed again (the library is restored)."""
    benchmark = nonfinite_cost_benchmark()
    if fw.name == "jax":
        params, x, y = jax_setup()
        loss, expected = jax_loss, jax_reference(params, x, y)
        to_numpy = np.asarray
    else:
        import torch.nn.functional as F

        model, x, y = torch_setup()
        loss = pergrad.module_loss(model, F.cross_entropy)
        params, expected, to_numpy = loss.params(), torch_reference(model, x, y), torch_to_numpy

    def clipped():
        return dp.clipped_sum_of(loss, params, x, y, max_norm=MAX_NORM, strategy=strategy)

    with benchmark.without_nonfinite_cleaning():
        poisoned = clipped().sum
    assert any(np.isnan(to_numpy(v)).any() for v in poisoned.values())
    assert_sums_close(clipped().sum, expected, to_numpy)


def test_benchmark_quick_run_times_the_same_update_with_and_without_cleaning():
    """One round of the PyTorch half on a tiny MLP: a row per strategy, positive times, and
    the two steps' updates identical on finite data (same noise seed)."""
    pytest.importorskip("torch", reason="the PyTorch half of the benchmark")
    benchmark = nonfinite_cost_benchmark()
    rows = benchmark.measure("torch", (6, 5, 3), 4, rounds=1, warmup=0)
    assert [row["strategy"] for row in rows] == ["materialize", "ghost"]
    for row in rows:
        assert row["with_ms"] > 0 and row["without_ms"] > 0 and row["ratio"] > 0
        assert row["diff"] == 0.0
    assert benchmark.table(rows).count("\n| torch |") == 2
