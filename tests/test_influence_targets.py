"""The target is not the training loss (issue 21): ``target_fn`` gives the test side its own
function of one example (a prediction, a margin), and ``regularizer`` puts the training
regulariser in the Hessian and in no gradient. Reference: the closed form of linear regression
in float64 numpy, ``scores = G (X^T X / n + R + damping I)^-1 T^T``."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad import influence

# Small programs of many shapes, op by op: compiled without XLA's backend optimisations.
pytestmark = pytest.mark.usefixtures("fast_xla_compile")

N_TRAIN, N_TEST, DIM = 12, 5, 4
L2 = 0.3
RNG = np.random.default_rng(21)
X = RNG.normal(size=(N_TRAIN, DIM))
Y = RNG.normal(size=N_TRAIN)
X_TEST = RNG.normal(size=(N_TEST, DIM))
W = RNG.normal(size=DIM)
B = 0.7


def closed_form(damping: float, l2_on_w: float, targets: np.ndarray) -> np.ndarray:
    """Scores for the loss 0.5 (x.w + b - y)^2 with an L2 penalty on w only."""
    design = np.hstack([X, np.ones((N_TRAIN, 1))])  # parameters (w, b)
    residual = design @ np.append(W, B) - Y
    grads = design * residual[:, None]
    hessian = design.T @ design / N_TRAIN + np.diag([l2_on_w] * DIM + [0.0])
    return grads @ np.linalg.solve(hessian + damping * np.eye(DIM + 1), targets.T)


PREDICTION_GRADS = np.hstack([X_TEST, np.ones((N_TEST, 1))])  # d(x.w + b)/d(w, b)


def problem(framework: str):
    """``(params, loss, prediction, regulariser on w, arrays)`` in one framework, float64."""
    if framework == "jax":
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as xp

        arrays = [xp.asarray(a) for a in (W, X, Y, X_TEST)]
        params = {"w": arrays[0], "b": xp.asarray(B)}
    else:
        torch = pytest.importorskip("torch")
        arrays = [torch.tensor(a, dtype=torch.float64) for a in (W, X, Y, X_TEST)]
        params = {"w": arrays[0], "b": torch.tensor(B, dtype=torch.float64)}

    def loss(p, x, y):
        return 0.5 * (x @ p["w"] + p["b"] - y) ** 2

    def prediction(p, x):
        return x @ p["w"] + p["b"]

    def weight_decay(p):
        return 0.5 * L2 * (p["w"] ** 2).sum()

    return params, loss, prediction, weight_decay, arrays[1:]


@pytest.fixture(params=["jax", "torch"])
def framework(request):
    yield request.param
    if request.param == "jax":
        import jax

        jax.config.update("jax_enable_x64", False)


def to_numpy(a):
    return a.detach().numpy() if hasattr(a, "detach") else np.asarray(a)


def test_target_fn_and_regularizer_match_the_closed_form(framework):
    params, loss, prediction, weight_decay, (x, y, x_test) = problem(framework)
    scores = influence.influence_function(
        loss,
        params,
        (x, y),
        (x_test,),
        damping=1e-3,
        target_fn=prediction,
        regularizer=weight_decay,
    )
    np.testing.assert_allclose(
        to_numpy(scores), closed_form(1e-3, L2, PREDICTION_GRADS), rtol=1e-8, atol=1e-10
    )


def test_the_test_side_is_solved_when_it_is_larger(framework):
    params, loss, prediction, weight_decay, (x, y, x_test) = problem(framework)
    # swap roles: 5 training examples, 12 targets (the training side is then solved for)
    scores = influence.influence_function(
        loss, params, (x_test, x_test @ params["w"] * 0), (x,), target_fn=prediction, damping=0.5
    )
    design = np.hstack([X_TEST, np.ones((N_TEST, 1))])
    residual = design @ np.append(W, B)
    hessian = design.T @ design / N_TEST + 0.5 * np.eye(DIM + 1)
    expected = (design * residual[:, None]) @ np.linalg.solve(
        hessian, np.hstack([X, np.ones((N_TRAIN, 1))]).T
    )
    np.testing.assert_allclose(to_numpy(scores), expected, rtol=1e-8, atol=1e-10)


def test_l2_as_damping_equals_l2_as_regularizer_when_every_parameter_is_penalised(framework):
    params, loss, _, _, (x, y, x_test) = problem(framework)
    y_test = x_test @ params["w"]

    def everything(p):
        return 0.5 * L2 * ((p["w"] ** 2).sum() + p["b"] ** 2)

    as_damping = influence.influence_function(loss, params, (x, y), (x_test, y_test), L2)
    as_regularizer = influence.influence_function(
        loss, params, (x, y), (x_test, y_test), regularizer=everything
    )
    np.testing.assert_allclose(to_numpy(as_regularizer), to_numpy(as_damping), rtol=1e-9)
    self_scores = influence.self_influence(loss, params, (x, y), regularizer=everything)
    np.testing.assert_allclose(
        to_numpy(self_scores),
        np.diag(to_numpy(influence.influence_function(loss, params, (x, y), (x, y), damping=L2))),
        rtol=1e-9,
    )


def test_tracin_and_top_k_take_a_target(framework):
    params, loss, prediction, weight_decay, (x, y, x_test) = problem(framework)
    scores = influence.tracin(
        loss, [params, params], [0.1, 0.2], (x, y), (x_test,), target_fn=prediction
    )
    design = np.hstack([X, np.ones((N_TRAIN, 1))])
    grads = design * (design @ np.append(W, B) - Y)[:, None]
    np.testing.assert_allclose(to_numpy(scores), 0.3 * grads @ PREDICTION_GRADS.T, rtol=1e-9)

    expected = closed_form(1e-3, L2, PREDICTION_GRADS)
    best = influence.top_k(
        loss,
        params,
        [(x[:7], y[:7]), (x[7:], y[7:])],
        (x_test,),
        k=3,
        target_fn=prediction,
        regularizer=weight_decay,
        hessian_batch=(x, y),
        damping=1e-3,
        solver="exact",
        progress=False,
    )
    np.testing.assert_array_equal(best.proponents, np.argsort(-expected.T, axis=1)[:, :3])


def test_bad_targets_and_regularizers_are_named(framework):
    params, loss, _, _, (x, y, x_test) = problem(framework)
    with pytest.raises(TypeError, match="target_fn must be the target of ONE example"):
        influence.influence_function(loss, params, (x, y), (x_test, y), target_fn=3)
    with pytest.raises(TypeError, match="regularizer must be a function of the parameters"):
        influence.influence_function(loss, params, (x, y), (x, y), regularizer="l2")
    with pytest.raises(ValueError, match=r"regularizer\(params\) must return a scalar; got shape"):
        influence.self_influence(loss, params, (x, y), regularizer=lambda p: p["w"] ** 2)
