"""Parameters no layer rule owns, beside layers that have one (issue 19).

A ViT embedding owns its class token and position embeddings next to the patch convolution; a
model may own a learnable scale next to its layers. Such a bare parameter gets its per-example
gradient from its module run alone (``capture/torch_generic.py``) and must not send the layers
beside it off the ghost path. Every result is checked against ordinary training code run one
example at a time (``_reference.torch_module_loop_grads``), which shares no code with pergrad.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch ghost strategy")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from _reference import torch_module_loop_grads  # noqa: E402

# Each strategy must run as chosen: a ghost run that fell back would hide what is tested.
pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

BATCH, TOKENS, WIDTH, CLASSES = 6, 5, 16, 3
RTOL = 1e-5  # float32


class Embed(nn.Module):
    """The issue's module: a position table added to a projection it also owns."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, WIDTH)
        self.pos = nn.Parameter(0.5 * torch.randn(1, TOKENS, WIDTH))

    def forward(self, x):
        return self.proj(x) + self.pos


class EmbedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)).mean(1))


class PatchEmbeddings(nn.Module):
    """As Hugging Face's ``ViTPatchEmbeddings``: a module without parameters of its own."""

    def __init__(self):
        super().__init__()
        self.projection = nn.Conv2d(3, WIDTH, kernel_size=4, stride=4)

    def forward(self, images):
        return self.projection(images).flatten(2).transpose(1, 2)


class ViTEmbeddings(nn.Module):
    """As Hugging Face's ``ViTEmbeddings``: class token prepended, position embeddings added."""

    def __init__(self, patches: int):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.patch_embeddings = PatchEmbeddings()
        self.position_embeddings = nn.Parameter(0.5 * torch.randn(1, patches + 1, WIDTH))

    def forward(self, images):
        patches = self.patch_embeddings(images)
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embeddings


class TinyViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = ViTEmbeddings(patches=4)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images):
        hidden = torch.tanh(self.mix(self.embeddings(images)))
        return self.head(hidden[:, 0] + hidden[:, 1:].mean(1))


class Temperature(nn.Module):
    """Bare parameters of the model itself: a learnable temperature and a gate vector."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, CLASSES)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.gate = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return self.fc(x * self.gate) / self.scale


class Gate(nn.Module):
    """A rule-less module with a parameter of its own, nested in a module that has a Linear."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        return x * torch.sigmoid(self.weight)


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, WIDTH)
        self.gate = Gate()
        self.shift = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x):
        return self.gate(torch.tanh(self.fc(x))) + self.shift


class GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = GatedBlock()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.block(x))


def images():
    return torch.randn(BATCH, 3, 8, 8)


def tokens():
    return torch.randn(BATCH, TOKENS, 8)


def features():
    return torch.randn(BATCH, 8)


# model, its input, and the layers choose_strategy reports
MODELS = {
    "embed": (
        EmbedModel,
        tokens,
        {"embed": "generic", "embed.proj": "linear", "head": "linear"},
    ),
    "vit": (
        TinyViT,
        images,
        {
            "embeddings": "generic",
            "embeddings.patch_embeddings.projection": "conv",
            "mix": "linear",
            "head": "linear",
        },
    ),
    "root": (Temperature, features, {"": "generic", "fc": "linear"}),
    "nested": (
        GatedModel,
        features,
        {"block": "generic", "block.fc": "linear", "block.gate": "generic", "head": "linear"},
    ),
}


def problem(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model_fn, input_fn, layers = MODELS[name]
    model = model_fn()
    x, y = input_fn(), torch.randint(0, CLASSES, (BATCH,))
    return model, (x, y), layers


def flat_norms(grads: dict) -> np.ndarray:
    return (
        torch.cat([g.reshape(len(g), -1) for g in grads.values()], 1)
        .double()
        .norm(dim=1)
        .cpu()
        .numpy()
    )


def reference_clipped_sum(grads: dict, max_norm: float) -> dict:
    factors = np.minimum(1.0, max_norm / np.maximum(flat_norms(grads), 1e-30))
    return {k: np.tensordot(factors, g.double().cpu().numpy(), axes=1) for k, g in grads.items()}


def assert_close(actual, expected, rtol=RTOL):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("name", list(MODELS))
def test_bare_parameters_run_alone_and_the_layers_beside_them_stay_ghost(name):
    model, (x, y), layers = problem(name)
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = loss.params()
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    assert set(want) == set(params)

    choice = pergrad.norms.choose_strategy(loss, params, x, y)
    assert choice.strategy == "ghost", choice.reason
    assert choice.layers == layers
    assert not choice.unsupported

    max_norm = float(np.median(flat_norms(want)))
    expected_sum = reference_clipped_sum(want, max_norm)
    for _ in range(2):  # the first (checked) run of the layout, and a later one
        per_layer = pergrad.norms.per_example_norms_of(loss, params, x, y, per_layer=True)
        for key, grads in want.items():
            assert_close(per_layer[key], grads.reshape(BATCH, -1).norm(dim=1))
        norms = pergrad.norms.per_example_norms_of(loss, params, x, y)
        assert_close(norms, flat_norms(want))
        clipped = pergrad.dp.clipped_sum_of(loss, params, x, y, max_norm=max_norm)
        assert set(clipped.sum) == set(expected_sum)
        for key, value in expected_sum.items():
            assert_close(clipped.sum[key].detach(), value)


def test_the_units_take_the_parameters_passed_not_the_models_own():
    """Run alone, a unit's layers with a rule must compute with the values the batched pass
    used: here parameters other than the model's."""
    model, (x, y), _ = problem("vit", seed=1)
    loss = pergrad.module_loss(model, F.cross_entropy)
    other = {k: v + 0.3 * torch.randn_like(v) for k, v in loss.params().items()}
    moved = TinyViT()
    moved.load_state_dict(other)
    want = torch_module_loop_grads(moved, F.cross_entropy, [x], [y])
    assert_close(pergrad.norms.per_example_norms_of(loss, other, x, y), flat_norms(want))


def test_a_dp_step_with_bare_parameters_is_the_loops_clipped_mean():
    model, (x, y), _ = problem("vit", seed=2)
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    max_norm = float(np.median(flat_norms(want)))
    expected = reference_clipped_sum(want, max_norm)
    before = {k: p.detach().double().clone() for k, p in model.named_parameters()}
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        model,
        F.cross_entropy,
        max_norm=max_norm,
        noise_multiplier=0.0,
        expected_batch_size=BATCH,
    )
    stats = optimizer.step(x, y)
    assert stats.strategy == "ghost"
    for key, param in model.named_parameters():
        step = before[key].cpu().numpy() - 0.5 * expected[key] / BATCH
        np.testing.assert_allclose(param.detach().cpu().numpy(), step, rtol=1e-5, atol=1e-6)


