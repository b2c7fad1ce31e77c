"""The capture kernel's framework-free quantities (``capture/quantities.py``): ONE function,
registered once, is computed by every layer family of both frameworks that gives tokens or
lookups. The quantity here is the per-example weight gradient itself, rebuilt from the records
(``G_i = A_i^T D_i``, a table's ``onehot(rows)^T D``), so the reference is independent: the
framework's own per-example gradients (``torch.func`` / ``jax.vmap(jax.grad)``)."""

import numpy as np
import pytest

from pergrad._src.api.reductions import layer_reductions_of
from pergrad._src.backends import backend_of
from pergrad._src.capture import quantities
from pergrad._src.influence.ihvp import as_backend_array

NAME = "test.gradient_from_records"


def gradient_of_tokens(tokens):
    grad = tokens.a.mT @ tokens.d  # (B, I, O)
    if tokens.layout == "out_in":
        grad = grad.mT
    return grad.reshape((grad.shape[0], *tokens.shape))


def gradient_of_lookups(lookups):
    rows, width = lookups.shape
    eye = as_backend_array(backend_of(lookups.d, "test", "d"), np.eye(rows), lookups.d)
    return eye[lookups.rows].mT @ lookups.d  # one-hot rows: (B, V, N) @ (B, N, D)


@pytest.fixture(scope="module", autouse=True)
def registered():
    quantities.register_quantity(NAME, gradient_of_tokens, gradient_of_lookups)
    yield
    quantities._QUANTITIES.pop(NAME)


def test_torch_families_compute_the_quantity_from_their_records():
    torch = pytest.importorskip("torch")
    from torch import nn

    import pergrad

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 3, padding_idx=0)
            self.conv = nn.Conv1d(3, 4, 3, padding=1)
            self.grouped = nn.Conv1d(4, 4, 3, groups=2)  # no tokens: formed
            self.fc = nn.Linear(4, 2)

        def forward(self, ids):
            h = self.emb(ids).transpose(1, 2)  # (B, 3, T)
            h = self.grouped(torch.tanh(self.conv(h)))  # (B, 4, T - 2)
            return self.fc(h.transpose(1, 2)).sum(1)

    model = Net().double()
    loss = pergrad.module_loss(model, lambda out, y: ((out - y) ** 2).sum())
    ids = torch.randint(0, 7, (5, 6))
    ids[0, :2] = 0  # the padding row gets no gradient
    y = torch.randn(5, 2, dtype=torch.float64)
    results = layer_reductions_of(loss, loss.params(), ids, y, reduction=NAME)
    reference = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(loss.params(), ids, y)
    reduced = {}
    for name, result in zip(loss.params(), results):
        torch.testing.assert_close(result.value, reference[name], rtol=1e-9, atol=1e-12)
        reduced[name] = result.reduced
    # the records' value where the family has records; the formed gradient elsewhere
    assert reduced == {
        "emb.weight": True,
        "conv.weight": True,
        "conv.bias": False,
        "grouped.weight": False,
        "grouped.bias": False,
        "fc.weight": True,
        "fc.bias": False,
    }


def test_jax_families_compute_the_same_quantity_from_their_records():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(1)
    params = {
        "table": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32),
        "w_in_out": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),  # x @ W
        "w_out_in": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),  # x @ W.T
        "w_reshaped": jnp.asarray(rng.normal(size=(8,)), jnp.float32),  # via a reshape: formed
    }

    def loss(p, ids, y):
        h = jnp.tanh(p["table"][ids] @ p["w_in_out"])  # (T, 4)
        h = h @ p["w_reshaped"].reshape(4, 2) @ p["w_out_in"][:, :2].T
        return ((h.sum(0) - y) ** 2).sum() + (h @ p["w_out_in"][:, 2:]).sum()

    def simple(p, ids, y):
        h = jnp.tanh(p["table"][ids] @ p["w_in_out"])
        return ((h @ p["w_out_in"].T).sum(0) - y).sum() ** 2

    ids = jnp.asarray(rng.integers(0, 7, size=(5, 6)))
    y = jnp.asarray(rng.normal(size=(5, 2)), jnp.float32)
    for fn, expect_reduced in (
        (simple, {"table": True, "w_in_out": True, "w_out_in": True}),
        (loss, {"table": True, "w_in_out": True, "w_reshaped": False}),
    ):
        used = {k: params[k] for k in (*expect_reduced, "w_out_in")}
        results = layer_reductions_of(fn, used, ids, y, reduction=NAME)
        reference = jax.vmap(jax.grad(fn), in_axes=(None, 0, 0))(used, ids, y)
        names = sorted(used)  # a dict's leaves come in key order
        for name, result in zip(names, results):
            np.testing.assert_allclose(
                np.asarray(result.value), np.asarray(reference[name]), rtol=1e-4, atol=1e-5
            )
            if name in expect_reduced:
                assert result.reduced == expect_reduced[name], name


def test_a_built_in_name_is_refused():
    with pytest.raises(ValueError, match="'per_example' is a built-in"):
        quantities.register_quantity("per_example", gradient_of_tokens)
