"""pergrad.influence against leave-one-out retraining, numpy references, and across solvers and
frameworks.

The leave-one-out experiment (L2-regularised logistic regression on digits 3 vs 8, retrained
without each of 50 points by Newton's method in numpy) lives in ``benchmarks/influence_loo.py``,
which prints the table quoted in the README; the tests import it and assert on the same numbers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from pergrad import influence
from pergrad.influence import CG, Exact, InfluenceWarning, LiSSA

LOO_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "influence_loo.py"
RNG = np.random.default_rng(3)

# A test that expects a caveat says so with pytest.warns; any other one fails the test.
pytestmark = [
    pytest.mark.filterwarnings("error::pergrad.influence.InfluenceWarning"),
    # Small programs of many shapes, op by op: compiled without XLA's backend optimisations.
    pytest.mark.usefixtures("fast_xla_compile"),
]


def _load_loo_module():
    spec = importlib.util.spec_from_file_location("influence_loo", LOO_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def loo():
    """The benchmark module, its data and the numpy leave-one-out retraining (float64)."""
    pytest.importorskip("sklearn", reason="the leave-one-out data are scikit-learn's digits")
    module = _load_loo_module()
    data = module.load_data()
    return module, data, module.leave_one_out(data)


def float64(framework: str):
    """JAX computes in float64 only inside ``jax.enable_x64``; torch follows its inputs."""
    if framework == "jax":
        jax = pytest.importorskip("jax")
        return jax.enable_x64(True)
    pytest.importorskip("torch")
    return contextlib.nullcontext()


def logistic_problem(module, framework: str, data, theta):
    setup = module.jax_setup if framework == "jax" else module.torch_setup
    return setup(data, theta)


def to_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def numpy_logistic_grads(module, theta, x, y) -> np.ndarray:
    """``(n, 65)`` per-example gradients of the benchmark's loss, in closed form."""
    design = np.hstack([x, np.ones((len(x), 1))])
    prob = 1.0 / (1.0 + np.exp(-(design @ theta)))
    ridge = np.full(len(theta), module.L2)
    ridge[-1] = 0.0
    return (prob - y)[:, None] * design + ridge * theta


# --------------------------------------------------------------------------------------------
# The key validation: influence functions predict leave-one-out retraining.


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_exact_and_cg_predict_leave_one_out_retraining(loo, framework):
    module, data, result = loo
    with float64(framework):
        for solver in ("exact", CG(tol=1e-8)):
            scores = module.predicted_scores(framework, data, result.theta, solver)
            predicted = scores[result.removed] / len(data.x_train)
            # Measured 0.9962 for both solvers and frameworks (benchmarks/influence_loo.py).
            assert module.pearson(predicted, result.actual) >= 0.95
            # Right sign and scale: the actual change is the prediction plus higher-order terms.
            assert 0.8 < module.slope(predicted, result.actual) < 1.5


def test_lissa_predicts_leave_one_out_retraining(loo):
    module, data, result = loo
    pytest.importorskip("jax", reason="run in JAX, whose jitted Hessian-vector products are fast")
    deterministic, minibatch = LiSSA(depth=300), LiSSA(depth=300, batch_size=50)
    # Measured with depth 300: 0.9908 (deterministic, 17% from exact at this depth) and 0.9806
    # (minibatches of 50); with depth 1000: 0.9953 and 0.9922 (4 repeats).
    for solver, bound in ((deterministic, 0.98), (minibatch, 0.95)):
        with float64("jax"), warnings.catch_warnings():
            warnings.simplefilter("ignore", InfluenceWarning)  # not converged: see the numbers
            scores = module.predicted_scores("jax", data, result.theta, solver)
        predicted = scores[result.removed] / len(data.x_train)
        assert module.pearson(predicted, result.actual) >= bound


