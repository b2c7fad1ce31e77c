"""K-FAC / EK-FAC curvature for influence functions (issue 21), both frameworks.

References: the exact solver on a linear layer whose Gauss-Newton matrix is a Kronecker product
(fed K-FAC's exact factors); a float64 numpy reconstruction of the block-diagonal
``Q diag(lambda) Q^T`` from its definition, with each layer's inputs and output gradients and
each example's gradient from a loop of single-example autograd; the exact solver's scores on a
trained MLP (a ranking property); the other framework's scores on the same weights.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad import influence  # noqa: E402


def squared_error(out, target):
    return 0.5 * ((out - target) ** 2).sum()


def unit_residual_batch(weight: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each input repeated once per output ``c``, with the label that makes its residual
    ``sqrt(q) e_c``: the empirical Fisher of this batch is the Gauss-Newton matrix ``A (x) I``
    of ``0.5 |W a - y|^2`` exactly (K-FAC's factors are exact)."""
    width_out = weight.shape[0]
    inputs = np.repeat(x, width_out, axis=0)
    units = np.tile(np.eye(width_out), (len(x), 1)) * np.sqrt(width_out)
    return inputs, inputs @ weight.T - units


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("solver", ["kfac", "ekfac"])
def test_exact_factors_on_one_linear_layer_give_the_gauss_newton_inverse(framework, solver):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(3, 4))
    x, y = rng.normal(size=(12, 4)), rng.normal(size=(12, 3))
    x_test, y_test = rng.normal(size=(5, 4)), rng.normal(size=(5, 3))
    factor_x, factor_y = unit_residual_batch(weight, x)
    grid = [1e-3, 0.3]
    if framework == "torch":
        model = nn.Linear(4, 3, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(torch.tensor(weight))
        loss = pergrad.module_loss(model, squared_error)
        params, arrays = loss.params(), [torch.tensor(a) for a in (x, y, x_test, y_test)]
        factor_batch = (torch.tensor(factor_x), torch.tensor(factor_y))
        run = _scores(loss, params, arrays, factor_batch, grid, solver)
    else:
        jax = pytest.importorskip("jax")
        with jax.enable_x64(True):
            jnp = jax.numpy

            def loss(p, xi, yi):
                return 0.5 * ((p["w"] @ xi - yi) ** 2).sum()  # W @ a: weight (out, in)

            arrays = [jnp.asarray(a) for a in (x, y, x_test, y_test)]
            factor_batch = (jnp.asarray(factor_x), jnp.asarray(factor_y))
            run = _scores(loss, {"w": jnp.asarray(weight)}, arrays, factor_batch, grid, solver)
    factored, exact = run
    # The model is linear, so the Hessian of the mean loss is the Gauss-Newton matrix A (x) I.
    np.testing.assert_allclose(factored, exact, rtol=1e-9, atol=1e-11)


def _scores(loss, params, arrays, factor_batch, grid, solver):
    x, y, x_test, y_test = arrays
    factored = influence.influence_function(
        loss, params, (x, y), (x_test, y_test), grid, solver, hessian_batch=factor_batch
    )
    exact = influence.influence_function(loss, params, (x, y), (x_test, y_test), grid, "exact")
    return np.asarray(factored), np.asarray(exact)


# --- the reconstruction from the definition ----------------------------------------------------


class TokenMLP(nn.Module):
    """Linear layers applied at every position of a short sequence, a bias and a bare scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2, bias=False)
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5]))
        self.factored = {"fc1.weight": self.fc1, "fc2.weight": self.fc2}

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale

    @staticmethod
    def tokens(layer, inputs, output_grad):
        """A layer's inputs ``(T, p)`` and output gradients ``(T, q)`` for one example."""
        return inputs, output_grad


class ConvNet(nn.Module):
    """A 1-d convolution (its patches are the positions) under a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, kernel_size=3, padding=1)
        self.head = nn.Linear(3 * 5, 2)
        self.factored = {"conv.weight": self.conv, "head.weight": self.head}

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))

    @staticmethod
    def tokens(layer, inputs, output_grad):
        if isinstance(layer, nn.Linear):
            return inputs[None], output_grad[None]
        padded = np.pad(inputs, ((0, 0), (1, 1)))  # (C_in, L + 2)
        patches = np.stack([padded[:, t : t + 3].reshape(-1) for t in range(5)])
        return patches, output_grad.T  # (L, C_in * 3), (L, C_out)


def reference_inverse(model, x, y, method: str, damping: float):
    """The block-diagonal ``(F + damping I)^-1`` from its definition, float64 numpy, and each
    example's gradient, from one example at a time with hooks on the two layers."""
    layers = model.factored
    names = [name for name, _ in model.named_parameters()]
    records = {name: ([], []) for name in layers}  # per example: inputs (T, p), grads (T, q)
    grads = []
    outputs = {}

    def keep(name):
        def hook(module, inputs, output):
            records[name][0].append(inputs[0][0].detach().numpy())
            output.retain_grad()
            outputs[name] = (module, output)

        return hook

    for i in range(len(x)):
        hooks = [layer.register_forward_hook(keep(name)) for name, layer in layers.items()]
        model.zero_grad()
        squared_error(model(x[i : i + 1]), y[i : i + 1]).backward()
        for hook in hooks:
            hook.remove()
        for name in layers:
            module, output = outputs[name]
            a, g = model.tokens(module, records[name][0].pop(), output.grad[0].numpy())
            records[name][0].append(a)
            records[name][1].append(g)
        grads.append({n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()})
    blocks = []
    for name in names:
        per_example = np.stack([g[name].reshape(-1) for g in grads])
        if name not in layers:
            fisher = per_example.T @ per_example / len(x)
            blocks.append(np.linalg.inv(fisher + damping * np.eye(len(fisher))))
            continue
        a, g = (np.stack(r) for r in records[name])  # (n, T, p), (n, T, q)
        factor_in = np.einsum("ntp,ntr->pr", a, a) / (len(x) * a.shape[1])
        factor_out = np.einsum("ntq,nts->qs", g, g) / len(x)
        l_in, q_in = np.linalg.eigh(factor_in)
        l_out, q_out = np.linalg.eigh(factor_out)
        if method == "kfac":
            eigenvalues = np.outer(l_out, l_in)
        else:
            rotated = [q_out.T @ grad[name].reshape(len(q_out), -1) @ q_in for grad in grads]
            eigenvalues = np.mean([r**2 for r in rotated], axis=0)
        basis = np.kron(q_out, q_in)  # matches the row-major flattening of (q, p)
        blocks.append(basis @ np.diag(1 / (eigenvalues.reshape(-1) + damping)) @ basis.T)
    size = sum(len(b) for b in blocks)
    inverse = np.zeros((size, size))
    start = 0
    for block in blocks:
        inverse[start : start + len(block), start : start + len(block)] = block
        start += len(block)
    flat = np.stack([np.concatenate([g[n].reshape(-1) for n in names]) for g in grads])
    return inverse, flat


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("model_class", [TokenMLP, ConvNet])
def test_factored_scores_equal_a_reconstruction_from_the_definition(method, model_class):
    torch.manual_seed(0)
    model = model_class().double()
    shape = (3, 3) if model_class is TokenMLP else (2, 5)  # 3 positions; 2 channels x 5
    x = torch.randn(10, *shape, dtype=torch.float64)
    y = torch.randn(10, *((3, 2) if model_class is TokenMLP else (2,)), dtype=torch.float64)
    damping = 0.05
    loss = pergrad.module_loss(model, squared_error)
    scores = influence.influence_function(
        loss, loss.params(), (x, y), (x[:4], y[:4]), damping, method, chunk_size=3
    )
    inverse, flat = reference_inverse(model, x, y, method, damping)
    expected = flat @ inverse @ flat[:4].T
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-8, atol=1e-10)
    self_scores = influence.self_influence(loss, loss.params(), (x, y), damping, method)
    np.testing.assert_allclose(self_scores.numpy(), np.diag(flat @ inverse @ flat.T), rtol=1e-8)


