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


def gpt2(tied, vocab=23, width=8, length=5):
    """A tiny Hugging Face GPT-2 (random weights, float64), its per-example loss and a batch."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F

    import pergrad

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=length,
        n_embd=width,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    model = transformers.GPT2LMHeadModel(config).double().eval()

    def next_token_loss(output, labels):
        return F.cross_entropy(output.logits.reshape(-1, vocab), labels.reshape(-1))

    ids = torch.randint(0, vocab, (3, length))
    labels = torch.randint(0, vocab, (3, length))
    return model, next_token_loss, pergrad.module_loss(model, next_token_loss), (ids, labels)


@pytest.mark.parametrize("tied", [False, True])
def test_factored_projection_of_gpt2_equals_projecting_its_materialised_gradients(tied):
    """GPT-2's Conv1D, nn.Embedding and output nn.Linear layers are projected from their records:
    each block equals P_in^T G P_out of the gradient G from one-example autograd, a tied table
    (GPT-2's default: the sum of its lookup's and its output layer's gradients) in its own
    (vocabulary, width) frame; the biases and norms are projected densely, in parameter order."""
    from pergrad._src.influence.kronecker import kronecker_matrices
    from pergrad._src.influence.projection import matrix_rows

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, next_token_loss, loss, (ids, labels) = gpt2(tied)
    k_in, k_out, other, seed = 3, 2, 4, 5
    features = influence.project_factored(
        loss, loss.params(), (ids, labels), k_in=k_in, k_out=k_out, other_dim=other, seed=seed
    ).numpy()
    grads = []
    for b in range(len(ids)):
        model.zero_grad()
        next_token_loss(model(ids[b : b + 1]), labels[b : b + 1]).backward()
        grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
    # the i-th projectable weight of model.named_modules() projects with
    # kronecker_matrices(seed, i, ...); tied, lm_head (the last layer) shares wte's number 0
    kinds = (torch.nn.Linear, torch.nn.Embedding, transformers.pytorch_utils.Conv1D)
    met = [name for name, module in model.named_modules() if isinstance(module, kinds)]
    blocks, others = {}, []
    for name, _ in model.named_parameters():  # tied: lm_head.weight is not listed
        owner, leaf = name.rsplit(".", 1)
        if leaf != "weight" or owner not in met:
            others.append(name)
            continue
        g = np.stack([grad[name] for grad in grads])  # (B, *weight.shape)
        if owner == "lm_head":
            g = g.transpose(0, 2, 1)  # nn.Linear's (out, in) -> (in, out), as Conv1D's
        p_in, p_out = kronecker_matrices(seed, met.index(owner), *g.shape[1:], k_in, k_out)
        blocks[name] = np.einsum("ik,bio,ol->bkl", p_in, g, p_out).reshape(len(ids), -1)
    flat = np.concatenate(
        [np.stack([grad[n] for grad in grads]).reshape(len(ids), -1) for n in others], axis=1
    )
    rows = matrix_rows(seed + 1_000_003, other, "gaussian", 0, flat.shape[1])
    expected = np.concatenate([*blocks.values(), flat @ rows], axis=1)
    assert features.shape == expected.shape
    np.testing.assert_allclose(features, expected, rtol=1e-9, atol=1e-12 * np.abs(expected).max())


@pytest.mark.slow(
    reason="a quick run of the factored-projection benchmark: about 15 s on 2 CPU cores"
)
def test_factored_projection_benchmark_quick_run(tmp_path, monkeypatch):
    """benchmarks/factored_projection.py --quick: a row per method, the factored and the
    materialised features of the same dimension, in a markdown table with the machine named."""
    pytest.importorskip("transformers")
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "factored_projection.py"
    spec = importlib.util.spec_from_file_location("factored_projection_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # for its dataclasses
    spec.loader.exec_module(benchmark)
    out = tmp_path / "factored_projection.md"
    benchmark.main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert "Machine:" in text and "(quick run)" in text
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line and "method" not in line
    }
    assert set(rows) == set(benchmark.METHODS)
    assert rows["factored"][1] == rows["materialise then project"][1]  # the same D
    assert all(float(row[3]) > 0 for row in rows.values())  # examples/s
