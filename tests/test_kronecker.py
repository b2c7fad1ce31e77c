"""Factored (LoGra) projections, ``pergrad._src.influence.kronecker.project_factored`` (issue
21): each dense layer's block equals projecting its materialised per-example gradient with the
Kronecker matrix ``P_in (x) P_out`` (exactly, up to float error), on both frameworks, with the
reference gradients from a loop of single-example autograd (PyTorch) or ``jax.vmap(jax.grad)``;
the other parameters' gradients are projected densely."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad._src.influence.kronecker import kronecker_matrices, project_factored
from pergrad._src.influence.projection import matrix_rows

BATCH, LENGTH, K_IN, K_OUT, OTHER, SEED = 3, 4, 3, 2, 4, 1


def dense_reference(grads_by_layer, widths, others, indices):
    """Features from materialised gradients: (B, in, out) per layer (layer ``indices[i]``'s
    matrices), then the others."""
    blocks = []
    for index, grads, (width_in, width_out) in zip(indices, grads_by_layer, widths):
        p_in, p_out = kronecker_matrices(SEED, index, width_in, width_out, K_IN, K_OUT)
        blocks.append(np.einsum("ik,bio,ol->bkl", p_in, grads, p_out).reshape(BATCH, -1))
    flat = np.concatenate([g.reshape(BATCH, -1) for g in others], axis=1)
    blocks.append(flat @ matrix_rows(SEED + 1_000_003, OTHER, "gaussian", 0, flat.shape[1]))
    return np.concatenate(blocks, axis=1)


def test_torch_linear_layers_are_projected_from_their_records():
    torch = pytest.importorskip("torch")
    from torch import nn

    import pergrad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(BATCH, LENGTH, 5, dtype=torch.float64)
    y = torch.randn(BATCH, LENGTH, 3, dtype=torch.float64)

    def mse(out, target):
        return ((out - target) ** 2).sum()

    loss = pergrad.module_loss(model, mse)
    features = project_factored(
        loss, loss.params(), (x, y), k_in=K_IN, k_out=K_OUT, other_dim=OTHER, seed=SEED
    )
    grads = {name: [] for name, _ in model.named_parameters()}
    for b in range(BATCH):
        model.zero_grad()
        mse(model(x[b : b + 1]), y[b : b + 1]).backward()
        for name, p in model.named_parameters():
            grads[name].append(p.grad.detach().clone().numpy())
    grads = {k: np.stack(v) for k, v in grads.items()}
    expected = dense_reference(
        [grads["0.weight"].transpose(0, 2, 1), grads["2.weight"].transpose(0, 2, 1)],
        [(5, 7), (7, 3)],
        [grads["0.bias"], grads["2.bias"]],
        indices=[0, 1],  # the nn.Linear layers of model.named_modules(), numbered
    )
    assert tuple(features.shape) == (BATCH, 2 * K_IN * K_OUT + OTHER)
    np.testing.assert_allclose(features.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_a_torch_table_tied_to_the_output_layer_is_projected_without_forming_it():
    """GPT-2's pattern: the token embedding is also the output layer. The table's block is
    ``P_rows^T G P_cols`` of its tied per-example gradient (the sum of both uses'), from the
    two layers' records: a block of its own, not a formed gradient projected densely."""
    torch = pytest.importorskip("torch")
    from torch import nn

    import pergrad

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.mid = nn.Linear(4, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.mid(self.emb(ids))))

    torch.manual_seed(0)
    model = TiedLM().double()
    ids = torch.randint(0, 6, (BATCH, LENGTH))
    targets = torch.randint(0, 6, (BATCH, LENGTH))

    def token_loss(logits, target):
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), target.flatten(), reduction="sum"
        )

    loss = pergrad.module_loss(model, token_loss)
    assert list(loss.params()) == ["emb.weight", "mid.weight", "mid.bias"]
    features = project_factored(
        loss, loss.params(), (ids, targets), k_in=K_IN, k_out=K_OUT, other_dim=OTHER, seed=SEED
    )
    grads = {name: [] for name in loss.params()}
    for b in range(BATCH):
        model.zero_grad()
        token_loss(model(ids[b : b + 1]), targets[b : b + 1]).backward()
        for name, p in model.named_parameters():  # the tied table once, both uses summed
            grads[name].append(p.grad.detach().clone().numpy())
    grads = {k: np.stack(v) for k, v in grads.items()}
    expected = dense_reference(
        # the table in its own (rows, cols) frame, weight 0; mid (in, out), weight 1
        [grads["emb.weight"], grads["mid.weight"].transpose(0, 2, 1)],
        [(6, 4), (4, 4)],
        [grads["mid.bias"]],
        indices=[0, 1],
    )
    assert tuple(features.shape) == (BATCH, 2 * K_IN * K_OUT + OTHER)
    np.testing.assert_allclose(features.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_jax_dense_contractions_are_projected_from_their_records():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(0)  # numpy's: jax.random compiles once per array shape

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    params = {
        "b1": normal(6),
        "w1": normal(5, 6),  # x @ w1: the factored route
        "w2": normal(3, 6),  # x @ w2.T, stored (out, in): from its records, as nn.Linear's
    }
    x = normal(BATCH, LENGTH, 5)
    y = normal(BATCH, LENGTH, 3)

    def loss(p, xi, yi):
        h = jnp.tanh(xi @ p["w1"] + p["b1"])
        return ((jnp.einsum("tf,kf->tk", h, p["w2"]) - yi) ** 2).sum()

    features = project_factored(
        loss, params, (x, y), k_in=K_IN, k_out=K_OUT, other_dim=OTHER, seed=SEED
    )
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x, y)
    expected = dense_reference(
        # both in the (in, out) frame, as PyTorch's nn.Linear
        [np.asarray(grads["w1"]), np.asarray(grads["w2"]).transpose(0, 2, 1)],
        [(5, 6), (6, 3)],
        [np.asarray(grads["b1"])],
        indices=[0, 1],  # the order in which the engine meets the contractions
    )
    np.testing.assert_allclose(np.asarray(features), expected, rtol=2e-4, atol=2e-5)


