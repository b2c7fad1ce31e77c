"""``strategy="auto"`` between the ghost norms and materialised per-example gradients (issue 36).

Both routes are exact; they differ in time and memory. ``capture/cost.route_costs`` estimates
each one's extra work over a batch gradient from the layer shapes a run of one example shows
(``capture/torch_probe.py``), and "auto" materialises where that is cheaper and its ``B x P``
numbers fit ``cost.MAX_FORMED_NUMBERS``. These tests check that the choice follows the model
(not timings: nothing here is timed), that ``choose_strategy`` says why, that the route taken
gives the ghost strategy's numbers, and that probing leaves the model and the random stream
alone.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad._src.capture import cost  # noqa: E402
from pergrad._src.capture.cost import LayerWork  # noqa: E402


class SampleConvNet(nn.Module):
    """Opacus's MNIST example model (``examples/mnist.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        return self.fc2(F.relu(self.fc1(x.view(-1, 32 * 4 * 4))))


def conv_net_call(batch: int = 64):
    torch.manual_seed(0)
    model = SampleConvNet()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    return loss, (loss.params(), x, y)


def mlp_call(batch: int = 64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))  # fmt: skip
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))
    return loss, (loss.params(), x, y)


def test_a_small_conv_net_on_a_small_batch_materialises():
    """Opacus's MNIST model: its convolutions' ghost norms form each example's kernel gradient
    anyway, and at 16 examples the ghost strategy's fixed cost per layer decides."""
    loss, args = conv_net_call(batch=16)
    choice = pergrad.norms.choose_strategy(loss, *args)
    assert choice.strategy == "materialize", choice.reason
    assert choice.reason.startswith("materialising the per-example gradients is cheaper")
    assert "ghost norms" in choice.reason and "416,160 numbers" in choice.reason
    # the ghost plan's analysis is still reported
    assert choice.layers == {"conv1": "conv", "conv2": "conv", "fc1": "linear", "fc2": "linear"}


def test_the_same_conv_net_on_a_large_batch_keeps_the_ghost_norms():
    """Per example, the ghost norms cost it less than materialising: past about 20 examples
    their fixed cost is paid off."""
    loss, args = conv_net_call(batch=256)
    choice = pergrad.norms.choose_strategy(loss, *args)
    assert choice.strategy == "ghost"
    assert "the ghost norms are cheaper: estimated extra work" in choice.reason


def test_an_mlp_keeps_the_ghost_norms_by_cost():
    """One position per layer: the ghost norms are closed forms, materialising writes B x P."""
    loss, args = mlp_call()
    choice = pergrad.norms.choose_strategy(loss, *args)
    assert choice.strategy == "ghost"
    assert "the ghost norms are cheaper: estimated extra work" in choice.reason


def test_a_long_sequence_transformer_layer_keeps_the_ghost_norms_by_memory():
    """B x P past cost.MAX_FORMED_NUMBERS: materialising is out of the question; probed not at
    all (a 16 x 512-token batch through a 1024 -> 4096 layer would take a while)."""
    layer = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    loss = pergrad.module_loss(layer, lambda out, y: ((out - y) ** 2).mean())
    x = torch.randn(16, 512, 1024)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, x)
    assert choice.strategy == "ghost"
    assert "materialising would form 134,299,648 per-example numbers" in choice.reason


def test_the_choice_follows_the_cost_model(monkeypatch):
    """The same call flips with the model's price of a materialised number: the choice is the
    model's comparison, not a fixed rule."""
    loss, args = conv_net_call(batch=16)
    assert pergrad.norms.choose_strategy(loss, *args).strategy == "materialize"
    with monkeypatch.context() as patch:
        patch.setattr(cost, "GHOST_LAYER_COST", 0)  # only the per-example work: ghost's less
        assert pergrad.norms.choose_strategy(loss, *args).strategy == "ghost"
    with monkeypatch.context() as patch:
        patch.setattr(cost, "MATERIALIZED_NUMBER_COST", 10**4)
        assert pergrad.norms.choose_strategy(loss, *args).strategy == "ghost"
    with monkeypatch.context() as patch:
        patch.setattr(cost, "MAX_FORMED_NUMBERS", 10**5)  # its 416,160 numbers no longer fit
        assert pergrad.norms.choose_strategy(loss, *args).strategy == "ghost"
    monkeypatch.setattr(cost, "MATERIALIZED_NUMBER_COST", 1)
    loss, args = mlp_call()  # the ghost norms' closed forms still cost less
    assert pergrad.norms.choose_strategy(loss, *args).strategy == "ghost"