# --- how good the approximation is --------------------------------------------------------------


@functools.cache
def trained_token_regression(seed: int):
    """A tanh MLP applied at 4 positions, fitted by L-BFGS to a noisy teacher."""
    torch.manual_seed(seed)
    x = torch.randn(60, 4, 4, dtype=torch.float64)
    teacher = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        y = teacher(x) + 0.3 * torch.randn(60, 4, 2, dtype=torch.float64)
        x_test = torch.randn(10, 4, 4, dtype=torch.float64)
        y_test = teacher(x_test)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=80, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        value = squared_error(model(x), y) / len(x)
        value.backward()
        return value

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a busy machine
    try:
        optimizer.step(closure)
    finally:
        torch.set_num_threads(threads)
    return pergrad.module_loss(model, squared_error), (x, y), (x_test, y_test)


def rank_correlation(scores: np.ndarray, reference: np.ndarray) -> float:
    """Mean over test examples of the Spearman correlation of the training examples' ranks."""
    ranks = [np.argsort(np.argsort(m, axis=0), axis=0) for m in (scores, reference)]
    return float(np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(*(r.T for r in ranks))]))


def test_factored_scores_rank_training_examples_closer_to_the_exact_solver_than_grad_dot():
    correlations = {"kfac": [], "ekfac": [], "grad_dot": []}
    for seed in range(1):  # the model test_ekfac_is_closer... fits too (cached)
        loss, train, test = trained_token_regression(seed)
        params = loss.params()
        with warnings.catch_warnings():  # a fitted model's Hessian may be barely indefinite
            warnings.simplefilter("ignore", influence.InfluenceWarning)
            exact = influence.influence_function(loss, params, train, test, 1e-3, "exact")
        for method in ("kfac", "ekfac"):
            # residuals of variance 0.09: the empirical Fisher is about 0.09 x the Gauss-Newton
            scores = influence.influence_function(loss, params, train, test, 1e-4, method)
            correlations[method].append(rank_correlation(scores.numpy(), exact.numpy()))
        grads = pergrad.per_example_grads(loss)
        dots = influence.grad_dot(grads(params, *train), grads(params, *test))
        correlations["grad_dot"].append(rank_correlation(dots.numpy(), exact.numpy()))
    mean = {name: np.mean(values) for name, values in correlations.items()}
    assert mean["ekfac"] > mean["grad_dot"] + 0.1, mean
    assert mean["kfac"] > mean["grad_dot"] + 0.1, mean