# --------------------------------------------------------------------------------------------
# Exact scores against numpy's closed-form gradients and Hessian.


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_exact_scores_match_numpy(loo, framework):
    module, data, result = loo
    theta = result.theta
    train_grads = numpy_logistic_grads(module, theta, data.x_train, data.y_train)
    test_grads = numpy_logistic_grads(module, theta, data.x_test[:7], data.y_test[:7])
    _, hessian = module.gradient_and_hessian(theta, data.x_train, data.y_train)
    damping = 0.05
    solved = np.linalg.solve(hessian + damping * np.eye(len(theta)), test_grads.T)
    expected = train_grads @ solved
    with float64(framework):
        loss, params, train, test = logistic_problem(module, framework, data, theta)
        test = tuple(t[:7] for t in test)
        scores = influence.influence_function(loss, params, train, test, damping=damping)
        assert tuple(scores.shape) == (len(data.x_train), 7)
        np.testing.assert_allclose(to_numpy(scores), expected, rtol=1e-8, atol=1e-10)
        own = influence.self_influence(loss, params, train, damping=damping)
    expected_own = np.einsum(
        "ip,pi->i", train_grads, np.linalg.solve(hessian + damping * np.eye(65), train_grads.T)
    )
    np.testing.assert_allclose(to_numpy(own), expected_own, rtol=1e-8)


def test_hessian_batch_defines_the_hessian(loo):
    module, data, result = loo
    theta, subset = result.theta, slice(0, 120)
    train_grads = numpy_logistic_grads(module, theta, data.x_train, data.y_train)
    test_grads = numpy_logistic_grads(module, theta, data.x_test, data.y_test)
    _, hessian = module.gradient_and_hessian(theta, data.x_train[subset], data.y_train[subset])
    expected = train_grads @ np.linalg.solve(hessian, test_grads.T)
    loss, params, train, test = logistic_problem(module, "torch", data, theta)
    hessian_batch = tuple(t[subset] for t in train)
    for solver in ("exact", CG(tol=1e-10)):
        scores = influence.influence_function(
            loss, params, train, test, solver=solver, hessian_batch=hessian_batch
        )
        np.testing.assert_allclose(to_numpy(scores), expected, rtol=1e-6, atol=1e-8)


