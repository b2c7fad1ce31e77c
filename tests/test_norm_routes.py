"""``choose_strategy(...).norm_routes``: how the ghost strategy computes each layer's per-example
norms (Gram matrices, the formed per-example gradient, or a closed form), and that the route
reported is the route taken.

The Gram route's limit is checked against a brute-force search of its cost rule
(``c T (p + q) <= p q``: the Gram matrices' multiply-adds, each priced ``c`` float32
multiply-adds of the formed gradient: ``FAST_GRAM_COST`` for PyTorch's certified float32 Gram
route, ``FLOAT64_COST`` for float64, as JAX prices it), and the route taken is observed by
counting calls of the Gram kernel on both sides of the limit, with the norms checked against
a loop.
"""

from __future__ import annotations

import pytest

import pergrad


def brute_force_limit(width_in: int, width_out: int, gram_cost: float) -> int:
    """The largest number of positions whose Gram matrices cost no more multiply-adds (each
    counted ``gram_cost`` times) than forming the per-example gradient."""
    positions = 0
    while (
        gram_cost * (positions + 1) ** 2 * (width_in + width_out)
        <= (positions + 1) * width_in * width_out
    ):
        positions += 1
    return positions


# --- PyTorch ------------------------------------------------------------------------------


def test_torch_routes_name_every_layer_and_the_gram_limit():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.conv = nn.Conv1d(8, 6, 3)
            self.norm = nn.LayerNorm(6)
            self.head = nn.Linear(6, 24)

        def forward(self, ids):
            h = self.conv(self.embed(ids).transpose(1, 2)).transpose(1, 2)
            return self.head(self.norm(h)).mean(1)

    model = Model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    ids, labels = torch.randint(0, 20, (4, 9)), torch.randint(0, 24, (4,))
    choice = pergrad.norms.choose_strategy(loss, loss.params(), ids, labels)
    assert choice.strategy == "ghost"
    assert set(choice.norm_routes) == set(choice.layers) == {"embed", "conv", "norm", "head"}
    from pergrad._src.capture import cost

    limit = brute_force_limit(6, 24, cost.FAST_GRAM_COST)
    assert f"up to {limit} positions" in choice.norm_routes["head"]
    assert "6 x 24 per-example gradient formed" in choice.norm_routes["head"]
    assert "24 x 6 per-example kernel gradient" in choice.norm_routes["conv"]  # 8 x 3 inputs
    assert "per row" in choice.norm_routes["embed"]
    assert "scale and shift" in choice.norm_routes["norm"]


@pytest.mark.parametrize("beyond", [False, True], ids=["at the limit", "one past it"])
def test_torch_route_reported_is_the_route_taken(monkeypatch, beyond):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch import nn

    from _reference import torch_flat_norms, torch_module_loop_grads
    from pergrad._src.capture import cost, torch_norms

    width = 32
    limit = brute_force_limit(width, width, cost.FAST_GRAM_COST)
    positions = limit + beyond
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Flatten(), nn.Linear(positions * width, 3))
    loss = pergrad.module_loss(model, F.cross_entropy)
    X, Y = torch.randn(5, positions, width), torch.randint(0, 3, (5,))
    route = pergrad.norms.choose_strategy(loss, loss.params(), X, Y).norm_routes["0"]
    assert f"up to {limit} positions" in route

    grams = []
    original = torch_norms._gram_in
    monkeypatch.setattr(
        torch_norms, "_gram_in", lambda a, d, unit: grams.append(a.shape) or original(a, d, unit)
    )
    norms = pergrad.norms.per_example_norms_of(loss, loss.params(), X, Y, strategy="ghost")
    # layer 0 sees `positions` tokens per example; layer 2 one (its own closed form)
    assert bool(grams) == (not beyond)
    assert all(shape[2] == positions for shape in grams)
    want = torch_flat_norms(torch_module_loop_grads(model, F.cross_entropy, [X], [Y]))
    torch.testing.assert_close(norms.double(), torch.as_tensor(want), rtol=1e-5, atol=1e-7)


# --- JAX ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "positions, expected",
    [
        (1, "one position"),
        (2, "Gram matrices in float32"),  # 2 x 2 (8 + 8) <= 8 x 8: Gram, certified float32
        (3, "cheaper than Gram matrices"),  # 2 x 3 (8 + 8) > 8 x 8 (the rule PyTorch's takes)
    ],
)
def test_jax_routes_follow_the_traced_shapes(positions, expected):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    if jax.config.jax_enable_x64:
        pytest.skip("the expected routes are those of float32 JAX (jax_enable_x64 off)")

    def loss(params, tokens, y):
        h = jnp.tanh(params["table"][tokens] @ params["dense"])  # (T, 8)
        return (h.mean(0) @ params["head"] - y) ** 2

    key = jax.random.key(0)
    params = {
        "table": jax.random.normal(key, (11, 8)),
        "dense": jax.random.normal(key, (8, 8)),
        "head": jax.random.normal(key, (8,)),
    }
    tokens = jax.random.randint(key, (4, positions), 0, 11)
    y = jnp.zeros(4)
    choice = pergrad.norms.choose_strategy(loss, params, tokens, y)
    assert choice.strategy == "ghost"
    routes = choice.norm_routes
    assert set(routes) == set(choice.layers)
    assert expected in routes["['dense']"]
    if positions > 1:
        assert "certified" in routes["['dense']"]
    if positions > 2:
        assert (
            f"8 x 8 per-example gradient formed in float32 ({positions} positions"
            in (routes["['dense']"])
        )
    assert "per row" in routes["['table']"]
    assert "one position" in routes["['head']"]