def test_ekfac_is_closer_to_the_empirical_fisher_than_kfac():
    """EK-FAC's eigenvalues are the exact diagonal of the Fisher in K-FAC's eigenbasis, so its
    block is the closest to the Fisher among all in that basis (K-FAC's included)."""
    loss, train, _ = trained_token_regression(0)
    params = loss.params()
    grads = pergrad.per_example_grads(loss)(params, *train)["0.weight"].reshape(60, -1).numpy()
    fisher = grads.T @ grads / len(grads)
    size = len(fisher)
    errors = {}
    for method in ("kfac", "ekfac"):
        vectors = {k: torch.zeros(size, *v.shape, dtype=v.dtype) for k, v in params.items()}
        vectors["0.weight"] = torch.eye(size, dtype=torch.float64).reshape(size, 6, 4)
        solved = influence.inverse_hvp(loss, params, train, vectors, 1e-3, method)
        block = np.linalg.inv(solved["0.weight"].reshape(size, size).numpy()) - 1e-3 * np.eye(size)
        errors[method] = np.linalg.norm(block - fisher)
    assert errors["ekfac"] < 0.9 * errors["kfac"], errors


# --- both frameworks ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_both_frameworks_give_the_same_scores_on_the_same_weights(method):
    jax = pytest.importorskip("jax")
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(12, 3, 3, dtype=torch.float64), torch.randn(12, 3, 2, dtype=torch.float64)
    loss = pergrad.module_loss(model, squared_error)
    expected = influence.influence_function(
        loss, loss.params(), (x, y), (x[:3], y[:3]), [0.01, 0.1], method
    ).numpy()
    with jax.enable_x64(True):
        jnp = jax.numpy

        def jax_loss(p, xi, yi):  # x @ W with W (in, out): the transposed layout of nn.Linear
            hidden = jnp.tanh(xi @ p["w1"] + p["b1"])
            return 0.5 * ((hidden @ p["w2"] + p["b2"] - yi) ** 2).sum()

        weights = {name: p.detach().numpy() for name, p in model.named_parameters()}
        params = {
            "w1": jnp.asarray(weights["0.weight"].T),
            "b1": jnp.asarray(weights["0.bias"]),
            "w2": jnp.asarray(weights["2.weight"].T),
            "b2": jnp.asarray(weights["2.bias"]),
        }
        xs, ys = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
        got = influence.influence_function(
            jax_loss, params, (xs, ys), (xs[:3], ys[:3]), [0.01, 0.1], method
        )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-9, atol=1e-12)


