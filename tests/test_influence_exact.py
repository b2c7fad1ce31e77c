"""The exact influence solver (issue 21): a Cholesky factorisation for a positive-definite
system, one eigendecomposition shared by a grid of dampings, and a spectrum diagnosis whose
suggested damping always exceeds the one passed. Reference: float64 numpy closed forms of a
least-squares problem, ``G (X^T X / n + d I)^-1 T^T``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pergrad import influence
from pergrad._src.influence import ihvp

# Small programs of many shapes, op by op: compiled without XLA's backend optimisations.
pytestmark = pytest.mark.usefixtures("fast_xla_compile")

RNG = np.random.default_rng(5)
N, DIM = 20, 6
X = RNG.normal(size=(N, DIM))
Y = RNG.normal(size=N)
W = RNG.normal(size=DIM)


def closed_form(damping: float, x_test: np.ndarray, y_test: np.ndarray) -> np.ndarray:
    grads = X * (X @ W - Y)[:, None]
    test_grads = x_test * (x_test @ W - y_test)[:, None]
    hessian = X.T @ X / N
    return grads @ np.linalg.solve(hessian + damping * np.eye(DIM), test_grads.T)


def framework_arrays(framework: str, *arrays):
    if framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        return [jnp.asarray(a) for a in arrays]
    torch = pytest.importorskip("torch")
    return [torch.tensor(a, dtype=torch.float64) for a in arrays]


def to_numpy(a):
    return a.detach().numpy() if hasattr(a, "detach") else np.asarray(a)


def loss(w, x, y):
    return 0.5 * ((x * w).sum() - y) ** 2


@pytest.fixture(params=["jax", "torch"])
def framework(request):
    if request.param == "jax":
        jax = pytest.importorskip("jax")
        with jax.enable_x64(True):
            yield "jax"
    else:
        yield "torch"


@pytest.mark.parametrize("n_test", [3, 30])  # solve for the test side, then the train side
def test_a_grid_of_dampings_equals_one_call_per_damping_and_the_closed_form(framework, n_test):
    x_test, y_test = RNG.normal(size=(n_test, DIM)), RNG.normal(size=n_test)
    w, x, y, xt, yt = framework_arrays(framework, W, X, Y, x_test, y_test)
    grid = [0.0, 1e-3, 0.1, 1.0]
    stacked = influence.influence_function(loss, w, (x, y), (xt, yt), damping=grid)
    assert tuple(stacked.shape) == (4, N, n_test)
    for g, damping in enumerate(grid):
        expected = closed_form(damping, x_test, y_test)
        np.testing.assert_allclose(to_numpy(stacked[g]), expected, rtol=1e-8, atol=1e-12)
        single = influence.influence_function(loss, w, (x, y), (xt, yt), damping=damping)
        np.testing.assert_allclose(to_numpy(single), expected, rtol=1e-8, atol=1e-12)
    by_cg = influence.influence_function(
        loss, w, (x, y), (xt, yt), damping=grid[1:], solver=influence.CG(tol=1e-10)
    )
    np.testing.assert_allclose(to_numpy(by_cg), to_numpy(stacked[1:]), rtol=1e-6, atol=1e-10)


def test_one_damping_takes_cholesky_and_a_grid_one_eigendecomposition(framework, monkeypatch):
    w, x, y = framework_arrays(framework, W, X, Y)
    calls = {"eigh": 0, "cholesky": 0}
    from pergrad._src.backends import backend_of

    bk_class = type(backend_of(w, "test", "w"))
    original_eigh, original_cholesky = bk_class.eigh, bk_class.cholesky

    def counting_eigh(self, matrix):
        calls["eigh"] += 1
        return original_eigh(self, matrix)

    def counting_cholesky(self, matrix):
        calls["cholesky"] += 1
        return original_cholesky(self, matrix)

    monkeypatch.setattr(bk_class, "eigh", counting_eigh)
    monkeypatch.setattr(bk_class, "cholesky", counting_cholesky)
    influence.influence_function(loss, w, (x, y), (x, y), damping=1e-3)
    assert calls == {"eigh": 0, "cholesky": 1}
    influence.influence_function(loss, w, (x, y), (x, y), damping=[1e-3, 1e-2, 1e-1, 1.0])
    assert calls == {"eigh": 1, "cholesky": 1}


def test_a_singular_hessian_goes_to_the_eigendecomposition_and_is_refused(framework):
    x_twice = np.repeat(RNG.normal(size=(N, 1)), DIM, axis=1)  # rank one
    w, x, y = framework_arrays(framework, W, x_twice, Y)
    with pytest.raises(ValueError, match=r"singular.*pass damping > 0, e.g. damping="):
        influence.influence_function(loss, w, (x, y), (x, y))


def test_the_suggested_damping_exceeds_the_one_passed():
    """An indefinite float32 spectrum: whatever is suggested must be larger than what was
    passed (it once suggested 1e-3 * the largest eigenvalue, below a damping of 0.5)."""
    shifted = np.array([-2.0, -1e-9, 0.3, 100.0])  # one near zero, one clearly negative
    with pytest.raises(ValueError, match="singular") as caught:
        ihvp._check_spectrum("f", shifted, "float32", damping=0.5)
    suggested = float(str(caught.value).rsplit("damping=", 1)[1].rstrip("."))
    assert suggested > 0.5 + 2.0
    assert "clearly negative" in str(caught.value)
    with pytest.warns(influence.InfluenceWarning, match="negative eigenvalue") as warned:
        ihvp._check_spectrum("f", np.array([-2.0, 0.3, 100.0]), "float32", damping=0.5)
    suggested = float(str(warned[0].message).rsplit("damping=", 1)[1].rstrip("."))
    assert suggested > 2.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ihvp._check_spectrum("f", np.array([0.3, 100.0]), "float32", damping=0.5)


def test_a_bad_grid_is_named(framework):
    w, x, y = framework_arrays(framework, W, X, Y)
    with pytest.raises(ValueError, match="non-empty list"):
        influence.influence_function(loss, w, (x, y), (x, y), damping=[])
    with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
        influence.influence_function(loss, w, (x, y), (x, y), damping=[0.1, -1.0])
