"""``pergrad.influence.trak`` (issue 21) against the TRAK formula computed here in float64 numpy
from a loop of single-example gradients: ``mean_m[Phi_m (Phi_m^T Phi_m + d I)^-1 phi_m^T] *
mean_m[Q_m]``, with ``Phi_m`` the projected margin gradients of model ``m``; and across JAX and
PyTorch on the same weights and seed."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad import influence

# every per-example gradient here must vectorise: a silent loop would hide a slow path
pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

N_TRAIN, N_TARGET, DIM, HIDDEN, CLASSES = 9, 4, 4, 5, 3
RNG = np.random.default_rng(8)
X = RNG.normal(size=(N_TRAIN, DIM)).astype(np.float32)
Y = RNG.integers(0, CLASSES, N_TRAIN)
XT = RNG.normal(size=(N_TARGET, DIM)).astype(np.float32)
YT = RNG.integers(0, CLASSES, N_TARGET)
MODELS = [
    {
        "w1": RNG.normal(size=(DIM, HIDDEN)).astype(np.float32),
        "w2": RNG.normal(size=(HIDDEN, CLASSES)).astype(np.float32),
    }
    for _ in range(2)
]


def jax_problem():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def logits(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    def margin(p, x, y):
        z = logits(p, x)
        others = jnp.where(jnp.arange(CLASSES) == y, -jnp.inf, z)
        return z[y] - jax.nn.logsumexp(others)

    def weight(p, x, y):
        return 1 - jax.nn.softmax(logits(p, x))[y]

    def loop(p, x, y):
        grads = [jax.grad(margin)(p, x[i], y[i]) for i in range(len(x))]
        return {k: jnp.stack([g[k] for g in grads]) for k in p}

    models = [{k: jnp.asarray(v) for k, v in m.items()} for m in MODELS]
    arrays = (jnp.asarray(X), jnp.asarray(Y), jnp.asarray(XT), jnp.asarray(YT))
    return margin, weight, loop, models, arrays, np.asarray


def torch_problem():
    torch = pytest.importorskip("torch")

    def logits(p, x):
        return torch.tanh(x @ p["w1"]) @ p["w2"]

    def margin(p, x, y):  # indexing by a gather, so that torch.func.vmap can batch it
        z = logits(p, x)
        others = torch.where(torch.arange(CLASSES) == y, -torch.inf, z)
        return z.gather(0, y.reshape(1))[0] - torch.logsumexp(others, 0)

    def weight(p, x, y):
        return 1 - torch.softmax(logits(p, x), 0).gather(0, y.reshape(1))[0]

    def loop(p, x, y):
        grads = []
        for i in range(len(x)):
            leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
            grads.append(
                dict(zip(p, torch.autograd.grad(margin(leaves, x[i], y[i]), list(leaves.values()))))
            )
        return {k: torch.stack([g[k] for g in grads]) for k in p}

    models = [{k: torch.tensor(v) for k, v in m.items()} for m in MODELS]
    arrays = (torch.tensor(X), torch.tensor(Y), torch.tensor(XT), torch.tensor(YT))
    return margin, weight, loop, models, arrays, lambda a: a.detach().numpy()


PROBLEMS = {"jax": jax_problem, "torch": torch_problem}


def reference(framework, proj_dim, damping, with_weights=True):
    margin, weight, loop, models, (x, y, xt, yt), to_numpy = PROBLEMS[framework]()
    total, q_total = 0.0, 0.0
    for m, params in enumerate(models):
        phi = to_numpy(influence.project(loop(params, x, y), proj_dim, seed=m, kind="rademacher"))
        phi_t = to_numpy(
            influence.project(loop(params, xt, yt), proj_dim, seed=m, kind="rademacher")
        )
        phi, phi_t = phi.astype(np.float64), phi_t.astype(np.float64)
        kernel = phi.T @ phi + damping * np.eye(proj_dim)
        total = total + phi @ np.linalg.solve(kernel, phi_t.T)
        q_total = q_total + np.array([float(weight(params, x[i], y[i])) for i in range(N_TRAIN)])
    scores = total / len(models)
    return scores * (q_total / len(models))[:, None] if with_weights else scores


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("proj_dim", [3, 16])  # more examples than k, then fewer
def test_trak_matches_the_formula(framework, proj_dim):
    margin, weight, _, models, (x, y, xt, yt), to_numpy = PROBLEMS[framework]()
    scores = influence.trak(
        margin, models, (x, y), (xt, yt), weight_fn=weight, proj_dim=proj_dim, damping=0.1
    )
    expected = reference(framework, proj_dim, 0.1)
    assert tuple(scores.shape) == (N_TRAIN, N_TARGET)
    np.testing.assert_allclose(
        to_numpy(scores), expected, rtol=2e-4, atol=1e-5 * np.abs(expected).max()
    )


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_damping_grid_equals_one_call_per_damping(framework):
    margin, weight, _, models, (x, y, xt, yt), to_numpy = PROBLEMS[framework]()
    grid = [0.0, 0.1, 10.0]
    stacked = to_numpy(
        influence.trak(
            margin, models, (x, y), (xt, yt), weight_fn=weight, proj_dim=16, damping=grid
        )
    )
    assert stacked.shape == (3, N_TRAIN, N_TARGET)
    for g, damping in enumerate(grid[1:], start=1):
        np.testing.assert_allclose(
            stacked[g],
            reference(framework, 16, damping),
            rtol=2e-4,
            atol=1e-5 * np.abs(stacked[g]).max(),
        )


def test_trak_is_the_same_on_both_frameworks():
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    results = []
    for framework in ("jax", "torch"):
        margin, weight, _, models, (x, y, xt, yt), to_numpy = PROBLEMS[framework]()
        results.append(
            to_numpy(
                influence.trak(
                    margin, models, (x, y), (xt, yt), weight_fn=weight, proj_dim=32, seed=3
                )
            )
        )
    np.testing.assert_allclose(
        results[0], results[1], rtol=1e-3, atol=1e-4 * np.abs(results[0]).max()
    )


def test_without_weights_and_without_damping_fewer_examples_than_k():
    """With k > n and no damping, Phi (Phi^T Phi)^+ Phi^T is the projection onto the span of the
    training features: a training example's own column scores its target copy as itself."""
    margin, _, _, models, (x, y, _, _), to_numpy = (
        PROBLEMS["jax"]() if _has("jax") else PROBLEMS["torch"]()
    )
    scores = to_numpy(influence.trak(margin, models[:1], (x, y), (x, y), proj_dim=64))
    np.testing.assert_allclose(scores, np.eye(N_TRAIN), atol=2e-3)