# --- bad input ----------------------------------------------------------------------------------


def test_options_are_checked():
    with pytest.raises(ValueError, match="dense_limit must be an int >= 0; got -1"):
        influence.EKFAC(dense_limit=-1)
    with pytest.raises(ValueError, match="dense_limit"):
        influence.KFAC(dense_limit=1.5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'damping'"):
        influence.EKFAC(damping=0.1)


def tiny_problem(examples: int = 3):
    torch.manual_seed(0)
    model = nn.Linear(6, 2).double()
    loss = pergrad.module_loss(model, squared_error)
    x, y = (
        torch.randn(examples, 6, dtype=torch.float64),
        torch.randn(examples, 2, dtype=torch.float64),
    )
    return loss, (x, y)


def test_bad_solver_name_regularizer_and_singular_factors_are_refused():
    loss, batch = tiny_problem()
    with pytest.raises(ValueError, match=r"solver must be one of .*'kfac', 'ekfac'.*got 'ekafc'"):
        influence.influence_function(loss, loss.params(), batch, batch, 0.1, "ekafc")
    with pytest.raises(ValueError, match="cannot add a regularizer's Hessian.*damping=l2"):
        influence.influence_function(
            loss,
            loss.params(),
            batch,
            batch,
            0.1,
            "kfac",
            regularizer=lambda p: 0.0 * p["bias"].sum(),
        )
    # 3 examples cannot pin down a layer with 6 inputs: A is singular, damping 0 is refused
    for method in ("kfac", "ekfac"):
        with pytest.raises(
            ValueError, match=r"singular.*\[.weight.\].*pass damping > 0, e.g. damping="
        ):
            influence.self_influence(loss, loss.params(), batch, 0.0, method)
    with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
        influence.inverse_hvp(loss, loss.params(), batch, {}, -1.0, "ekfac")


def fisher_block_scores(grads: list[np.ndarray], damping: float) -> np.ndarray:
    """Self-influence with one exact empirical-Fisher block per leaf (``grads``: (n, m) each)."""
    total = 0.0
    for g in grads:
        fisher = g.T @ g / len(g)
        total = total + np.einsum(
            "nm,nm->n", g @ np.linalg.inv(fisher + damping * np.eye(len(fisher))), g
        )
    return total


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_loss_without_factored_layers_falls_back_to_a_block_per_parameter(framework):
    rng = np.random.default_rng(3)
    w, x, y = rng.normal(size=3), rng.normal(size=(8, 3)), rng.normal(size=8)

    def loss(p, xi, yi):  # no contraction (jax), no module_loss (torch): no layer to factor
        return 0.5 * ((p["w"] * xi).sum() + p["b"] - yi) ** 2

    with contextlib.ExitStack() as stack:
        if framework == "torch":
            params = {"w": torch.tensor(w), "b": torch.tensor(0.5)}
            batch = (torch.tensor(x), torch.tensor(y))
        else:
            jax = pytest.importorskip("jax")
            stack.enter_context(jax.enable_x64(True))
            params = {"w": jax.numpy.asarray(w), "b": jax.numpy.asarray(0.5)}
            batch = (jax.numpy.asarray(x), jax.numpy.asarray(y))
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        got = np.asarray(influence.self_influence(loss, params, batch, 0.1, "ekfac"))
    assert any(
        issubclass(c.category, pergrad.FallbackWarning)
        and "no layer whose weight it can factor" in str(c.message)
        for c in caught
    ), [str(c.message) for c in caught]
    residual = x @ w + 0.5 - y
    expected = fisher_block_scores([x * residual[:, None], residual[:, None]], 0.1)
    np.testing.assert_allclose(got, expected, rtol=1e-9)