def test_small_calls_keep_the_ghost_norms_without_estimating():
    loss, args = conv_net_call(batch=4)  # 104,040 numbers, under cost.MIN_CHOICE_NUMBERS
    choice = pergrad.norms.choose_strategy(loss, *args)
    assert choice.strategy == "ghost" and "estimated" not in choice.reason


def test_named_strategies_are_not_overruled():
    loss, args = conv_net_call()
    assert pergrad.norms.choose_strategy(loss, *args, strategy="ghost").strategy == "ghost"


def test_the_materialised_route_gives_the_ghost_strategys_numbers():
    loss, args = conv_net_call(batch=16)
    assert pergrad.norms.choose_strategy(loss, *args).strategy == "materialize"
    auto = pergrad.dp.clipped_sum_of(loss, *args, max_norm=0.05)
    ghost = pergrad.dp.clipped_sum_of(loss, *args, max_norm=0.05, strategy="ghost")
    for name in auto.sum:
        torch.testing.assert_close(auto.sum[name], ghost.sum[name], rtol=1e-4, atol=1e-6)
    norms = pergrad.norms.per_example_norms_of(loss, *args)
    torch.testing.assert_close(
        norms, pergrad.norms.per_example_norms_of(loss, *args, strategy="ghost"), rtol=1e-4, atol=0
    )


def test_a_dp_steps_choice_counts_the_layers_it_holds():
    """A DP step holds each layer whose per-example gradients are no more numbers than its
    output gradients as those (``capture/torch_held.py``). SampleConvNet: conv1 (1,040
    parameters, 16 x 14 x 14 = 3,136 outputs per example) is held, so the DP step's ghost
    route holds less; conv2 (8,224 against 32 x 5 x 5 = 800) and the linear layers are not.
    A convolution formed over its positions costs what it did (``cost.held_norm_work``)."""
    from pergrad._src.capture import torch_probe

    loss, args = conv_net_call(batch=64)
    layers = pergrad.norms.choose_strategy(loss, *args).layers
    works = torch_probe.layer_works(loss, layers, 0, args)
    held = torch_probe.layer_works(loss, layers, 0, args, frozenset(layers))
    assert sorted(w.kind for w in works) == ["dense", "dense", "dense", "formed"]
    assert sorted(w.kind for w in held) == ["dense", "dense", "dense", "held"]
    assert [w.numbers for w in held if w.kind == "held"] == [16 * 64 + 16]
    norms_only = cost.route_costs(64, 26_010, works)
    clipped = cost.route_costs(64, 26_010, held)
    assert clipped.ghost == norms_only.ghost
    assert norms_only.held - clipped.held == 64 * (16 * 14 * 14 - 1040)
    choice = pergrad.norms.choose_strategy(loss, *args, clipped_sum=True)
    assert "1 layer(s) held" in choice.reason and "held" not in norms_choice(loss, args)
    # a frozen bias: conv1's gradient would be formed for nothing, so it keeps its records
    params = {k: v for k, v in args[0].items() if k != "conv1.bias"}
    frozen = pergrad.norms.choose_strategy(loss, params, *args[1:], clipped_sum=True)
    assert "held" not in frozen.reason


def test_a_held_dense_layer_costs_materialisings_work_on_its_numbers():
    """A linear layer over 64 tokens of width 8: held, its norms and its share of the sum are
    ``MATERIALIZED_NUMBER_COST`` per parameter (its forming is the weight gradient the held
    sum saves); its records' route (the formed gradient, ``T p q``, and the bound's ``4 T (p +
    q)``) costs more."""
    from pergrad._src.capture import torch_probe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 10))
    loss = pergrad.module_loss(model, lambda out, y: F.cross_entropy(out.mean(1), y))
    args = (loss.params(), torch.randn(4, 64, 8), torch.randint(0, 10, (4,)))
    layers = {"0": "linear", "2": "linear"}
    works = torch_probe.layer_works(loss, layers, 0, args)
    held = torch_probe.layer_works(loss, layers, 0, args, frozenset(layers))
    assert [w.kind for w in held] == ["held", "held"]
    assert [w.norm_work for w in held] == [cost.MATERIALIZED_NUMBER_COST * n for n in (72, 90)]
    by_records = [64 * 8 * 8 + cost.BOUND_WORK * 64 * 16, 64 * 8 * 10 + cost.BOUND_WORK * 64 * 18]
    assert [cost.layer_norm_work(w) for w in works] == by_records
    assert cost.route_costs(4, 162, held).ghost < cost.route_costs(4, 162, works).ghost


