"""A reduction added as a plug-in: taught to a layer family from outside the capture engine and
the rules (issue 16), here the per-layer Kronecker projection of LoGra (Choe et al. 2024),
``P_out^T G_b P_in = (D_b P_out)^T (A_b P_in)``, computed from the captured records without
forming ``G_b``. Reference: a loop of single-example autograd gradients, projected."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch capture engine")

from torch import nn  # noqa: E402

from pergrad._src.capture import rules  # noqa: E402
from pergrad._src.capture.torch_engine import capturing, layer_calls  # noqa: E402

BATCH, LENGTH = 3, 4


@pytest.fixture
def projection():
    @rules.register_reduction("test_kronecker_projection", "linear")
    def project(layer, calls, p_in, p_out):
        a = torch.cat([c.inputs[0].reshape(BATCH, -1, layer.in_features) for c in calls], 1)
        d = torch.cat([c.output_grad.reshape(BATCH, -1, layer.out_features) for c in calls], 1)
        return {"weight": torch.einsum("btq,btp->bqp", d @ p_out, a @ p_in)}

    yield project
    for rule in {id(r): r for r in rules._RULES.values()}.values():  # noqa: SLF001
        rule.plugins.pop("test_kronecker_projection", None)


def test_a_plug_in_reduction_runs_on_the_engines_records(projection):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(BATCH, LENGTH, 5, dtype=torch.float64)
    target = torch.randn(BATCH, LENGTH, 3, dtype=torch.float64)
    layers = {"0": model[0], "2": model[2]}
    with capturing(layers, BATCH) as records:
        ((model(x) - target) ** 2).sum().backward()

    for name, layer in layers.items():
        rule = rules.rule_for(layer)
        assert rule is not None and rule.reduction("test_kronecker_projection") is projection
        p_in = torch.randn(layer.in_features, 2, dtype=torch.float64)
        p_out = torch.randn(layer.out_features, 2, dtype=torch.float64)
        projected = rule.reduction("test_kronecker_projection")(
            layer, layer_calls(name, records[name]), p_in, p_out
        )["weight"]
        for b in range(BATCH):
            (grad,) = torch.autograd.grad(
                ((model(x[b : b + 1]) - target[b : b + 1]) ** 2).sum(), layer.weight
            )
            torch.testing.assert_close(projected[b], p_out.T @ grad @ p_in)


def test_built_in_reductions_and_unknown_plug_ins():
    rule = rules.rule_for(nn.Linear(2, 2))
    assert rule.reduction("squared_norms") is rule.squared_norms
    assert rule.reduction("no_such_reduction") is None


def test_register_reduction_refuses_an_unknown_family_or_a_built_in_name():
    with pytest.raises(ValueError, match="no layer family 'lineer'.*'linear'"):
        rules.register_reduction("x", "lineer")
    with pytest.raises(ValueError, match="'squared_norms' is a built-in"):
        rules.register_reduction("squared_norms", "linear")


class Mixed(nn.Module):
    """Linear layers (the plug-in's family), an embedding and a LayerNorm (no plug-in: their
    per-example gradients), a bare parameter (a generic unit)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 5)
        self.fc = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.out = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.3))

    def forward(self, ids):
        return self.out(self.norm(torch.tanh(self.fc(self.emb(ids))))) * self.scale


def test_layer_reductions_of_runs_the_plug_in_over_one_captured_pass(projection):
    import pergrad
    from pergrad._src.api.reductions import layer_reductions_of

    torch.manual_seed(1)
    model = Mixed().double()
    ids = torch.randint(0, 9, (BATCH, LENGTH))
    target = torch.randn(BATCH, LENGTH, 3, dtype=torch.float64)

    def mse(out, y):
        return ((out - y) ** 2).sum()

    loss = pergrad.module_loss(model, mse)
    params = loss.params()
    p_in = torch.randn(7, 2, dtype=torch.float64)
    p_out = torch.randn(3, 2, dtype=torch.float64)
    # one projection pair for the 7 -> 3 layer; fc (5 -> 7) gets its own
    pairs = {
        7: (p_in, p_out),
        5: (torch.randn(5, 2, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)),
    }

    @rules.register_reduction("test_projection_by_width", "linear")
    def by_width(layer, calls, pairs):
        return projection(layer, calls, *pairs[layer.in_features])

    try:
        results = layer_reductions_of(
            loss, params, ids, target, reduction="test_projection_by_width", reduction_args=(pairs,)
        )
    finally:
        for rule in {id(r): r for r in rules._RULES.values()}.values():  # noqa: SLF001
            rule.plugins.pop("test_projection_by_width", None)
    assert len(results) == len(params)
    for name, result in zip(params, results):
        for b in range(BATCH):
            grads = torch.autograd.grad(
                mse(model(ids[b : b + 1]), target[b : b + 1]), dict(model.named_parameters())[name]
            )[0]
            if name in ("fc.weight", "out.weight"):
                assert result.reduced, name
                p_i, p_o = pairs[grads.shape[1]]
                torch.testing.assert_close(result.value[b], p_o.T @ grads @ p_i)
            else:  # biases of a family whose plug-in skips them, the embedding, the norm, scale
                assert not result.reduced, name
                torch.testing.assert_close(result.value[b], grads)


def test_a_loss_the_engine_cannot_capture_comes_back_as_per_example_gradients():
    import pergrad
    from pergrad._src.api.reductions import layer_reductions_of

    def loss(w, x):  # a plain function, not a module_loss: no layers to hook
        return torch.tanh(x @ w).sum()

    w, x = torch.randn(4, 3), torch.randn(BATCH, 4)
    with pytest.warns(pergrad.FallbackWarning, match="capture engine cannot take this call"):
        (result,) = layer_reductions_of(loss, w, x, reduction="anything")
    assert not result.reduced
    torch.testing.assert_close(result.value, pergrad.per_example_grads(loss)(w, x))
