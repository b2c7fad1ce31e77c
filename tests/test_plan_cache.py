"""The PyTorch ghost strategy's plan, remembered per loss (``capture/torch_plan.plan``).

"auto" and "ghost" plan every call; the plan, the cost model's layer works
(``capture/torch_probe.layer_works``) and the norm routes are kept on the loss under the
model's structure, read afresh at each call. These tests check that a remembered plan is the
one a loss that never planned works out (after each change that a plan depends on: a module or
a parameter replaced, ``requires_grad`` flipped, another parameter dict, a rule registered, a
batch norm put in training mode), that the results equal a loop of single examples, that the
second call takes the remembered plan, and that the model is left as it was.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_flat_norms, torch_module_loop_grads  # noqa: E402
from pergrad._src.capture import cost, rules, torch_plan, torch_probe  # noqa: E402


class Scaled(nn.Linear):
    """A linear layer under another class: no rule matches it (rules match classes exactly)."""


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), Scaled(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)
    ).eval()


def batch(size: int = 5):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,))


def assert_same_plan(loss, params, fresh=None) -> torch_plan.GhostPlan:
    """The loss's plan, checked equal to that of ``fresh`` (default: a new loss of its model),
    a loss that never planned."""
    found = torch_plan.plan(loss, params)
    fresh = pergrad.module_loss(loss.model, F.cross_entropy) if fresh is None else fresh
    assert found == torch_plan.plan(fresh, params)  # (every field but the structure)
    return found


def assert_loop_norms(loss, strategy: str = "ghost") -> None:
    x, y = batch()
    params = loss.params()
    norms = pergrad.norms.per_example_norms_of(loss, params, x, y, strategy=strategy)
    loop = torch_module_loop_grads(loss.model, F.cross_entropy, [x], [y])
    expected = torch_flat_norms({name: loop[name] for name in params})
    np.testing.assert_allclose(norms.double().numpy(), expected, rtol=1e-5, atol=1e-7)


def test_a_remembered_plan_gives_the_loop_norms_and_is_taken_on_the_second_call(monkeypatch):
    worked_out, routes, works = [], [], []
    for module, name, calls in (
        (torch_plan, "_worked_out", worked_out),
        (torch_plan, "norm_route", routes),
        (torch_probe, "_works", works),
    ):
        original = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _f=original, _c=calls, **k: _c.append(1) or _f(*a, **k)
        )
    loss = pergrad.module_loss(make_model(), F.cross_entropy)
    x, y = batch()
    for _ in range(2):
        assert_loop_norms(loss)
        choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y)
        layers = choice.layers
        assert set(choice.norm_routes) == set(layers)
        torch_probe.layer_works(
            loss,
            layers,
            0,
            (loss.params(), x, y),
            structure=torch_plan.plan(loss, loss.params()).structure,
        )
    assert layers == {"0": "linear", "2": "generic", "3": "batch_norm_eval", "5": "linear"}
    assert len(worked_out) == 1  # planned once, then remembered
    assert len(routes) == len(layers)  # each layer's route worked out once
    assert len(works) == 1


def test_a_replaced_module_is_planned_again():
    model = make_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    assert assert_same_plan(loss, loss.params()).layers["2"] == "generic"
    model[2] = nn.Linear(8, 8)  # now a layer with a rule
    assert assert_same_plan(loss, loss.params()).layers["2"] == "linear"
    assert_loop_norms(loss)
    for head in (nn.Linear(8, 3), nn.Linear(8, 5)):  # a wider head: shapes and routes follow
        model[5] = head
        found = assert_same_plan(loss, loss.params())
        args = (loss.params(), *batch())
        fresh = pergrad.module_loss(model, F.cross_entropy)
        works = torch_probe.layer_works(loss, found.layers, 0, args, structure=found.structure)
        assert works == torch_probe.layer_works(fresh, found.layers, 0, args)
        assert works[-1].widths == (8, head.out_features)
        routes = pergrad.norms.choose_strategy(loss, *args).norm_routes
        assert routes["5"] == rules.rule_for(head).route(head)
        assert f"8 x {head.out_features}" in routes["5"]


def test_a_replaced_parameter_is_planned_again():
    model = make_model()
    model[0], model[2] = nn.Linear(8, 8), nn.Linear(8, 8)
    loss = pergrad.module_loss(model, F.cross_entropy)
    assert assert_same_plan(loss, loss.params()).unsupported == {}
    untied = loss.params()
    del untied["2.weight"]  # the same names before and after the tie
    assert assert_same_plan(loss, untied).unsupported == {}
    kept = model[2].weight  # (alive: its id is not reused)
    model[2].weight = model[0].weight  # tied weights: only the parameters' objects tell
    for params in (untied, loss.params()):
        found = assert_same_plan(loss, params)
        assert "tied weights" in found.unsupported["0"]  # (no cross rule for two linear layers)
    assert kept is not model[2].weight


def test_flipped_requires_grad_and_another_params_dict_are_planned_again():
    model = make_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    assert "0" in assert_same_plan(loss, loss.params()).layers
    for param in model[0].parameters():
        param.requires_grad_(False)
    assert "0" not in assert_same_plan(loss, loss.params()).layers
    assert_loop_norms(loss)
    head = {name: p for name, p in loss.params().items() if name.startswith("5.")}
    assert assert_same_plan(loss, head).layers == {"5": "linear"}
    assert "3" in assert_same_plan(loss, loss.params()).layers


def test_a_rule_registered_meanwhile_and_a_module_put_in_training_mode_are_seen(monkeypatch):
    model = make_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    assert assert_same_plan(loss, loss.params()).layers["2"] == "generic"
    monkeypatch.setitem(rules._RULES, Scaled, rules.rule_for(nn.Linear(1, 1)))  # noqa: SLF001
    assert assert_same_plan(loss, loss.params()).layers["2"] == "linear"
    assert_loop_norms(loss)
    fresh = pergrad.module_loss(model, F.cross_entropy)  # (refused in training mode)
    model[3].train()  # a batch norm in training mode mixes the batch: no ghost rule
    assert "3" in assert_same_plan(loss, loss.params(), fresh).unsupported
    model[3].eval()
    assert assert_same_plan(loss, loss.params()).layers["3"] == "batch_norm_eval"


def test_planning_leaves_the_model_as_it_was():
    model = make_model()
    loss = pergrad.module_loss(model, F.cross_entropy)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    x, y = batch()
    for strategy in ("auto", "ghost"):
        pergrad.norms.per_example_norms_of(loss, loss.params(), x, y, strategy=strategy)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(
        not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)  # noqa: SLF001
        for m in model.modules()
    )
    assert not model.training


def test_a_position_bias_table_found_later_is_planned_again():
    """A table is a position-bias table while its parent has ``compute_bias`` (T5's pattern),
    which can be set on the parent object itself."""
    attention = nn.Module()
    attention.relative_attention_bias = nn.Embedding(4, 2)
    model = nn.Sequential(nn.Linear(2, 2))
    model.attention = attention
    loss = pergrad.module_loss(model, F.cross_entropy)
    assert assert_same_plan(loss, loss.params()).layers["attention.relative_attention_bias"] == (
        "embedding"
    )
    attention.compute_bias = lambda query_length, key_length: None
    found = assert_same_plan(loss, loss.params())
    assert found.layers["attention.relative_attention_bias"] == torch_plan.POSITION_BIAS


def test_routes_and_works_follow_the_cost_models_settings(monkeypatch):
    """The routes and the held works read ``cost``'s switches, which benchmarks change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Flatten(), nn.Linear(32, 3))
    loss = pergrad.module_loss(model, F.cross_entropy)
    args = (loss.params(), torch.randn(5, 8, 2), torch.randint(0, 3, (5,)))
    found = torch_plan.plan(loss, args[0])
    seen = set()
    for fast in (True, False, True):
        for factor in (1, 2):
            monkeypatch.setattr(cost, "FAST_NORMS", fast)
            monkeypatch.setattr(cost, "MATERIALIZED_NUMBER_COST", 32 * factor)
            routes = pergrad.norms.choose_strategy(loss, *args).norm_routes
            assert routes == {name: rules.rule_for(model[int(name)]).route(model[int(name)])
                              for name in ("0", "2")}  # fmt: skip
            seen.add(routes["0"])
            works = torch_probe.layer_works(loss, found.layers, 0, args, frozenset({"0"}),
                                            found.structure)  # fmt: skip
            held = next(work for work in works if work.kind == "held")
            numbers = sum(p.numel() for p in model[0].parameters())
            assert held.norm_work == 32 * factor * numbers  # (cost.held_norm_work: a dense layer)
    assert len(seen) == 2  # (the settings change the routes)