def _has(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_bad_arguments_are_named(framework):
    margin, weight, _, models, (x, y, xt, yt), _ = PROBLEMS[framework]()
    with pytest.raises(TypeError, match="checkpoints must be a non-empty list"):
        influence.trak(margin, [], (x, y), (xt, yt))
    with pytest.raises(ValueError, match="proj_dim must be a positive int"):
        influence.trak(margin, models, (x, y), (xt, yt), proj_dim=0)
    with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
        influence.trak(margin, models, (x, y), (xt, yt), damping=-1.0)
    with pytest.raises(TypeError, match="weight_fn must be a function of ONE example"):
        influence.trak(margin, models, (x, y), (xt, yt), weight_fn="1-p")
    with pytest.raises(ValueError, match="weight_fn must return a scalar"):
        influence.trak(margin, models, (x, y), (xt, yt), weight_fn=lambda p, xi, yi: p["w2"].sum(0))


def test_factored_projection_features_feed_the_same_formula():
    """projection="factored": the features are project_factored's (tested against materialised
    gradients in test_kronecker.py); the kernel and weighting are the formula's."""
    pytest.importorskip("jax")
    margin, weight, _, models, (x, y, xt, yt), to_numpy = PROBLEMS["jax"]()
    scores = influence.trak(
        margin,
        models,
        (x, y),
        (xt, yt),
        weight_fn=weight,
        proj_dim=3,
        damping=0.1,
        projection="factored",
        factored_dims=(2, 2),
        chunk_size=4,
    )
    total, q_total = 0.0, 0.0
    for m, params in enumerate(models):
        options = {"k_in": 2, "k_out": 2, "other_dim": 3, "seed": m}
        phi = to_numpy(influence.project_factored(margin, params, (x, y), **options))
        phi_t = to_numpy(influence.project_factored(margin, params, (xt, yt), **options))
        phi, phi_t = phi.astype(np.float64), phi_t.astype(np.float64)
        assert phi.shape == (N_TRAIN, 2 * 4)  # w1 and w2 blocks of 2 x 2; no other leaves
        total = total + phi @ np.linalg.solve(phi.T @ phi + 0.1 * np.eye(8), phi_t.T)
        q_total = q_total + np.array([float(weight(params, x[i], y[i])) for i in range(N_TRAIN)])
    expected = total / len(models) * (q_total / len(models))[:, None]
    np.testing.assert_allclose(
        to_numpy(scores), expected, rtol=2e-4, atol=1e-5 * np.abs(expected).max()
    )
    with pytest.raises(ValueError, match="projection must be 'dense' or 'factored'"):
        influence.trak(margin, models, (x, y), (xt, yt), projection="kronecker")