def test_a_bare_parameter_read_outside_its_module_is_caught_and_auto_falls_back():
    """The parent reads ``embed.pos`` itself: the unit run alone misses that use, which the first
    run's check of the per-example sum against the batch gradient catches."""

    class Reader(EmbedModel):
        def forward(self, x):
            return self.head(torch.tanh(self.embed(x)).mean(1) + self.embed.pos.sum(1))

    torch.manual_seed(3)
    model = Reader()
    x, y = tokens(), torch.randint(0, CLASSES, (BATCH,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    with pytest.warns(pergrad.FallbackWarning, match="'embed'.*do not add up"):
        norms = pergrad.norms.per_example_norms_of(loss, loss.params(), x, y)
    assert_close(norms, flat_norms(want))


def dp_steps(model, batch, steps: int, **options):
    """``steps`` zero-noise DPOptimizer steps on one batch; the FallbackWarnings they gave."""
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=0.0,
        **options,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = [optimizer.step(*batch) for _ in range(steps)]
    return stats, [w for w in caught if issubclass(w.category, pergrad.FallbackWarning)]


def test_dp_optimizer_says_once_when_bare_parameters_are_too_large(monkeypatch):
    from pergrad._src.capture import cost

    monkeypatch.setattr(cost, "MAX_FORMED_NUMBERS", 10)
    model, batch, _ = problem("embed")
    stats, caught = dp_steps(model, batch, steps=3)
    assert [s.strategy for s in stats] == ["chunked"] * 3
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("DPOptimizer: the ghost strategy cannot take every parameter")
    assert "480 per-example numbers (more than 10) to run 'embed' alone" in message
    assert caught[0].filename == __file__  # attributed to the caller's step()


def test_dp_optimizer_says_once_when_a_layer_cannot_go_ghost():
    """Two Linear layers sharing one weight: no cross rule for that pair."""

    class TwoLinears(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(8, 8)
            self.second = nn.Linear(8, 8)
            self.second.weight = self.first.weight
            self.head = nn.Linear(8, CLASSES)

        def forward(self, x):
            return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))

    torch.manual_seed(4)
    model = TwoLinears()
    stats, caught = dp_steps(model, (features(), torch.randint(0, CLASSES, (BATCH,))), steps=2)
    assert [s.strategy for s in stats] == ["chunked"] * 2
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'first'" in message and "no cross rule for ('linear', 'linear')" in message


@pytest.mark.parametrize("strategy", ["ghost", "chunked"])
def test_dp_optimizer_is_silent_when_the_strategy_is_named_or_ghost(strategy):
    model, batch, _ = problem("root")
    stats, caught = dp_steps(model, batch, steps=2, strategy=strategy)
    assert [s.strategy for s in stats] == [strategy] * 2 and not caught


class LinearOfItsOwn(nn.Module):
    """A weight used through ``F.linear`` by a module with no rule: run alone as a unit, its
    matrix product is one autocast lowers to bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def test_bare_parameters_under_bfloat16_autocast_keep_the_ghost_norms():
    """Under ``torch.autocast(bfloat16)`` a unit run alone and the batched pass round
    differently (~1e-2): their sum check allows for it (it refused such units before, and
    "auto" took the chunked strategy). The norms are the float32 loop's to bfloat16 accuracy,
    and every example's contribution to the clipped sum stays within the bound."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Linear(6, 8), LinearOfItsOwn(), nn.Tanh(), nn.Flatten(), nn.Linear(40, 5)
    )
    x, y = torch.randn(BATCH, 5, 6), torch.randint(0, 5, (BATCH,))
    loss = pergrad.module_loss(model, F.cross_entropy)
    params = loss.params()
    want = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms = pergrad.norms.per_example_norms_of(loss, params, x, y, strategy="ghost")
        max_norm = 0.5 * float(norms.min())  # every example clipped
        clipped = pergrad.dp.clipped_sum_of(loss, params, x, y, max_norm=max_norm, strategy="ghost")
    np.testing.assert_allclose(norms.double().numpy(), flat_norms(want), rtol=5e-2)
    total = torch.cat([v.detach().double().flatten() for v in clipped.sum.values()])
    assert float(total.norm()) <= BATCH * max_norm * (1 + 1e-5)