def norms_choice(loss, args):
    return pergrad.norms.choose_strategy(loss, *args).reason


@pytest.mark.parametrize("batch", [16, 64])
def test_dp_optimizer_takes_the_clipped_sums_choice(batch):
    """What ``choose_strategy(..., clipped_sum=True)`` reports is the route the DP step
    takes."""
    loss, args = conv_net_call(batch=batch)
    expected = pergrad.norms.choose_strategy(loss, *args, clipped_sum=True).strategy
    assert expected == ("materialize" if batch == 16 else "ghost")
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(loss.model.parameters(), lr=0.1),
        loss.model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=batch,
    )
    assert optimizer.step(*args[1:]).strategy == expected


def test_choose_strategy_names_a_bad_clipped_sum():
    loss, args = conv_net_call(batch=4)
    with pytest.raises(TypeError, match="clipped_sum must be True or False; got 'yes'"):
        pergrad.norms.choose_strategy(loss, *args, clipped_sum="yes")


class Noisy(nn.Module):
    """Dropout in training mode and a buffer written in ``forward``: the probe must leave both
    the random stream and the buffer alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv1d(4, 64, 3), nn.Linear(64, 10)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        hidden = F.dropout(self.fc1(x).relu(), 0.5, self.training)
        return self.fc2(hidden.mean(-1))


def test_probing_leaves_the_model_and_the_random_stream_alone():
    torch.manual_seed(0)
    model = Noisy().train()
    loss = pergrad.module_loss(model, F.cross_entropy)
    x, y = torch.randn(512, 4, 64), torch.randint(0, 10, (512,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y)
    assert "estimated extra work" in choice.reason  # the probe ran
    assert torch.equal(torch.get_rng_state(), state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(not m._forward_hooks for m in model.modules())


class NeedsTheBatch(nn.Module):
    """A model that cannot run one example alone (it splits the batch in halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Conv1d(4, 64, 3)

    def forward(self, x):
        first, second = x.chunk(2)
        return torch.cat([self.fc(first), self.fc(second)]).mean((1, 2))


def test_a_model_that_does_not_run_one_example_keeps_the_ghost_norms():
    model = NeedsTheBatch()
    loss = pergrad.module_loss(model, lambda out, y: ((out - y) ** 2).sum())
    x, y = torch.randn(512, 4, 64), torch.randn(512)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y)
    assert choice.strategy == "ghost"
    assert "no estimate of materialising's cost: the model did not run" in choice.reason


def test_an_empty_batch_still_materialises():
    loss, (params, x, y) = conv_net_call()
    assert pergrad.norms.choose_strategy(loss, params, x[:0], y[:0]).strategy == "materialize"


# --- the cost model itself -------------------------------------------------------------------


def test_layer_norm_work_by_route():
    one_position = LayerWork("dense", 1, (512, 32), 1, 512 * 32)
    assert cost.layer_norm_work(one_position) == 512 + 32  # |a|^2 |d|^2
    formed = LayerWork("dense", 25, (256, 32), 1, 256 * 32)  # 2 T (p + q) > p q
    assert cost.layer_norm_work(formed) == 25 * 256 * 32 + cost.BOUND_WORK * 25 * 288
    gram = LayerWork("dense", 4, (1024, 1024), 1, 1024**2)  # Gram matrices cost less
    bound = cost.BOUND_WORK * 4 * 2048
    assert cost.layer_norm_work(gram) == cost.FAST_GRAM_COST * 16 * 2048 + bound  # float32
    assert cost.layer_norm_work(gram, fast_gram=False) == cost.FLOAT64_COST * 16 * 2048 + bound
    # T (p + q) = 0.625 p q: Gram in certified float32 (PyTorch), formed at float64's price (JAX)
    between = LayerWork("dense", 128, (256, 1024), 1, 256 * 1024)
    bound = cost.BOUND_WORK * 128 * 1280
    assert cost.layer_norm_work(between) == cost.FAST_GRAM_COST * 128**2 * 1280 + bound
    assert cost.layer_norm_work(between, fast_gram=False) == 128 * 256 * 1024 + bound
    light = LayerWork("light", 1, (4096,), 1, 512)
    assert cost.layer_norm_work(light) == 4096


