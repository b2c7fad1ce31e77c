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