def test_inverse_hvp_matches_numpy_solve(loo):
    module, data, result = loo
    theta = result.theta
    _, hessian = module.gradient_and_hessian(theta, data.x_train, data.y_train)
    vectors = RNG.normal(size=(3, 65))
    loss, params, train, _ = logistic_problem(module, "torch", data, theta)
    import torch

    tree = {"w": torch.tensor(vectors[:, :-1]), "b": torch.tensor(vectors[:, -1])}
    solved = influence.inverse_hvp(loss, params, train, tree, 0.1, CG(tol=1e-10))
    expected = np.linalg.solve(hessian + 0.1 * np.eye(65), vectors.T).T
    assert set(solved) == {"w", "b"} and tuple(solved["w"].shape) == (3, 64)
    np.testing.assert_allclose(to_numpy(solved["w"]), expected[:, :-1], rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(to_numpy(solved["b"]), expected[:, -1], rtol=1e-6, atol=1e-10)


def test_tracin_matches_numpy(loo):
    module, data, result = loo
    checkpoints = [result.theta * 0.5, result.theta]
    rates = [0.3, 0.1]
    expected = sum(
        rate
        * numpy_logistic_grads(module, theta, data.x_train, data.y_train)
        @ numpy_logistic_grads(module, theta, data.x_test, data.y_test).T
        for theta, rate in zip(checkpoints, rates)
    )
    params = [logistic_problem(module, "torch", data, theta)[1] for theta in checkpoints]
    loss, _, train, test = logistic_problem(module, "torch", data, result.theta)
    scores = influence.tracin(loss, params, rates, train, test, chunk_size=64)
    np.testing.assert_allclose(to_numpy(scores), expected, rtol=1e-8, atol=1e-12)


# --------------------------------------------------------------------------------------------
# A small non-convex model (float32): solvers agree, sides and chunks do not matter.


def mlp_problem(fw, n_train=24, n_test=9, seed=0):
    """A tanh network on random data, at random weights: non-convex, so solved with damping."""
    rng = np.random.default_rng(seed)

    def loss(params, x, y):  # ONE example
        hidden = fw.tanh(fw.matmul(x, params["w1"]) + params["b1"])
        return ((hidden * params["w2"]).sum() - y) ** 2

    params = {
        "w1": fw.array(rng.normal(size=(4, 6)) * 0.5),
        "b1": fw.array(rng.normal(size=6) * 0.1),
        "w2": fw.array(rng.normal(size=6) * 0.5),
    }
    x, y = rng.normal(size=(n_train + n_test, 4)), rng.normal(size=n_train + n_test)
    train = (fw.array(x[:n_train]), fw.array(y[:n_train]))
    test = (fw.array(x[n_train:]), fw.array(y[n_train:]))
    return loss, params, train, test


DAMPING = 1.5  # H's eigenvalues lie in [-0.93, 2.2] (seed 0) and [-0.91, 3.6] (seed 2)


def test_cg_and_lissa_agree_with_exact(fw):
    loss, params, train, test = mlp_problem(fw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InfluenceWarning)
        exact = to_numpy(influence.influence_function(loss, params, train, test, DAMPING))
        cg = influence.influence_function(loss, params, train, test, DAMPING, CG(tol=1e-5))
        lissa = influence.influence_function(loss, params, train, test, DAMPING, LiSSA(depth=150))
    scale = np.abs(exact).max()
    np.testing.assert_allclose(to_numpy(cg), exact, atol=1e-4 * scale)
    np.testing.assert_allclose(to_numpy(lissa), exact, atol=1e-3 * scale)


def test_swapping_train_and_test_transposes_the_scores(fw):
    # n_test > n_train takes the other branch (solve for the train side).
    loss, params, train, test = mlp_problem(fw, n_train=5, n_test=11, seed=2)
    forward = influence.influence_function(loss, params, train, test, DAMPING)
    backward = influence.influence_function(loss, params, test, train, DAMPING, hessian_batch=train)
    assert tuple(forward.shape) == (5, 11)
    np.testing.assert_allclose(to_numpy(forward), to_numpy(backward).T, rtol=1e-4, atol=1e-6)


def test_chunk_size_gives_the_same_scores(fw):
    loss, params, train, test = mlp_problem(fw)
    whole = influence.influence_function(loss, params, train, test, DAMPING, solver="cg")
    chunked = influence.influence_function(
        loss, params, train, test, DAMPING, solver="cg", chunk_size=5
    )
    np.testing.assert_allclose(to_numpy(chunked), to_numpy(whole), rtol=1e-4, atol=1e-6)


def test_self_influence_is_the_diagonal(fw):
    loss, params, train, _ = mlp_problem(fw)
    full = to_numpy(influence.influence_function(loss, params, train, train, DAMPING))
    own = influence.self_influence(loss, params, train, DAMPING)
    assert tuple(own.shape) == (24,)
    np.testing.assert_allclose(to_numpy(own), np.diag(full), rtol=1e-4)
    assert (to_numpy(own) > 0).all()  # H + damping*I is positive definite here


def test_jax_and_torch_give_the_same_scores():
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from conftest import _jax_framework, _torch_framework

    results = []
    for framework in (_jax_framework(), _torch_framework()):
        loss, params, train, test = mlp_problem(framework)  # the same weights and data
        scores = influence.influence_function(loss, params, train, test, DAMPING, solver="cg")
        results.append(to_numpy(scores))
    jax_scores, torch_scores = results
    np.testing.assert_allclose(jax_scores, torch_scores, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Scores from gradients you already have.


def random_grads(fw, batch_size):
    tree = {
        "layer": {"w": RNG.normal(size=(batch_size, 3, 2))},
        "b": RNG.normal(size=(batch_size, 4)),
    }
    flat = np.concatenate([tree["b"], tree["layer"]["w"].reshape(batch_size, -1)], axis=1)
    return {"layer": {"w": fw.array(tree["layer"]["w"])}, "b": fw.array(tree["b"])}, flat


def test_grad_dot_and_cosine_match_numpy(fw):
    train, train_flat = random_grads(fw, 6)
    test, test_flat = random_grads(fw, 4)
    dots = influence.grad_dot(train, test)
    cosines = influence.grad_cosine(train, test)
    expected_dots = train_flat @ test_flat.T
    norms = np.outer(np.linalg.norm(train_flat, axis=1), np.linalg.norm(test_flat, axis=1))
    assert tuple(dots.shape) == (6, 4)
    np.testing.assert_allclose(fw.to_numpy(dots), expected_dots, rtol=1e-5)
    np.testing.assert_allclose(fw.to_numpy(cosines), expected_dots / norms, rtol=1e-5)


def test_grad_cosine_of_a_zero_gradient_is_zero(fw):
    train, _ = random_grads(fw, 3)
    zero = {"layer": {"w": fw.array(np.zeros((1, 3, 2)))}, "b": fw.array(np.zeros((1, 4)))}
    np.testing.assert_array_equal(fw.to_numpy(influence.grad_cosine(train, zero)), 0.0)


def test_grad_dot_refuses_mismatched_structures(fw):
    train, _ = random_grads(fw, 3)
    other = {"layer": {"w": fw.array(np.zeros((2, 3, 2)))}, "b": fw.array(np.zeros((2, 5)))}
    with pytest.raises(ValueError, match=r"train_grads .*\['b'\]: \(4,\).* test_grads .*\(5,\)"):
        influence.grad_dot(train, other)
    with pytest.raises(ValueError, match="same structure"):
        influence.grad_cosine(train, {"b": fw.array(np.zeros((2, 4)))})


# --------------------------------------------------------------------------------------------
# Numerical caveats are reported.


def test_cg_that_runs_out_of_iterations_warns(fw):
    loss, params, train, test = mlp_problem(fw)
    with pytest.warns(InfluenceWarning, match="CG did not converge within max_iter=2"):
        influence.influence_function(loss, params, train, test, DAMPING, CG(max_iter=2))


def test_lissa_too_shallow_warns_and_too_small_a_scale_raises(fw):
    loss, params, train, test = mlp_problem(fw)
    with pytest.warns(InfluenceWarning, match="LiSSA has not converged"):
        influence.influence_function(loss, params, train, test, 0.01, LiSSA(depth=5))
    with pytest.raises(ValueError, match=r"LiSSA diverged .*scale=0.001"):
        influence.influence_function(loss, params, train, test, DAMPING, LiSSA(scale=1e-3))


def saddle_problem(fw):
    # fn = (a * b - x)^2 with mean(x) = 2: at a = b = 0.1 the Hessian is [[0.02, -3.96],
    # [-3.96, 0.02]], eigenvalues 3.98 and -3.94 (eigenvector (1, 1), along the gradients).
    def loss(params, x):
        return (params[0] * params[1] - x) ** 2

    return loss, fw.array(np.full(2, 0.1)), (fw.array(np.array([1.0, 2.0, 3.0])),)


def test_exact_warns_about_an_indefinite_hessian(fw):
    loss, params, batch = saddle_problem(fw)
    with pytest.warns(
        InfluenceWarning, match=r"1 negative eigenvalue.*smallest -3.94.*damping > 3.94"
    ):
        influence.self_influence(loss, params, batch)
    with pytest.warns(InfluenceWarning, match="negative curvature"):
        influence.self_influence(loss, params, batch, solver="cg")


def test_exact_refuses_a_singular_hessian(fw):
    # Two identical features and no regulariser: the Hessian of a linear model is singular.
    def loss(w, x, y):
        return ((x * w).sum() - y) ** 2

    x = np.repeat(RNG.normal(size=(8, 1)), 2, axis=1)
    batch = (fw.array(x), fw.array(RNG.normal(size=8)))
    with pytest.raises(ValueError, match="singular.*pass damping > 0"):
        influence.self_influence(loss, fw.array(np.zeros(2)), batch)
    own = influence.self_influence(loss, fw.array(np.zeros(2)), batch, damping=1e-3)
    assert np.isfinite(fw.to_numpy(own)).all()


# --------------------------------------------------------------------------------------------
# Bad input: each error names the argument, what was expected and what came.


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"solver": "newton"},
            ValueError,
            r"solver must be one of \['exact', 'cg', 'lissa', 'kfac', 'ekfac'\].*'newton'",
        ),
        ({"solver": 3}, TypeError, "solver must be one of"),
        ({"damping": -1.0}, ValueError, r"damping must be a finite number >= 0 .*got -1.0"),
        ({"damping": True}, ValueError, "damping must be"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
    ],
)
def test_bad_options(fw, kwargs, error, pattern):
    loss, params, train, test = mlp_problem(fw, n_train=4, n_test=2)
    with pytest.raises(error, match=pattern):
        influence.influence_function(loss, params, train, test, **kwargs)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: CG(tol=0), r"CG: tol must be a positive number; got 0"),
        (lambda: CG(max_iter=1.5), "CG: max_iter must be a positive int"),
        (lambda: LiSSA(scale=-1.0), "LiSSA: scale must be a positive number or None"),
        (lambda: LiSSA(depth=0), "LiSSA: depth must be a positive int; got 0"),
        (lambda: LiSSA(batch_size=0), "LiSSA: batch_size must be a positive int or None"),
        (lambda: Exact(block_size=-2), "Exact: block_size must be a positive int"),
    ],
)
def test_bad_solver_options(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_bad_batches(fw):
    loss, params, train, test = mlp_problem(fw, n_train=4, n_test=2)
    call = influence.influence_function
    with pytest.raises(
        TypeError, match=r"train_batch must be a tuple of fn's batched arguments.*\(X,\)"
    ):
        call(loss, params, train[0], test)
    with pytest.raises(ValueError, match="test_batch is an empty tuple"):
        call(loss, params, train, ())
    with pytest.raises(ValueError, match=r"test_batch is an empty batch \(0 examples\)"):
        call(loss, params, train, (test[0][:0], test[1][:0]))
    with pytest.raises(
        ValueError,
        match=r"arrays of train_batch disagree.*train_batch\[0\]: 4, train_batch\[1\]: 3",
    ):
        call(loss, params, (train[0], train[1][:3]), test)
    with pytest.raises(ValueError, match="test_batch has 1 argument.*train_batch has 2"):
        call(loss, params, train, (test[0],))
    with pytest.raises(ValueError, match="hessian_batch has 1 argument"):
        call(loss, params, train, test, hessian_batch=(train[0],))
    with pytest.raises(TypeError, match="fn must be the loss of ONE example"):
        call("loss", params, train, test)
    with pytest.raises(TypeError, match="params must hold floating-point arrays.*\\['steps'\\]"):
        call(loss, {"steps": fw.array(np.arange(3))}, train, test)
    with pytest.raises(TypeError, match="params must hold JAX arrays or torch tensors"):
        call(loss, {"steps": 3}, train, test)


def test_batch_from_another_framework_is_refused():
    torch = pytest.importorskip("torch")
    params = {"w": torch.zeros(3)}
    with pytest.raises(TypeError, match=r"train_batch\[0\] is a numpy.ndarray.*torch array"):
        influence.self_influence(lambda p, x: (p["w"] * x).sum() ** 2, params, (np.ones((4, 3)),))


def test_tracin_checks_checkpoints_and_rates(fw):
    loss, params, train, test = mlp_problem(fw, n_train=4, n_test=2)
    with pytest.raises(ValueError, match="learning_rates has 1 entries but there are 2"):
        influence.tracin(loss, [params, params], [0.1], train, test)
    with pytest.raises(ValueError, match="learning_rates must be positive"):
        influence.tracin(loss, [params], [-0.1], train, test)
    with pytest.raises(TypeError, match="checkpoints must be a non-empty list"):
        influence.tracin(loss, [], 0.1, train, test)
    single = influence.tracin(loss, [params], 0.5, train, test)
    dot = influence.grad_dot(
        *(__import__("pergrad").per_example_grads(loss)(params, *batch) for batch in (train, test))
    )
    np.testing.assert_allclose(fw.to_numpy(single), 0.5 * fw.to_numpy(dot), rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Random projections.


def projection_grads(fw, count=5):
    """Per-example gradients in two leaves, and the same numbers laid side by side."""
    tree = {"a": RNG.normal(size=(count, 7, 3)), "b": RNG.normal(size=(count, 1000))}
    flat = np.concatenate([tree["a"].reshape(count, -1), tree["b"]], axis=1)
    return {key: fw.array(value) for key, value in tree.items()}, flat


def projection_matrix(fw, size, k, **options):
    """The (P, k) matrix itself: the projection of the identity, as one leaf."""
    return fw.to_numpy(influence.project(fw.array(np.eye(size)), k, **options))


@pytest.mark.parametrize("kind", ["gaussian", "rademacher"])
def test_project_is_a_fixed_linear_map_whatever_the_leaves_and_blocks(fw, kind):
    grads, flat = projection_grads(fw)
    matrix = projection_matrix(fw, flat.shape[1], 16, seed=4, kind=kind, block_size=300)
    projected = influence.project(grads, 16, seed=4, kind=kind, block_size=77)
    assert tuple(projected.shape) == (5, 16)
    np.testing.assert_allclose(fw.to_numpy(projected), flat @ matrix, rtol=1e-4, atol=1e-4)
    if kind == "rademacher":
        np.testing.assert_allclose(np.abs(matrix), 16**-0.5, rtol=1e-6)


def test_project_depends_on_the_seed_not_the_framework():
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from conftest import _jax_framework, _torch_framework

    grads = RNG.normal(size=(4, 300))
    jax_fw, torch_fw = _jax_framework(), _torch_framework()
    by_jax = jax_fw.to_numpy(influence.project(jax_fw.array(grads), 8, seed=1))
    by_torch = torch_fw.to_numpy(influence.project(torch_fw.array(grads), 8, seed=1))
    other_seed = torch_fw.to_numpy(influence.project(torch_fw.array(grads), 8, seed=2))
    np.testing.assert_allclose(by_jax, by_torch, rtol=1e-5, atol=1e-5)
    assert np.abs(other_seed - by_torch).max() > 0.1


def test_projected_dot_products_approximate_the_full_ones(fw):
    grads, flat = projection_grads(fw, count=6)
    projected = influence.project(grads, 2000, seed=0)
    approximate = fw.to_numpy(influence.grad_dot(projected, projected))
    exact = flat @ flat.T
    # Johnson-Lindenstrauss: relative error of order sqrt(2 / k) = 3% on the squared norms.
    np.testing.assert_allclose(np.diag(approximate), np.diag(exact), rtol=0.15)
    assert np.corrcoef(approximate.ravel(), exact.ravel())[0, 1] > 0.95


def test_projection_error_shrinks_as_k_grows(fw):
    """The JL bound: the relative error of projected dot products falls like 1 / sqrt(k)."""
    grads, flat = projection_grads(fw, count=6)
    exact = flat @ flat.T

    def mean_error(k):
        errors = []
        for seed in range(6):
            projected = influence.project(grads, k, seed=seed)
            approximate = fw.to_numpy(influence.grad_dot(projected, projected))
            errors.append(np.abs(approximate - exact).mean() / np.abs(exact).mean())
        return float(np.mean(errors))

    small, medium, large = mean_error(25), mean_error(100), mean_error(400)
    assert large < medium < small
    assert large < 0.5 * small  # 1 / sqrt(16) = 0.25 expected; 0.5 leaves room for noise


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"k": 0}, "k must be a positive int; got 0"),
        ({"k": 2.5}, "k must be a positive int; got 2.5"),
        ({"k": 4, "seed": -1}, "seed must be a non-negative int"),
        ({"k": 4, "kind": "sparse"}, r"kind must be one of \['gaussian', 'rademacher'\]"),
        ({"k": 4, "block_size": 0}, "block_size must be a positive int"),
    ],
)
def test_project_bad_options(fw, options, pattern):
    grads, _ = projection_grads(fw)
    with pytest.raises(ValueError, match=f"project: {pattern}"):
        influence.project(grads, **options)


def test_torch_module_parameters_are_left_alone():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import pergrad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = dict(model.named_parameters())  # the model's own tensors, requiring grad
    before = {name: value.detach().clone() for name, value in params.items()}
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    scores = influence.influence_function(loss, params, (x[:7], y[:7]), (x[7:], y[7:]), 1.0)
    assert tuple(scores.shape) == (7, 3) and not scores.requires_grad
    for name, value in model.named_parameters():
        assert value.requires_grad and value.grad is None and torch.equal(value, before[name])
