"""``pergrad.influence.TRAK`` (issue 21): TRAK features streamed to disk, targets scored later.

The reference is the in-memory :func:`pergrad.influence.trak` on the same data, weights, seed and
damping (itself tested against the TRAK formula from a loop of single-example gradients in
``test_trak.py``): the streamed scores, over batches of unequal sizes, must equal it, with the
dense and the factored projection, on both frameworks. The stored features of a JAX model and of
the same model written in PyTorch must be identical. An interrupted featurisation resumes.
"""

from __future__ import annotations

import numpy as np
import pytest

from pergrad import influence
from pergrad.influence import TRAK
from test_trak import CLASSES, DIM, HIDDEN, MODELS, N_TARGET, N_TRAIN, PROBLEMS, RNG

pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

SIZES = (4, 4, 1)  # unequal batches over the N_TRAIN = 9 training examples
# a second layout of the same tiny MLP with biases: JAX x @ w + b, PyTorch nn.Linear
BIASES = [
    {"b1": RNG.normal(size=HIDDEN).astype(np.float32), "b2": RNG.normal(size=CLASSES)}
    for _ in MODELS
]


def batches(x, y, sizes=SIZES):
    starts = np.cumsum((0, *sizes))
    return [(x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def torch_module_problem():
    """The biased MLP as an nn.Module through pergrad.module_loss (the factored route in
    PyTorch): checkpoints are dicts of its named parameters, copied from MODELS and BIASES."""
    torch = pytest.importorskip("torch")
    import pergrad

    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
    )

    def batch_margin(out, y):  # out (1, CLASSES): the margin of one example
        others = torch.where(torch.arange(CLASSES) == y[:, None], -torch.inf, out)
        return (out.gather(1, y[:, None])[:, 0] - torch.logsumexp(others, 1)).sum()

    def weight(p, x, y):
        out = torch.func.functional_call(model, p, (x[None],))[0]
        return 1 - torch.softmax(out, 0).gather(0, y.reshape(1))[0]

    margin = pergrad.module_loss(model, batch_margin)
    checkpoints = [
        {
            "0.weight": torch.tensor(m["w1"].T.copy()),
            "0.bias": torch.tensor(b["b1"]),
            "2.weight": torch.tensor(m["w2"].T.copy()),
            "2.bias": torch.tensor(b["b2"], dtype=torch.float32),
        }
        for m, b in zip(MODELS, BIASES)
    ]
    _, _, _, _, arrays, to_numpy = PROBLEMS["torch"]()
    return margin, weight, checkpoints, arrays, to_numpy


def jax_biased_problem():
    """The biased MLP in JAX, the same weights as torch_module_problem."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def logits(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def margin(p, x, y):
        z = logits(p, x)
        return z[y] - jax.nn.logsumexp(jnp.where(jnp.arange(CLASSES) == y, -jnp.inf, z))

    def weight(p, x, y):
        return 1 - jax.nn.softmax(logits(p, x))[y]

    checkpoints = [
        {k: jnp.asarray(v, dtype=jnp.float32) for k, v in {**m, **b}.items()}
        for m, b in zip(MODELS, BIASES)
    ]
    _, _, _, _, arrays, to_numpy = PROBLEMS["jax"]()
    return margin, weight, checkpoints, arrays, to_numpy


def problem(framework, projection):
    """(margin, weight, checkpoints, (x, y, xt, yt), to_numpy); PyTorch's factored projection
    needs an nn.Module."""
    if projection == "factored" and framework == "torch":
        return torch_module_problem()
    margin, weight, _, models, arrays, to_numpy = PROBLEMS[framework]()
    return margin, weight, models, arrays, to_numpy


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize(
    ("framework", "projection"),
    [("jax", "dense"), ("torch", "dense"), ("jax", "factored"), ("torch", "factored")],
)
def test_streamed_scores_equal_in_memory_scores(tmp_path, framework, projection):
    margin, weight, models, (x, y, xt, yt), to_numpy = problem(framework, projection)
    options = {"proj_dim": 3, "seed": 5, "projection": projection, "factored_dims": (2, 2)}
    expected = to_numpy(
        influence.trak(margin, models, (x, y), (xt, yt), weight_fn=weight, damping=0.1, **options)
    )
    trak = TRAK(margin, models, tmp_path, weight_fn=weight, **options)
    assert trak.featurize(batches(x, y), progress=False) == N_TRAIN
    scores = trak.score((xt, yt), damping=0.1, chunk_rows=2)
    assert type(scores) is type(xt) and tuple(scores.shape) == (N_TRAIN, N_TARGET)
    assert_close(to_numpy(scores), expected)
    best = trak.top_k((xt, yt), k=3, damping=0.1, chunk_rows=4)
    reference = influence.top_k_from_scores(expected, k=3)
    np.testing.assert_array_equal(best.proponents, reference.proponents)
    np.testing.assert_array_equal(best.opponents, reference.opponents)
    assert_close(best.proponent_scores, reference.proponent_scores)


def test_fewer_examples_than_k_and_a_damping_grid(tmp_path):
    """n_train < k: the store solves the k x k system (a pseudo-inverse at damping 0) where the
    in-memory trak solves the n x n one; the matrices are the same. Without weight_fn."""
    framework = "jax" if _has("jax") else "torch"
    margin, _, models, (x, y, xt, yt), to_numpy = problem(framework, "dense")
    grid = [0.0, 0.1, 10.0]
    expected = to_numpy(influence.trak(margin, models, (x, y), (xt, yt), proj_dim=16, damping=grid))
    trak = TRAK(margin, models, tmp_path, proj_dim=16)
    trak.featurize(batches(x, y), progress=False)
    assert trak.weights(0) is None
    scores = to_numpy(trak.score((xt, yt), damping=grid))
    assert scores.shape == (3, N_TRAIN, N_TARGET)
    for got, want in zip(scores, expected):
        assert_close(got, want)


@pytest.mark.parametrize("projection", ["dense", "factored"])
def test_features_are_identical_across_jax_and_pytorch(tmp_path, projection):
    """The same MLP and weights in JAX (x @ w + b) and PyTorch (nn.Linear, or the same
    functional model for the dense projection): the stored features and weights agree. With the
    dense projection (the same flattening order on both sides), PyTorch targets scored against
    the JAX store equal PyTorch's own in-memory scores."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    if projection == "dense":
        sides = {f: problem(f, "dense") for f in ("jax", "torch")}
    else:
        sides = {"jax": jax_biased_problem(), "torch": torch_module_problem()}
    options = {"proj_dim": 6, "seed": 2, "projection": projection, "factored_dims": (2, 3)}
    stores = {}
    for framework, (margin, weight, models, (x, y, _, _), _) in sides.items():
        stores[framework] = TRAK(margin, models, tmp_path / framework, weight_fn=weight, **options)
        stores[framework].featurize(batches(x, y), progress=False)
    for m in range(len(MODELS)):
        jax_features, torch_features = stores["jax"].features(m), stores["torch"].features(m)
        assert jax_features.shape == torch_features.shape == (N_TRAIN, stores["jax"].feature_dim)
        np.testing.assert_allclose(jax_features, torch_features, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stores["jax"].weights(m), stores["torch"].weights(m), rtol=1e-5)
    if projection == "factored":  # nn.Linear's (out, in) weights flatten unlike x @ w's
        return
    margin, weight, models, (x, y, xt, yt), to_numpy = sides["torch"]
    expected = to_numpy(
        influence.trak(margin, models, (x, y), (xt, yt), weight_fn=weight, damping=0.1, **options)
    )
    on_jax_store = TRAK(margin, models, tmp_path / "jax")
    assert_close(to_numpy(on_jax_store.score((xt, yt), damping=0.1)), expected)


def test_an_interrupted_featurisation_resumes(tmp_path):
    """A stream that dies after two batches leaves a store of those examples that refuses to
    score; resume=True skips them and finishes, to the scores of an uninterrupted run. Rows a
    killed process wrote after the last saved state are dropped."""
    framework = "torch" if _has("torch") else "jax"
    margin, weight, models, (x, y, xt, yt), to_numpy = problem(framework, "dense")
    stream = batches(x, y)

    def dying():
        yield from stream[:2]
        raise KeyboardInterrupt

    trak = TRAK(margin, models, tmp_path, weight_fn=weight, proj_dim=3)
    with pytest.raises(KeyboardInterrupt):
        trak.featurize(dying(), progress=False)
    reopened = TRAK(margin, models, tmp_path, weight_fn=weight)
    assert (reopened.num_train, reopened.complete) == (sum(SIZES[:2]), False)
    with pytest.raises(ValueError, match="incomplete .*resume=True"):
        reopened.score((xt, yt), damping=0.1)
    with pytest.raises(ValueError, match="already holds the features of 8 examples"):
        reopened.featurize(stream, progress=False)
    with open(tmp_path / "features_0.f32", "ab") as file:  # a killed run's unsaved rows
        file.write(np.ones(7, np.float32).tobytes())
    with pytest.raises(ValueError, match="ended 4 examples before the 8 already stored"):
        reopened.featurize(stream[:1], resume=True, progress=False)
    assert reopened.featurize(stream, resume=True, progress=False) == N_TRAIN
    expected = to_numpy(
        influence.trak(margin, models, (x, y), (xt, yt), weight_fn=weight, proj_dim=3, damping=0.1)
    )
    assert_close(to_numpy(reopened.score((xt, yt), damping=0.1)), expected)


def test_reopening_checks_the_options_and_the_checkpoints(tmp_path, capsys):
    framework = "torch" if _has("torch") else "jax"
    margin, weight, models, (x, y, xt, yt), to_numpy = problem(framework, "dense")
    trak = TRAK(margin, models, tmp_path, weight_fn=weight, proj_dim=4, seed=7, kind="gaussian")
    trak.featurize(batches(x, y), progress=True)
    assert "featurizing batches" in capsys.readouterr().err
    reopened = TRAK(margin, models, tmp_path)  # the options come from the store
    assert (reopened.options.proj_dim, reopened.options.seed) == (4, 7)
    assert_close(to_numpy(reopened.score((xt, yt))), to_numpy(trak.score((xt, yt))))
    with pytest.raises(ValueError, match="proj_dim=8 but the features .* proj_dim=4"):
        TRAK(margin, models, tmp_path, proj_dim=8)
    with pytest.raises(ValueError, match="made with 2 checkpoints; got 1"):
        TRAK(margin, models[:1], tmp_path)
    with pytest.raises(ValueError, match=r"checkpoints\[0\] is not the model"):
        TRAK(margin, models[::-1], tmp_path)
    with pytest.raises(ValueError, match="made with weight_fn"):
        TRAK(margin, models, tmp_path).featurize(batches(x, y), resume=True)


def test_bad_arguments_are_named(tmp_path):
    framework = "torch" if _has("torch") else "jax"
    margin, weight, models, (x, y, xt, yt), _ = problem(framework, "dense")
    with pytest.raises(TypeError, match="path must be a folder path"):
        TRAK(margin, models, 3)
    with pytest.raises(TypeError, match="checkpoints must be a non-empty list"):
        TRAK(margin, [], tmp_path)
    with pytest.raises(ValueError, match="factored_dims must be a pair of positive ints"):
        TRAK(margin, models, tmp_path, factored_dims=(2, 0))
    trak = TRAK(margin, models, tmp_path, proj_dim=3)
    with pytest.raises(ValueError, match="holds no TRAK features yet"):
        trak.score((xt, yt))
    with pytest.raises(TypeError, match="resume must be True or False"):
        trak.featurize(batches(x, y), resume="yes")
    with pytest.raises(ValueError, match="yielded no examples"):
        trak.featurize([], progress=False)
    trak.featurize(batches(x, y), resume=True, progress=False)
    with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
        trak.score((xt, yt), damping=-1.0)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        trak.score((xt, yt), chunk_rows=0)
    with pytest.raises(ValueError, match="k must be a positive int"):
        trak.top_k((xt, yt), k=0)
    with pytest.raises(ValueError, match="damping must be one number"):
        trak.top_k((xt, yt), damping=[0.1, 1.0])
    with pytest.raises(ValueError, match=r"model must be an int in \[0, 2\)"):
        trak.features(2)


def _has(module):
    try:
        __import__(module)
    except ImportError:
        return False
    return True
