"""The solver and estimator protocol (issue 32): a toy solver and toy estimators, registered here
by subclassing ``pergrad.influence.Solver`` / ``Estimator``, serve ``influence_function``,
``self_influence``, ``inverse_hvp`` and ``top_k`` by name and as instances, as the built-in ones
do. References: numpy closed forms of a linear least-squares problem in float64, whose
per-example gradient is ``x_i r_i`` with the residual ``r_i = x_i . w - y_i``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

import pergrad
from pergrad import influence

RNG = np.random.default_rng(11)
N, N_TEST, DIM = 12, 3, 4
W = RNG.normal(size=DIM)
X, Y = RNG.normal(size=(N, DIM)), RNG.normal(size=N)
XT, YT = RNG.normal(size=(N_TEST, DIM)), RNG.normal(size=N_TEST)


def loss(w, x, y):
    return 0.5 * ((x * w).sum() - y) ** 2


def gradients(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``(n, DIM)`` per-example gradients of ``loss`` at ``W``, in closed form."""
    return x * (x @ W - y)[:, None]


TRAIN_GRADS, TEST_GRADS = gradients(X, Y), gradients(XT, YT)
FISHER_DIAGONAL = (TRAIN_GRADS**2).mean(0)


def arrays(fw):
    return [fw.array(a) for a in (W, X, Y, XT, YT)]