def test_a_plain_torch_function_is_projected_densely_with_a_warning():
    torch = pytest.importorskip("torch")
    import pergrad

    def loss(w, x):
        return torch.tanh(x @ w).sum()

    w, x = torch.randn(4, 3, dtype=torch.float64), torch.randn(BATCH, 4, dtype=torch.float64)
    with pytest.warns(pergrad.FallbackWarning, match="capture engine cannot take this call"):
        features = project_factored(loss, w, (x,), other_dim=OTHER, seed=SEED)
    grads = pergrad.per_example_grads(loss)(w, x).reshape(BATCH, -1).numpy()
    expected = grads @ matrix_rows(SEED + 1_000_003, OTHER, "gaussian", 0, 12)
    np.testing.assert_allclose(features.numpy(), expected, rtol=1e-10)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="k_in must be a positive int"):
        project_factored(len, {}, (), k_in=0)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        project_factored(len, {}, (), seed=-1)
    with pytest.raises(ValueError, match="batch must be a tuple"):
        project_factored(len, {}, 1)


def test_project_factored_as_the_first_call_of_a_fresh_process():
    """The layer numbering read the ghost rules before anything had imported (registered) them,
    so project_factored as a program's first pergrad call failed with a KeyError (the suite's
    other tests import them first: hence a fresh interpreter)."""
    import subprocess
    import sys

    script = (
        "import torch, pergrad\n"
        "from pergrad.influence import project_factored\n"
        "model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))\n"
        "loss = pergrad.module_loss(model, torch.nn.functional.cross_entropy)\n"
        "x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))\n"
        "own = project_factored(loss, loss.params(), (x, y), k_in=2, k_out=2)\n"
        "copy = {k: v.clone() for k, v in loss.params().items()}\n"
        "again = project_factored(loss, copy, (x, y), k_in=2, k_out=2)\n"
        "assert own.shape[0] == 6 and torch.equal(own, again), (own, again)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