def test_route_costs_compare_within_the_memory_budget():
    layers = [LayerWork("formed", 196, (64, 16), 1, 1040)]
    costs = cost.route_costs(64, 1040, layers)
    assert costs.numbers == 64 * 1040
    assert costs.materialize == cost.MATERIALIZED_NUMBER_COST * 64 * 1040
    assert not costs.materialize_is_cheaper()  # 66,560 numbers: under MIN_CHOICE_NUMBERS
    per_example = cost.layer_norm_work(layers[0])
    assert costs.ghost == 64 * per_example + cost.GHOST_LAYER_COST  # fixed: once per layer
    big = cost.route_costs(1024, 1040, layers)
    assert big.ghost > big.materialize and big.materialize_is_cheaper()
    too_big = cost.route_costs(cost.MAX_FORMED_NUMBERS // 1000, 1040, layers)
    assert too_big.ghost > too_big.materialize and not too_big.materialize_is_cheaper()


def test_route_costs_weigh_memory_past_the_free_budget():
    """Materialising faster, but holding more than the ghost norms and past
    ``FREE_FORMED_NUMBERS``: the ghost norms, by memory, and the reason says so; within either
    bound, materialising. A DP step's layer whose output gradients outnumber its per-example
    gradients is held as those (``capture/torch_held.py``): no more than materialising's."""
    layer = LayerWork("formed", 4, (64, 16), 1, 1040)  # holds 4 x 16 per example
    # B x P past the free budget: 2 B P against B x 64 held
    batch = cost.FREE_FORMED_NUMBERS // 1040 + 1
    past = cost.route_costs(batch, 1040, [layer])
    assert past.held == batch * 4 * 16
    assert past.materialize < past.ghost and not past.materialize_is_cheaper()
    assert "ghost by memory" in past.describe()
    # a layer whose output gradients are more than materialising would hold: with its records
    # held, materialising; held as its per-example gradients (a DP step's "held" layer, 1040
    # numbers), no more than materialising's, so still ghost by memory
    wide = LayerWork("formed", 196, (64, 16), 1, 1040)  # 196 x 16 > 2 x 1040 per example
    records = cost.route_costs(batch, 1040, [wide])
    assert records.held == batch * 196 * 16 and records.materialize_is_cheaper()
    held = cost.route_costs(batch, 1040, [LayerWork("held", 1, (), 1, 1040)])
    assert held.held == batch * 1040 and held.held_layers == 1
    assert not held.materialize_is_cheaper() and "1 layer(s) held" in held.describe()
    # under the free budget, whatever the ghost norms hold
    small = cost.route_costs(1024, 1040, [layer])
    assert cost.MATERIALIZED_MEMORY * small.numbers <= cost.FREE_FORMED_NUMBERS
    assert small.materialize_is_cheaper() and "memory" not in small.describe()


def test_a_vit_sized_call_keeps_the_ghost_norms_by_memory():
    """A transformer block on 65 tokens at batch 32 (a ViT's): materialising is estimated
    faster, but would hold 2 B P numbers, past what the ghost norms hold: "auto" keeps the
    ghost norms (measured: materialising took 2.72x the non-private step's memory)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    model = nn.Sequential(block, nn.LayerNorm(128), nn.Linear(128, 10))
    loss = pergrad.module_loss(model, lambda out, y: F.cross_entropy(out.mean(0, keepdim=True), y))
    x, y = torch.randn(32, 65, 128), torch.randint(0, 10, (32, 1))
    choice = pergrad.norms.choose_strategy(loss, loss.params(), x, y)
    assert choice.strategy == "ghost", choice.reason
    assert "ghost by memory" in choice.reason


@pytest.mark.slow(
    reason="a subprocess quick run of the auto-choice benchmark: about 1-2 minutes on 2 cores"
)
def test_auto_choice_benchmark_quick_run(tmp_path):
    """benchmarks/auto_choice.py --quick: a row for every workload, the route auto took being
    choose_strategy's, and each workload's reason."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "auto_choice.md"
    command = [sys.executable, "benchmarks/auto_choice.py", "--quick", "--out", str(out)]
    root = Path(__file__).resolve().parents[1]
    subprocess.run(command, cwd=root, check=True, capture_output=True, timeout=600)
    text = out.read_text()
    assert text.startswith("# Which route")
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")][2:]
    taken = {row[0].strip(): row[-2].strip() for row in rows}
    assert taken == {
        "MNIST conv (Opacus's SampleConvNet)": "ghost",
        "MNIST conv, batch 16": "materialize",
        "MLP 784-256-256-10": "ghost",
        "wide MLP 784-1024-1024-10": "ghost",
        "transformer, 256 tokens": "ghost",  # materialising faster, but by memory
        "transformer, 128 tokens": "ghost",
    }
    for workload, route in taken.items():  # the reason of each workload's choice
        assert f"- {workload}: **{route}**: " in text