def batches(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


def assert_top_k_matches(result, reference: np.ndarray, k: int) -> None:
    """Each test example's kept training examples are the reference's k best and k worst (by
    their reference scores, so rounding cannot swap near ties), with those scores."""
    assert result.num_train == reference.shape[0]
    for j in range(reference.shape[1]):
        column = reference[:, j]
        np.testing.assert_allclose(
            column[result.proponents[j]], np.sort(column)[::-1][:k], rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(
            column[result.opponents[j]], np.sort(column)[:k], rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(
            result.proponent_scores[j], column[result.proponents[j]], rtol=1e-4, atol=1e-6
        )


@pytest.fixture
def toys(monkeypatch):
    """A toy solver and two toy estimators, registered for one test only: the registries are
    restored afterwards, so no other test sees their names."""
    monkeypatch.setattr(influence.Solver, "registry", dict(influence.Solver.registry))
    monkeypatch.setattr(influence.Estimator, "registry", dict(influence.Estimator.registry))

    @dataclass(frozen=True)
    class DiagonalFisher(influence.Solver, name="toy_diagonal_fisher"):
        """``(F + d I)^-1``, ``F`` the diagonal of the Hessian batch's empirical Fisher."""

        def prepare(self, caller, loss, batch, count):
            grads = loss.grads(batch)
            return (grads * grads).mean(0)

        def solve(self, caller, prepared, rows, dampings):
            return [rows / (prepared + d) for d in dampings]

    @dataclass(frozen=True)
    class TrainDirection(influence.Estimator, name="toy_train_direction"):
        """The training gradient's direction dotted with the test gradient."""

        def prepare(self, task, test_batch):
            loss = task.loss()
            test, _ = loss.check_batch("test_batch", test_batch)
            rows = loss.target(task.target_fn).grads(test)

            def score(batch, count):
                grads = loss.grads(batch)
                return (grads @ rows.T) / ((grads * grads).sum(1) ** 0.5).reshape(count, 1)

            return score

    @dataclass(frozen=True)
    class WholeDot(influence.Estimator, name="toy_whole_dot"):
        """Gradient dot products from the whole training batch at once (no ``prepare``)."""

        def scores(self, task, train_batch, test_batch):
            loss = task.loss()
            return loss.grads(tuple(train_batch)) @ loss.grads(tuple(test_batch)).T

    return SimpleNamespace(solver=DiagonalFisher, estimator=TrainDirection, whole=WholeDot)


def test_a_registered_solver_serves_every_function_by_name_and_as_an_instance(fw, toys):
    w, x, y, xt, yt = arrays(fw)

    def expected(damping):
        return (TRAIN_GRADS / (FISHER_DIAGONAL + damping)) @ TEST_GRADS.T

    by_name = influence.influence_function(
        loss, w, (x, y), (xt, yt), damping=0.1, solver="toy_diagonal_fisher"
    )
    np.testing.assert_allclose(fw.to_numpy(by_name), expected(0.1), rtol=1e-4, atol=1e-6)
    grid = influence.influence_function(
        loss, w, (x, y), (xt, yt), damping=[0.1, 1.0], solver=toys.solver()
    )
    np.testing.assert_allclose(
        fw.to_numpy(grid), np.stack([expected(0.1), expected(1.0)]), rtol=1e-4, atol=1e-6
    )
    own = influence.self_influence(loss, w, (x, y), damping=0.1, solver="TOY_Diagonal_Fisher")
    np.testing.assert_allclose(
        fw.to_numpy(own),
        (TRAIN_GRADS**2 / (FISHER_DIAGONAL + 0.1)).sum(1),
        rtol=1e-4,
        atol=1e-6,
    )
    vectors = RNG.normal(size=(2, DIM))
    solved = influence.inverse_hvp(
        loss, w, (x, y), fw.array(vectors), damping=0.1, solver=toys.solver()
    )
    np.testing.assert_allclose(
        fw.to_numpy(solved), vectors / (FISHER_DIAGONAL + 0.1), rtol=1e-4, atol=1e-6
    )
    best = influence.top_k(
        loss,
        w,
        batches(x, y, 5),
        (xt, yt),
        k=3,
        method="influence",
        hessian_batch=(x, y),
        damping=0.1,
        solver="toy_diagonal_fisher",
        progress=False,
    )
    assert_top_k_matches(best, expected(0.1), 3)


def test_a_registered_estimator_streams_through_top_k_by_name_and_as_an_instance(fw, toys):
    w, x, y, xt, yt = arrays(fw)
    norms = np.linalg.norm(TRAIN_GRADS, axis=1, keepdims=True)
    expected = (TRAIN_GRADS / norms) @ TEST_GRADS.T
    for method in ("toy_train_direction", toys.estimator()):
        best = influence.top_k(
            loss, w, batches(x, y, 5), (xt, yt), k=4, method=method, progress=False
        )
        assert_top_k_matches(best, expected, 4)
    # the whole matrix comes with the base class, from the same prepare
    whole = toys.estimator().scores(influence.Task(loss, w), (x, y), (xt, yt))
    np.testing.assert_allclose(fw.to_numpy(whole), expected, rtol=1e-4, atol=1e-6)


def test_an_estimator_that_needs_the_whole_training_set_is_refused_by_top_k(fw, toys):
    w, x, y, xt, yt = arrays(fw)
    scores = toys.whole().scores(influence.Task(loss, w), (x, y), (xt, yt))
    np.testing.assert_allclose(
        fw.to_numpy(scores), TRAIN_GRADS @ TEST_GRADS.T, rtol=1e-4, atol=1e-6
    )
    for method in ("toy_whole_dot", toys.whole(), "trak"):
        with pytest.raises(
            ValueError, match=r"method must be one of \[.*'toy_train_direction'\].*whole"
        ):
            influence.top_k(loss, w, batches(x, y, 5), (xt, yt), method=method)


def test_top_k_takes_kfac_through_the_same_protocol(fw):
    """A loss with no layer to factor: EK-FAC's curvature is one exact empirical-Fisher block
    for ``w``, ``F = G^T G / n``."""
    w, x, y, xt, yt = arrays(fw)
    fisher = TRAIN_GRADS.T @ TRAIN_GRADS / N
    expected = TRAIN_GRADS @ np.linalg.solve(fisher + 0.1 * np.eye(DIM), TEST_GRADS.T)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = influence.top_k(
            loss,
            w,
            batches(x, y, 5),
            (xt, yt),
            k=3,
            hessian_batch=(x, y),
            damping=0.1,
            solver="ekfac",
            progress=False,
        )
    assert any(issubclass(c.category, pergrad.FallbackWarning) for c in caught)
    assert_top_k_matches(best, expected, 3)


def test_a_registry_refuses_a_taken_name_and_a_badly_written_one(toys):
    with pytest.raises(ValueError, match=r"solver name 'cg' is taken by .*ihvp\.CG"):

        class Mine(influence.Solver, name="cg"):
            pass

    with pytest.raises(ValueError, match="must be a non-empty lower-case str"):

        class Loud(influence.Estimator, name="Loud"):
            pass

    assert "cg" in influence.Solver.registry and "Loud" not in influence.Estimator.registry


def test_a_misspelt_or_unmade_choice_teaches_the_fix(fw, toys):
    w, x, y, xt, yt = arrays(fw)
    with pytest.raises(
        ValueError,
        match=r"solver must be one of \[.*'toy_diagonal_fisher'\].*did you mean "
        r"'toy_diagonal_fisher'",
    ):
        influence.influence_function(loss, w, (x, y), (xt, yt), solver="toy_diagonal_fishr")
    with pytest.raises(TypeError, match=r"got the class CG: pass CG\(\)"):
        influence.influence_function(loss, w, (x, y), (xt, yt), solver=influence.CG)
    with pytest.raises(ValueError, match=r"damping= sets the options of method='influence'"):
        influence.top_k(loss, w, batches(x, y, 5), (xt, yt), method=toys.estimator(), damping=0.1)
    # options left at their defaults (0 for the damping as well as 0.0) are no conflict
    best = influence.top_k(
        loss,
        w,
        batches(x, y, 5),
        (xt, yt),
        k=2,
        method=toys.estimator(),
        damping=0,
        solver="cg",
        progress=False,
    )
    assert best.num_train == N
